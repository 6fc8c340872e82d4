"""A run of async steps that never suspend keeps its lease (issue 13's review): appends no
longer renew the lease, the lease threads do, and on SQLite they share the store's lock with
the loop's own writes. A run stepping for several leases back to back must not lose it."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.store.schema import journal

LEASE_S = 3.0
STEP_BUSY_S = 0.001
"""Each step holds the loop this long (a busy wait, never yielding)."""
STEPS = 10_000
"""Bounded by steps: at least STEPS x STEP_BUSY_S = 10 s of steps back to back, over three
leases on any machine (a faster engine no longer makes the run too short to test)."""


class Spin(BaseModel):
    n: int = 0


def spin() -> Workflow:
    wf = Workflow("spin", context=Spin)

    @wf.step(initial=True, on={"again": "tick", "done": "end"})
    async def tick(ctx: Spin) -> str:  # never awaits anything: never yields the loop
        until = time.perf_counter() + STEP_BUSY_S
        while time.perf_counter() < until:
            pass
        ctx.n += 1
        return "again" if ctx.n < STEPS else "done"

    wf.final("end")
    return wf


def test_async_steps_that_never_suspend_keep_their_lease(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flowloop")
    with Engine(sqlite_url, workflows=[spin()], lease_seconds=LEASE_S) as engine:
        run = engine.run(spin(), Spin())
        stats = engine._executor().stats
        with engine.store.engine.connect() as conn:  # type: ignore[attr-defined]
            first, last = conn.execute(
                sa.select(sa.func.min(journal.c.at), sa.func.max(journal.c.at)).where(
                    journal.c.run_id == run.id
                )
            ).one()
    assert isinstance(run.context, Spin)
    assert (run.status, run.context.n) == ("succeeded", STEPS)
    assert stats.lost_leases == 0
    lost = [r.getMessage() for r in caplog.records if "lease" in r.getMessage().lower()]
    assert not lost, lost
    assert last - first >= 3 * LEASE_S, "the run was too quick to test anything: raise STEPS"


BLOCKING_S = 2.5
"""A plain `def` step's call that blocks this long: over four 0.6 s leases, past the
renewer's stall bound (three leases) — a wedged loop would lose its lease."""


class Slow(BaseModel):
    thread: str = ""


def slow() -> Workflow:
    wf = Workflow("slow", context=Slow)

    @wf.step(initial=True, next="end")
    def call(ctx: Slow) -> None:  # Engine.run calls it on the loop's own thread
        time.sleep(BLOCKING_S)  # a slow call (an HTTP request, a query), not a wait
        ctx.thread = threading.current_thread().name

    wf.final("end")
    return wf


def test_a_sync_step_on_the_loops_thread_keeps_its_lease(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Engine.run calls a plain `def` step without a timeout on the loop's thread: while it
    runs the loop does not tick, yet it is busy in a step, not wedged — the lease is
    renewed as for a step in a thread, and no stall is reported."""
    caplog.set_level(logging.INFO, logger="flowloop")
    with Engine(sqlite_url, workflows=[slow()], lease_seconds=0.6) as engine:
        run = engine.run(slow(), Slow())
        stats = engine._executor().stats
    assert isinstance(run.context, Slow)
    assert (run.status, run.context.thread) == ("succeeded", threading.current_thread().name)
    assert stats.lost_leases == 0
    noted = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert not [m for m in noted if "lease" in m.lower() or "blocked" in m], noted
