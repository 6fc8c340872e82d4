"""An operator's ``unpause`` of a running run withdraws the pause it asked for: the run goes
on at its next boundary, even when its worker has already read the pause request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from polling import poll
from pydantic import BaseModel
from sqlalchemy.exc import OperationalError

from flowloop import Engine, Workflow, frozen
from flowloop import journal as j
from flowloop.engine import RunInfo
from flowloop.errors import InvalidTransition
from flowloop.run_requests import HONOUR_ATTEMPTS

WAIT_S = 30.0
STEP_WAIT_S = 3 * WAIT_S
"""How long the long step waits for its release: longer than any wait of the test, so a
test that fails its wait never sees the step give up (and the run retried) first."""


class Ctx(BaseModel):
    n: int = 0


def _long_step_workflow(started: threading.Event, release: threading.Event) -> Workflow:
    workflow = Workflow("withdrawn", context=Ctx)

    @workflow.step(initial=True, next="then")
    async def long_step(ctx: Ctx) -> None:
        started.set()
        assert await asyncio.to_thread(release.wait, STEP_WAIT_S)
        ctx.n = 1

    @workflow.step(next="done")
    async def then(ctx: Ctx) -> None:
        ctx.n += 1

    workflow.final("done")
    return workflow


def _calling(child: Workflow) -> Workflow:
    """A parent that calls ``child`` and ends when it has."""
    parent = Workflow("parent", context=Ctx)
    parent.call(
        "calling",
        child=child,
        context=lambda ctx: Ctx(),
        on={"succeeded": "done"},
        result=lambda ctx, got: setattr(ctx, "n", got.n),
        initial=True,
    )
    parent.final("done")
    return parent


class _Call:
    """``engine.run(workflow)`` called in a thread of its own, as a web app's request
    would; ``executor`` is that thread's, ``info`` what the call returned."""

    def __init__(self, engine: Engine, workflow: Workflow, release: threading.Event) -> None:
        self.executor: Any = None
        self.info: RunInfo | None = None
        self.release = release
        """Set: the long step returns."""

        def call() -> None:
            self.executor = engine._executor()
            self.info = engine.run(workflow, Ctx())

        self.thread = threading.Thread(target=call)

    def ended(self) -> RunInfo:
        """What the call returned, once it has (the run ended without a release)."""
        self.thread.join(WAIT_S)
        assert self.info is not None, "the call did not return"
        return self.info


@contextmanager
def _in_its_step(
    engine: Engine, workflow: Workflow, started: threading.Event, release: threading.Event
) -> Iterator[_Call]:
    """A call of ``workflow`` whose first step has started; at the end its step is released
    and the call awaited."""
    call = _Call(engine, workflow, release)
    call.thread.start()
    try:
        assert started.wait(WAIT_S)
        yield call
    finally:
        release.set()
        call.thread.join(WAIT_S)


@contextmanager
def _a_run_in_its_long_step(store_url: str) -> Iterator[tuple[Engine, _Call, str]]:
    """An engine polling requests every 0.05 s, and a call of :func:`_long_step_workflow`
    in its long step; with the run's id."""
    started, release = threading.Event(), threading.Event()
    workflow = _long_step_workflow(started, release)
    with (
        Engine(store_url, workflows=[workflow], poll_seconds=0.05) as engine,
        _in_its_step(engine, workflow, started, release) as call,
    ):
        (run,) = engine.runs()
        yield engine, call, run.id


@contextmanager
def _a_child_in_its_long_step(store_url: str) -> Iterator[tuple[Engine, _Call, Any, Any]]:
    """An engine polling requests every 0.05 s, and a call of a parent whose child is in
    its long step: with the call, the parent's run and the child's (``call.release``
    ends the step; at the end it is released anyway and the call awaited)."""
    started, release = threading.Event(), threading.Event()
    child = _long_step_workflow(started, release)
    parent = _calling(child)
    with (
        Engine(store_url, workflows=[parent, child], poll_seconds=0.05) as engine,
        _in_its_step(engine, parent, started, release) as call,
    ):
        kid = next(run for run in engine.runs() if run.workflow == child.name)
        top = next(run for run in engine.runs() if run.workflow == parent.name)
        yield engine, call, top, kid


