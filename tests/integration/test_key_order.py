"""A run whose due time moved keeps its place in its key's queue (``key_limit=1``: "one at
a time, in order", "oldest first per key"). A run retried at once, or recovered after its
worker died (``step_interrupted``, ``retry_at`` now), is due later than the runs of its
key queued after it; the claim ranked a key's runs by due time, so it went after every
one of them. It goes next now: a key's runs are ranked by their place in its queue. A run
whose retry is due later holds no slot meanwhile and is not a candidate: the key's next
runs go while it backs off. On a real SQLite file and a real PostgreSQL schema, on a
fake clock."""

from __future__ import annotations

from pydantic import BaseModel
from storekit import dead_owner, event, start_step

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.store import Boundary, SQLStore


class Ctx(BaseModel):
    customer: str = "k"
    n: int = 0


def _keyed(
    calls: list[tuple[int, int]], *, failing: int | None = None, retry: Retry | None = None
) -> Workflow:
    """Workflow ``keyed`` (``key_limit=1``): each call of its step is noted as ``(n,
    attempt)``; run ``failing``'s first attempt raises."""
    keyed = Workflow("keyed", context=Ctx, concurrency_key=lambda c: c.customer, key_limit=1)

    @keyed.step(initial=True, next="done", retry=retry or Retry())
    def work(ctx: Ctx, step: Step) -> None:
        calls.append((ctx.n, step.attempt))
        if ctx.n == failing and step.attempt == 1:
            raise RuntimeError("provider down")

    keyed.final("done")
    return keyed


def _start(engine: Engine, keyed: Workflow, clock: FakeClock, count: int) -> list[str]:
    """``count`` runs of key ``k``, a second apart (each due when started)."""
    ids = []
    for n in range(count):
        ids.append(engine.start(keyed, {"n": n}).id)
        clock.advance(1)
    return ids


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
        ids = _start(engine, keyed, clock, 4)
        store = engine.store
        assert isinstance(store, SQLStore)
        (first,) = store.claim(
            worker="other", now=clock.now(), limit=4, lease_seconds=60, workflows=["keyed"]
        )
        assert first.id == ids[0]
        started = start_step(first, "other")
        assert store.write([started, _fail_step(started, retry_at=clock.now())]) == [True, True]
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
        ids = _start(engine, keyed, clock, 4)
        store = engine.store
        assert isinstance(store, SQLStore)
        gone = dead_owner()
        (first,) = store.claim(
            worker=gone, now=clock.now(), limit=4, lease_seconds=60, workflows=["keyed"]
        )
        assert first.id == ids[0]
        assert store.write([start_step(first, gone)]) == [True]
        clock.advance(5)
        engine.run_until_idle()
        interrupted = [e for e in engine.history(ids[0]) if e.kind == j.STEP_INTERRUPTED]
    assert [e.data["retry_at"] for e in interrupted] == [clock.now()]
    assert calls == [(0, 2), (1, 1), (2, 1), (3, 1)]


def test_a_run_backing_off_does_not_hold_its_key(store_url: str) -> None:
    """Run 0's retry is due in a minute: runs 1-3 of its key go meanwhile, then run 0."""
    calls: list[tuple[int, int]] = []
    keyed = _keyed(calls, failing=0, retry=Retry(attempts=3, base=60, cap=60))
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        _start(engine, keyed, clock, 4)
        engine.run_until_idle(idle_horizon=0)
        assert calls == [(0, 1), (1, 1), (2, 1), (3, 1)]
        clock.advance(60)
        engine.run_until_idle(idle_horizon=0)
    assert calls[4:] == [(0, 2)]
