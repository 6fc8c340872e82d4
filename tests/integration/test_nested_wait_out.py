"""A run started from a step of another run (``await engine.arun`` in an ``async def`` step,
``engine.run`` in a plain ``def`` one) waits out its own retry backoff or durable sleep on
the engine's executor, which is driving its caller meanwhile. The wait is limited to the
started run's family: the caller, waiting for it, never counts as work still going on.

(Before, the wait drove the executor until none of its runs was active — the caller among
them, so it never ended; and a first Ctrl-C drained the caller too, cutting it off after
the grace period.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, Retry, Step, Workflow, children
from flowloop import journal as j
from flowloop.engine import RunInfo
from flowloop.executor import Executor
from flowloop.interrupt import Interrupted, run_interruptibly
from flowloop.journal import JournalEvent, RunRecord
from flowloop.lifecycle import LIVE
from flowloop.specs import Sleep
from flowloop.store import joins as joins_store

WAIT_S = 30.0
"""Bound of each wait that the fixed code ends at once (a failing test waits it out)."""
LONG_BACKOFF_S = 150.0
"""A backoff longer than every bound here, yet within the default idle horizon (300 s),
so that a wait-out waits for it (beyond it, the call would return at once)."""
SPIN_BOUND_S = 10.0
"""The same, for a wait the unfixed code spends spinning a CPU."""
SETTLE_S = 0.3
"""Event-loop time for a wait-out just begun to reach its sleep (shorter, the Ctrl-C
test might pass without its fix; never fail with it)."""


class Ctx(BaseModel):
    n: int = 0
    seen: str = ""


def _flaky(backoff: float = 0.01) -> Workflow:
    """A run whose first attempt fails, retried after ``backoff`` seconds."""
    wf = Workflow("flaky", context=Ctx)

    @wf.step(initial=True, next="done", retry=Retry(attempts=2, backoff="fixed", base=backoff))
    def once(ctx: Ctx, step: Step) -> None:
        if step.attempt == 1:
            raise ConnectionError("the first attempt fails")
        ctx.n = 1

    wf.final("done")
    return wf


def _napping() -> Workflow:
    """A run that sleeps durably (briefly) between its two steps."""
    wf = Workflow("napping", context=Ctx)

    @wf.step(initial=True, next="wake")
    async def nap(ctx: Ctx, step: Step) -> Sleep:
        return step.sleep(0.01)

    @wf.step(next="done")
    async def wake(ctx: Ctx) -> None:
        ctx.n = 1

    wf.final("done")
    return wf


@pytest.mark.parametrize("kind", ["async", "def"])
@pytest.mark.parametrize("make_inner", [_flaky, _napping], ids=["retry", "sleep"])
def test_a_run_started_from_a_step_waits_out_its_own_pause_and_ends(
    store_url: str, kind: str, make_inner: Callable[[], Workflow]
) -> None:
    inner = make_inner()
    outer = Workflow("outer", context=Ctx)
    if kind == "async":

        @outer.step(initial=True, next="done")
        async def call_inner(ctx: Ctx) -> None:
            info = await asyncio.wait_for(engine.arun(inner, Ctx()), WAIT_S)
            ctx.n = info.context.n  # type: ignore[attr-defined]

    else:

        @outer.step(initial=True, next="done", retry=Retry(attempts=1))
        def run_inner(ctx: Ctx) -> None:
            ctx.n = engine.run(inner, Ctx()).context.n  # type: ignore[attr-defined]

    outer.final("done")
    with Engine(store_url, workflows=[outer, inner], poll_seconds=0.05) as engine:
        info = engine.run(outer, Ctx())
        assert info.status == "succeeded", info.error
        assert engine.get(info.id).context.n == 1  # type: ignore[union-attr]
        (nested,) = [run for run in engine.runs() if run.workflow == inner.name]
        assert nested.status == "succeeded"


def test_a_wait_out_does_not_wait_for_a_run_the_same_loop_drives_beside_it(
    sqlite_url: str,
) -> None:
    """Two ``engine.arun`` calls gathered on one loop: the first waits out a retry, the
    second's step waits for the first call to return. Waiting for the second too, the first
    call would only return once the second's step gave up."""
    first_returned = asyncio.Event()
    waiter = Workflow("waiter", context=Ctx)

    @waiter.step(initial=True, next="done", retry=Retry(attempts=1))
    async def wait_for_first(ctx: Ctx) -> None:
        await asyncio.wait_for(first_returned.wait(), WAIT_S)
        ctx.n = 2

    waiter.final("done")
    flaky = _flaky()

    async def both(engine: Engine) -> tuple[str, str]:
        async def first() -> str:
            info = await engine.arun(flaky, Ctx())
            first_returned.set()
            return info.status

        async def second() -> str:
            return (await engine.arun(waiter, Ctx())).status

        return tuple(await asyncio.gather(first(), second()))  # type: ignore[return-value]

    with Engine(sqlite_url, workflows=[flaky, waiter], poll_seconds=0.05) as engine:
        assert asyncio.run(both(engine)) == ("succeeded", "succeeded")


