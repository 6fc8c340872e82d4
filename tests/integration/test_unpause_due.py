"""A paused run unpaused before its due time is due then, not at once, on SQLite and
PostgreSQL, on a fake clock: a run started for later (``run_at``), one backing off before a
retry, one debounced, one deferred by a rate limit (its place in the limit's queue kept) —
also when `flowloop unpause` runs without -w or its parent's unpause reaches it; a run
deadline still comes first. (The unpause made them due at once: the step ran before its
``run_at``, the rest of the backoff was skipped, the rate limit's slot was lost.) A run
due already is due at once, as before, and so is a parent waiting for its children."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from polling import poll
from pydantic import BaseModel

from flowloop import FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.flowcontrol import RateLimit
from flowloop.testing import TestEngine

HOUR = 3600.0


class C(BaseModel):
    log: list[str] = []


def later(deadline: float | None = None) -> Workflow:
    """One step, ``go``; with ``deadline``, ``expired`` on its deadline."""
    wf = Workflow(
        "later",
        context=C,
        deadline=deadline,
        on_deadline="expired" if deadline is not None else None,
    )

    @wf.step(initial=True, next="done")
    def go(ctx: C) -> None:
        ctx.log.append("went")

    wf.final("done", *(["expired"] if deadline is not None else []))
    return wf


def flaky() -> Workflow:
    """Its step fails its first attempt and is retried an hour later."""
    wf = Workflow("flaky", context=C)

    @wf.step(
        initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=HOUR, cap=HOUR)
    )
    def call(ctx: C, step: Step) -> None:
        if step.attempt == 1:
            raise ConnectionError("down")
        ctx.log.append(f"attempt {step.attempt}")

    wf.final("done")
    return wf


def parent_of(child: Workflow, deadline: float | None = None) -> Workflow:
    wf = Workflow(
        "parent",
        context=C,
        deadline=deadline,
        on_deadline="expired" if deadline is not None else None,
    )
    wf.call("p", child=child, context=lambda ctx: C(), on={"succeeded": "pdone"}, initial=True)
    wf.final("pdone", *(["expired"] if deadline is not None else []))
    return wf


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(auto_advance=False)


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[TestEngine]:
    with TestEngine(store_url, clock=clock, workflows=[later(), flaky()]) as engine:
        yield engine


def begun(engine: TestEngine, run_id: str) -> list[tuple[float, int]]:
    """When each attempt of a step of the run began, and its number."""
    return [(e.at, e.attempt) for e in engine.history(run_id) if e.kind == j.STEP_STARTED]


def unpause(engine: TestEngine, store_url: str, run_id: str, how: str) -> None:
    """By this engine, or by one without the definition (`flowloop unpause` without -w)."""
    if how == "engine":
        engine.unpause(run_id)
    else:
        with TestEngine(store_url, clock=engine.clock) as bare:
            bare.unpause(run_id)
    assert_row_is_the_fold(engine, run_id)


def assert_row_is_the_fold(engine: TestEngine, run_id: str) -> None:
    """The row, due time and reason included, is what its journal folds to."""
    stored = engine.store.get_run(run_id)
    assert stored is not None and stored.record == j.fold(engine.store.journal(run_id))


@pytest.mark.parametrize("how", ["engine", "bare"])
def test_unpause__a_run_started_for_later_runs_at_its_run_at(
    engine: TestEngine, store_url: str, how: str
) -> None:
    run_at = engine.clock.now() + 2 * HOUR
    run = engine.start(later(), C(), run_at=run_at)
    engine.advance(HOUR / 2)
    engine.pause(run.id)
    engine.advance(HOUR / 2)
    unpause(engine, store_url, run.id, how)
    info = engine.get(run.id)
    assert (info.status, info.next_run_at, info.reason) == ("scheduled", run_at, None)
    engine.advance(HOUR - 1)
    assert begun(engine, run.id) == []
    # Paused and unpaused again: the same due time.
    engine.pause(run.id)
    engine.unpause(run.id)
    assert engine.get(run.id).next_run_at == run_at
    engine.advance(1)
    assert begun(engine, run.id) == [(run_at, 1)]
    assert engine.get(run.id).status == "succeeded"
    assert engine.replay(run.id).differences == []


@pytest.mark.parametrize("how", ["engine", "bare"])
def test_unpause__a_run_backing_off_is_retried_when_its_backoff_ends(
    engine: TestEngine, store_url: str, how: str
) -> None:
    run = engine.start(flaky(), C())
    t0 = engine.clock.now()
    engine.run_until_idle(skip_time=False)
    info = engine.get(run.id)
    assert (info.status, info.next_run_at) == ("retrying", t0 + HOUR)
    engine.pause(run.id)  # nobody owns it: paused at once
    engine.advance(HOUR / 4)
    unpause(engine, store_url, run.id, how)
    assert engine.get(run.id).next_run_at == t0 + HOUR
    engine.advance(HOUR * 3 / 4 - 1)
    assert begun(engine, run.id) == [(t0, 1)]
    engine.advance(1)
    assert begun(engine, run.id) == [(t0, 1), (t0 + HOUR, 2)]
    info = engine.get(run.id)
    assert (info.status, info.context.log) == ("succeeded", ["attempt 2"])  # type: ignore[union-attr]
    assert engine.replay(run.id).differences == []


def test_unpause__a_child_backing_off_keeps_its_backoff_through_its_parents_pause(
    store_url: str, clock: FakeClock
) -> None:
    with TestEngine(store_url, clock=clock, workflows=[parent_of(flaky()), flaky()]) as engine:
        run = engine.start(parent_of(flaky()), C())
        t0 = clock.now()
        engine.run_until_idle(skip_time=False)
        (child,) = engine.runs(workflow="flaky")
        assert engine.get(child.id).status == "retrying"
        engine.pause(run.id)
        assert engine.get(child.id).status == "paused"
        engine.advance(HOUR / 2)
        engine.unpause(run.id)
        assert engine.get(child.id).next_run_at == t0 + HOUR
        assert_row_is_the_fold(engine, child.id)
        engine.advance(HOUR / 2 - 1)
        assert begun(engine, child.id) == [(t0, 1)]
        engine.advance(1)
        assert begun(engine, child.id) == [(t0, 1), (t0 + HOUR, 2)]
        assert engine.get(run.id).status == "succeeded"
        assert engine.replay(child.id).differences == []


def test_unpause__a_debounced_run_runs_when_its_window_ends(engine: TestEngine) -> None:
    first = engine.start(later(), C(log=["1"]), key="k", debounce=HOUR)
    engine.advance(HOUR / 2)
    again = engine.start(later(), C(log=["2"]), key="k", debounce=HOUR)
    assert again.id == first.id
    window_end = engine.clock.now() + HOUR
    engine.pause(first.id)
    engine.advance(HOUR / 2)
    engine.unpause(first.id)
    assert engine.get(first.id).next_run_at == window_end
    assert_row_is_the_fold(engine, first.id)
    engine.advance(HOUR / 2 - 1)
    assert begun(engine, first.id) == []
    engine.advance(1)
    assert begun(engine, first.id) == [(window_end, 1)]
    assert engine.get(first.id).context.log == ["2", "went"]  # type: ignore[union-attr]
    assert engine.replay(first.id).differences == []


def test_unpause__a_run_deferred_by_a_rate_limit_keeps_its_due_time_and_place(
    store_url: str,
) -> None:
    """The rate limit counts by the database's clock: the fake one starts at it, and is set
    to the deferral's due time once the database's clock is there (a bounded wait). The
    unpaused run comes back for its slot in the limit's queue, and is served (before, a
    newcomer: sent to the queue's end, deferred again)."""
    wf = Workflow("limited", context=C)

    @wf.step(initial=True, next="done", rate_limit=RateLimit("slow", 1, per=timedelta(seconds=2)))
    def call(ctx: C) -> None:
        ctx.log.append("called")

    wf.final("done")
    clock = FakeClock(time.time(), auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        runs = [engine.start(wf, C()) for _ in range(2)]
        engine.run_until_idle(skip_time=False)
        deferred = next(r.id for r in runs if engine.get(r.id).status == "scheduled")
        [entry] = [e for e in engine.history(deferred) if e.kind == j.RUN_DEFERRED]
        due, reason = entry.data["due"], entry.data["reason"]
        assert reason == "rate_limit:slow"
        engine.pause(deferred)
        engine.unpause(deferred)
        info = engine.get(deferred)
        assert (info.status, info.next_run_at, info.reason) == ("scheduled", due, reason)
        assert_row_is_the_fold(engine, deferred)
        poll(lambda: engine.store.db_now() >= due, timeout=10, what="the slot", every=0.05)
        clock.set(max(clock.now(), due))
        engine.run_until_idle(skip_time=False)
        assert engine.get(deferred).status == "succeeded"
        kinds = [e.kind for e in engine.history(deferred)]
        assert kinds.count(j.RUN_DEFERRED) == 1
        assert engine.replay(deferred).differences == []


def test_unpause__a_run_due_already_is_due_at_once(engine: TestEngine) -> None:
    now_run = engine.start(later(), C())
    for_later = engine.start(later(), C(), run_at=engine.clock.now() + HOUR)
    engine.pause(now_run.id)
    engine.pause(for_later.id)
    engine.clock.advance(2 * HOUR)  # (no worker runs meanwhile)
    engine.unpause(now_run.id)
    engine.unpause(for_later.id)
    now = engine.clock.now()
    assert engine.get(now_run.id).next_run_at == now
    assert engine.get(for_later.id).next_run_at == now
    engine.run_until_idle(skip_time=False)
    assert begun(engine, now_run.id) == [(now, 1)] and begun(engine, for_later.id) == [(now, 1)]


def test_unpause__before_the_deadline_a_run_started_for_later_is_due_by_it(
    store_url: str, clock: FakeClock
) -> None:
    """Its run_at after its deadline: the deadline moves it on then (it ran its step)."""
    wf = later(deadline=HOUR)
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        deadline = clock.now() + HOUR
        run = engine.start(wf, C(), run_at=clock.now() + 2 * HOUR)
        engine.pause(run.id)
        engine.advance(HOUR / 2)
        engine.unpause(run.id)
        assert engine.get(run.id).next_run_at == deadline
        assert_row_is_the_fold(engine, run.id)
        engine.advance(HOUR / 2 - 1)
        assert begun(engine, run.id) == []
        engine.advance(1)
        info = engine.get(run.id)
        assert (info.status, info.state) == ("succeeded", "expired")
        assert begun(engine, run.id) == []
        assert engine.history(run.id)[-1].at == deadline
        assert engine.replay(run.id).differences == []


def test_unpause__after_the_deadline_a_run_moves_on_at_once(
    store_url: str, clock: FakeClock
) -> None:
    wf = later(deadline=HOUR)
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        run = engine.start(wf, C(), run_at=clock.now() + 2 * HOUR)
        engine.pause(run.id)
        engine.advance(3 * HOUR)
        assert engine.get(run.id).status == "paused"
        engine.unpause(run.id)
        now = clock.now()
        engine.run_until_idle(skip_time=False)
        info = engine.get(run.id)
        assert (info.status, info.state) == ("succeeded", "expired")
        assert begun(engine, run.id) == [] and engine.history(run.id)[-1].at == now
        assert engine.replay(run.id).differences == []


def test_unpause__a_parent_waiting_for_its_children_is_claimed_at_once(
    store_url: str, clock: FakeClock
) -> None:
    """Its due time, the deadline's alone (the store makes it due when its children end),
    is not taken for its own: it waits for its children again at once."""
    parent = parent_of(flaky(), deadline=3 * HOUR)
    with TestEngine(store_url, clock=clock, workflows=[parent, flaky()]) as engine:
        run = engine.start(parent, C())
        engine.run_until_idle(skip_time=False)
        assert engine.get(run.id).next_run_at == clock.now() + 3 * HOUR  # (its deadline)
        engine.pause(run.id)
        engine.unpause(run.id)
        now = clock.now()
        assert engine.get(run.id).next_run_at == now
        engine.run_until_idle(skip_time=False)
        again = [e for e in engine.history(run.id) if e.kind == j.CHILDREN_STARTED]
        assert [e.at for e in again] == [now, now] and again[-1].data.get("again")
        engine.advance(HOUR)
        assert engine.get(run.id).status == "succeeded"
        assert engine.replay(run.id).differences == []


def waiter(version: int, *, into: str = "act") -> Workflow:
    """v1: ``start``, then the wait ``waiting`` (an hour's timeout); v2 maps ``waiting``
    onto the step ``into`` (a new one, or the wait's own name made a step)."""
    migrates = {1: {"waiting": into} if into != "waiting" else {}} if version == 2 else None
    wf = Workflow("waiter", context=C, version=version, migrates_from=migrates)

    @wf.step(initial=True, next="waiting" if version == 1 else into)
    def start(ctx: C) -> None:
        pass

    if version == 1:
        wf.wait("waiting", on={"go": "done"}, timeout=HOUR, on_timeout="done")
    else:

        @wf.step(name=into, next="done")
        def act(ctx: C) -> None:
            ctx.log.append("acted")

    wf.final("done")
    return wf


@pytest.mark.parametrize("how", ["engine", "bare"])
@pytest.mark.parametrize("into", ["act", "waiting"])
def test_unpause__a_run_migrated_out_of_its_wait_while_paused_is_due_at_once(
    store_url: str, clock: FakeClock, how: str, into: str
) -> None:
    """Paused waiting (an hour's timeout), migrated to a step (another state, or the wait's
    own name made one): unpaused, it runs the step at once, as a migration makes a run it
    moves out of its wait unpaused (it waited for the old wait's timeout: the merge of the
    due time before the pause took it for the run's)."""
    v1, v2 = waiter(1), waiter(2, into=into)
    with TestEngine(store_url, clock=clock, workflows=[v1, v2]) as engine:
        run = engine.start(v1, C())
        engine.run_until_idle(skip_time=False)
        assert engine.get(run.id).next_run_at == clock.now() + HOUR
        engine.pause(run.id)
        engine.migrate(run.id, to=2)
        engine.clock.advance(60)
        unpause(engine, store_url, run.id, how)
        now = clock.now()
        info = engine.get(run.id)
        assert (info.status, info.state, info.next_run_at) == ("scheduled", into, now)
        engine.run_until_idle(skip_time=False)
        info = engine.get(run.id)
        assert (info.status, info.context.log) == ("succeeded", ["acted"])  # type: ignore[union-attr]
        assert engine.history(run.id)[-1].at == now


def test_unpause__a_run_still_in_its_wait_keeps_its_timeout_through_a_migration(
    store_url: str, clock: FakeClock
) -> None:
    """Migrated with its wait kept (v2 the same wait), the timeout still counts from its
    entry into the wait."""
    v1 = waiter(1)
    v2 = Workflow("waiter", context=C, version=2, migrates_from={1: {}})

    @v2.step(initial=True, next="waiting")
    def start(ctx: C) -> None:
        pass

    v2.wait("waiting", on={"go": "done"}, timeout=HOUR, on_timeout="done")
    v2.final("done")
    with TestEngine(store_url, clock=clock, workflows=[v1, v2]) as engine:
        run = engine.start(v1, C())
        engine.run_until_idle(skip_time=False)
        timeout = clock.now() + HOUR
        engine.pause(run.id)
        engine.migrate(run.id, to=2)
        engine.clock.advance(60)
        engine.unpause(run.id)
        assert engine.get(run.id).next_run_at == timeout
        assert_row_is_the_fold(engine, run.id)


def sleeper_limited(version: int = 1) -> Workflow:
    """``first`` sleeps 5 s (``step.sleep``), then ``call`` is limited to once an hour."""
    migrates = {1: {}} if version == 2 else None
    wf = Workflow("napping", context=C, version=version, migrates_from=migrates)

    @wf.step(initial=True, next="call")
    def first(ctx: C, step: Step) -> Step:
        return step.sleep(5)

    @wf.step(next="done", rate_limit=RateLimit("slow", 1, per=timedelta(hours=1)))
    def call(ctx: C) -> None:
        ctx.log.append("called")

    wf.final("done")
    return wf


@pytest.mark.parametrize("how", ["engine", "bare"])
def test_unpause__a_run_deferred_after_a_sleep_keeps_its_deferral(store_url: str, how: str) -> None:
    """Slept, then deferred by the rate limit (the other run took the hour's slot): the
    unpause keeps the deferral's due time and reason, and no claim defers it again (it
    took the sleep's end, long past: due at once, a newcomer sent to the queue's end)."""
    wf = sleeper_limited()
    clock = FakeClock(time.time(), auto_advance=False)  # (the limit counts by the database's)
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        runs = [engine.start(wf, C()) for _ in range(2)]
        engine.run_until_idle(skip_time=False)
        engine.clock.advance(5)  # (the sleeps end)
        engine.run_until_idle(skip_time=False)
        deferred = next(r.id for r in runs if engine.get(r.id).status == "scheduled")
        [entry] = [e for e in engine.history(deferred) if e.kind == j.RUN_DEFERRED]
        due, reason = entry.data["due"], entry.data["reason"]
        assert reason == "rate_limit:slow" and due > clock.now() + HOUR / 2
        engine.pause(deferred)
        unpause(engine, store_url, deferred, how)
        info = engine.get(deferred)
        assert (info.status, info.next_run_at, info.reason) == ("scheduled", due, reason)
        engine.run_until_idle(skip_time=False)
        kinds = [e.kind for e in engine.history(deferred)]
        assert kinds.count(j.RUN_DEFERRED) == 1 and kinds[-1] == j.RUN_UNPAUSED


def test_migrate__a_run_deferred_after_a_sleep_keeps_its_deferral(store_url: str) -> None:
    """The migration (a new version, ``call`` kept) keeps the deferral too (it took the
    sleep's end for the run's due time: due at once, the deferral lost)."""
    v1, v2 = sleeper_limited(), sleeper_limited(2)
    clock = FakeClock(time.time(), auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[v1, v2]) as engine:
        runs = [engine.start(v1, C()) for _ in range(2)]
        engine.run_until_idle(skip_time=False)
        engine.clock.advance(5)
        engine.run_until_idle(skip_time=False)
        deferred = next(r.id for r in runs if engine.get(r.id).status == "scheduled")
        before = engine.get(deferred)
        engine.migrate(deferred, to=2)
        info = engine.get(deferred)
        assert (info.next_run_at, info.reason) == (before.next_run_at, "rate_limit:slow")
        assert_row_is_the_fold(engine, deferred)
