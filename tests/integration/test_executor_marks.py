"""What an executor notes for one run or one call must not reach another: a drain limited to
some runs leaves the others going on, and a run given up as lost and claimed again is
driven as any claimed run (its pause and stop requests are honoured)."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from flowloop import Engine, Workflow

WAIT_S = 30.0


class Ctx(BaseModel):
    n: int = 0


def test_a_drain_of_some_runs_does_not_release_the_others(store_url: str) -> None:
    """``drain(grace, scope)`` waits for the runs in ``scope`` only (a nested wait-out's end
    does it). Run A, outside the scope and in its step meanwhile, goes on to its next step
    at its boundary: before the fix, a scoped drain set the executor's drain flag, and A
    was released "on shutdown" there instead (``arun`` then drove it on from the queue)."""
    workflow = Workflow("outside", context=Ctx)
    events: dict[str, asyncio.Event] = {}

    @workflow.step(initial=True, next="second")
    async def first(ctx: Ctx) -> None:
        events["started"].set()
        await asyncio.wait_for(events["go"].wait(), WAIT_S)
        ctx.n = 1

    @workflow.step(next="done")
    async def second(ctx: Ctx) -> None:
        ctx.n += 1

    workflow.final("done")

    with Engine(store_url, workflows=[workflow]) as engine:

        async def main() -> None:
            events.update(started=asyncio.Event(), go=asyncio.Event())
            run_a = asyncio.create_task(engine.arun(workflow, Ctx()))
            await asyncio.wait_for(events["started"].wait(), WAIT_S)
            await engine._executor().drain(0.01, scope={"another-run"})
            events["go"].set()
            info = await asyncio.wait_for(run_a, WAIT_S)
            assert info.status == "succeeded", info
            assert info.context.n == 2  # type: ignore[attr-defined]
            # Straight on: not released at the boundary (and driven on by arun's wait-out).
            kinds = [event.kind for event in engine.history(info.id)]
            assert "run_released" not in kinds, kinds

        asyncio.run(main())


def test_a_run_lost_and_claimed_again_takes_a_stop(store_url: str) -> None:
    """The run's lease is lost while its step swallows the cancellation (its task lives
    on); the lease expires and this executor claims the run again. The new drive is not
    "lost": a stop request reaches it and cuts its step off. Before the fix the old mark
    stayed, every request for the run was ignored, and it ran to its end. Then the old
    task, cancelled again once the new drive has ended, does not cut the run off under its
    stale fence (a write refused, a lease reported lost for a run that was not)."""
    workflow = Workflow("reclaimed", context=Ctx)
    events: dict[str, asyncio.Event] = {}
    calls: list[int] = []

    @workflow.step(initial=True, next="done")
    async def stubborn(ctx: Ctx) -> None:
        calls.append(1)
        if len(calls) == 1:  # the first drive: swallows the cancellation of its lost lease
            events["first_started"].set()
            try:
                await asyncio.wait_for(events["never"].wait(), WAIT_S)
            except asyncio.CancelledError:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                events["swallowed"].set()
            await asyncio.wait_for(events["old_ends"].wait(), WAIT_S)
            return
        events["second_started"].set()
        await asyncio.wait_for(events["never"].wait(), WAIT_S)  # until the stop cuts it off

    workflow.final("done")

    with Engine(store_url, workflows=[workflow], lease_seconds=2.0) as engine:

        async def main() -> None:
            names = ("first_started", "swallowed", "old_ends", "second_started", "never")
            events.update({name: asyncio.Event() for name in names})
            executor = engine._executor()
            first = asyncio.create_task(engine.arun(workflow, Ctx()))
            await asyncio.wait_for(events["first_started"].wait(), WAIT_S)
            (run,) = engine.runs()
            executor.leases.begin()  # (the threads serve the second drive after arun ends)
            try:
                # The lease threads found the lease gone: fenced, no longer renewed, the
                # task cancelled.
                executor.leases.abandon(run.id, "test: its lease is gone")
                await asyncio.wait_for(events["swallowed"].wait(), WAIT_S)
                # Its lease expires; this executor claims the run again and drives it.
                engine.store.expire_leases([engine.worker_id])
                (again,) = engine.store.claim_interrupted(
                    worker=engine.worker_id, limit=1, lease_seconds=2.0
                )
                second = executor.spawn(again, starting=True)
                await asyncio.wait_for(events["second_started"].wait(), WAIT_S)
                assert not executor.lost(run.id)
                # An operator's stop, polled (a poll hands over what the row holds).
                assert engine.store.request_control(run.id, "stop")
                executor.apply_controls({run.id: "stop"})
                await asyncio.wait_for(asyncio.gather(second, return_exceptions=True), WAIT_S)
                # The old task, cancelled again (its caller's Ctrl-C, say), writes nothing
                # under its stale fence: no cut-off refused, no lease reported lost.
                lost_before = executor.stats.lost_leases
                first.cancel()
                await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), WAIT_S)
                assert executor.stats.lost_leases == lost_before
            finally:
                events["old_ends"].set()
                await asyncio.wait_for(asyncio.gather(first, return_exceptions=True), WAIT_S)
                executor.leases.end()
            assert engine.get(run.id).status == "stopped"

        asyncio.run(main())
