"""A key's queued runs are claimed oldest first (``key_limit=1``: "one at a time, in
order"): within a key the claim orders its runs by their creation, which never moves.

By due time (as it was), a run retried at once or recovered after its worker died
(``step_interrupted``, ``retry_at`` now) is due later than the runs of its key queued
after it, so it went after every one of them. By its place in its key's queue
(``limit_rank``: the key's live runs + 1 when created, what the round-robin between keys
reads), as a first fix did, a run started later went first: a place is not monotonic
(once runs queued ahead end, a new run's count can be smaller than an older queued
run's). A run started for later (``run_at``) is, once due, older than its key's runs
started after it. A run whose retry is due later holds no slot and is not a candidate:
the key's next runs go while it backs off. On a real SQLite file and a real PostgreSQL
schema, on a fake clock."""

from __future__ import annotations

import sqlalchemy as sa
from pydantic import BaseModel
from storekit import dead_owner, event, start_step, succeed_step

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.store import Boundary, SQLStore, StoredRun
from flowloop.store.schema import runs


class Ctx(BaseModel):
    customer: str = "k"
    n: int = 0


def _keyed(
    calls: list[tuple[int, int]],
    *,
    failing: int | None = None,
    retry: Retry | None = None,
    key_limit: int = 1,
) -> Workflow:
    """Workflow ``keyed`` (``key_limit=1`` unless said): each call of its step is noted as
    ``(n, attempt)``; run ``failing``'s first attempt raises."""
    keyed = Workflow(
        "keyed", context=Ctx, concurrency_key=lambda c: c.customer, key_limit=key_limit
    )

    @keyed.step(initial=True, next="done", retry=retry or Retry())
    def work(ctx: Ctx, step: Step) -> None:
        calls.append((ctx.n, step.attempt))
        if ctx.n == failing and step.attempt == 1:
            raise RuntimeError("provider down")

    keyed.final("done")
    return keyed


def _start(engine: Engine, keyed: Workflow, clock: FakeClock, numbers: range) -> list[str]:
    """Runs of key ``k``, a second apart (each due when started)."""
    ids = []
    for n in numbers:
        ids.append(engine.start(keyed, {"n": n}).id)
        clock.advance(1)
    return ids


def _claim_first(engine: Engine, clock: FakeClock, worker: str) -> StoredRun:
    """The key's first run, claimed by ``worker`` (one only: ``key_limit=1``)."""
    store = engine.store
    assert isinstance(store, SQLStore)
    (first,) = store.claim(
        worker=worker, now=clock.now(), limit=4, lease_seconds=600, workflows=["keyed"]
    )
    return first


def _fail_step(started: Boundary, *, retry_at: float) -> Boundary:
    """The ``step_failed`` boundary that retries the started step at ``retry_at``."""
    record = started.record
    failed = event(
        record,
        j.STEP_FAILED,
        state=record.state,
        attempt=record.attempt,
        error_type="RuntimeError",
        error_message="provider down",
        retryable=True,
        data={"retry_at": retry_at},
    )
    return Boundary(
        events=[failed], record=j.apply(record, failed), fence=started.fence, release=True
    )


def test_a_run_retried_at_once_goes_before_its_keys_later_runs(store_url: str) -> None:
    """Run 0's first attempt failed on another worker, retried at once (due now, later
    than runs 1-3 were due); this worker's claim comes before that worker's own: run 0
    is its key's next run."""
    calls: list[tuple[int, int]] = []
    keyed = _keyed(calls)
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        ids = _start(engine, keyed, clock, range(4))
        first = _claim_first(engine, clock, "other")
        assert first.id == ids[0]
        started = start_step(first, "other")
        failed = _fail_step(started, retry_at=clock.now())
        assert engine.store.write([started, failed]) == [True, True]
        engine.run_until_idle()
    assert calls == [(0, 2), (1, 1), (2, 1), (3, 1)]


def test_a_recovered_interrupted_run_goes_before_its_keys_later_runs(store_url: str) -> None:
    """Run 0's worker died inside its step (a dead process on this host: its lease is
    taken over at once); recovery journals ``step_interrupted`` due now, later than runs
    1-3 were due. Run 0 is its key's next run."""
    calls: list[tuple[int, int]] = []
    keyed = _keyed(calls)
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        ids = _start(engine, keyed, clock, range(4))
        gone = dead_owner()
        first = _claim_first(engine, clock, gone)
        assert first.id == ids[0]
        assert engine.store.write([start_step(first, gone)]) == [True]
        clock.advance(5)
        engine.run_until_idle()
        interrupted = [e for e in engine.history(ids[0]) if e.kind == j.STEP_INTERRUPTED]
    assert [e.data["retry_at"] for e in interrupted] == [clock.now()]
    assert calls == [(0, 2), (1, 1), (2, 1), (3, 1)]


