"""A worker whose host clock is skewed from the database's defers runs to due times by the
database's clock and wakes for them by the engine's clock (a :class:`DatabaseClock`, the
one its claims judge due times by), on SQLite and PostgreSQL. Before, ``Gates`` woke for a
deferred run by ``due - time.time()``: a host 90 s behind the database woke 90 s late for
a run its breaker or rate limit had deferred, one 90 s ahead gave up the wake-up at once
and slept its whole poll.

The skew is this process's ``time.time()`` moved by ±90 s; the database keeps the true
time (PostgreSQL's server, and SQLite's ``julianday('now')``, which reads the system's
clock itself, not Python's ``time.time``)."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop import journal as j
from flowloop.clock import SystemClock
from flowloop.dbclock import DatabaseClock
from flowloop.flowcontrol import Breaker, RateLimit
from flowloop.gates import Gates

SKEW_S = 90.0
HORIZON_S = 600.0
TOLERANCE_S = 2.0
"""How far the wake-up may be from the due time seen from the database now: the clock's
measured offset is off by at most the round trip of its measurement."""

provider = Breaker("skewed-provider", failures=1, within=timedelta(minutes=1), cool_down=30)
rate = RateLimit("skewed-rate", 1, per=timedelta(minutes=1))


class Call(BaseModel):
    n: int = 0


def call(ctx: Call) -> None:
    ctx.n += 1


guarded = Workflow("skew_guarded", context=Call)
guarded.step(name="call", initial=True, next="done", breaker=provider)(call)
guarded.final("done")
paced = Workflow("skew_paced", context=Call)
paced.step(name="call", initial=True, next="done", rate_limit=rate)(call)
paced.final("done")


@pytest.fixture(params=[-SKEW_S, SKEW_S], ids=["host_behind", "host_ahead"])
def skew(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> float:
    """This host's wall clock, ``skew`` seconds off the database's."""
    real = time.time
    offset = float(request.param)
    monkeypatch.setattr(time, "time", lambda: real() + offset)
    return offset


def _gates(engine: Engine, skew: float) -> Gates:
    """A worker's gates with the clock a worker on a skewed host judges due times by."""
    clock = DatabaseClock(engine.store.db_now)
    clock.refresh()
    assert abs(clock.offset + skew) < TOLERANCE_S, clock.offset  # it saw the skew
    return Gates(engine.store, "w1", clock)


def test_a_run_the_open_breaker_defers_wakes_its_worker_when_due(
    store_url: str, skew: float
) -> None:
    with Engine(store_url, workflows=[guarded]) as engine:
        store = engine.store
        record = store.get_run(engine.start(guarded, Call()).id).record  # type: ignore[union-attr]
        assert store.breaker_failed(provider, "w0", "ConnectionError: down") == "opened"  # type: ignore[attr-defined]
        until = float(store.breaker_state(provider.name).until)  # type: ignore[attr-defined]
        gates = _gates(engine, skew)
        entry = asyncio.run(gates.check(guarded, record, "call", attempt=0))
        assert entry is not None and entry.kind == j.RUN_DEFERRED
        assert entry.data["due"] == until  # the end of the cool-down by the database's clock
        wait = gates.wake_in(HORIZON_S)
        expected = until - store.db_now()
        assert abs(wait - expected) < TOLERANCE_S, (wait, expected)


def test_a_run_the_rate_limit_defers_wakes_its_worker_when_due(store_url: str, skew: float) -> None:
    with Engine(store_url, workflows=[paced]) as engine:
        store = engine.store
        record = store.get_run(engine.start(paced, Call()).id).record  # type: ignore[union-attr]
        granted, at, _ = store.take_tokens([rate], queued=set())  # type: ignore[attr-defined]
        assert granted
        gates = _gates(engine, skew)
        entry = asyncio.run(gates.check(paced, record, "call", attempt=0))
        assert entry is not None and entry.kind == j.RUN_DEFERRED
        assert entry.data["due"] == pytest.approx(at + rate.interval)  # the limit's next slot
        wait = gates.wake_in(HORIZON_S)
        expected = entry.data["due"] - store.db_now()
        assert abs(wait - expected) < TOLERANCE_S, (wait, expected)


AHEAD_S = 0.4
"""Under :data:`flowloop.dbclock.SKEW_IGNORED`: a database clock takes it as no offset."""

brief = Breaker("brief-provider", failures=1, within=timedelta(minutes=1), cool_down=1)
briefly_guarded = Workflow("skew_brief", context=Call)
briefly_guarded.step(name="call", initial=True, next="done", breaker=brief)(call)
briefly_guarded.final("done")


class _Ahead(SystemClock):
    """A host clock AHEAD_S ahead of the database's."""

    def now(self) -> float:
        return time.time() + AHEAD_S


def test_a_cool_down_ending_within_the_ignored_skew_is_waited_out_not_deferred_again(
    store_url: str,
) -> None:
    # The engine's clock, ahead by less than a database clock corrects, claims the deferred
    # run before the database says the cool-down ended: before, each claim deferred it to
    # the same due time and the next claim took it at once (hundreds of run_deferred for
    # one cool-down's end, measured 438); the gate now waits out that last short span.
    with Engine(store_url, workflows=[briefly_guarded], clock=_Ahead()) as engine:
        assert engine.store.breaker_failed(brief, "w0", "ConnectionError: down") == "opened"  # type: ignore[attr-defined]
        info = engine.run(briefly_guarded, Call())
        assert info.status == "succeeded"
        kinds = [entry.kind for entry in engine.history(info.id)]
    assert kinds.count(j.RUN_DEFERRED) == 1, kinds


briefly_paced_rate = RateLimit("brief-rate", 1, per=timedelta(seconds=1))
briefly_paced = Workflow("skew_brief_paced", context=Call)
briefly_paced.step(name="call", initial=True, next="done", rate_limit=briefly_paced_rate)(call)
briefly_paced.final("done")


def test_a_rate_slot_due_within_the_ignored_skew_is_waited_for_not_deferred_again(
    store_url: str,
) -> None:
    # As above for a rate limit's next slot: before, a slot due between 0.2 s (the short
    # wait) and the engine clock's lead spun the same way (measured 393 run_deferred).
    with Engine(store_url, workflows=[briefly_paced], clock=_Ahead()) as engine:
        granted, _, _ = engine.store.take_tokens([briefly_paced_rate], queued=set())  # type: ignore[attr-defined]
        assert granted
        info = engine.run(briefly_paced, Call())
        assert info.status == "succeeded"
        kinds = [entry.kind for entry in engine.history(info.id)]
    assert kinds.count(j.RUN_DEFERRED) == 1, kinds
