"""A half-open breaker's trial is one call: only its outcome closes or reopens the breaker,
and no second call goes through while it still runs — on SQLite and PostgreSQL, a real
worker (steps held by events) or the real store and gates, by the database's clock.

Before: the trial was a breaker name remembered per worker, so any call of that breaker
ending on the trial's worker counted as the trial — a call let through before the breaker
opened, succeeding while the trial ran, closed it (and one failing reopened it); and a
trial that outlasted the cool-down let a second trial through beside it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from loopkit import until
from pydantic import BaseModel
from storekit import dead_owner

from flowloop import Engine, Workflow
from flowloop import journal as j
from flowloop.flowcontrol import Breaker
from flowloop.gates import Gates
from flowloop.retry import NO_RETRY
from flowloop.worker import Worker

COOL_S = 0.3
WAIT_S = 30.0

provider = Breaker("provider", failures=3, within=60, cool_down=COOL_S)
HELD: dict[str, threading.Event] = {}
"""A call whose ``hold`` names an event here waits for it (set by the test)."""
ENTERED: dict[str, threading.Event] = {}
"""Set when the call of that name has begun."""


class Call(BaseModel):
    name: str
    fail: bool = False
    hold: bool = False


calls = Workflow("calls", context=Call)


@calls.step(initial=True, next="done", breaker=provider, retry=NO_RETRY)
def call(ctx: Call) -> None:
    ENTERED.setdefault(ctx.name, threading.Event()).set()
    if ctx.hold:
        assert HELD[ctx.name].wait(WAIT_S), f"{ctx.name} was never released"
    if ctx.fail:
        raise ConnectionError(f"provider down ({ctx.name})")


calls.final("done")


@pytest.fixture(autouse=True)
def _events() -> Iterator[None]:
    HELD.clear()
    ENTERED.clear()
    yield
    for event in HELD.values():  # never leave a step thread waiting
        event.set()


def call_of(run_id: str, seq: int) -> str:
    """How the breaker names its trial call (``trial`` in ``flowloop status --json``): the
    run and the seq of the call's ``step_started``."""
    return f"{run_id}:{seq}"


def trial_run(store: Any) -> str:
    """The run of the breaker's trial call."""
    return str(store.breaker_state(provider.name).trial).rpartition(":")[0]


def held(name: str) -> Call:
    HELD[name] = threading.Event()
    return Call(name=name, hold=True)


def kinds(store: Any) -> list[str]:
    return [e.kind for e in store.breaker_journal(provider.name)]


async def cooled_down(store: Any) -> None:
    """Until the database's clock passes the breaker's ``until`` (bounded)."""
    until_at = float(store.breaker_state(provider.name).until)
    await until(lambda: store.db_now() >= until_at, timeout=WAIT_S, what="the cool-down")


async def entered(name: str) -> None:
    await until(
        lambda: name in ENTERED and ENTERED[name].is_set(), timeout=WAIT_S, what=f"{name} called"
    )


async def with_worker(url: str, body: Callable[[Engine], Awaitable[None]]) -> None:
    with Engine(url, workflows=[calls], poll_seconds=0.05) as engine:
        stop = asyncio.Event()
        task = asyncio.create_task(Worker(engine, concurrency=8, grace=1.0).run(stop))
        try:
            await asyncio.sleep(0)
            await body(engine)
        finally:
            for event in HELD.values():
                event.set()
            stop.set()
            await asyncio.wait_for(task, WAIT_S)


async def open_with_a_call_in_flight(engine: Engine, stale: Call, trial: Call) -> tuple[str, str]:
    """``stale`` let through while closed (held); three failures open the breaker; after
    the cool-down ``trial`` (held) is the trial. Returns both runs' ids."""
    store: Any = engine.store
    stale_id = engine.start(calls, stale).id
    await entered(stale.name)
    for i in range(3):
        engine.start(calls, Call(name=f"F{i}", fail=True))
    await until(lambda: "opened" in kinds(store), timeout=WAIT_S, what="the breaker to open")
    await cooled_down(store)
    trial_id = engine.start(calls, trial).id
    await entered(trial.name)
    assert kinds(store) == ["opened", "half_opened"]
    return stale_id, trial_id


def test_a_call_let_through_before_it_opened_succeeding_does_not_close_it(store_url: str) -> None:
    async def body(engine: Engine) -> None:
        store: Any = engine.store
        failing = held("T").model_copy(update={"fail": True})
        stale_id, trial_id = await open_with_a_call_in_flight(engine, held("S"), failing)
        HELD["S"].set()  # the call made before the breaker opened succeeds now
        await until(lambda: engine.get(stale_id).status == "succeeded", what="S to succeed")
        assert engine.get(trial_id).status == "running"
        assert store.breaker_state(provider.name).status == "half_open"
        assert kinds(store) == ["opened", "half_opened"]
        assert trial_run(store) == trial_id
        # The trial's own failure opens it for another cool-down.
        HELD["T"].set()
        ended = await _ended(engine, trial_id)
        assert ended == "failed"
        assert kinds(store) == ["opened", "half_opened", "opened"]
        assert store.breaker_state(provider.name).status == "open"

    asyncio.run(with_worker(store_url, body))


