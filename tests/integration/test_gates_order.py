"""A step behind both a breaker and a rate limit: the breaker's half-open trial goes to a
call the rate limit lets through. Before, the trial was taken first (``half_opened``
journaled) and the run then deferred for its token: no call was made for a whole cool-down,
every other run was refused as ``breaker_open``, and the trial was taken again and again —
on SQLite and PostgreSQL, with the real store and its database clock."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow
from flowloop import journal as j
from flowloop.flowcontrol import Breaker, RateLimit, call_id
from flowloop.gates import Gates

rate = RateLimit("one-a-minute", 1, per=timedelta(minutes=1))
provider = Breaker("provider", failures=1, within=timedelta(minutes=1), cool_down=0.05)


class Call(BaseModel):
    n: int = 0


guarded = Workflow("guarded_call", context=Call)


@guarded.step(initial=True, next="done", rate_limit=rate, breaker=provider)
def call(ctx: Call) -> None:
    ctx.n += 1


guarded.final("done")
roomy = Workflow("roomy_call", context=Call)
roomy.step(
    name="call", initial=True, next="done", rate_limit=RateLimit("roomy", 100), breaker=provider
)(call)
roomy.final("done")


def _opened_and_cooled_down(store: Any) -> float:
    """Open the breaker (a failure), then wait out its 50 ms cool-down by the database's
    clock (bounded): its end, as a time."""
    assert store.breaker_failed(provider, "w0", "ConnectionError: down") == "opened"
    until = float(store.breaker_state(provider.name).until)
    deadline = time.monotonic() + 10
    while store.db_now() < until and time.monotonic() < deadline:
        time.sleep(0.01)
    return until


def test_a_run_the_rate_limit_defers_does_not_take_the_breakers_trial(store_url: str) -> None:
    with Engine(store_url, workflows=[guarded, roomy], clock=FakeClock()) as engine:
        store = engine.store
        record = store.get_run(engine.start(guarded, Call()).id).record  # type: ignore[union-attr]
        assert store.take_tokens([rate], queued=set())[0]  # type: ignore[attr-defined]
        _opened_and_cooled_down(store)
        gates = Gates(store, "w1", engine.clock)
        entry = asyncio.run(gates.check(guarded, record, "call", attempt=0))
        assert entry is not None and entry.kind == j.RUN_DEFERRED
        assert entry.data["reason"] == "rate_limit:one-a-minute"
        # The trial is still there for the call that gets a token, not held by this run.
        assert store.breaker_state(provider.name).status == "open"  # type: ignore[attr-defined]
        kinds = [e.kind for e in store.breaker_journal(provider.name)]  # type: ignore[attr-defined]
        assert kinds == ["opened"]
        # A call the rate limit lets through takes the trial (and is made).
        other = store.get_run(engine.start(roomy, Call()).id).record  # type: ignore[union-attr]
        assert (
            asyncio.run(Gates(store, "w2", engine.clock).check(roomy, other, "call", attempt=0))
            is None
        )
        after = store.breaker_state(provider.name)  # type: ignore[attr-defined]
        assert (after.status, after.trial) == ("half_open", call_id(other.id, other.last_seq + 1))


def test_a_run_refused_by_the_breaker_after_its_token_keeps_no_grant(store_url: str) -> None:
    """Another worker took the trial between this run's token and its turn at the breaker:
    the run is deferred, and the grant kept for its ``step_started`` was left behind (a
    later call of the run on this worker journaled a stale grant)."""
    with Engine(store_url, workflows=[guarded, roomy], clock=FakeClock()) as engine:
        store = engine.store
        record = store.get_run(engine.start(roomy, Call()).id).record  # type: ignore[union-attr]
        _opened_and_cooled_down(store)
        take = store.take_tokens  # type: ignore[attr-defined]

        def then_another_worker_takes_the_trial(*args: Any, **kwargs: Any) -> Any:
            taken = take(*args, **kwargs)
            assert store.breaker_admit(provider, "w9", "elsewhere:1").allowed  # type: ignore[attr-defined]
            return taken

        store.take_tokens = then_another_worker_takes_the_trial  # type: ignore[attr-defined]
        gates = Gates(store, "w1", engine.clock)
        entry = asyncio.run(gates.check(roomy, record, "call", attempt=0))
        assert entry is not None and entry.data["reason"] == "breaker_open:provider"
        assert gates.granted(record.id) == {}


def test_a_cool_down_ending_after_the_look_does_not_give_the_trial_before_the_token(
    store_url: str,
) -> None:
    """The look before the tokens saw the breaker open; its cool-down ended before this run
    was refused, and the refusal went through the breaker's admission, which gave the
    run the trial before its token: the rate limit then deferred it, and the trial was
    held by a run that made no call. A run the look refuses is refused as the look saw."""
    with Engine(store_url, workflows=[guarded, roomy], clock=FakeClock()) as engine:
        store = engine.store
        record = store.get_run(engine.start(guarded, Call()).id).record  # type: ignore[union-attr]
        assert store.take_tokens([rate], queued=set())[0]  # type: ignore[attr-defined]
        until = _opened_and_cooled_down(store)
        db_now = store.db_now  # type: ignore[attr-defined]
        store.db_now = lambda: until - 0.01  # type: ignore[attr-defined]  # the look, just before
        try:
            entry = asyncio.run(
                Gates(store, "w1", engine.clock).check(guarded, record, "call", attempt=0)
            )
        finally:
            store.db_now = db_now  # type: ignore[attr-defined]
        assert entry is not None and entry.kind == j.RUN_DEFERRED
        assert entry.data["reason"] == "breaker_open:provider"
        assert store.breaker_state(provider.name).status == "open"  # type: ignore[attr-defined]
        assert [e.kind for e in store.breaker_journal(provider.name)] == ["opened"]  # type: ignore[attr-defined]
