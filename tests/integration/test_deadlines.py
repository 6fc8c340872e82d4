"""Run deadlines on SQLite and PostgreSQL: stored as a due time on the run, so a waiting
or retrying run is claimed when it passes and moves to on_deadline; a step in flight is cut
off (an async step cancelled) and the run moves on the same way."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.store.joins import JoinStoreMixin
from flowloop.testing import SimulatedCrash, TestEngine

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


# -- a deadline that passes while no attempt runs: no attempt journaled for it -------------


def backing_off(base: float, calls: list[int]) -> Workflow:
    wf = Workflow("deadline_backoff", context=Ctx, deadline=HOUR, on_deadline="expired")

    @wf.step(initial=True, next="done", retry=Retry(attempts=5, backoff="fixed", base=base))
    def poll(ctx: Ctx, step: Step) -> None:
        calls.append(step.attempt)
        raise ConnectionError("down")

    wf.final("done", "expired")
    return wf


def tail(engine: Engine, run_id: str, n: int) -> list[tuple[str, int]]:
    return [(e.kind, e.attempt) for e in engine.history(run_id)][-n:]


def test_deadline__passed_in_a_backoff_journals_no_attempt_that_never_ran(
    engine: Engine, clock: FakeClock
) -> None:
    """A retry due after the deadline: the claim at the deadline journaled the next
    attempt's step_started, then deadline_passed — an attempt never called, which
    `attempts()` showed as still running."""
    calls: list[int] = []
    info = engine.run(backing_off(3000, calls), Ctx())
    clock.advance(3000)
    engine.run_until_idle(idle_horizon=0)  # attempt 2 fails; attempt 3 would come at 6000 s
    clock.advance(HOUR - 3000)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, info.state) == ("succeeded", "expired")
    assert calls == [1, 2]
    assert tail(engine, info.id, 2) == [(j.STEP_FAILED, 2), (j.DEADLINE_PASSED, 2)]
    assert engine.replay(info.id).differences == []


def test_deadline__passed_in_a_backoff_moves_on_to_a_step(engine: Engine, clock: FakeClock) -> None:
    """on_deadline a step: the retrying run is scheduled there (no attempt of the step it
    was backing off in), and that step runs."""
    wf = Workflow("deadline_cleanup", context=Ctx, deadline=HOUR, on_deadline="cleanup")

    @wf.step(initial=True, next="done", retry=Retry(attempts=5, backoff="fixed", base=HOUR))
    def poll(ctx: Ctx) -> None:
        raise ConnectionError("down")

    @wf.step(next="expired")
    def cleanup(ctx: Ctx) -> None:
        ctx.note = "cleaned up"

    wf.final("done", "expired")
    info = engine.run(wf, Ctx())
    clock.advance(HOUR)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, info.state) == ("succeeded", "expired")
    assert info.context.note == "cleaned up"  # type: ignore[union-attr]
    started = [e.state for e in engine.history(info.id) if e.kind == j.STEP_STARTED]
    assert started == ["poll", "cleanup"]
    assert engine.replay(info.id).differences == []


def test_deadline__a_retry_claimed_late_past_it_is_not_attempted(
    engine: Engine, clock: FakeClock
) -> None:
    """The retry was due before the deadline, but no worker claimed it until after (all
    were down): the run moves to on_deadline without a step_started first."""
    calls: list[int] = []
    info = engine.run(backing_off(1800, calls), Ctx())  # due at 30 min: before the deadline
    assert engine.get(info.id).status == "retrying"
    clock.advance(2 * HOUR)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, info.state) == ("succeeded", "expired")
    assert calls == [1]
    assert tail(engine, info.id, 2) == [(j.STEP_FAILED, 1), (j.DEADLINE_PASSED, 1)]
    assert engine.replay(info.id).differences == []


def test_deadline__passed_by_a_step_that_succeeded_starts_no_next_step(
    engine: Engine, clock: FakeClock
) -> None:
    """A step succeeds at (fake) time past the deadline: the next step's start was
    journaled with its success, then cut off at once. The run moves on by a claim."""
    wf = Workflow("deadline_between", context=Ctx, deadline=HOUR, on_deadline="expired")
    ran: list[str] = []

    @wf.step(initial=True, next="second")
    def first(ctx: Ctx) -> None:
        ran.append("first")
        clock.advance(HOUR + 1)  # it took that long (the deadline passed as it returned)

    @wf.step(next="done")
    def second(ctx: Ctx) -> None:
        ran.append("second")

    wf.final("done", "expired")
    info = engine.run(wf, Ctx())
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, info.state) == ("succeeded", "expired")
    assert ran == ["first"]
    kinds = [e.kind for e in engine.history(info.id)]
    assert kinds[-2:] == [j.STEP_SUCCEEDED, j.DEADLINE_PASSED]
    assert kinds.count(j.STEP_STARTED) == 1
    assert engine.replay(info.id).differences == []


def test_deadline__a_crash_after_the_success_past_it_keeps_it(store_url: str) -> None:
    """Crash safety: killed after the success past the deadline is committed (the run
    handed back due at once), the next worker moves it to on_deadline."""
    clock = FakeClock(auto_advance=False)
    wf = Workflow("deadline_crash", context=Ctx, deadline=HOUR, on_deadline="expired")

    @wf.step(initial=True, next="second")
    def first(ctx: Ctx) -> None:
        clock.advance(HOUR + 1)

    @wf.step(next="done")
    def second(ctx: Ctx) -> None:
        raise AssertionError("never called: the deadline passed before it")

    wf.final("done", "expired")
    with TestEngine(store_url, workflows=[wf], clock=clock) as engine:
        run = engine.start(wf, Ctx())
        engine.crash_at("first", "after")
        with pytest.raises(SimulatedCrash):
            engine.run_until_idle()
        engine.resume()
        info = engine.get(run.id)
        assert (info.status, info.state) == ("succeeded", "expired")
        assert [e.kind for e in engine.history(run.id)][-2:] == [
            j.STEP_SUCCEEDED,
            j.DEADLINE_PASSED,
        ]
        assert engine.replay(run.id).differences == []


# -- engine.run of a run with a deadline that fans out: its children are driven ------------


class Tally(BaseModel):
    n: int = 0
    items: list[int] = []


def tallied(name: str, child: Workflow | None) -> Workflow:
    """A run with a deadline a minute away that calls ``child`` (a map over its items), or
    that counts when ``child`` is None."""
    wf = Workflow(name, context=Tally, deadline=60, on_deadline="expired")
    if child is None:

        @wf.step(initial=True, next="done")
        def count(ctx: Tally) -> None:
            ctx.n = 1

    else:
        wf.map(
            "fan",
            child=child,
            items=lambda ctx: ctx.items or [1, 2],
            context=lambda ctx, item: Tally(),
            on={"done": "done"},
            reduce=lambda ctx, results: setattr(ctx, "n", sum(r.context.n for r in results)),
            initial=True,
        )
    wf.final("done", "expired")
    return wf


def test_deadline__engine_run_drives_the_children_before_it(store_url: str) -> None:
    """engine.run drove a run and, once it fanned out, its children; a run with a deadline
    within the idle horizon (5 minutes) waited for that deadline instead (a due time of
    the run it drove: the children were not driven yet) — and expired, its children never
    run (a FakeClock jumped there at once; a real one waited the minute out)."""
    grandchild = tallied("dl_leaf", None)
    child = tallied("dl_inner", grandchild)
    wf = tallied("dl_outer", child)
    with Engine(store_url, clock=FakeClock()) as engine:
        info = engine.run(wf, Tally())
        assert (info.status, info.state, info.context.n) == ("succeeded", "done", 4)
        assert [e.kind for e in engine.history(info.id)][-1] == j.CHILDREN_JOINED


def test_deadline__engine_run_returns_when_the_children_wait_for_events(store_url: str) -> None:
    """engine.run of a run whose children wait for events returns at once, as it does for
    a run that waits itself; a deadline within 5 minutes was waited for instead (the run's
    only due time while its children wait): a real clock hung that long, then the run came
    back expired. Once its children end, a retry's backoff after them is still waited for."""
    attempts: list[int] = []
    kid = Workflow("dl_approval", context=Tally)
    kid.wait("asked", on={"approve": "approved"}, initial=True)
    kid.final("approved")
    wf = Workflow("dl_asks", context=Tally, deadline=240, on_deadline="expired")
    wf.call("ask", child=kid, context=lambda ctx: Tally(), on={"succeeded": "book"}, initial=True)

    @wf.step(next="done", retry=Retry(attempts=2, backoff="fixed", base=10))
    def book(ctx: Tally, step: Step) -> None:
        attempts.append(step.attempt)
        if step.attempt == 1:
            raise ConnectionError("try again")

    wf.final("done", "expired")
    clock = FakeClock()
    with Engine(store_url, clock=clock) as engine:
        started = clock.now()
        info = engine.run(wf, Tally())
        assert (info.status, info.state) == ("scheduled", "ask")
        assert clock.now() == started  # no deadline waited for
        store = engine.store
        assert isinstance(store, JoinStoreMixin)
        (child,) = store.children_of(info.id)
        engine.send(child.id, "approve")
        info = engine.drive(info.id)
        assert (info.status, info.state, attempts) == ("succeeded", "done", [1, 2])