@pytest.mark.usefixtures("python_sigint")
def test_a_first_ctrl_c_during_a_nested_wait_out_ends_the_callers_step_at_once(
    sqlite_url: str,
) -> None:
    """A first Ctrl-C lets the step in flight finish. When that step waits for a run it
    started, which waits out a long backoff, the wait ends at once: the step gets the
    started run as it stands (``retrying``, resumable) and its own run is handed back."""
    inner = _flaky(backoff=LONG_BACKOFF_S)
    outer = Workflow("outer", context=Ctx)

    @outer.step(initial=True, next="after")
    async def call_inner(ctx: Ctx) -> None:
        info = await asyncio.wait_for(engine.arun(inner, Ctx()), WAIT_S)
        ctx.seen = info.status

    @outer.step(next="done")
    async def after(ctx: Ctx) -> None:
        ctx.n = 1

    outer.final("done")

    def interrupt_on_retry(record: RunRecord, events: Sequence[JournalEvent]) -> None:
        if record.workflow == inner.name and any(e.kind == j.STEP_FAILED for e in events):
            os.kill(os.getpid(), signal.SIGINT)  # run_interruptibly's handler: hand back

    with Engine(sqlite_url, workflows=[outer, inner], poll_seconds=0.05) as engine:
        engine.listeners.append(interrupt_on_retry)
        outcome = run_interruptibly(engine, outer, Ctx())
        assert isinstance(outcome, Interrupted) and outcome.signals == 1
        assert outcome.run is not None
        run = engine.get(outcome.run.id)
        assert (run.status, run.state) == ("scheduled", "after")
        assert run.context == Ctx(seen="retrying")
        (nested,) = [r for r in engine.runs() if r.workflow == inner.name]
        assert nested.status == "retrying"
        engine.run_until_idle(idle_horizon=0)  # resumed (the backoff is not yet over)
        assert engine.get(run.id).status == "succeeded"