@contextmanager
def _a_queued_run(store_url: str) -> Iterator[tuple[Engine, str, threading.Event]]:
    """An engine and a run of :func:`_long_step_workflow` started, not claimed yet (its
    step returns at once); with the event its step sets when it starts."""
    started, release = threading.Event(), threading.Event()
    release.set()
    workflow = _long_step_workflow(started, release)
    with Engine(store_url, workflows=[workflow]) as engine:
        yield engine, engine.start(workflow, Ctx()).id, started


def _kept_then_dropped(
    kept: dict[str, str], run_id: str, withdraw: Callable[[], None], pause: str = "pause"
) -> None:
    """Wait until the executor keeps ``run_id``'s pause (it would pause there; ``pause``:
    an operator's own, or its parent's), call ``withdraw``, and wait until the executor
    has dropped the pause."""
    poll(
        lambda: kept.get(run_id) == pause,
        timeout=WAIT_S,
        what="the executor to keep the pause",
        every=0.01,
    )
    withdraw()
    poll(
        lambda: run_id not in kept,
        timeout=WAIT_S,
        what="the executor to drop the withdrawn pause",
        every=0.01,
    )


def test_an_unpause_after_the_worker_read_the_pause_lets_the_run_go_on(store_url: str) -> None:
    """The pause is read by the executor's poll while the step runs; the unpause clears the
    request before the step ends. The polls after it hand the executor the requests
    without that pause, and the boundary goes on: the run succeeds instead of pausing.
    (Without the fix the wait for the pause to be dropped fails after ``WAIT_S``.)"""
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        engine.pause(run_id)

        def unpause() -> None:
            assert engine.unpause(run_id).status == "running"

        _kept_then_dropped(call.executor._controls, run_id, unpause)
        call.release.set()
        info = call.ended()
        assert "run_paused" not in [event.kind for event in engine.history(run_id)]
    assert info.status == "succeeded", info
    assert info.context.n == 2  # type: ignore[attr-defined]


def test_a_pause_that_is_not_withdrawn_still_pauses_the_run(store_url: str) -> None:
    """Requests handed over after the pause still hold it: the run pauses at its boundary,
    and the polls that follow (with the same request) do not drop it."""
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        guard = call.executor.leases.guard
        before = guard.handed
        engine.pause(run_id)
        poll(
            lambda: guard.handed > before + 2,
            timeout=WAIT_S,
            what="three polls with the pause handed over",
            every=0.01,
        )
        call.release.set()
        assert call.ended().status == "paused", call.info
        assert engine.unpause(run_id).status in ("scheduled", "running", "succeeded")
        assert engine.run_until_idle() is not None
        assert engine.get(run_id).status == "succeeded"


def test_an_unpause_does_not_withdraw_a_stop_made_meanwhile(store_url: str) -> None:
    """``unpause`` reads the run (a pause pending), then withdraws the pause; a stop that an
    operator asks for in between stays (before, the request was cleared whatever it had
    become, and the run went on): the unpause is refused and the run is stopped."""
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        engine.pause(run_id)
        store: Any = engine.store
        read = store.get_run

        def stop_lands_after_the_read(wanted: str) -> Any:
            row = read(wanted)
            del store.get_run  # once
            store.request_control(wanted, "stop")  # an operator's stop, meanwhile
            return row

        store.get_run = stop_lands_after_the_read
        with pytest.raises(InvalidTransition):
            engine.unpause(run_id)
        row = engine.store.get_run(run_id)
        assert row is not None
        # Pending, or honoured already (the worker polls every 0.05 s).
        assert row.control == "stop" or row.record.status == "stopped", row
        info = call.ended()  # the stop cuts the step off
    assert info.status == "stopped", info


def test_unpausing_a_parent_withdraws_its_childs_pending_pause(store_url: str) -> None:
    """A parent waits in a call state while its child runs a long step. Pausing the parent
    pauses it at once and asks the child to pause at its boundary; unpausing the parent
    withdraws that request too (before, only children already paused were unpaused: the
    child paused at its boundary, and the parent waited for it for ever)."""
    with _a_child_in_its_long_step(store_url) as (engine, call, top, kid):
        engine.pause(top.id)
        _kept_then_dropped(
            call.executor._controls, kid.id, lambda: engine.unpause(top.id), "parent pause"
        )
        call.release.set()
        info = call.ended()
        assert engine.get(kid.id).status == "succeeded"
    assert info.status == "succeeded", info
    assert info.context.n == 2  # type: ignore[attr-defined]


