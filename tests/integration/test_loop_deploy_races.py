"""Loops under a deploy's and an operator's races, second pass: the schedule a deploy
deferred for another worker's iteration, a database error while it is applied, an unpause
racing an iteration's end, and a loop function that swallows its timeout's cancellation.
On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from loopkit import T0, LoopHarness, SteppedClock, describe, drive, settle
from sqlalchemy.exc import OperationalError

from flowloop.loops import Iteration, Loop


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def started(h: LoopHarness, name: str) -> list[float]:
    return [e.slot - T0 for e in h.journal(name) if e.kind == "iteration_started" and e.slot]


def test_schedule_deferred_for_another_workers_iteration__fires_at_the_new_schedules_next_slot(
    store_url: str,
) -> None:
    """Worker "new" (`every=5`) starts while worker "w1" (`every=10`) runs the iteration of
    slot T0, which ends at T0 + 7. Before, the deferred change restarted the loop as a new
    one, at once: a second iteration right after the first (slot T0 + 8). Now the new
    schedule goes on from the iteration that ran: its slot T0 + 5 came due while the
    iteration ran (an overlap), so its next is T0 + 10."""

    async def main() -> None:
        clock = SteppedClock()
        release = asyncio.Event()

        async def fn(it: Iteration) -> None:
            if it.number == 1:
                await release.wait()

        async with LoopHarness(store_url, [Loop("tick", fn, every=10)], clock=clock) as old:
            await drive(clock, 1)
            assert old.row("tick").status == "running"
            async with LoopHarness(
                store_url, [Loop("tick", fn, every=5)], clock=clock, worker_id="new"
            ) as new:
                await drive(clock, 6)
                release.set()
                await drive(clock, 9)
                events = new.journal("tick")
                rescheduled = [e for e in events if e.kind == "loop_rescheduled"]
                assert len(rescheduled) == 1, describe(events)
                assert rescheduled[0].slot == T0 + 10, describe(events)
                assert started(new, "tick") == [0, 10, 15], describe(events)

    run(main())


def test_schedule_deferred_with_fixed_delay__waits_every_after_the_iterations_end(
    store_url: str,
) -> None:
    """The same with `mode="fixed_delay"`: the next slot is the end (T0 + 2) plus 5."""

    async def main() -> None:
        clock = SteppedClock()
        release = asyncio.Event()

        async def fn(it: Iteration) -> None:
            if it.number == 1:
                await release.wait()

        async with LoopHarness(store_url, [Loop("tick", fn, every=10)], clock=clock) as old:
            await drive(clock, 1)
            new_loop = Loop("tick", fn, every=5, mode="fixed_delay")
            async with LoopHarness(store_url, [new_loop], clock=clock, worker_id="new") as new:
                await drive(clock, 1)
                release.set()
                await drive(clock, 9)
                events = new.journal("tick")
                assert started(new, "tick") == [0, 7], describe(events)
                assert old.row("tick").schedule == new_loop.schedule

    run(main())


def test_schedule_deferred__a_database_error_while_applying_it_is_retried_not_fatal(
    store_url: str,
) -> None:
    """The deferred schedule is applied when worker "new" sees the iteration's end — here
    through an operator's change to another loop (the worker re-reads its loops). Its
    write fails (the database out for a moment). Before, the error left the scheduler's
    task: the worker's loops stopped for good. Now it is logged and tried again at the
    next sweep, and the new schedule lands."""

    async def main() -> None:
        clock = SteppedClock()
        release = asyncio.Event()

        async def fn(it: Iteration) -> None:
            if it.loop == "tick" and it.number == 1:
                await release.wait()

        async def idle(it: Iteration) -> None:
            return None

        async with LoopHarness(store_url, [Loop("tick", fn, every=10)], clock=clock):
            await drive(clock, 1)
            loops = [Loop("tick", fn, every=5), Loop("other", idle, every=3600)]
            async with LoopHarness(store_url, loops, clock=clock, worker_id="new") as new:
                await drive(clock, 0.5, step=0.5)
                store = new.scheduler.store
                failures: list[str] = []
                real = store.sync_loops

                def broken(*args: Any, **kwargs: Any) -> Any:
                    if len(failures) < 2:
                        failures.append("sync_loops")
                        raise OperationalError("UPDATE", {}, Exception("database is locked"))
                    return real(*args, **kwargs)

                store.sync_loops = broken  # type: ignore[method-assign]
                release.set()
                await settle()
                new.engine.pause_loop("other")  # the worker re-reads its loops
                await drive(clock, 1.5, step=0.5)
                task = new._task
                assert task is not None
                assert not task.done(), task.exception()
                assert failures, "the resync was not tried"
                await drive(clock, 6)
                assert not task.done(), task.exception()
                events = new.journal("tick")
                kinds = [e.kind for e in events]
                assert "loop_rescheduled" in kinds, describe(events)
                assert new.row("tick").schedule == "every 5s (fixed_rate)"

    run(main())
