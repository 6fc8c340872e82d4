"""What a step that ended without an outcome is journaled as: a run this worker gave up
(self-fenced) and recovered later says "lease lost", not "the worker died".

The lease is lost for real: an async step blocks the event loop (time.sleep) for longer
than the lease, so the heartbeat cannot renew it; the worker fences itself off the run,
and its own recovery takes the run back once the lease has run out in the database.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import BaseModel

from flowloop import Engine, Step, Workflow
from flowloop import journal as j

LEASE_S = 0.6


class Ctx(BaseModel):
    done: bool = False


def blocking_workflow(release: asyncio.Event) -> Workflow:
    wf = Workflow("blocks", context=Ctx)

    @wf.step(initial=True, next="end")
    async def block(ctx: Ctx, step: Step) -> None:
        if step.attempt == 1:
            time.sleep(LEASE_S * 1.5)  # the heartbeat cannot renew meanwhile
            await asyncio.wait_for(release.wait(), timeout=30)  # fenced off while here
        ctx.done = True

    wf.final("end")
    return wf


def test_self_fenced_run__recovery_journals_lease_lost(store_url: str) -> None:
    async def scenario() -> str:
        release = asyncio.Event()
        wf = blocking_workflow(release)
        with Engine(store_url, workflows=[wf], lease_seconds=LEASE_S, poll_seconds=0.05) as e:
            run_id = e.start(wf, Ctx()).id
            executor = e._new_executor()
            stop = asyncio.Event()
            worker = asyncio.create_task(executor.run(until_idle=False, stop=stop, grace=5))
            try:
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