def test_a_wait_out_inside_another_leaves_the_outer_one_its_own_wake(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The outer run's first attempt fails: ``engine.run`` waits it out (the executor's
    until-idle loop, on the call's event loop). Its retried ``def`` step runs a nested
    ``engine.run`` whose run waits out a retry too, on the step's own event loop. The
    outer wait then still sleeps on an event of its own loop: sharing one, it got the
    nested loop's, every wait failed at once ("bound to a different event loop") and the
    loop spun, claiming thousands of times a second."""
    inner = _flaky()
    outer = Workflow("outer", context=Ctx)

    @outer.step(initial=True, next="rest", retry=Retry(attempts=2, backoff="fixed", base=0.01))
    def first(ctx: Ctx, step: Step) -> None:
        if step.attempt == 1:
            raise ConnectionError("the first attempt fails")
        ctx.n = engine.run(inner, Ctx()).context.n  # type: ignore[attr-defined]

    @outer.step(next="done")
    async def rest(ctx: Ctx) -> None:
        await asyncio.sleep(0.5)  # ~10 polls at poll_seconds=0.05, not thousands of claims

    outer.final("done")
    claims = _counting_claims(monkeypatch)
    with Engine(sqlite_url, workflows=[outer, inner], poll_seconds=0.05) as engine:
        info = engine.run(outer, Ctx())
        assert info.status == "succeeded", info.error
        assert engine.get(info.id).context.n == 1  # type: ignore[union-attr]
    assert claims[0] < SPIN_CLAIMS, claims


def test_a_wait_out_claims_although_its_caller_takes_every_slot(sqlite_url: str) -> None:
    """``max_concurrency=1`` and the one slot is the caller's, whose step waits for the
    run it started: the wait-out counts only its own runs against the limit (counting the
    caller, it claimed nothing and spun until the step gave up)."""
    inner = _flaky()
    outer = Workflow("outer", context=Ctx)

    @outer.step(initial=True, next="done", retry=Retry(attempts=1))
    async def call_inner(ctx: Ctx) -> None:
        info = await asyncio.wait_for(engine.arun(inner, Ctx()), SPIN_BOUND_S)
        ctx.n = info.context.n  # type: ignore[attr-defined]

    outer.final("done")
    with Engine(
        sqlite_url, workflows=[outer, inner], poll_seconds=0.05, max_concurrency=1
    ) as engine:
        info = engine.run(outer, Ctx())
        assert info.status == "succeeded", info.error
        assert engine.get(info.id).context.n == 1  # type: ignore[union-attr]


@pytest.mark.usefixtures("python_sigint")
def test_a_first_ctrl_c_ends_two_wait_outs_going_on_at_once(sqlite_url: str) -> None:
    """A step waits for two runs, each waiting out a long backoff in a wait of its own on
    the step's loop, the second begun while the first sleeps: a first Ctrl-C ends both at
    once. (With one wake event for all, the later wait replaced the earlier's, which then
    slept its backoff out.)"""
    inner = _flaky(backoff=LONG_BACKOFF_S)
    outer = Workflow("outer", context=Ctx)

    @outer.step(initial=True, next="done")
    async def call_two(ctx: Ctx) -> None:
        first = asyncio.ensure_future(engine.arun(inner, Ctx()))
        while not [r for r in engine.runs() if r.status == "retrying"]:
            await asyncio.sleep(0.01)
        await asyncio.sleep(SETTLE_S)  # the first wait-out is asleep now
        # A run due later, started before: this call waits it out without running it.
        second = asyncio.ensure_future(engine.arun(inner, Ctx(), idempotency_key="later"))
        await asyncio.sleep(SETTLE_S)  # the second wait-out is asleep too
        os.kill(os.getpid(), signal.SIGINT)  # run_interruptibly's handler: hand back
        infos = await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
        ctx.seen = ",".join(info.status for info in infos)

    outer.final("done")
    with Engine(sqlite_url, workflows=[outer, inner], poll_seconds=0.05) as engine:
        engine.start(inner, Ctx(), idempotency_key="later", run_at=time.time() + LONG_BACKOFF_S)
        outcome = run_interruptibly(engine, outer, Ctx())
        assert isinstance(outcome, RunInfo), outcome  # the step, its run's last, finished
        assert outcome.status == "succeeded"
        assert engine.get(outcome.id).context == Ctx(seen="retrying,scheduled")


SPIN_CLAIMS = 200
"""More claims than a 0.5 s step's polls and wakes could make; a spinning loop makes them
in a fraction of it."""


def _counting_claims(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the executor's claims (``[count]``)."""
    count = [0]
    real = Executor._claim

    def counted(self: Executor, *args: Any) -> tuple[int, bool]:
        count[0] += 1
        return real(self, *args)

    monkeypatch.setattr(Executor, "_claim", counted)
    return count


def test_waits_held_back_by_a_workflows_limit_claim_as_soon_as_a_slot_is_free(
    sqlite_url: str,
) -> None:
    """Four ``arun`` calls of a workflow that runs one at a time, gathered on one loop:
    each call waits for its own run, held back by the limit while another call's runs.
    The end of a run frees the slot and wakes them, rather than each waiting for its next
    poll (a long one here)."""
    limited = Workflow("one_at_a_time", context=Ctx, max_concurrency=1)

    @limited.step(initial=True, next="done")
    async def only(ctx: Ctx) -> None:
        ctx.n = 1

    limited.final("done")

    async def four(engine: Engine) -> list[str]:
        calls = [engine.arun(limited, Ctx()) for _ in range(4)]
        infos = await asyncio.wait_for(asyncio.gather(*calls), SPIN_BOUND_S)
        return [info.status for info in infos]

    with Engine(sqlite_url, workflows=[limited], poll_seconds=WAIT_S) as engine:
        assert asyncio.run(four(engine)) == ["succeeded"] * 4


@pytest.mark.parametrize("leaf_retries", [False, True], ids=["straight", "leaf_retries"])
def test_engine_run_drives_a_child_that_calls_a_child_of_its_own(
    store_url: str, leaf_retries: bool
) -> None:
    """top calls mid, which calls leaf. ``engine.run(top)`` drives all three to the end: the
    family it drives is looked up again when a member started children of its own (before,
    it returned ``top`` still ``scheduled`` in its call state, with ``leaf`` never run)."""
    leaf = _flaky() if leaf_retries else _napping()
    mid = _calling("mid", leaf)
    top = _calling("top", mid)
    with Engine(store_url, workflows=[top, mid, leaf], poll_seconds=0.05) as engine:
        info = engine.run(top, Ctx())
        assert (info.status, info.state) == ("succeeded", "done"), info.error
        assert info.context == Ctx(n=1)
        assert {run.workflow: run.status for run in engine.runs()} == {
            "top": "succeeded",
            "mid": "succeeded",
            leaf.name: "succeeded",
        }


def test_engine_run_returns_when_a_grandchild_waits_for_an_event(store_url: str) -> None:
    """The family grew (leaf was created), yet nothing of it is due: leaf waits for an
    event. ``engine.run(top)`` returns at once, top and mid ``scheduled`` in their call
    states; the event then lets a later ``run_until_idle`` finish all three."""
    leaf = Workflow("held", context=Ctx)
    leaf.wait("hold", on={"go": "done"}, initial=True)
    leaf.final("done")
    mid = _calling("mid", leaf)
    top = _calling("top", mid)
    with Engine(store_url, workflows=[top, mid, leaf], poll_seconds=0.05) as engine:
        info = engine.run(top, Ctx())
        assert (info.status, info.state) == ("scheduled", "go")
        states = {run.workflow: run.state for run in engine.runs()}
        assert states == {"top": "go", "mid": "go", "held": "hold"}
        (held,) = [run for run in engine.runs() if run.workflow == "held"]
        engine.send(held.id, "go")
        engine.run_until_idle()
        assert engine.get(info.id).status == "succeeded"


def _calling(name: str, child: Workflow) -> Workflow:
    """A workflow whose initial state calls ``child`` and takes its ``n``."""
    wf = Workflow(name, context=Ctx)
    wf.call(
        "go",
        child=child,
        context=lambda ctx: Ctx(),
        on={"succeeded": "done"},
        result=lambda ctx, done: setattr(ctx, "n", done.n),
        initial=True,
    )
    wf.final("done")
    return wf


def test_a_family_is_looked_up_a_generation_at_a_time(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``engine.run`` looks its run's family up again after each round of its drive. A map
    of 30 items, each calling a child that waits for an event: the family of 61 live runs
    is found with a query per generation (3), ids only — a query per run, of whole rows,
    made a map of 800 items, 5 at a time, take 12.1 s instead of 3.5 (quadratic)."""
    leaf = Workflow("leaf_waits", context=Ctx)
    leaf.wait("waiting", on={"go": "done"}, initial=True)
    leaf.final("done")
    mid = _calling("mid_calls", leaf)
    top = Workflow("top_maps", context=Ctx)
    top.map(
        "fan",
        child=mid,
        items=lambda ctx: list(range(30)),
        context=lambda ctx, item: Ctx(),
        on={"done": "end", "failed": "end"},
        max_parallel=30,
        initial=True,
    )
    top.final("end")
    with Engine(store_url, workflows=[top]) as engine:
        info = engine.run(top, Ctx())  # returns once every leaf waits for its event
        live = [run.id for run in engine.runs(limit=1000) if run.status in LIVE]
        assert len(live) == 61, sorted(run.status for run in engine.runs(limit=1000))
        statements: list[str] = []

        def note(*args: Any) -> None:
            statements.append(args[2])

        sa.event.listen(engine.store.engine, "before_cursor_execute", note)
        try:
            family = children.family(engine.store, info.id)
            assert sorted(family) == sorted(live)
            assert family[0] == info.id
            assert len(statements) == 3, statements  # the top, the 30 calls, the 30 leaves
            # A generation of more parents than one query takes is looked up in parts.
            monkeypatch.setattr(joins_store, "PARENTS_PER_QUERY", 7)
            statements.clear()
            assert sorted(children.family(engine.store, info.id)) == sorted(live)
            assert len(statements) == 1 + 5 + 5, statements  # 1 parent, then 30 twice
        finally:
            sa.event.remove(engine.store.engine, "before_cursor_execute", note)
