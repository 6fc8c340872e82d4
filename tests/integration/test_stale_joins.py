"""A join completed by children's ends that must not take their parent on, on SQLite and
PostgreSQL:

* a child that ends after its parent has gone on from the call or map state (its deadline
  passed while another worker ran the child, which honours the stop at its next boundary)
  leaves the parent where it has gone (before, it made the parent due at once, wherever
  it was: a parent asleep for an hour after its deadline ran its next step at once);
* an operator's stop of a parent stops its children first, and their ends complete its
  join: a worker that claims the parent then honours its stop instead of joining them
  (before, it took the parent's failure route, and the stop was lost on a finished run)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from pydantic import BaseModel
from storekit import start_step

from flowloop import Engine, FakeClock, Step, Workflow
from flowloop import journal as j
from flowloop.journal import JournalEvent, RunRecord
from flowloop.store import Boundary, Fence
from flowloop.store.joins import JoinStoreMixin

HOUR = 3600.0
OTHER = "other-worker"


class Ctx(BaseModel):
    notes: list[str] = []


def child() -> Workflow:
    wf = Workflow("straggler", context=Ctx)
    wf.wait("idle", on={"go": "work"}, initial=True)

    @wf.step(next="done")
    def work(ctx: Ctx) -> None: ...

    wf.final("done")
    return wf


def parent() -> Workflow:
    """Past its deadline it cleans up, then sleeps an hour before its next step."""
    wf = Workflow("gone_on", context=Ctx, deadline=HOUR, on_deadline="cleanup")
    wf.call(
        "sub",
        child=child(),
        context=lambda ctx: Ctx(),
        on={"succeeded": "finished", "failed": "finished", "stopped": "finished"},
        initial=True,
    )

    @wf.step(next="later")
    def cleanup(ctx: Ctx, step: Step) -> object:
        ctx.notes.append("cleanup")
        return step.sleep(timedelta(hours=1))

    @wf.step(next="finished")
    def later(ctx: Ctx) -> None:
        ctx.notes.append("later")

    wf.final("finished")
    return wf


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(auto_advance=False)


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[Engine]:
    with Engine(store_url, clock=clock) as engine:
        yield engine


def stop_as_its_worker(engine: Engine, run_id: str, clock: FakeClock) -> None:
    """What the other worker writes when it honours the stop asked of its run."""
    stored = engine.store.get_run(run_id)
    assert stored is not None and stored.control == "stop"
    record = stored.record
    stopped = j.JournalEvent(
        run_id=run_id,
        seq=record.last_seq + 1,
        kind=j.RUN_STOPPED,
        at=clock.now(),
        state=record.state,
        worker=OTHER,
        data={"reason": "stopped during step"},
    )
    boundary = Boundary(
        events=[stopped],
        record=j.apply(record, stopped),
        fence=Fence(OTHER, stored.lease_epoch),
        clear_control=True,
        seen_control=stored.control,
    )
    assert engine.store.write([boundary]) == [True]


def test_a_child_ending_after_its_parent_went_on_leaves_the_parent_asleep(
    engine: Engine, clock: FakeClock
) -> None:
    wf = parent()
    engine.register(wf)
    run = engine.start(wf, Ctx())
    engine.run_until_idle(idle_horizon=0)  # the parent calls its child, which waits
    store = engine.store
    assert isinstance(store, JoinStoreMixin)
    (kid,) = store.children_of(run.id)
    engine.send(kid.id, "go")  # due at its step: another worker takes it and runs it
    (claimed,) = store.claim(
        worker=OTHER, now=clock.now(), limit=1, lease_seconds=10 * HOUR, run_ids=[kid.id]
    )
    assert store.write([start_step(claimed, OTHER)]) == [True]

    clock.advance(HOUR + 1)  # the parent's deadline passes: it asks its child to stop
    engine.run_until_idle(idle_horizon=0)
    asleep = engine.get(run.id)
    assert (asleep.status, asleep.state) == ("scheduled", "later")
    sleep_end = clock.now() + HOUR
    assert asleep.next_run_at == pytest.approx(sleep_end, abs=1e-3)

    stop_as_its_worker(engine, kid.id, clock)  # the child's end completes the join
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(run.id)
    assert (info.status, info.state) == ("scheduled", "later")
    assert info.next_run_at == pytest.approx(sleep_end, abs=1e-3)  # still asleep
    assert info.context.notes == ["cleanup"]  # its next step has not run early
    assert engine.get(kid.id).status == "stopped"

    clock.advance(HOUR)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(run.id)
    assert (info.status, info.state) == ("succeeded", "finished")
    assert info.context.notes == ["cleanup", "later"]
    assert engine.replay(run.id).differences == []


def looping() -> Workflow:
    """A step before its call state, so that a retry from it calls a second child."""
    wf = Workflow("calls_again", context=Ctx)

    @wf.step(initial=True, next="sub")
    def prepare(ctx: Ctx) -> None: ...

    wf.call(
        "sub",
        child=child(),
        context=lambda ctx: Ctx(),
        on={"succeeded": "finished", "failed": "finished", "stopped": "finished"},
    )
    wf.final("finished")
    return wf


def test_a_child_of_an_earlier_visit_ending_leaves_its_parent_waiting_for_the_later_one(
    engine: Engine, clock: FakeClock
) -> None:
    wf = looping()
    engine.register(wf)
    run = engine.start(wf, Ctx())
    engine.run_until_idle(idle_horizon=0)
    store = engine.store
    assert isinstance(store, JoinStoreMixin)
    (first,) = store.children_of(run.id)
    engine.send(first.id, "go")  # another worker runs it ...
    (claimed,) = store.claim(
        worker=OTHER, now=clock.now(), limit=1, lease_seconds=10 * HOUR, run_ids=[first.id]
    )
    assert store.write([start_step(claimed, OTHER)]) == [True]
    engine.stop(run.id)  # ... and is asked to stop with its parent
    engine.retry(run.id, from_state="prepare")
    engine.run_until_idle(idle_horizon=0)  # the parent calls a second child, which waits
    waiting = [e for e in engine.history(run.id) if e.kind == j.CHILDREN_STARTED]
    assert len(waiting) == 2

    stop_as_its_worker(engine, first.id, clock)  # the first visit's join is complete now
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(run.id)
    assert (info.status, info.state, info.next_run_at) == ("scheduled", "sub", None)
    # Not woken for the first child's end: no "waits again" entry.
    assert [e for e in engine.history(run.id) if e.kind == j.CHILDREN_STARTED] == waiting
    assert engine.replay(run.id).differences == []


def order() -> Workflow:
    wf = Workflow("stopped_order", context=Ctx)
    wf.call(
        "pack",
        child=child(),
        context=lambda ctx: Ctx(),
        on={"succeeded": "ship", "failed": "refund", "stopped": "refund"},
        initial=True,
    )

    @wf.step(next="finished")
    def ship(ctx: Ctx) -> None:
        ctx.notes.append("ship")

    @wf.step(next="finished")
    def refund(ctx: Ctx) -> None:
        ctx.notes.append("refund")

    wf.final("finished")
    return wf


def test_a_parent_stopped_by_an_operator_is_not_joined_by_a_worker_meanwhile(
    engine: Engine,
) -> None:
    wf = order()
    engine.register(wf)
    run = engine.start(wf, Ctx())
    engine.run_until_idle(idle_horizon=0)  # it calls its child, which waits
    store = engine.store
    assert isinstance(store, JoinStoreMixin)
    (kid,) = store.children_of(run.id)

    def a_worker_polls(record: RunRecord, events: list[JournalEvent]) -> None:
        # Between the cascade's stop of the child (which completes the join and makes the
        # parent due) and the parent's own: a worker's poll comes at that instant.
        if record.id == kid.id and any(e.kind == j.RUN_STOPPED for e in events):
            engine.run_until_idle(idle_horizon=0)

    engine.listen(a_worker_polls, direct=True)
    info = engine.stop(run.id)
    assert (info.status, info.state) == ("stopped", "pack")
    assert info.context.notes == []  # its failure route was not taken
    assert engine.get(kid.id).status == "stopped"
    assert store.get_run(run.id).control is None  # type: ignore[union-attr]
    assert engine.replay(run.id).differences == []
