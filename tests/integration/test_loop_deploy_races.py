"""Loops under a deploy's and an operator's races, second pass: the schedule a deploy
deferred for another worker's iteration, a database error while it is applied, an unpause
racing an iteration's end (a loop function that swallows its timeout's cancellation:
test_loop_runaways.py). On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from loopkit import T0, LoopHarness, SteppedClock, describe, drive, settle
from sqlalchemy.exc import OperationalError

from flowloop import Engine
from flowloop.loops import Iteration, Loop
from flowloop.store.loops import LoopEvent, LoopRow, LoopStoreMixin


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def fire(store: LoopStoreMixin, name: str, slot: float, *, lease_seconds: float) -> None:
    """Fire ``slot`` as worker "gone", holding the lease ``lease_seconds`` from now."""
    row = store.get_loop(name)
    assert row is not None
    event = LoopEvent(loop=name, kind="iteration_started", at=slot, slot=slot, worker="gone")
    fired = store.fire_loop(
        name=name,
        follows_seq=row.last_seq,
        worker="gone",
        lease_seconds=lease_seconds,
        events=[event],
        changes={"last_slot": slot, "last_started_at": slot, "next_fire_at": None},
    )
    assert fired is not None


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


def test_unpause_while_the_worker_records_a_paused_outcome__the_loop_goes_on(
    store_url: str,
) -> None:
    """`flowloop pause` during an iteration, then `unpause` just as the iteration ends: the
    worker has read the pause (to honour it) and the unpause withdraws it before the
    worker's write. Before, the write honoured the pause it had read: the loop ended
    paused although the unpause had been acknowledged (`control` cleared, no error). Now
    the write is fenced on the request it honours: refused, the worker reads the loop
    again and records the outcome with no request — the loop goes on."""

    async def main() -> None:
        clock = SteppedClock()
        release = asyncio.Event()

        async def fn(it: Iteration) -> None:
            if it.number == 1:
                await release.wait()

        async with LoopHarness(store_url, [Loop("tick", fn, every=10)], clock=clock) as h:
            await drive(clock, 1)
            assert h.engine.pause_loop("tick").control == "pause"
            store = h.scheduler.store
            real = store.write_loop
            acknowledged: list[LoopRow] = []

            def racing(**kwargs: Any) -> bool:
                if kwargs["owner"] == "w1" and not acknowledged:
                    acknowledged.append(h.engine.unpause_loop("tick"))  # between read and write
                return real(**kwargs)

            store.write_loop = racing  # type: ignore[method-assign]
            release.set()
            await drive(clock, 1)
            assert acknowledged and acknowledged[0].control is None, acknowledged
            row = h.row("tick")
            assert (row.status, row.control, row.last_result) == ("scheduled", None, "ok"), row
            await drive(clock, 9)
            events = h.journal("tick")
            assert "loop_paused" not in [e.kind for e in events], describe(events)
            assert started(h, "tick") == [0, 10], describe(events)

    run(main())


def test_unpause_reading_a_pause_its_worker_honours_meanwhile__unpauses_the_loop(
    store_url: str,
) -> None:
    """The other order: the unpause reads the loop running with a pause pending, then the
    iteration ends and its worker honours the pause (loop paused) before the unpause
    withdraws it. Before, the withdrawal touched a paused loop's (already cleared) request:
    the unpause returned without an error and the loop stayed paused. Now the withdrawal is
    fenced on the running loop's pending pause; refused, the unpause reads the loop again
    and unpauses the paused loop."""
    with Engine(store_url) as engine:
        store = engine.store
        assert isinstance(store, LoopStoreMixin)
        store.sync_loop(name="tick", schedule="every 10s", first_slot=T0, at=T0, worker="w")
        fire(store, "tick", T0, lease_seconds=60)
        store.request_loop_control("tick", "pause")
        real, reads = store.write_loop, store.get_loop
        honoured: list[bool] = []

        def worker_honours_it() -> None:
            row = reads("tick")
            assert row is not None and row.status == "running"
            paused = LoopEvent(loop="tick", kind="loop_paused", at=T0 + 1, worker="gone")
            honoured.append(
                real(
                    name="tick",
                    owner="gone",
                    epoch=row.lease_epoch,
                    follows_seq=row.last_seq,
                    changes={
                        "status": "paused",
                        "next_fire_at": None,
                        "control": None,
                        "reason": "paused by an operator",
                        "last_result": "ok",
                        "iterations": 1,
                    },
                    events=[paused],
                )
            )

        def read_then_race(name: str) -> LoopRow | None:
            row = reads(name)
            if not honoured and row is not None and row.control == "pause":
                worker_honours_it()  # after the unpause's read, before its write
            return row

        store.get_loop = read_then_race  # type: ignore[method-assign]
        row = engine.unpause_loop("tick")
        assert honoured == [True]
        assert (row.status, row.control) == ("scheduled", None), row
        kinds = [e.kind for e in engine.loop_history("tick")]
        assert kinds[-2:] == ["loop_paused", "loop_unpaused"], kinds


def test_schedule_changed_after_downtime__a_loop_that_does_not_coalesce_keeps_its_due_slot(
    store_url: str,
) -> None:
    """An hourly cron loop with `coalesce=False`, its workers down 20 minutes past its slot
    at 2 h, comes back as `*/30`. Before, the due slot was dropped — the loop restarted at
    the new schedule's next time (2 h 30), the slot journaled nowhere but in the
    `loop_rescheduled` entry's `was` — where a loop that coalesces runs it at once. Now it
    is kept as one iteration, at once, at the new schedule's latest slot (2 h here; never
    earlier than the slot kept); the new schedule's slots since it are not caught up."""

    async def fn(it: Iteration) -> None:
        return None

    async def main() -> None:
        clock = SteppedClock()
        hourly = Loop("rep", fn, cron="0 * * * *", coalesce=False)
        async with LoopHarness(store_url, [hourly], clock=clock):
            await drive(clock, 3600, step=60)  # the slot at 1 h ran
        clock.advance(3600 + 1200)  # down until 2 h 20 min
        halfhourly = Loop("rep", fn, cron="*/30 * * * *", coalesce=False)
        async with LoopHarness(store_url, [halfhourly], clock=clock, worker_id="w2") as h:
            await drive(clock, 1)
            events = h.journal("rep")
            got = [(e.kind, None if e.slot is None else e.slot - T0) for e in events]
            assert got[3:] == [
                ("loop_rescheduled", 7200),
                ("iteration_started", 7200),
                ("iteration_succeeded", 7200),
            ], describe(events)
            assert h.row("rep").next_fire_at == T0 + 9000

    run(main())


