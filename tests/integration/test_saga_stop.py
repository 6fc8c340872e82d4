"""A stop, a pause or a shutdown that reaches a run while it is compensating, on SQLite and
PostgreSQL, with a worker driving it in a thread and the operator's request coming from
another engine.

The compensating state's drive commits each ``compensation_started`` before the call; a
cut-off of that call was written after the claim's record (a seq already taken), was
refused, and the run stayed ``running`` until its lease ran out — then recovery wrote it
"runs again" and stopped it. The leases here are long (a minute) and the waits short,
so a run left for its lease fails the test."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import sqlalchemy as sa
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.stats import step_stats
from flowloop.store import SQLStore
from flowloop.worker import Worker

LEASE_S = 60.0
"""Far longer than any wait below: nothing here may wait for a lease to run out."""
WAIT_S = 8.0
HOLD_S = 2 * LEASE_S
"""How long a held compensation would sleep unless cut off."""


class Undo(BaseModel):
    hold: bool = True
    log: list[str] = []


class Signals:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.entered = threading.Event()  # a held compensation was called
        self.cancelled = threading.Event()  # ... and cut off
        self.gate = threading.Event()  # lets a gated compensation end


SIG = Signals()


def saga(*, gated: bool = False) -> Workflow:
    """a -> b (fails) -> rollback: undoes a (held while ``ctx.hold``); with ``gated``,
    a -> a2 -> b, and a2's compensation (the first to run) waits for ``SIG.gate``."""
    wf = Workflow("undo_saga", context=Undo)

    async def undo_a(ctx: Undo, step: Step) -> None:
        if ctx.hold and not gated:
            SIG.entered.set()
            try:
                await asyncio.sleep(HOLD_S)
            except asyncio.CancelledError:
                SIG.cancelled.set()
                raise
        ctx.log.append(f"undo {step.idempotency_key.split(':', 1)[1]} #{step.attempt}")

    async def undo_a2(ctx: Undo, step: Step) -> None:
        SIG.entered.set()
        while not SIG.gate.is_set():
            await asyncio.sleep(0.01)
        ctx.log.append(f"undo {step.idempotency_key.split(':', 1)[1]} #{step.attempt}")

    @wf.step(initial=True, next="a2" if gated else "b", compensate=undo_a)
    def a(ctx: Undo) -> None:
        ctx.log.append("a")

    if gated:

        @wf.step(next="b", compensate=undo_a2)
        def a2(ctx: Undo) -> None:
            ctx.log.append("a2")

    @wf.step(next="done", retry=Retry(attempts=1), on_error={"*": "rollback"})
    def b(ctx: Undo) -> None:
        raise RuntimeError("b broke")

    wf.final("done")
    wf.final("rollback", compensate=True)
    return wf


class PollsSeen:
    """Counts the worker's polls that found a request (``store.pending_controls``)."""

    def __init__(self, engine: Engine) -> None:
        self.found = 0
        inner = engine.store.pending_controls

        def pending(*, worker: str) -> dict[str, str]:
            requests = inner(worker=worker)
            if requests:
                self.found += 1
            return requests

        engine.store.pending_controls = pending  # type: ignore[method-assign]


@contextmanager
def worker_thread(engine: Engine, *, grace: float = 5.0) -> Iterator[Callable[[], None]]:
    """A worker of ``engine`` on its own thread and event loop; yields what shuts it down
    (a SIGTERM's graceful stop, waited for), also done on the way out."""
    SIG.reset()
    worker = Worker(engine, grace=grace)
    ready = threading.Event()
    loop_of: list[asyncio.AbstractEventLoop] = []
    stop_of: list[asyncio.Event] = []

    async def main() -> None:
        stop_of.append(asyncio.Event())
        loop_of.append(asyncio.get_running_loop())
        ready.set()
        await worker.run(stop_of[0])

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(WAIT_S)

    def shut_down() -> None:
        if thread.is_alive():
            loop_of[0].call_soon_threadsafe(stop_of[0].set)
            thread.join(WAIT_S + grace)
        assert not thread.is_alive()

    try:
        yield shut_down
    finally:
        SIG.gate.set()
        shut_down()


@pytest.fixture
def engines(store_url: str) -> Iterator[tuple[Engine, Engine]]:
    """The worker's engine (a long lease, quick polls) and the operator's."""
    wf = saga()
    with (
        Engine(store_url, workflows=[wf], lease_seconds=LEASE_S, poll_seconds=0.05) as driving,
        Engine(store_url, workflows=[wf]) as operator,
    ):
        yield driving, operator


def kinds(engine: Engine, run_id: str) -> list[str]:
    return [event.kind for event in engine.history(run_id)]


def status_becomes(engine: Engine, run_id: str, *statuses: str) -> None:
    poll(
        lambda: engine.get(run_id).status in statuses and engine.get(run_id).owner is None,
        timeout=WAIT_S,
        what=f"run {run_id} {' or '.join(statuses)} and let go (its lease is {LEASE_S:g}s)",
        every=0.02,
        describe=lambda: "\n".join(
            f"{e.seq} {e.kind} {e.state} {e.error_message or ''} {e.data}"
            for e in engine.history(run_id)
        ),
    )