def test_a_run_started_later_does_not_pass_an_older_queued_one(store_url: str) -> None:
    """Run 0 runs on another worker, runs 1 and 2 are stopped while queued, then run 4 is
    started: its place (2 live runs + 1 = 3) is smaller than run 3's (4). Run 3, queued
    first, still goes first."""
    calls: list[tuple[int, int]] = []
    keyed = _keyed(calls)
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        ids = _start(engine, keyed, clock, range(4))
        first = _claim_first(engine, clock, "other")
        assert first.id == ids[0]
        started = start_step(first, "other")
        assert engine.store.write([started]) == [True]
        engine.stop(ids[1])
        engine.stop(ids[2])
        _start(engine, keyed, clock, range(4, 5))
        done = succeed_step(started.record, started.fence, next_state="done", final=True)
        assert engine.store.write([done]) == [True]
        engine.run_until_idle()
    assert calls == [(3, 1), (4, 1)]


def test_with_key_limit_two_a_run_started_later_does_not_pass_an_older_queued_one(
    store_url: str,
) -> None:
    """``key_limit=2``: runs 0 and 1 are claimed and end while run 2 waits (its place 3),
    then run 3 is started (its place 2: only run 2 is live). A claim of one run takes run
    2, then one more takes run 3: by place first, run 3 went first (both runs' turns fit
    the key's limit, so the limit did not hide it as with ``key_limit=1``)."""
    keyed = _keyed([], key_limit=2)
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        store = engine.store
        assert isinstance(store, SQLStore)
        ids = _start(engine, keyed, clock, range(3))
        ahead = store.claim(
            worker="other", now=clock.now(), limit=2, lease_seconds=600, workflows=["keyed"]
        )
        assert sorted(run.id for run in ahead) == sorted(ids[:2])
        for run in ahead:
            started = start_step(run, "other")
            done = succeed_step(started.record, started.fence, next_state="done", final=True)
            assert store.write([started, done]) == [True, True]
        ids += _start(engine, keyed, clock, range(3, 4))
        with store.engine.connect() as conn:
            places = conn.execute(
                sa.select(runs.c.id, runs.c.limit_rank).where(runs.c.id.in_(ids[2:]))
            )
            assert dict(places.all()) == {ids[2]: 3, ids[3]: 2}
        taken = [
            store.claim(
                worker="w", now=clock.now(), limit=1, lease_seconds=600, workflows=["keyed"]
            )
            for _ in range(2)
        ]
    assert [[run.id for run in runs] for runs in taken] == [[ids[2]], [ids[3]]]


def test_a_run_started_for_later_goes_before_its_keys_runs_started_after_it(
    store_url: str,
) -> None:
    """Run 0 holds the key on another worker; run 1 is started for ten seconds later, runs
    2 and 3 after it, due at once. Once run 0 ends and run 1 is due, run 1 is the oldest
    of its key's queued runs and goes first (by due time it went last); before it is due
    it holds nothing up (below)."""
    calls: list[tuple[int, int]] = []
    keyed = _keyed(calls)
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        (holder,) = _start(engine, keyed, clock, range(1))
        first = _claim_first(engine, clock, "other")
        assert first.id == holder
        started = start_step(first, "other")
        assert engine.store.write([started]) == [True]
        engine.start(keyed, {"n": 1}, run_at=clock.now() + 10)
        clock.advance(1)
        _start(engine, keyed, clock, range(2, 4))
        clock.advance(10)
        done = succeed_step(started.record, started.fence, next_state="done", final=True)
        assert engine.store.write([done]) == [True]
        engine.run_until_idle()
    assert calls == [(1, 1), (2, 1), (3, 1)]


def test_a_run_started_for_later_does_not_hold_its_key_before_it_is_due(
    store_url: str,
) -> None:
    """Run 0 is started for a minute later, runs 1 and 2 after it: they go meanwhile."""
    calls: list[tuple[int, int]] = []
    keyed = _keyed(calls)
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        engine.start(keyed, {"n": 0}, run_at=clock.now() + 60)
        clock.advance(1)
        _start(engine, keyed, clock, range(1, 3))
        engine.run_until_idle(idle_horizon=0)
        assert calls == [(1, 1), (2, 1)]
        clock.advance(60)
        engine.run_until_idle(idle_horizon=0)
    assert calls[2:] == [(0, 1)]


def test_a_run_backing_off_does_not_hold_its_key(store_url: str) -> None:
    """Run 0's retry is due in a minute: runs 1-3 of its key go meanwhile, then run 0."""
    calls: list[tuple[int, int]] = []
    keyed = _keyed(calls, failing=0, retry=Retry(attempts=3, base=60, cap=60))
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        _start(engine, keyed, clock, range(4))
        engine.run_until_idle(idle_horizon=0)
        assert calls == [(0, 1), (1, 1), (2, 1), (3, 1)]
        clock.advance(60)
        engine.run_until_idle(idle_horizon=0)
    assert calls[4:] == [(0, 2)]
