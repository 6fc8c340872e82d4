"""Wait states, events and durable timers: test workflows and helpers.

The workflows here are loaded three ways: imported by the tests, loaded by real worker
processes (``python -m flowloop.cli worker tests/waitkit.py``), and run as a script by
sender processes (``python tests/waitkit.py send …``). Their structure (hence fingerprint)
is the same in all three.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Step, Workflow
from flowloop.definition import Sleep
from flowloop.engine import RunInfo
from flowloop.journal import JournalEvent
from flowloop.store import InboxEvent
from flowloop.store.schema import inbox, journal, runs

HERE = Path(__file__).resolve()
TIMER_S = 1.5
"""Real-time timers of the worker tests: short, yet long enough to kill a worker first."""
TIMER_WORKFLOWS = ("timed", "napper")
T = TypeVar("T")


# -- workflows ------------------------------------------------------------------------------


class Approval(BaseModel):
    by: str
    note: str = ""


class Doc(BaseModel):
    doc_id: str = "D1"
    approved_by: str | None = None
    rejected_because: str | None = None
    prepared: int = 0


def approved(ctx: Doc, approval: Approval) -> None:
    if approval.by.startswith("!"):
        raise PermissionError(f"{approval.by} may not approve")
    ctx.approved_by = approval.by


def rejected(ctx: Doc, approval: Approval) -> None:
    ctx.rejected_because = f"{approval.by}: {approval.note}"


review = Workflow("review", context=Doc, key="doc_id")
"""prepare → awaiting (approve | reject | 2 days) → approved | rejected | expired."""


@review.step(initial=True, next="awaiting")
def prepare(ctx: Doc) -> None:
    ctx.prepared += 1


review.wait(
    "awaiting",
    on={"approve": "approved", "reject": "rejected"},
    payloads={"approve": Approval, "reject": Approval},
    handlers={"approve": approved, "reject": rejected},
    timeout=timedelta(days=2),
    on_timeout="expired",
)
review.final("approved", "rejected", "expired")


class Note(BaseModel):
    text: str


class Chain(BaseModel):
    notes: list[str] = []


def add_note(ctx: Chain, note: Note) -> None:
    if note.text.startswith("!"):
        raise ValueError("notes may not start with '!'")
    ctx.notes.append(note.text)


chain = Workflow("chain", context=Chain)
"""Two wait states in a row: ``go`` moves first → second, where ``note`` loops."""


@chain.step(initial=True, next="first")
def begin_chain(ctx: Chain) -> None:
    pass


chain.wait("first", on={"go": "second"})
chain.wait(
    "second",
    on={"note": "second", "close": "closed"},
    payloads={"note": Note},
    handlers={"note": add_note},
)
chain.final("closed")


class Empty(BaseModel):
    n: int = 0


initial_wait = Workflow("initial_wait", context=Empty)
initial_wait.wait("gate", on={"open": "opened"}, initial=True, timeout=100, on_timeout="shut")
initial_wait.final("opened", "shut")


parked = Workflow("parked", context=Empty)
"""One quick step, then a wait without timeout: the shape of the 10,000 waiting runs."""


@parked.step(initial=True, next="parked")
async def park(ctx: Empty) -> None:
    pass


parked.wait("parked", on={"go": "done"})
parked.final("done")


class Tick(BaseModel):
    fired: int = 0
    after: int = 0


timed = Workflow("timed", context=Tick)
"""A wait whose real-time timeout (TIMER_S) is the only way out the tests take."""


@timed.step(initial=True, next="hold")
def arm(ctx: Tick) -> None:
    pass


timed.wait("hold", on={"release": "released"}, timeout=TIMER_S, on_timeout="expired")
timed.final("released", "expired")


napper = Workflow("napper", context=Tick)
"""``step.sleep``: the next step starts only after a stored delay."""


@napper.step(initial=True, next="after")
def nap(ctx: Tick, step: Step) -> Sleep:
    return step.sleep(timedelta(seconds=TIMER_S))


@napper.step(next="done")
def after(ctx: Tick) -> None:
    ctx.after += 1


napper.final("done")


class Item(BaseModel):
    value: str


class Bag(BaseModel):
    items: list[str] = []
    taken: int = 0


def add_item(ctx: Bag, item: Item) -> None:
    ctx.items.append(item.value)


collector = Workflow("collector", context=Bag)
"""collect (wait) --item--> take (step) --> collect …; ``finish`` ends it."""


@collector.step(initial=True, next="collect")
def open_bag(ctx: Bag) -> None:
    pass


collector.wait(
    "collect",
    on={"item": "take", "finish": "done"},
    payloads={"item": Item},
    handlers={"item": add_item},
)


@collector.step(next="collect")
def take(ctx: Bag) -> None:
    ctx.taken += 1


collector.final("done")


gatherer = Workflow("gatherer", context=Bag)
"""A wait that loops on itself: every ``item`` is one fenced write by its sender."""


@gatherer.step(initial=True, next="gather")
def open_gather(ctx: Bag) -> None:
    pass


gatherer.wait(
    "gather",
    on={"item": "gather", "finish": "done"},
    payloads={"item": Item},
    handlers={"item": add_item},
)
gatherer.final("done")

ALL = (review, chain, initial_wait, parked, timed, napper, collector, gatherer)

GATE: list[bool] = []
"""Set (non-empty) only in a :func:`_hold_main` process: its ``hold_gate`` step waits there."""

gated = Workflow("gated", context=Empty)
"""A first step that the ``hold`` process holds until the test lets it go (elsewhere it
returns at once), then a wait without a timeout, then a step: a run in flight that another
process can send a kept event to. Not in ALL; the CLI workers load it from this file."""


@gated.step(initial=True, next="ready")
def hold_gate(ctx: Empty, step: Step) -> None:
    if GATE:
        print(f"holding {step.run_id}", flush=True)
        sys.stdin.readline()  # the test's line: go on


gated.wait("ready", on={"go": "finish"})


@gated.step(next="done")
def finish(ctx: Empty) -> None:
    ctx.n += 1


gated.final("done")


# -- reading runs ---------------------------------------------------------------------------


def ctx(info: RunInfo) -> Any:
    """The run's context model (loosely typed: each test knows its workflow's)."""
    assert isinstance(info.context, BaseModel), info.context
    return info.context


def kinds(engine: Engine, run_id: str) -> list[str]:
    return [event.kind for event in engine.history(run_id)]


def received(engine: Engine, run_id: str, event: str | None = None) -> list[JournalEvent]:
    """The run's ``event_received`` entries (of ``event``)."""
    return [
        e
        for e in engine.history(run_id)
        if e.kind == "event_received" and (event is None or e.event == event)
    ]


