"""What a step that ended without an outcome is journaled as: a run this worker gave up
(self-fenced) and recovered later says "lease lost", not "the worker died".

The lease is lost for real: while the step runs, its lease is ended in the database (as
a renewal delayed past the lease would find it); the next renewal says so, the worker
fences itself off the run, and its own recovery takes the run back.

A loop blocked for longer than the lease no longer loses it (issue 20, item 13): the
renewals run in a thread of their own (flowloop/leasethread.py).
"""

from __future__ import annotations

import asyncio
import time

import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, Step, Workflow
from flowloop import journal as j
from flowloop.store.sql import SQLStore

LEASE_S = 0.6


class Ctx(BaseModel):
    done: bool = False


def waiting_workflow(entered: asyncio.Event, release: asyncio.Event) -> Workflow:
    wf = Workflow("blocks", context=Ctx)

    @wf.step(initial=True, next="end")
    async def block(ctx: Ctx, step: Step) -> None:
        if step.attempt == 1:
            entered.set()
            await asyncio.wait_for(release.wait(), timeout=30)  # fenced off while here
        ctx.done = True

    wf.final("end")
    return wf


def end_lease(engine: Engine, run_id: str) -> None:
    """End the run's lease in the database, as if its renewals had come too late."""
    assert isinstance(engine.store, SQLStore)
    with engine.store.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE flowloop_runs SET lease_expires_at = 0 WHERE id = :id"), {"id": run_id}
        )


def test_self_fenced_run__recovery_journals_lease_lost(store_url: str) -> None:
    async def scenario() -> str:
        entered, release = asyncio.Event(), asyncio.Event()
        wf = waiting_workflow(entered, release)
        with Engine(store_url, workflows=[wf], lease_seconds=LEASE_S, poll_seconds=0.05) as e:
            run_id = e.start(wf, Ctx()).id
            executor = e._new_executor()
            stop = asyncio.Event()
            worker = asyncio.create_task(executor.run(until_idle=False, stop=stop, grace=5))
            try:
                await asyncio.wait_for(entered.wait(), timeout=30)
                end_lease(e, run_id)
                deadline = time.monotonic() + 30
                while e.get(run_id).status != "succeeded":
                    assert time.monotonic() < deadline, [ev.kind for ev in e.history(run_id)]
                    await asyncio.sleep(0.05)
            finally:
                stop.set()
                await worker
                executor.close()
            history = e.history(run_id)
        interrupted = [ev for ev in history if ev.kind == j.STEP_INTERRUPTED]
        assert len(interrupted) == 1, [ev.kind for ev in history]
        (entry,) = interrupted
        assert entry.data["cause"] == "lease_lost"
        assert entry.retryable and entry.attempt == 1
        assert entry.error_message is not None
        assert "lost its lease" in entry.error_message and "self-fenced" in entry.error_message
        assert "died" not in entry.error_message
        return run_id

    asyncio.run(scenario())


def test_a_loop_blocked_past_the_lease_keeps_it(store_url: str) -> None:
    """An async step blocks the event loop (time.sleep) for 2.5 leases: the lease thread
    renews meanwhile, so the run is neither fenced off nor interrupted (it was, before the
    renewals left the loop)."""
    wf = Workflow("sleeps", context=Ctx)

    @wf.step(initial=True, next="end")
    async def block(ctx: Ctx) -> None:
        time.sleep(LEASE_S * 2.5)  # the loop does nothing else meanwhile
        ctx.done = True

    wf.final("end")
    with Engine(store_url, workflows=[wf], lease_seconds=LEASE_S, poll_seconds=0.05) as e:
        info = e.run(wf, Ctx())
        kinds = [ev.kind for ev in e.history(info.id)]
    assert info.status == "succeeded", kinds
    assert kinds.count(j.STEP_STARTED) == 1 and j.STEP_INTERRUPTED not in kinds, kinds
