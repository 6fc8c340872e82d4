"""Building blocks for the flow-control tests across worker processes
(tests/acceptance/test_limits.py) and bench/limits.py.

:data:`FLOW` is the source of a workflow file; every step call appends one JSON line to
``$LIMIT_LEDGER_DIR/ledger-<pid>.jsonl``: the workflow, run, key, state, when the call
started and ended (``time.time()``: all processes run on this machine) and whether it
raised. Workflows:

* ``capped`` — ``max_concurrency=2``, two steps;
* ``keyed`` — ``concurrency_key=customer``, ``key_limit=1``, two steps;
* ``fair`` — ``concurrency_key=customer`` (round-robin, no per-key limit), one step;
* ``paced`` — one step taking ``RateLimit("pace", 20, per=1s)``;
* ``guarded`` — one step behind ``Breaker("provider", failures=4, cool_down=$LIMIT_COOL)``;
  it raises while ``$LIMIT_FAIL_FLAG`` exists, after waiting (up to 10 s) until two
  processes have entered it, so the failures come from two workers; a run of customer
  ``hang`` writes ``hang-<pid>`` in the ledger directory and waits while
  ``$LIMIT_HANG_FLAG`` exists.

Steps sleep ``$LIMIT_STEP_SLEEP`` seconds (default 0.02) except ``paced``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FLOW = '''\
"""limitkit's workflows (see tests/limitkit.py)."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

from pydantic import BaseModel

from flowloop import Retry, Step, Workflow
from flowloop.flowcontrol import Breaker, RateLimit


class Ctx(BaseModel):
    customer: str = "c"
    n: int = 0


def _log(step: Step, ctx: Ctx, started: float, ok: bool = True) -> None:
    directory = os.environ.get("LIMIT_LEDGER_DIR")
    if not directory:
        return
    line = json.dumps({"wf": step.workflow, "run": step.run_id, "key": ctx.customer,
                       "state": step.state, "start": started, "end": time.time(),
                       "pid": os.getpid(), "ok": ok})
    with open(os.path.join(directory, f"ledger-{os.getpid()}.jsonl"), "a") as handle:
        handle.write(line + "\\n")


def work(ctx: Ctx, step: Step) -> None:
    started = time.time()
    time.sleep(float(os.environ.get("LIMIT_STEP_SLEEP") or 0.02))
    _log(step, ctx, started)


def call(ctx: Ctx, step: Step) -> None:
    _log(step, ctx, time.time())


def _two_entered(directory: str) -> None:
    mark = os.path.join(directory, f"entered-{os.getpid()}")
    open(mark, "w").close()
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        if len([n for n in os.listdir(directory) if n.startswith("entered-")]) >= 2:
            return
        time.sleep(0.01)


def charge(ctx: Ctx, step: Step) -> None:
    started = time.time()
    hang = os.environ.get("LIMIT_HANG_FLAG", "")
    if ctx.customer == "hang" and hang:
        open(os.path.join(os.environ["LIMIT_LEDGER_DIR"], f"hang-{os.getpid()}"), "w").close()
        while os.path.exists(hang):
            time.sleep(0.05)
    flag = os.environ.get("LIMIT_FAIL_FLAG", "")
    if flag and os.path.exists(flag):
        _two_entered(os.environ["LIMIT_LEDGER_DIR"])
        _log(step, ctx, started, ok=False)
        raise RuntimeError("provider down")
    _log(step, ctx, started)


ONCE = Retry(attempts=1)

capped = Workflow("capped", context=Ctx, max_concurrency=2)
capped.step(name="a", initial=True, next="b")(work)
capped.step(name="b", next="done")(work)
capped.final("done")

keyed = Workflow("keyed", context=Ctx, concurrency_key=lambda c: c.customer, key_limit=1)
keyed.step(name="a", initial=True, next="b")(work)
keyed.step(name="b", next="done")(work)
keyed.final("done")

fair = Workflow("fair", context=Ctx, concurrency_key=lambda c: c.customer)
fair.step(name="a", initial=True, next="done")(work)
fair.final("done")

pace = RateLimit("pace", 20, per=timedelta(seconds=1))
paced = Workflow("paced", context=Ctx)
paced.step(name="call", initial=True, next="done", rate_limit=pace)(call)
paced.final("done")

provider = Breaker("provider", failures=4, within=timedelta(seconds=60),
                   cool_down=timedelta(seconds=float(os.environ.get("LIMIT_COOL") or 2)))
guarded = Workflow("guarded", context=Ctx)
guarded.step(name="charge", initial=True, next="done", breaker=provider, retry=ONCE)(charge)
guarded.final("done")
'''


def write_flow(directory: Path) -> Path:
    path = directory / "limit_flow.py"
    path.write_text(FLOW)
    return path


def ledger(directory: Path) -> list[dict[str, Any]]:
    rows = []
    for path in sorted(directory.glob("ledger-*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return rows


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end at t closes before a start at t)."""
    points = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    best = current = 0
    for _, change in points:
        current += change
        best = max(best, current)
    return best


def max_in_window(times: list[float], window: float) -> int:
    """The most of ``times`` in any half-open window ``[t, t + window)``."""
    ordered = sorted(times)
    best = 0
    j = 0
    for i, start in enumerate(ordered):
        while j < len(ordered) and ordered[j] < start + window:
            j += 1
        best = max(best, j - i)
    return best