def assert_journal_sound(engine: Engine, run_id: str) -> list[JournalEvent]:
    """Seqs 1..n without a gap, and the fold equals the stored row."""
    events = engine.history(run_id)
    assert [e.seq for e in events] == list(range(1, len(events) + 1))
    replay = engine.replay(run_id)
    assert replay.matches, replay.differences
    return events


def keep_stranded(engine: Engine, run_id: str, event: str, payload: str | None = None) -> None:
    """``event`` kept for the run and not handed over (as a worker killed right after
    keeping it leaves it)."""
    message = InboxEvent(run_id=run_id, event=event, payload=payload, dedupe_key=None, sent_at=0)
    assert engine.store.deliver(message, None) == "buffered"


def chain_with_go_kept(engine: Engine) -> str:
    """A chain run waiting in ``first`` with a ``go`` kept for it (stranded)."""
    run_id = engine.start(chain, Chain()).id
    engine.run_until_idle()
    assert engine.get(run_id).state == "first"
    keep_stranded(engine, run_id, "go")
    return run_id


def inbox_rows(url: str, run_id: str) -> list[Any]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.select(inbox).where(inbox.c.run_id == run_id).order_by(inbox.c.id)
            return [row for row in conn.execute(query)]
    finally:
        engine.dispose()


def run_totals(url: str) -> tuple[int, int, int, int]:
    """(runs, sum of lease epochs, sum of last seqs, owned runs): what claiming changes."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            row = conn.execute(
                sa.select(
                    sa.func.count(),
                    sa.func.coalesce(sa.func.sum(runs.c.lease_epoch), 0),
                    sa.func.coalesce(sa.func.sum(runs.c.last_seq), 0),
                    sa.func.count(runs.c.owner),
                ).select_from(runs)
            ).one()
            return int(row[0]), int(row[1]), int(row[2]), int(row[3])
    finally:
        engine.dispose()


def clone_run(url: str, template_id: str, copies: int) -> list[str]:
    """``copies`` more runs exactly like ``template_id`` (row and journal, new ids), in one
    transaction: the engine drove the template into its state; creating 10,000 runs one
    commit at a time would take most of the test's budget."""
    engine = sa.create_engine(url)
    ids = [uuid.uuid4().hex for _ in range(copies)]
    try:
        with engine.begin() as conn:
            row = conn.execute(sa.select(runs).where(runs.c.id == template_id)).one()._asdict()
            events = [
                r._asdict()
                for r in conn.execute(sa.select(journal).where(journal.c.run_id == template_id))
            ]
            for start in range(0, copies, 2000):
                chunk = ids[start : start + 2000]
                conn.execute(sa.insert(runs), [{**row, "id": new_id} for new_id in chunk])
                conn.execute(
                    sa.insert(journal),
                    [{**event, "run_id": new_id} for new_id in chunk for event in events],
                )
    finally:
        engine.dispose()
    return ids


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    every: float = 0.05,
    diagnose: Callable[[], str] | None = None,
) -> T:
    """Poll ``probe`` until it returns something truthy, at most ``timeout`` seconds."""
    return poll(probe, timeout=timeout, what=what, every=every, describe=diagnose)


