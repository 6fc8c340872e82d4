"""Run deadlines on SQLite and PostgreSQL: stored as a due time on the run, so a waiting
or retrying run is claimed when it passes and moves to on_deadline; a step in flight is cut
off (an async step cancelled) and the run moves on the same way."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Workflow
from flowloop import journal as j

HOUR = 3600.0


class Ctx(BaseModel):
    note: str = ""


def waiting() -> Workflow:
    wf = Workflow("approval", context=Ctx, deadline=timedelta(hours=2), on_deadline="expired")

    @wf.step(initial=True, next="approve")
    def ask(ctx: Ctx) -> None:
        ctx.note = "asked"

    wf.wait("approve", on={"approved": "done"})
    wf.final("done", "expired")
    return wf


def retrying() -> Workflow:
    wf = Workflow("flaky_api", context=Ctx, deadline=30 * 60, on_deadline="gave_up")

    @wf.step(
        initial=True, next="done", retry=Retry(attempts=10, backoff="fixed", base=HOUR, cap=HOUR)
    )
    def call(ctx: Ctx) -> None:
        raise ConnectionError("api down")

    wf.final("done", "gave_up")
    return wf


RELEASE = threading.Event()


def in_flight(kind: str) -> Workflow:
    wf = Workflow(f"slow_{kind}", context=Ctx, deadline=0.3, on_deadline="cut")
    if kind == "async":

        @wf.step(initial=True, next="done")
        async def work(ctx: Ctx) -> None:
            await asyncio.Event().wait()  # never set: only the deadline ends it

    else:

        @wf.step(initial=True, next="done")
        def work(ctx: Ctx) -> None:
            RELEASE.wait(30)

    @wf.step(next="handled")
    def cut(ctx: Ctx) -> None:
        ctx.note = "cut off"

    wf.final("done", "handled")
    return wf


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(auto_advance=False)


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[Engine]:
    with Engine(store_url, clock=clock) as engine:
        yield engine


def test_deadline__a_waiting_run_is_due_at_it_and_moves_to_on_deadline(
    engine: Engine, clock: FakeClock
) -> None:
    info = engine.run(waiting(), Ctx())
    assert (info.status, info.state) == ("scheduled", "approve")
    assert info.next_run_at == pytest.approx(clock.now() + 2 * HOUR, abs=1e-3)
    clock.advance(HOUR)
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(info.id).state == "approve"  # not yet
    clock.advance(HOUR + 1)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, info.state) == ("succeeded", "expired")
    passed = [e for e in engine.history(info.id) if e.kind == j.DEADLINE_PASSED]
    assert [(e.state, e.next_state) for e in passed] == [("approve", "expired")]
    assert engine.replay(info.id).differences == []


def test_deadline__counts_retry_backoff(engine: Engine, clock: FakeClock) -> None:
    info = engine.run(retrying(), Ctx())
    assert info.status == "retrying"
    # The retry would be due in an hour; the deadline (30 min) comes first.
    assert info.next_run_at == pytest.approx(clock.now() + 30 * 60, abs=1e-3)
    clock.advance(30 * 60 + 1)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, info.state) == ("succeeded", "gave_up")
    assert info.error is not None and info.error.startswith("DeadlineExceeded")


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_deadline__cuts_off_a_step_in_flight(store_url: str, kind: str) -> None:
    RELEASE.clear()
    try:
        with Engine(store_url) as real:  # the real clock: the step is cut off by asyncio
            info = real.run(in_flight(kind), Ctx())
            assert (info.status, info.state) == ("succeeded", "handled")
            assert info.context.note == "cut off"  # type: ignore[union-attr]
            kinds = [e.kind for e in real.history(info.id)]
            assert j.DEADLINE_PASSED in kinds and j.STEP_SUCCEEDED in kinds
    finally:
        RELEASE.set()


class Job(BaseModel):
    n: int = 0


def waiting_child() -> Workflow:
    wf = Workflow("waits_forever", context=Job)
    wf.wait("idle", on={"go": "done"}, initial=True)
    wf.final("done")
    return wf


def test_deadline__a_parent_past_it_stops_the_children_it_waited_for(
    engine: Engine, clock: FakeClock
) -> None:
    wf = Workflow("fan_deadline", context=Ctx, deadline=HOUR, on_deadline="expired")
    wf.map(
        "fan",
        child=waiting_child(),
        items=lambda ctx: range(3),
        context=lambda ctx, i: Job(n=i),
        on={"done": "done"},
        initial=True,
    )
    wf.final("done", "expired")
    engine.register(wf)
    started = engine.start(wf, Ctx())
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(started.id).state == "fan"
    clock.advance(HOUR + 1)
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(started.id).state == "expired"
    store = engine.store
    from flowloop.store.joins import JoinStoreMixin

    assert isinstance(store, JoinStoreMixin)
    assert store.child_counts(started.id) == {"stopped": 3}


def test_deadline__the_children_it_stops_are_told_to_listeners(
    engine: Engine, clock: FakeClock
) -> None:
    """The children a worker stops at their parent's deadline were written past the
    executor's listeners: metrics never counted them stopped, tracing never ended their
    spans. They are told as any boundary a worker commits."""
    wf = Workflow("told_deadline", context=Ctx, deadline=HOUR, on_deadline="expired")
    wf.map(
        "fan",
        child=waiting_child(),
        items=lambda ctx: range(3),
        context=lambda ctx, i: Job(n=i),
        on={"done": "done"},
        initial=True,
    )
    wf.final("done", "expired")
    engine.register(wf)
    told: list[tuple[str, str]] = []
    engine.listen(lambda record, events: told.extend((record.id, e.kind) for e in events))
    started = engine.start(wf, Ctx())
    engine.run_until_idle(idle_horizon=0)
    clock.advance(HOUR + 1)
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(started.id).state == "expired"
    store = engine.store
    from flowloop.store.joins import JoinStoreMixin

    assert isinstance(store, JoinStoreMixin)
    children = {child.id for child in store.children_of(started.id)}
    stopped = {run_id for run_id, kind in told if kind == j.RUN_STOPPED}
    assert stopped == children and len(children) == 3