def test_unpausing_a_parent_leaves_its_childs_own_pending_pause(store_url: str) -> None:
    """The child in its long step is paused by an operator, then its parent: unpausing the
    parent leaves the child's own request in place (before, it was withdrawn too)."""
    with _a_child_in_its_long_step(store_url) as (engine, call, top, kid):
        engine.pause(kid.id)
        engine.pause(top.id)
        engine.unpause(top.id)
        row = engine.store.get_run(kid.id)
        assert row is not None and row.control == "pause"
        _kept_then_dropped(call.executor._controls, kid.id, lambda: engine.unpause(kid.id))
        call.release.set()
        info = call.ended()
    assert info.status == "succeeded", info


def test_a_pause_after_a_stop_is_refused_and_the_run_stops(store_url: str) -> None:
    """A running run asked to stop, then to pause: the pause is refused and the stop stays
    (before, the pause replaced it, and the run paused instead of stopping)."""
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        engine.stop(run_id)
        # Refused as "stopping" while the stop is pending, as "stopped" once honoured.
        with pytest.raises(InvalidTransition, match="stopp"):
            engine.pause(run_id)
        info = call.ended()  # the stop cuts the step off
    assert info.status == "stopped", info


def test_a_pause_of_a_queued_run_with_a_stop_pending_is_refused(store_url: str) -> None:
    """A run not running whose row holds a stop for its next claim (a child asked to stop
    while released between steps, say): a pause does not pause it and wipe the stop."""
    workflow = _long_step_workflow(threading.Event(), threading.Event())
    with Engine(store_url, workflows=[workflow]) as engine:
        run = engine.start(workflow, Ctx())
        assert engine.store.request_control(run.id, "stop")
        with pytest.raises(InvalidTransition, match="is stopping"):
            engine.pause(run.id)
        row = engine.store.get_run(run.id)
        assert row is not None and row.control == "stop" and row.record.status != "paused"


def _polls_frozen(call: _Call, run_id: str) -> None:
    """Wait until the executor keeps ``run_id``'s pause, then hand it no poll's requests
    from then on: what an operator does next lands within a poll, before the boundary."""
    poll(
        lambda: call.executor._controls.get(run_id) == "pause",
        timeout=WAIT_S,
        what="the executor to keep the pause",
        every=0.01,
    )
    call.executor.leases.guard._controls = lambda requests: None


def test_a_stop_after_the_worker_read_the_pause_stops_the_run(store_url: str) -> None:
    """The worker has read the pause; a stop lands before its next poll. The boundary reads
    the request again and honours the stop (before, it paused the run and cleared the stop:
    the operator's stop was lost)."""
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        engine.pause(run_id)
        _polls_frozen(call, run_id)
        assert engine.stop(run_id).status == "running"  # asked of its worker
        call.release.set()
        info = call.ended()
        kinds = [event.kind for event in engine.history(run_id)]
    assert info.status == "stopped", info
    assert "run_paused" not in kinds, kinds
    row = engine.store.get_run(run_id)
    assert row is not None and row.control is None


def test_an_unpause_before_the_workers_next_poll_lets_the_run_go_on(store_url: str) -> None:
    """The worker has read the pause; the unpause withdraws it before the next poll could
    tell the worker. The boundary reads the request again and goes on (before, the run
    paused although the unpause had said it would not)."""
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        engine.pause(run_id)
        _polls_frozen(call, run_id)
        assert engine.unpause(run_id).status == "running"
        call.release.set()
        info = call.ended()
    assert info.status == "succeeded", info
    assert info.context.n == 2  # type: ignore[attr-defined]