def replays(engine: Engine, run_id: str) -> None:
    replay = engine.replay(run_id)
    assert replay.matches, replay.differences


def db_of(engine: Engine) -> sa.Engine:
    assert isinstance(engine.store, SQLStore)
    return engine.store.engine


def test_a_stop_during_a_compensation_stops_the_run_at_once_and_retry_undoes_it(
    engines: tuple[Engine, Engine],
) -> None:
    driving, operator = engines
    run_id = operator.start(saga(), Undo()).id
    with worker_thread(driving):
        assert SIG.entered.wait(WAIT_S)
        # Asked: its worker cuts it off — maybe already by the time stop reads the run back
        # (the worker polls every 50 ms: "running" only was a race, 1 run in 12 on PG).
        assert operator.stop(run_id).status in ("running", "stopped")
        assert SIG.cancelled.wait(WAIT_S)
        status_becomes(operator, run_id, "stopped")
        info = operator.get(run_id)
        assert (info.state, info.reason) == ("rollback", "stopped during compensation")
        assert kinds(operator, run_id)[-2:] == [j.COMPENSATION_STARTED, j.RUN_STOPPED]
        assert j.STEP_INTERRUPTED not in kinds(operator, run_id)
        assert driving.store.get_run(run_id).control is None  # type: ignore[union-attr]
        replays(operator, run_id)
        # A stop is no failed attempt: only b's failure is counted.
        counted = {(s.state, s.count, s.failed) for s in step_stats(db_of(operator))}
        assert counted == {("a", 1, 0), ("b", 1, 1)}

        # The retry goes on with the compensation still owed: the one cut off, under its
        # key, from its first attempt again.
        operator.retry(run_id, set_fields={"hold": False})
        status_becomes(operator, run_id, "succeeded")
    info = operator.get(run_id)
    assert (info.state, info.reason) == ("rollback", "compensated: a")
    assert isinstance(info.context, Undo)
    assert info.context.log == ["a", "undo a:1:undo #1"]
    started = [e for e in operator.history(run_id) if e.kind == j.COMPENSATION_STARTED]
    assert [(e.state, e.attempt) for e in started] == [("a", 1), ("a", 1)]
    replays(operator, run_id)


def test_a_pause_during_a_compensation_is_honoured_before_the_next_one(store_url: str) -> None:
    """The pause is honoured at the next compensation's boundary, committed with the
    success of the one that ran; unpaused, the run undoes what is still owed. (Before,
    the compensating drive never looked: every compensation ran, the run ended
    ``succeeded`` with the pause left on its row.)"""
    wf = saga(gated=True)
    with (
        Engine(store_url, workflows=[wf], lease_seconds=LEASE_S, poll_seconds=0.05) as driving,
        Engine(store_url, workflows=[wf]) as operator,
    ):
        polls = PollsSeen(driving)
        run_id = operator.start(wf, Undo()).id
        with worker_thread(driving):
            assert SIG.entered.wait(WAIT_S)
            assert operator.pause(run_id).status == "running"
            # Found twice: the first finding handed to the worker's loop before a2's
            # compensation may end.
            poll(lambda: polls.found >= 2, timeout=WAIT_S, what="two polls", every=0.01)
            SIG.gate.set()
            status_becomes(operator, run_id, "paused")
            assert kinds(operator, run_id)[-3:] == [
                j.COMPENSATION_STARTED,
                j.COMPENSATION_SUCCEEDED,
                j.RUN_PAUSED,
            ]
            assert driving.store.get_run(run_id).control is None  # type: ignore[union-attr]
            replays(operator, run_id)
            operator.unpause(run_id)
            status_becomes(operator, run_id, "succeeded")
        info = operator.get(run_id)
        assert (info.state, info.reason) == ("rollback", "compensated: a2, a")
        assert isinstance(info.context, Undo)
        assert info.context.log == ["a", "a2", "undo a2:1:undo #1", "undo a:1:undo #1"]
        replays(operator, run_id)


def test_a_shutdown_during_a_compensation_journals_its_cut_off_at_once(
    engines: tuple[Engine, Engine],
) -> None:
    """The worker's grace runs out during a compensation: the cut-off is written as it
    goes (the compensation runs again), not left for its lease to run out."""
    driving, operator = engines
    run_id = operator.start(saga(), Undo()).id
    with worker_thread(driving, grace=0.0) as shut_down:
        assert SIG.entered.wait(WAIT_S)
        shut_down()
    assert SIG.cancelled.is_set()
    info = operator.get(run_id)
    assert (info.status, info.owner) == ("retrying", None)
    last = operator.history(run_id)[-1]
    assert (last.kind, last.state, last.data["cause"]) == (
        j.STEP_INTERRUPTED,
        "rollback",
        "cut_off",
    )
    assert last.error_message == "cut off during the compensation of a (attempt 1); it runs again"
    replays(operator, run_id)
    # It runs again (its second attempt), on the next worker's claim.
    with worker_thread(driving, grace=0.0):
        assert SIG.entered.wait(WAIT_S)
        started = [e for e in operator.history(run_id) if e.kind == j.COMPENSATION_STARTED]
        assert [(e.state, e.attempt) for e in started] == [("a", 1), ("a", 2)]
