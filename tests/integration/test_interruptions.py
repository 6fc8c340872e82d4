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

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from storekit import dead_owner, event

from flowloop import Engine, Step, Workflow
from flowloop import journal as j
from flowloop.store import Boundary, Fence
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


async def take_over_and_go_away(url: str, wf: Workflow, run_id: str) -> None:
    """Another worker (one whose process is gone) recovers the run, claims it again and
    starts its attempt 2, then goes away in that step."""
    with Engine(url, workflows=[wf], lease_seconds=30.0, worker_id=dead_owner()) as other:
        taker = other._new_executor()
        try:
            assert await taker.recover() == 1
        finally:
            taker.close()
        (claimed,) = other.store.claim(
            worker=other.worker_id, now=time.time(), limit=1, lease_seconds=30.0, run_ids=[run_id]
        )
        record = claimed.record
        started = event(
            record, j.STEP_STARTED, state=record.state, attempt=2, worker=taker.worker_id
        )
        fence = Fence(other.worker_id, claimed.lease_epoch)
        boundary = Boundary(events=[started], record=j.apply(record, started), fence=fence)
        assert other.store.write([boundary]) == [True]


@pytest.mark.parametrize("taken_over", [False, True], ids=["own_attempt", "taken_over"])
def test_recovery_blames_the_worker_whose_attempt_was_cut_off(
    store_url: str, taken_over: bool
) -> None:
    """This worker lost its lease in attempt 1 and gave the run up. Its recovery of the run
    says ``lease_lost`` when the attempt it finds cut off is that one; when another worker
    took the run over meanwhile, began attempt 2 and went away in it, ``worker_gone``.
    Before the fix the mark of the earlier, unrelated loss stayed, and the journal blamed
    this worker for the other's attempt (fault audit, fence.py)."""
    entered, release = asyncio.Event(), asyncio.Event()
    wf = waiting_workflow(entered, release)

    async def scenario(engine: Engine, run_id: str) -> int:
        executor = engine._new_executor()
        try:
            (claimed,) = engine.store.claim(
                worker=engine.worker_id,
                now=time.time(),
                limit=1,
                lease_seconds=30.0,
                run_ids=[run_id],
            )
            task = executor.spawn(claimed, starting=True)
            await asyncio.wait_for(entered.wait(), 30)
            # The lease threads found the lease gone: fenced, the step cut off.
            executor.leases.abandon(run_id, "test: its lease is gone")
            await asyncio.gather(task, return_exceptions=True)
            engine.store.expire_leases([engine.worker_id])  # (its lease then ran out)
            if taken_over:
                await take_over_and_go_away(engine.url, wf, run_id)
            return await executor.recover()
        finally:
            executor.close()

    with Engine(store_url, workflows=[wf], lease_seconds=30.0) as e:
        run_id = e.start(wf, Ctx()).id
        assert asyncio.run(scenario(e, run_id)) == 1
        entry = e.history(run_id)[-1]
    assert entry.kind == j.STEP_INTERRUPTED and entry.worker == e.worker_id, entry
    assert entry.attempt == (2 if taken_over else 1)
    assert entry.error_message is not None
    if taken_over:
        assert entry.data["cause"] == "worker_gone", entry.data
        assert entry.error_message.startswith("its worker went away"), entry.error_message
    else:
        assert entry.data["cause"] == "lease_lost", entry.data
        assert "self-fenced" in entry.error_message, entry.error_message


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