def test_a_pause_of_a_queued_run_whose_stop_landed_after_the_read_is_refused(
    store_url: str,
) -> None:
    """``pause`` reads a queued run (no request), and a stop is asked for before its entry
    is written: the entry is refused, the pause too ("stopping"), and the stop stays for
    the run's claim (before, the pause was written and cleared the stop)."""
    with _a_queued_run(store_url) as (engine, run_id, started):
        store: Any = engine.store
        write = store.write

        def stop_lands_first(boundaries: Any) -> Any:
            del store.write  # once
            store.request_control(run_id, "stop")  # an operator's stop, meanwhile
            return write(boundaries)

        store.write = stop_lands_first
        with pytest.raises(InvalidTransition, match="stopping"):
            engine.pause(run_id)
        assert engine.run_until_idle() is not None
        info = engine.get(run_id)
    assert info.status == "stopped", info
    assert not started.is_set()  # honoured at its claim, before its step


def test_a_pause_withdrawn_after_the_claim_read_it_lets_the_run_go_on(store_url: str) -> None:
    """A queued run with a pause pending is claimed (the claim reads the request), and the
    pause is withdrawn before the claimer honours it: the claimer reads the request again
    and runs the run (before, it paused it)."""
    with _a_queued_run(store_url) as (engine, run_id, started):
        store: Any = engine.store
        assert store.request_control(run_id, "pause")
        claim = store.claim
        withdrawn: list[bool] = []

        def withdrawn_after_the_read(**kwargs: Any) -> Any:
            rows = claim(**kwargs)
            if rows and not withdrawn:
                assert rows[0].control == "pause"
                withdrawn.append(store.withdraw_control(run_id, "pause"))
            return rows

        store.claim = withdrawn_after_the_read
        assert engine.run_until_idle() is not None
        info = engine.get(run_id)
    assert withdrawn == [True]
    assert info.status == "succeeded", info
    assert started.is_set()


def _then_meanwhile(call: _Call, act: Callable[[str], None]) -> None:
    """After the executor reads a run's request again (before its boundary honours it),
    ``act(run_id)`` once: what an operator does between that read and the write."""
    executor = call.executor
    confirmed = executor._confirmed_control

    def and_then(run_id: str) -> str | None:
        action: str | None = confirmed(run_id)
        del executor._confirmed_control  # once
        act(run_id)
        return action

    executor._confirmed_control = and_then


def test_a_pause_withdrawn_between_the_read_and_the_write_lets_the_run_go_on(
    store_url: str,
) -> None:
    """The boundary's honouring write is refused (the request changed), the row is read
    again: no request now, and the run goes on with its step's outcome (before the retry,
    the run was given up as lost: its step ran again after the lease ran out)."""
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        engine.pause(run_id)
        _polls_frozen(call, run_id)
        _then_meanwhile(call, lambda run: engine.store.withdraw_control(run, "pause"))
        call.release.set()
        info = call.ended()
        kinds = [event.kind for event in engine.history(run_id)]
    assert info.status == "succeeded", info
    assert info.context.n == 2  # type: ignore[attr-defined]
    assert kinds.count("step_started") == 2 and "step_interrupted" not in kinds, kinds
    assert call.executor.stats.lost_leases == 0


def test_a_stop_between_the_read_and_the_write_stops_the_run_with_its_steps_outcome(
    store_url: str,
) -> None:
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        engine.pause(run_id)
        _polls_frozen(call, run_id)
        _then_meanwhile(call, lambda run: engine.store.request_control(run, "stop"))
        call.release.set()
        info = call.ended()
        kinds = [event.kind for event in engine.history(run_id)]
    assert info.status == "stopped", info
    assert kinds[-2:] == ["step_succeeded", "run_stopped"], kinds
    assert call.executor.stats.lost_leases == 0


def test_a_database_error_reading_the_request_again_honours_the_polled_one(
    store_url: str,
) -> None:
    """The read before the boundary fails as an outage does: the request the last poll
    read is honoured (the write is fenced on it), not an error out of the run's drive."""
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        engine.pause(run_id)
        _polls_frozen(call, run_id)
        store: Any = engine.store
        read = store.pending_controls

        def out_in_the_calls_thread(*, worker: str) -> Any:
            if threading.current_thread() is call.thread:
                raise OperationalError("SELECT control", {}, Exception("database is locked"))
            return read(worker=worker)

        store.pending_controls = out_in_the_calls_thread
        call.release.set()
        info = call.ended()
        del store.pending_controls
    assert info.status == "paused", info


