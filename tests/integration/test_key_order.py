"""A key's queued runs are claimed oldest first (``key_limit=1``: "one at a time, in
order"). A run's place in its key's queue (``limit_rank``: the key's live runs + 1 when
created) is what the claim's round-robin between keys reads; within a key the claim
orders by due time. A review caught a change that ranked within a key by that place:
a place is not monotonic (once runs queued ahead end, a new run's count can be smaller
than an older queued run's), so a run started later went first. A run whose retry is due
later holds no slot and is not a candidate: the key's next runs go while it backs off.
On a real SQLite file and a real PostgreSQL schema, on a fake clock."""

from __future__ import annotations

from pydantic import BaseModel
from storekit import start_step, succeed_step

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop.store import SQLStore


class Ctx(BaseModel):
    customer: str = "k"
    n: int = 0


def _keyed(calls: list[tuple[int, int]], *, failing: int | None = None) -> Workflow:
    """Workflow ``keyed`` (``key_limit=1``): each call of its step is noted as ``(n,
    attempt)``; run ``failing``'s first attempt raises (retried a minute later)."""
    keyed = Workflow("keyed", context=Ctx, concurrency_key=lambda c: c.customer, key_limit=1)

    @keyed.step(initial=True, next="done", retry=Retry(attempts=3, base=60, cap=60))
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


def test_a_run_started_later_does_not_pass_an_older_queued_one(store_url: str) -> None:
    """Run 0 runs on another worker, runs 1 and 2 are stopped while queued, then run 4 is
    started: its place (2 live runs + 1 = 3) is smaller than run 3's (4). Run 3, queued
    first, still goes first."""
    calls: list[tuple[int, int]] = []
    keyed = _keyed(calls)
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        ids = _start(engine, keyed, clock, range(4))
        store = engine.store
        assert isinstance(store, SQLStore)
        (first,) = store.claim(
            worker="other", now=clock.now(), limit=1, lease_seconds=600, workflows=["keyed"]
        )
        assert first.id == ids[0]
        started = start_step(first, "other")
        assert store.write([started]) == [True]
        engine.stop(ids[1])
        engine.stop(ids[2])
        _start(engine, keyed, clock, range(4, 5))
        done = succeed_step(started.record, started.fence, next_state="done", final=True)
        assert store.write([done]) == [True]
        engine.run_until_idle()
    assert calls == [(3, 1), (4, 1)]


def test_a_run_backing_off_does_not_hold_its_key(store_url: str) -> None:
    """Run 0's retry is due in a minute: runs 1-3 of its key go meanwhile, then run 0."""
    calls: list[tuple[int, int]] = []
    keyed = _keyed(calls, failing=0)
    clock = FakeClock()
    with Engine(store_url, workflows=[keyed], clock=clock) as engine:
        _start(engine, keyed, clock, range(4))
        engine.run_until_idle(idle_horizon=0)
        assert calls == [(0, 1), (1, 1), (2, 1), (3, 1)]
        clock.advance(60)
        engine.run_until_idle(idle_horizon=0)
    assert calls[4:] == [(0, 2)]