def test_a_call_let_through_before_it_opened_failing_does_not_reopen_it(store_url: str) -> None:
    async def body(engine: Engine) -> None:
        store: Any = engine.store
        failing = held("S").model_copy(update={"fail": True})
        stale_id, trial_id = await open_with_a_call_in_flight(engine, failing, held("T"))
        HELD["S"].set()  # the call made before the breaker opened fails now
        await until(lambda: engine.get(stale_id).status == "failed", what="S to fail")
        assert store.breaker_state(provider.name).status == "half_open"
        assert kinds(store) == ["opened", "half_opened"]
        assert trial_run(store) == trial_id
        # The trial's own success closes it.
        HELD["T"].set()
        assert await _ended(engine, trial_id) == "succeeded"
        assert kinds(store) == ["opened", "half_opened", "closed"]
        assert store.breaker_state(provider.name).status == "closed"

    asyncio.run(with_worker(store_url, body))


async def _ended(engine: Engine, run_id: str) -> str:
    await until(lambda: engine.get(run_id).finished, timeout=WAIT_S, what=f"{run_id} to end")
    return engine.get(run_id).status


def test_a_trial_slower_than_the_cool_down_lets_no_second_call_through(store_url: str) -> None:
    async def body(engine: Engine) -> None:
        store: Any = engine.store
        for i in range(3):
            engine.start(calls, Call(name=f"F{i}", fail=True))
        await until(lambda: "opened" in kinds(store), timeout=WAIT_S, what="the breaker to open")
        await cooled_down(store)
        trial_id = engine.start(calls, held("H")).id
        await entered("H")
        assert kinds(store) == ["opened", "half_opened"]
        await cooled_down(store)  # the trial's own cool-down is over; it still runs
        other = engine.start(calls, Call(name="O")).id

        def refused() -> bool:
            info = engine.get(other)
            return info.reason == "breaker_open:provider" or info.finished

        await until(refused, timeout=WAIT_S, what="O to be refused (or to run)")
        assert "O" not in ENTERED, "a second call went through while the trial ran"
        assert engine.get(other).status == "scheduled"
        assert kinds(store) == ["opened", "half_opened"]
        assert trial_run(store) == trial_id
        # The trial succeeds: closed; the refused run is called then.
        HELD["H"].set()
        assert await _ended(engine, trial_id) == "succeeded"
        assert await _ended(engine, other) == "succeeded"
        assert kinds(store) == ["opened", "half_opened", "closed"]

    asyncio.run(with_worker(store_url, body))


def test_a_trial_whose_worker_died_is_replaced_once_its_lease_has_ended(store_url: str) -> None:
    """The trial's worker is gone (a SIGKILL: its lease is not renewed, the call has no
    outcome): the breaker stays half open while the lease runs, then the next call is the
    trial; the first one's late outcome changes nothing."""
    with Engine(store_url, workflows=[calls]) as engine:
        store: Any = engine.store
        for _ in range(3):
            store.breaker_failed(provider, "w0", "ConnectionError: down")
        asyncio.run(cooled_down(store))
        gone = dead_owner()
        first = engine.start(calls, Call(name="X")).id
        (claimed,) = store.claim(
            worker=gone, now=store.db_now() + 1, limit=1, lease_seconds=60.0, run_ids=[first]
        )
        record = claimed.record
        assert (
            asyncio.run(Gates(store, gone, engine.clock).check(calls, record, "call", attempt=0))
            is None
        )
        trial = call_of(first, record.last_seq + 1)
        asyncio.run(cooled_down(store))  # the trial's cool-down is over; its lease is not

        other = store.get_run(engine.start(calls, Call(name="O")).id).record
        gates = Gates(store, "w2", engine.clock)
        refused = asyncio.run(gates.check(calls, other, "call", attempt=0))
        assert refused is not None and refused.kind == j.RUN_DEFERRED
        assert refused.data["reason"] == "breaker_open:provider"
        assert kinds(store) == ["opened", "half_opened"]
        assert store.breaker_state(provider.name).trial == trial

        assert store.expire_leases([gone]) == 1  # its lease ends (known dead, or run out)
        asyncio.run(cooled_down(store))  # (a refusal looks again a second later)
        assert asyncio.run(gates.check(calls, other, "call", attempt=0)) is None
        journal = store.breaker_journal(provider.name)
        assert [e.kind for e in journal] == ["opened", "half_opened", "half_opened"]
        replaced = journal[-1].data
        assert replaced["trial"] == call_of(other.id, other.last_seq + 1)
        assert replaced["given_up"] == trial
        # The first trial's late outcome changes nothing; the new one's closes it.
        assert store.breaker_failed(provider, gone, "late", trial) is None
        assert store.breaker_succeeded(provider, gone, trial) is None
        assert store.breaker_state(provider.name).status == "half_open"
        closing = call_of(other.id, other.last_seq + 1)
        assert store.breaker_succeeded(provider, "w2", closing) == "closed"
