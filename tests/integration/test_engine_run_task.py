"""What a step does to the task it runs in stays its run's: ``Engine.run`` drives the run it
starts in a task of the run's own (flowloop/executor.py, ``spawn``), so neither a stop, a
lost lease, nor a step's own cancellations and context variables reach the call.

(Driving the run in the call's own task saved a task per run, ~1.5 % of a 10-step run's
instructions; these tests are what it broke: bench/README.md, "seventeenth pass".)
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import threading
from collections.abc import Callable, Sequence

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, Step, Workflow
from flowloop import journal as j
from flowloop.journal import JournalEvent, RunRecord
from flowloop.retry import Retry
from flowloop.specs import Sleep
from flowloop.store.sql import SQLStore

WAIT_S = 30.0
"""Bound of a wait that a stop ends at once (no test waits it out)."""
LEASE_S = 2.0
"""Renewed every lease/3: the lease-lost test waits one renewal for the loss."""


class Ctx(BaseModel):
    n: int = 0


def _tasks_seen(name: str, seen: list[asyncio.Task[object] | None]) -> Workflow:
    """A one-step run whose step notes the task it runs in."""
    wf = Workflow(name, context=Ctx)

    @wf.step(initial=True, next="done")
    async def look(ctx: Ctx) -> None:
        seen.append(asyncio.current_task())

    wf.final("done")
    return wf


def _stop_when_started(engine: Engine, workflow: str, state: str) -> None:
    """Ask to stop a run of ``workflow`` once its step ``state`` is journaled as started."""

    def listener(record: RunRecord, events: Sequence[JournalEvent]) -> None:
        if record.workflow == workflow and any(
            e.kind == j.STEP_STARTED and e.state == state for e in events
        ):
            engine.stop(record.id)

    engine.listeners.append(listener)


def _forever(
    name: str, cancelled: threading.Event, begin: Callable[[Ctx], None] = lambda ctx: None
) -> Workflow:
    """A run whose second step waits until it is cancelled (its first: ``begin``)."""
    wf = Workflow(name, context=Ctx)
    wf.step(name="begin", initial=True, next="wait")(begin)

    @wf.step(next="done")
    async def wait(ctx: Ctx) -> None:
        try:
            await asyncio.sleep(WAIT_S)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    wf.final("done")
    return wf


def test_arun_from_a_callers_task_drives_the_run_in_a_task_of_its_own(sqlite_url: str) -> None:
    seen: list[asyncio.Task[object] | None] = []
    wf = _tasks_seen("seen", seen)
    with Engine(sqlite_url, workflows=[wf]) as engine:

        async def caller() -> asyncio.Task[object] | None:
            info = await engine.arun(wf, Ctx())
            assert info.status == "succeeded"
            return asyncio.current_task()

        callers_task = asyncio.run(caller())
    (step_task,) = seen
    assert step_task is not None and step_task is not callers_task


def test_a_stop_during_engine_run_is_the_runs_end_not_the_calls(store_url: str) -> None:
    cancelled = threading.Event()
    wf = _forever("stopped", cancelled)
    with Engine(store_url, workflows=[wf], poll_seconds=0.05) as engine:
        _stop_when_started(engine, "stopped", "wait")
        info = engine.run(wf, Ctx())
        assert cancelled.is_set()
        assert (info.status, info.reason) == ("stopped", "stopped during step")
        engine.listeners.clear()
        # The call's loop is kept: the next call finds nothing left of the stop.
        assert engine.run(_tasks_seen("after", []), Ctx()).status == "succeeded"


def test_a_run_stopped_inside_a_step_of_engine_run_leaves_that_step_going_on(
    sqlite_url: str,
) -> None:
    """A step of ``engine.run`` awaits ``engine.arun`` of another run, which is stopped
    during its step: the inner call returns it stopped, the outer step goes on (no
    cancellation of the inner run reaches it) and its run succeeds."""
    cancelled = threading.Event()
    inner = _forever("inner", cancelled)
    outer = Workflow("outer", context=Ctx)
    ends: list[str] = []

    @outer.step(initial=True, next="done")
    async def call_inner(ctx: Ctx) -> None:
        ends.append((await engine.arun(inner, Ctx())).status)
        await asyncio.sleep(0)  # a cancellation left pending would land here
        ctx.n = 1

    outer.final("done")
    with Engine(sqlite_url, workflows=[outer, inner], poll_seconds=0.05) as engine:
        _stop_when_started(engine, "inner", "wait")
        info = engine.run(outer, Ctx())
        assert cancelled.is_set() and ends == ["stopped"]
        assert info.status == "succeeded" and engine.get(info.id).context.n == 1  # type: ignore[union-attr]


def test_a_lease_lost_during_engine_run_ends_the_drive_not_the_call(store_url: str) -> None:
    """The lease ends in the database during a step (as if its renewals came too late):
    the renewal finds it lost, the drive is cancelled and writes nothing more, and
    ``engine.run`` returns the run as the database has it (recovery settles it later)."""
    cancelled = threading.Event()
    wf = _forever("lost", cancelled)

    def end_lease(record: RunRecord, events: Sequence[JournalEvent]) -> None:
        if any(e.kind == j.STEP_STARTED and e.state == "wait" for e in events):
            assert isinstance(engine.store, SQLStore)
            with engine.store.engine.begin() as conn:
                conn.execute(
                    sa.text("UPDATE flowloop_runs SET lease_expires_at = 0 WHERE id = :id"),
                    {"id": record.id},
                )

    with Engine(store_url, workflows=[wf], lease_seconds=LEASE_S, poll_seconds=0.05) as engine:
        engine.listeners.append(end_lease)
        info = engine.run(wf, Ctx())
        assert cancelled.is_set()
        assert (info.status, info.state) == ("running", "wait")
        assert [e.kind for e in engine.history(info.id)][-1] == j.STEP_STARTED  # nothing after
        engine.listeners.clear()
        assert engine.run(_tasks_seen("after", []), Ctx()).status == "succeeded"


def test_a_step_that_cancels_its_own_task_and_handles_it_leaves_the_call_alone(
    sqlite_url: str,
) -> None:
    """A timeout helper of the kind that cancels the current task and turns the
    CancelledError into its own outcome, without ``uncancel`` (async-timeout before 4.0
    did): the run goes on, and ``Engine.run`` returns it succeeded."""
    wf = Workflow("self_cancel", context=Ctx)

    @wf.step(initial=True, next="b")
    async def a(ctx: Ctx) -> None:
        this = asyncio.current_task()
        assert this is not None
        timer = asyncio.get_running_loop().call_soon(this.cancel)
        try:
            await asyncio.sleep(WAIT_S)
        except asyncio.CancelledError:
            ctx.n = -1  # "timed out", handled
        timer.cancel()

    @wf.step(next="done")
    async def b(ctx: Ctx) -> None:
        await asyncio.sleep(0)
        ctx.n += 10

    wf.final("done")
    with Engine(sqlite_url, workflows=[wf]) as engine:
        info = engine.run(wf, Ctx())
        assert info.status == "succeeded" and engine.get(info.id).context.n == 9  # type: ignore[union-attr]


@pytest.mark.usefixtures("python_sigint")
def test_ctrl_c_a_step_suppresses_with_uncancel_still_interrupts_engine_run(
    sqlite_url: str,
) -> None:
    """A step suppresses the Ctrl-C's cancellation as asyncio's docs show (``uncancel``):
    its run goes on to its end, and ``Engine.run`` still raises KeyboardInterrupt."""
    wf = Workflow("uncancels", context=Ctx)

    @wf.step(initial=True, next="done")
    async def a(ctx: Ctx) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the runner's handler: cancel the run
        try:
            await asyncio.sleep(WAIT_S)
        except asyncio.CancelledError:
            this = asyncio.current_task()
            assert this is not None
            this.uncancel()
            ctx.n = 1

    wf.final("done")
    with Engine(sqlite_url, workflows=[wf]) as engine:
        with pytest.raises(KeyboardInterrupt):
            engine.run(wf, Ctx())
        (run,) = engine.runs()
        assert run.status == "succeeded" and run.context == Ctx(n=1)


MARK: contextvars.ContextVar[str | None] = contextvars.ContextVar("mark", default=None)


def test_a_context_variable_a_step_sets_does_not_outlive_a_durable_sleep(
    sqlite_url: str,
) -> None:
    """After a durable sleep a run may go on in another process: the step after it does
    not see what the step before it left in a context variable, in this process either."""
    seen: list[str | None] = []
    wf = Workflow("marks", context=Ctx)

    @wf.step(initial=True, next="b")
    async def a(ctx: Ctx, step: Step) -> Sleep:
        MARK.set("set by a")  # left set, as an unbalanced attach would
        return step.sleep(0.01)

    @wf.step(next="done")
    async def b(ctx: Ctx) -> None:
        seen.append(MARK.get())

    wf.final("done")
    with Engine(sqlite_url, workflows=[wf], poll_seconds=0.05) as engine:
        assert engine.run(wf, Ctx()).status == "succeeded"
    assert seen == [None]


def test_a_stop_still_reaches_a_run_after_a_nested_engine_run_in_its_step(
    sqlite_url: str,
) -> None:
    """A plain ``def`` step of ``engine.run`` (called on the loop's thread) runs a nested
    ``engine.run``, on an event loop of its own that closes when it returns. The lease
    threads then hand the outer run's stop to the outer loop again, not to the closed one
    (where it was dropped: the next step ran to its end)."""
    cancelled = threading.Event()
    inner = _tasks_seen("inner", [])

    def nest(ctx: Ctx) -> None:
        assert engine.run(inner, Ctx()).status == "succeeded"

    outer = _forever("outer", cancelled, begin=nest)
    with Engine(sqlite_url, workflows=[outer, inner], poll_seconds=0.05) as engine:
        _stop_when_started(engine, "outer", "wait")
        info = engine.run(outer, Ctx())
        assert cancelled.is_set()
        assert (info.status, info.reason) == ("stopped", "stopped during step")


def test_a_creation_that_fails_in_engine_run_forgets_the_new_runs_trace(store_url: str) -> None:
    # Engine.arun's creation forgets a run it did not make (its trace) when the store
    # raises, as ``_making`` does for the other starts (inlined there: once per run).
    workflow = Workflow("unmade_on_failure", context=Ctx)

    @workflow.step(initial=True, next="done")
    async def only(ctx: Ctx) -> None:
        pass

    workflow.final("done")
    engine = Engine(store_url, workflows=[workflow])
    forgotten: list[str] = []
    engine.trace_forget = forgotten.append

    def refuse(new: object) -> object:
        raise sa.exc.OperationalError("INSERT", {}, Exception("database is gone"))

    engine.store.create_run = refuse  # type: ignore[method-assign]
    with pytest.raises(sa.exc.OperationalError):
        engine.run(workflow, Ctx())
    assert len(forgotten) == 1 and len(forgotten[0]) == 32
    engine.close()


def test_engine_run_answers_with_the_row_its_runs_end_wrote(store_url: str) -> None:
    """``Engine.run`` answers from the record its run's end committed (the row is not read
    back): the same RunInfo as reading the run, a success's and a failure's."""
    wf = Workflow("answered", context=Ctx)

    @wf.step(initial=True, next="done")
    async def first(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    bad = Workflow("answered_bad", context=Ctx)

    @bad.step(initial=True, next="done", retry=Retry(attempts=1))
    def fails(ctx: Ctx) -> None:
        raise ValueError("no")

    bad.final("done")
    with Engine(store_url, workflows=[wf, bad]) as engine:
        for workflow in (wf, bad):
            info = engine.run(workflow, Ctx())
            assert info.owner is None and info.finished
            assert info == engine.get(info.id)