def test_engine_run__a_sleep_into_a_call_state_is_waited_out(store_url: str) -> None:
    """A step that sleeps into a call state (``step.sleep``) leaves its run due at the
    sleep's end in that state, its children not made yet: engine.run waits that out (within
    the idle horizon) and drives them. The fix above took any run in a call or map state
    for one waiting for its children, and returned it at once, asleep (a review)."""
    kid = Workflow("sl_kid", context=Tally)

    @kid.step(initial=True, next="kid_done")
    def five(ctx: Tally) -> None:
        ctx.n = 5

    kid.final("kid_done")
    wf = Workflow("sl_into_call", context=Tally)

    @wf.step(initial=True, next="ask")
    def nap(ctx: Tally, step: Step) -> Any:
        return step.sleep(120)

    wf.call(
        "ask",
        child=kid,
        context=lambda ctx: Tally(),
        on={"succeeded": "done"},
        result=lambda ctx, child: setattr(ctx, "n", child.n),
    )
    wf.final("done")
    clock = FakeClock()
    with Engine(store_url, clock=clock) as engine:
        started = clock.now()
        info = engine.run(wf, Tally())
        assert (info.status, info.state, info.context.n) == ("succeeded", "done", 5)
        assert clock.now() >= started + 120  # the sleep was waited out, on the fake clock