# -- processes ------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


class WorkerProcess:
    """``flowloop worker tests/waitkit.py --db URL`` in its own process, its output in a file
    (``args``: more options, such as ``--lease``)."""

    def __init__(self, url: str, log: Path, *args: str) -> None:
        self.log = log
        self.started_at = time.time()
        self._handle = log.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flowloop.cli",
                "worker",
                str(HERE),
                "--db",
                url,
                "--grace",
                "2",
                *args,
            ],
            stdout=self._handle,
            stderr=subprocess.STDOUT,
            env=_env(),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._handle.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@contextmanager
def workers(url: str, folder: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker processes on demand (``start(*options)``); every one still alive is
    stopped at the end."""
    started: list[WorkerProcess] = []

    def start(*args: str) -> WorkerProcess:
        worker = WorkerProcess(url, folder / f"worker{len(started) + 1}.log", *args)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            worker.stop()


def sender_command(url: str, plan: Sequence[dict[str, Any]], *, start_at: float) -> list[str]:
    """A sender process that, at ``start_at``, sends ``plan`` in order: each entry
    ``{"run": id, "event": …, "payload": …, "buffer": bool, "dedupe_key": …}``."""
    return [
        sys.executable,
        str(HERE),
        "send",
        url,
        "--start-at",
        repr(start_at),
        "--plan",
        json.dumps(list(plan)),
    ]


def items_plan(run_id: str, prefix: str, count: int, *, buffer: bool) -> list[dict[str, Any]]:
    return [
        {"run": run_id, "event": "item", "payload": {"value": f"{prefix}{i:03d}"}, "buffer": buffer}
        for i in range(count)
    ]


def send_from_processes(commands: Sequence[list[str]], *, timeout: float = 60.0) -> list[list[str]]:
    """Run sender processes at once; each one's list of send results."""
    procs = [
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)
        for cmd in commands
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"sender failed ({proc.returncode}):\n{err[-3000:]}"
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _send_main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="waitkit send")
    parser.add_argument("url")
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--plan", required=True)
    args = parser.parse_args(argv)
    with Engine(args.url, workflows=ALL) as engine:
        delay = args.start_at - time.time()
        if delay > 0:  # every sender starts at the same instant
            time.sleep(delay)
        results = [
            engine.send(
                entry["run"],
                entry["event"],
                entry.get("payload"),
                buffer=bool(entry.get("buffer")),
                dedupe_key=entry.get("dedupe_key"),
            ).status
            for entry in json.loads(args.plan)
        ]
    print(json.dumps(results))


def hold_command(url: str) -> list[str]:
    """A worker process (:func:`_hold_main`) that creates a ``gated`` run and drives it: it
    prints ``holding RUN_ID`` while its first step waits for a line on its stdin, then
    enters the wait and SIGKILLs itself right after that commit, before it hands over the
    events kept for the run."""
    return [sys.executable, str(HERE), "hold", url]


def _hold_main(argv: Sequence[str]) -> None:
    from flowloop.stepping import Stepping

    def killed(self: Any, run_id: str) -> None:  # (called right after the commit)
        os.kill(os.getpid(), signal.SIGKILL)

    Stepping._deliver = killed  # type: ignore[method-assign]
    GATE.append(True)
    with Engine(argv[0], workflows=[*ALL, gated]) as engine:
        engine.run(gated, Empty())
    sys.exit("the hold process went on past its kill")


if __name__ == "__main__":
    if sys.argv[1:2] == ["hold"]:
        _hold_main(sys.argv[2:])
    elif sys.argv[1:2] != ["send"]:
        sys.exit("usage: waitkit.py send URL --plan JSON [--start-at T] | waitkit.py hold URL")
    else:
        _send_main(sys.argv[2:])