def test_unpausing_a_run_with_a_stop_pending_leaves_the_stop(store_url: str) -> None:
    """A paused run asked to stop meanwhile (a stop nobody has honoured on its row): the
    unpause takes the pause away, not the stop, and the run's next claim stops it (before,
    the unpause cleared the stop and the run ran to its end)."""
    with _a_queued_run(store_url) as (engine, run_id, started):
        assert engine.pause(run_id).status == "paused"
        assert engine.store.request_control(run_id, "stop")
        assert engine.unpause(run_id).status == "scheduled"
        engine.run_until_idle()
        info = engine.get(run_id)
    assert info.status == "stopped", info
    assert not started.is_set()


def test_an_operators_pause_of_a_parent_paused_run_leaves_a_stop_pending(
    store_url: str,
) -> None:
    """A run its parent paused, asked to stop meanwhile, then paused by an operator: the
    pause is refused ("stopping"), as for a run not paused yet, the stop stays on its row,
    and the run stops at its next claim (before, the operator's pause, made its own,
    cleared the stop)."""
    with _a_queued_run(store_url) as (engine, run_id, started):
        stored = engine.store.get_run(run_id)
        assert stored is not None
        kind, data = j.control_entry("parent pause")
        assert engine.operate(stored, kind, state=stored.record.state, data=data)
        assert engine.get(run_id).reason == "parent paused"
        assert engine.store.request_control(run_id, "stop")
        with pytest.raises(InvalidTransition, match="stopping"):
            engine.pause(run_id)
        row = engine.store.get_run(run_id)
        assert row is not None and row.control == "stop"
        engine.unpause(run_id)
        engine.run_until_idle()
        info = engine.get(run_id)
    assert info.status == "stopped", info
    assert not started.is_set()


def test_a_request_that_keeps_changing_gives_the_run_up_after_so_many_writes(
    store_url: str,
) -> None:
    """Each write honouring the request is refused because it changed again (a pause, a
    parent's pause, a pause ...): after HONOUR_ATTEMPTS writes the run is given up as a
    lost lease, its step's outcome not journaled (its next claim runs the step again)."""
    with _a_run_in_its_long_step(store_url) as (engine, call, run_id):
        engine.pause(run_id)
        _polls_frozen(call, run_id)
        executor = call.executor
        read_again = executor._request_now
        reads: list[str | None] = []
        flip = {"pause": "parent pause", "parent pause": "pause"}

        def and_changed(record: Any, fence: Any) -> tuple[bool, str | None]:
            lost, action = read_again(record, fence)
            reads.append(action)
            assert action is not None
            engine.store.request_control(run_id, flip[action])  # changed again
            return lost, action

        executor._request_now = and_changed
        _then_meanwhile(call, lambda run: engine.store.request_control(run, "parent pause"))
        call.release.set()
        call.ended()
        kinds = [event.kind for event in engine.history(run_id)]
    assert len(reads) == HONOUR_ATTEMPTS, reads
    assert executor.stats.lost_leases == 1
    assert "step_succeeded" not in kinds and "run_paused" not in kinds, kinds


@contextmanager
def _asked_after_it_was_let_go(store_url: str, action: str) -> Iterator[tuple[Engine, str]]:
    """A run that waits for an event (no timeout), asked for ``action`` by an operator who
    read it running (its worker let it go into the wait meanwhile); the engine and its id."""
    workflow = Workflow("waits", context=Ctx)
    workflow.wait("idle", on={"go": "done"}, initial=True)
    workflow.final("done")
    with Engine(store_url, workflows=[workflow]) as engine:
        run_id = engine.start(workflow, Ctx()).id
        stored = engine.store.get_run(run_id)
        assert stored is not None and stored.owner is None
        as_read = frozen.replaced(stored, record=frozen.replaced(stored.record, status="running"))
        assert engine._request(as_read, action)
        yield engine, run_id