def test_database_error_re_arming_after_a_recorded_outcome__the_loop_fires_on(
    store_url: str,
) -> None:
    """The iteration's outcome is written, then the read that re-arms the loop's timer
    fails (the database out for a moment). Before, the error was logged as an outcome not
    recorded, and the loop was never armed again on this worker: its next slot never
    fired. Now re-arming is tried again within a poll."""
    ran: list[float] = []

    async def fn(it: Iteration) -> None:
        ran.append(it.slot - T0)

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [Loop("tick", fn, every=10)], clock=clock) as h:
            store = h.scheduler.store
            write, read = store.write_loop, store.get_loop
            broken: list[str] = []

            def writes(**kwargs: Any) -> bool:
                done = write(**kwargs)
                if done and kwargs["owner"] == "w1" and not broken:
                    broken.append("next read")
                return done

            def reads(name: str) -> LoopRow | None:
                if broken == ["next read"]:
                    broken.append("failed")
                    raise OperationalError("SELECT", {}, Exception("database is locked"))
                return read(name)

            store.write_loop = writes  # type: ignore[method-assign]
            store.get_loop = reads  # type: ignore[method-assign]
            await drive(clock, 21)
            assert broken == ["next read", "failed"]
            assert ran == [0, 10, 20], describe(h.journal("tick"))

    run(main())
