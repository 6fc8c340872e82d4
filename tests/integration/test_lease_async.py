"""A run of async steps that never suspend keeps its lease (issue 13's review): appends no
longer renew the lease, the lease threads do, and on SQLite they share the store's lock with
the loop's own writes. A run stepping for several leases back to back must not lose it."""

from __future__ import annotations

import logging
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