def test_a_stop_asked_of_a_worker_that_let_the_run_go_is_written(store_url: str) -> None:
    """``stop`` read the run running and asked its worker; the worker had let it go
    meanwhile, into a wait with no timeout (no claim would come to honour the request):
    the stop is written at once (before, the request stayed on a run nobody would take up,
    and the run waited on)."""
    with _asked_after_it_was_let_go(store_url, "stop") as (engine, run_id):
        info = engine.get(run_id)
        row = engine.store.get_run(run_id)
    assert info.status == "stopped", info
    assert row is not None and row.control is None


@pytest.mark.parametrize("own", ["pause", "stop"])
def test_a_parents_pause_leaves_a_queued_childs_own_request(store_url: str, own: str) -> None:
    """A queued run with its own pause (or stop) pending, asked for its parent's pause:
    the parent's pause is not made, the run's own request stays and is honoured at its
    claim (before, the parent's pause was written over it; through ``engine.pause`` of a
    parent that happened when the child's own pause landed after the cascade had listed
    the child: the next test)."""
    with _a_queued_run(store_url) as (engine, run_id, started):
        assert engine.store.request_control(run_id, own)
        stored = engine.store.get_run(run_id)
        assert stored is not None
        assert engine._request(stored, "parent pause") is False
        row = engine.store.get_run(run_id)
        assert row is not None and (row.record.status, row.control) == ("scheduled", own)
        engine.run_until_idle()
        info = engine.get(run_id)
    assert info.status == ("paused" if own == "pause" else "stopped"), info
    assert info.reason != "parent paused"
    assert not started.is_set()


def _family() -> tuple[Workflow, Workflow, Workflow]:
    """A parent calling a child calling a grandchild that waits for an event (no timeout):
    once driven, the child is queued in its call state, waiting for its grandchild."""
    grand = Workflow("grand", context=Ctx)
    grand.wait("parked", initial=True, on={"go": "done"})
    grand.final("done")
    child = Workflow("child", context=Ctx)
    child.call(
        "calling", child=grand, context=lambda c: Ctx(), on={"succeeded": "done"}, initial=True
    )
    child.final("done")
    parent = Workflow("parent", context=Ctx)
    parent.call(
        "calling", child=child, context=lambda c: Ctx(), on={"succeeded": "done"}, initial=True
    )
    parent.final("done")
    return parent, child, grand


def test_a_childs_own_pause_landing_after_the_cascade_listed_it_stays(store_url: str) -> None:
    """The parent's pause lists its children, then an operator's pause of the (queued)
    child lands as a request, then the cascade reaches the child: the child's own pause
    stays, and unpausing the parent leaves it (before, the parent's pause was written over
    it, and unpausing the parent unpaused the child: the operator's pause was lost)."""
    parent, child, grand = _family()
    with Engine(store_url, workflows=[parent, child, grand]) as engine:
        top = engine.start(parent, Ctx()).id
        engine.run_until_idle()
        store: Any = engine.store
        (kid,) = [run.id for run in store.live_children(top)]
        listed = store.live_children(top)  # as the cascade lists them: no request yet
        assert engine.store.request_control(kid, "pause")  # the operator's, meanwhile
        live_children = store.live_children
        store.live_children = lambda run_id: listed if run_id == top else live_children(run_id)
        try:
            engine.pause(top)
        finally:
            del store.live_children
        engine.unpause(top)
        row = engine.store.get_run(kid)
    assert row is not None
    assert (row.control, row.record.reason) == ("pause", None), row


def _parent_paused_child(engine: Engine, parent: Workflow) -> tuple[str, str]:
    """A parent of :func:`_family` driven into its call state and paused: its queued child
    paused by the parent at once. The parent's id and the child's."""
    top = engine.start(parent, Ctx()).id
    engine.run_until_idle()
    store: Any = engine.store
    (kid,) = [run.id for run in store.live_children(top)]
    engine.pause(top)
    assert engine.get(kid).reason == "parent paused"
    return top, kid


def test_an_operators_pause_landing_on_a_parent_paused_child_stays_when_the_parent_unpauses(
    store_url: str,
) -> None:
    """An operator's pause read the child running and its request landed after the parent's
    pause had paused it: unpausing the parent leaves the child paused, now by the operator
    (before, the cascaded unpause cleared the request with its entry: the pause was lost
    and the child ran on)."""
    parent, child, grand = _family()
    with Engine(store_url, workflows=[parent, child, grand]) as engine:
        top, kid = _parent_paused_child(engine, parent)
        assert engine.store.request_control(kid, "pause")  # landed after the cascade
        engine.unpause(top)
        info = engine.get(kid)
        row = engine.store.get_run(kid)
    assert (info.status, info.reason) == ("paused", "paused"), info
    assert row is not None and row.control is None


