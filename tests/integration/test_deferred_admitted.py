"""A debounced or throttled run that a rate limit deferred at its first step keeps that
deferral — its due time and its reason, so its place in the limit's queue — through an
unpause (by the engine, or without the definition) and a migrate, on SQLite and
PostgreSQL. (The due time of its creation, or of its burst's last start, was taken for a
sleep before its first step: an unpause made it due when its window ended, at once, its
reason cleared — sent to the queue's end — and a migrate did the same.)"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow
from flowloop import journal as j
from flowloop.flowcontrol import RateLimit
from flowloop.testing import TestEngine


class C(BaseModel):
    log: list[str] = []


def limited(version: int = 1) -> Workflow:
    """One step under a rate limit of one call per 2 s."""
    wf = Workflow(
        "limited_admitted",
        context=C,
        version=version,
        migrates_from={1: {}} if version > 1 else None,
    )

    @wf.step(initial=True, next="done", rate_limit=RateLimit("slow", 1, per=timedelta(seconds=2)))
    def call(ctx: C) -> None:
        ctx.log.append(f"called v{version}")

    wf.final("done")
    return wf


def admitted(admission: str, n: int) -> dict[str, Any]:
    """The start's arguments: its own key (a burst, a throttle, of one start each)."""
    if admission == "debounce":
        return {"key": f"k{n}", "debounce": 0.001}
    return {"key": f"k{n}", "throttle": (10, 60)}


def deferred_run(engine: TestEngine, clock: FakeClock, admission: str) -> tuple[str, float, str]:
    """Two runs started so; one calls its step, the rate limit defers the other: its id,
    and its deferral's due time and reason."""
    wf = limited()
    runs = [engine.start(wf, C(), **admitted(admission, n)) for n in range(2)]
    clock.advance(0.001)  # (a debounced one's window ends)
    engine.run_until_idle(skip_time=False)
    deferred = next(r.id for r in runs if engine.get(r.id).status == "scheduled")
    [entry] = [e for e in engine.history(deferred) if e.kind == j.RUN_DEFERRED]
    due, reason = entry.data["due"], entry.data["reason"]
    assert reason == "rate_limit:slow" and due > clock.now()
    return deferred, due, reason


def served_in_its_turn(engine: Engine, clock: FakeClock, run_id: str, due: float) -> None:
    """At its deferral's due time (the rate limit counts by the database's clock: a bounded
    wait for it) the run is served, not deferred again (a newcomer: to the queue's end)."""
    poll(lambda: engine.store.db_now() >= due, timeout=10, what="the slot", every=0.05)
    clock.set(max(clock.now(), due))
    engine.run_until_idle(skip_time=False)
    assert engine.get(run_id).status == "succeeded"
    kinds = [e.kind for e in engine.history(run_id)]
    assert kinds.count(j.RUN_DEFERRED) == 1
    assert engine.replay(run_id).differences == []


def assert_row_is_the_fold(engine: Engine, run_id: str) -> None:
    stored = engine.store.get_run(run_id)
    assert stored is not None and stored.record == j.fold(engine.store.journal(run_id))


@pytest.mark.parametrize("how", ["engine", "bare"])
@pytest.mark.parametrize("admission", ["debounce", "throttle"])
def test_unpause__a_debounced_or_throttled_run_deferred_by_a_rate_limit_keeps_it(
    store_url: str, admission: str, how: str
) -> None:
    clock = FakeClock(time.time(), auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[limited()]) as engine:
        run_id, due, reason = deferred_run(engine, clock, admission)
        engine.pause(run_id)
        if how == "engine":
            engine.unpause(run_id)
        else:  # (`flowloop unpause` without -w)
            with TestEngine(store_url, clock=clock) as bare:
                bare.unpause(run_id)
        info = engine.get(run_id)
        assert (info.status, info.next_run_at, info.reason) == ("scheduled", due, reason)
        assert_row_is_the_fold(engine, run_id)
        served_in_its_turn(engine, clock, run_id, due)


@pytest.mark.parametrize("admission", ["debounce", "throttle"])
def test_migrate__a_debounced_or_throttled_run_deferred_by_a_rate_limit_keeps_it(
    store_url: str, admission: str
) -> None:
    clock = FakeClock(time.time(), auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[limited()]) as engine:
        run_id, due, reason = deferred_run(engine, clock, admission)
    with TestEngine(store_url, clock=clock, workflows=[limited(2)]) as engine:
        engine.migrate(run_id, to=2)
        info = engine.get(run_id)
        assert (info.version, info.status) == (2, "scheduled")
        assert (info.next_run_at, info.reason) == (due, reason)
        assert_row_is_the_fold(engine, run_id)
        served_in_its_turn(engine, clock, run_id, due)
        assert engine.get(run_id).context.log == ["called v2"]  # type: ignore[union-attr]