def test_a_pause_asked_of_a_worker_that_let_the_run_go_is_written(store_url: str) -> None:
    """``pause`` read the child running and asked its worker; the worker had let it go
    meanwhile (its parent's pause paused it): the pause is written at once and is the
    child's own, so unpausing the parent leaves it (before, the request stayed on a run
    nobody would take up, and the parent's unpause cleared it)."""
    parent, child, grand = _family()
    with Engine(store_url, workflows=[parent, child, grand]) as engine:
        top, kid = _parent_paused_child(engine, parent)
        stored = engine.store.get_run(kid)
        assert stored is not None and stored.owner is None
        as_read = frozen.replaced(stored, record=frozen.replaced(stored.record, status="running"))
        assert engine._request(as_read, "pause")
        row = engine.store.get_run(kid)
        assert row is not None and (row.record.reason, row.control) == ("paused", None), row
        engine.unpause(top)
        info = engine.get(kid)
    assert (info.status, info.reason) == ("paused", "paused"), info


def test_a_pause_asked_of_a_worker_that_let_the_run_go_into_a_wait_is_written(
    store_url: str,
) -> None:
    """As for a stop: a pause that reached a run its worker let go into a wait without a
    timeout pauses it at once (before, the request stayed until an event came)."""
    with _asked_after_it_was_let_go(store_url, "pause") as (engine, run_id):
        info = engine.get(run_id)
        row = engine.store.get_run(run_id)
        assert (info.status, info.reason) == ("paused", "paused"), info
        assert row is not None and row.control is None
        engine.unpause(run_id)
        assert engine.send(run_id, "go").status == "applied"
        assert engine.get(run_id).status == "succeeded"


def test_a_parent_unpaused_in_its_call_state_waits_again_and_says_so(store_url: str) -> None:
    """Unpausing a parent waiting for its children makes it due: its claim finds them all
    made and waits again. That entry was a second `children_started` like the first (the
    history and the diagram showed the children started twice); it now says `again`."""
    from flowloop.cli.views import describe_entry
    from flowloop.render_overlay import RunOverlay

    parent, child, grand = _family()
    with Engine(store_url, workflows=[parent, child, grand]) as engine:
        top = engine.start(parent, Ctx()).id
        engine.run_until_idle()
        engine.pause(top)
        engine.unpause(top)
        engine.run_until_idle()
        history = engine.history(top)
        started = [e for e in history if e.kind == j.CHILDREN_STARTED]
        assert [e.data.get("again", False) for e in started] == [False, True]
        assert started[0].data["join"] == started[1].data["join"]
        assert describe_entry(started[1]) == "waits again for 1 child run(s) of child"
        assert RunOverlay.from_journal(history).notes == {"calling": ("1 child run(s) of child",)}
        assert engine.get(top).status == "scheduled"  # waiting for its child, as before
        assert not engine.replay(top).differences


def test_a_parents_pause_reaching_a_child_let_go_into_a_wait_is_written(store_url: str) -> None:
    """The cascade read the child running and asked its worker; the worker had let it go
    into a wait without a timeout: the child is paused by its parent at once (before, the
    request stayed on it, and it took events while its parent was paused)."""
    parent, child, grand = _family()
    with Engine(store_url, workflows=[parent, child, grand]) as engine:
        engine.start(parent, Ctx())
        engine.run_until_idle()
        (waiting_grandchild,) = engine.runs(workflow="grand")
        stored = engine.store.get_run(waiting_grandchild.id)
        assert stored is not None and stored.owner is None
        as_read = frozen.replaced(stored, record=frozen.replaced(stored.record, status="running"))
        assert engine._request(as_read, "parent pause")
        row = engine.store.get_run(waiting_grandchild.id)
    assert row is not None
    assert (row.record.status, row.record.reason, row.control) == (
        "paused",
        "parent paused",
        None,
    ), row
