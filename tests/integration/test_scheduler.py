"""The loop scheduler on a real database with a clock the test moves: fire times, overlap,
misfire and coalescing, wall-clock jumps, control, recovery, two workers, and the worker's
loop features (alerts, workflow loops, shared capacity)."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
from loopkit import (
    T0,
    WAIT_S,
    LoopHarness,
    SteppedClock,
    assert_no_duplicate_slots,
    assert_slots_accounted,
    describe,
    drive,
    settle,
    started_slots,
    until,
)
from pydantic import BaseModel

from flowloop import Engine, Retry, Workflow
from flowloop.alerts import Alert, Alerts
from flowloop.loops import Iteration, Loop
from flowloop.store.loops import LoopEvent, LoopStoreMixin
from flowloop.worker import Worker


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def timed(clock: SteppedClock, duration: float = 0.0) -> tuple[list[float], Callable[..., Any]]:
    """A loop function that records the (wall) time it starts and takes ``duration``."""
    starts: list[float] = []

    async def fn(it: Iteration) -> None:
        starts.append(clock.now())
        await clock.sleep(duration)

    return starts, fn


def offsets(times: list[float]) -> list[float]:
    return [round(t - T0, 6) for t in times]


def slots(events: list[LoopEvent]) -> list[float]:
    return offsets(started_slots(events))


def at(event: LoopEvent) -> float:
    """The event's slot, as seconds after T0."""
    assert event.slot is not None
    return round(event.slot - T0, 6)


def only(events: list[LoopEvent], kind: str) -> list[LoopEvent]:
    return [e for e in events if e.kind == kind]


# -- fire times ------------------------------------------------------------------------------


def test_scheduler__fixed_rate_fires_at_slot_plus_every(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock, 3.0)
        async with LoopHarness(sqlite_url, [Loop("rate", fn, every=10)], clock=clock) as h:
            await drive(clock, 40)
            assert offsets(starts) == [0, 10, 20, 30, 40]
            events = h.journal("rate")
            assert slots(events) == [0, 10, 20, 30, 40]
            assert [e.data["reason"] for e in only(events, "iteration_started")] == ["on_time"] * 5
            assert [e.duration for e in only(events, "iteration_succeeded")] == [3.0] * 4
            await drive(clock, 3)
            assert h.row("rate").next_fire_at == T0 + 50

    run(main())


def test_scheduler__fixed_delay_fires_every_after_the_end(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock, 3.0)
        lp = Loop("delay", fn, every=10, mode="fixed_delay")
        async with LoopHarness(sqlite_url, [lp], clock=clock) as h:
            await drive(clock, 40)
            assert offsets(starts) == [0, 13, 26, 39]
            assert slots(h.journal("delay")) == [0, 13, 26, 39]

    run(main())


def test_scheduler__fixed_rate_overlap_is_skipped_and_counted(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock, 25.0)
        async with LoopHarness(sqlite_url, [Loop("slow", fn, every=10)], clock=clock) as h:
            await drive(clock, 65)
            assert offsets(starts) == [0, 30, 60]  # never two at once
            events = h.journal("slow")
            skips = only(events, "skipped_overlap")
            assert [(e.count, at(e)) for e in skips] == [(2, 10), (2, 40)]
            assert h.row("slow").skipped == 4
            assert_slots_accounted(events, 10)

    run(main())


def test_scheduler__fixed_delay_overlap_simply_waits(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock, 25.0)
        lp = Loop("slow", fn, every=10, mode="fixed_delay")
        async with LoopHarness(sqlite_url, [lp], clock=clock) as h:
            await drive(clock, 75)
            assert offsets(starts) == [0, 35, 70]
            assert "skipped_overlap" not in h.kinds("slow")
            assert h.row("slow").skipped == 0

    run(main())


def test_scheduler__skipping_often_raises_a_warning_alert(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        _, fn = timed(clock, 35.0)
        async with LoopHarness(sqlite_url, [Loop("slow", fn, every=10)], clock=clock) as h:
            await drive(clock, 160)  # 3 skipped per iteration: 12 by now
            assert h.row("slow").skipped >= 10
            assert [(a.level, a.what) for a in h.alerts] == [("warning", "loop iterations skipped")]

    run(main())


# -- downtime --------------------------------------------------------------------------------


async def run_then_go_down(url: str, clock: SteppedClock, lp: Loop, seconds: float) -> None:
    async with LoopHarness(url, [lp], clock=clock, worker_id="before"):
        await drive(clock, seconds)


def test_scheduler__downtime_within_grace_is_coalesced(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        _, fn = timed(clock)
        lp = Loop("tick", fn, every=10)
        await run_then_go_down(sqlite_url, clock, lp, 20)  # fired 0, 10, 20
        clock.advance(55)  # the worker is down: slots 30 … 70 come due
        async with LoopHarness(sqlite_url, [lp], clock=clock, worker_id="after") as h:
            await drive(clock, 10)
            events = h.journal("tick")
            assert slots(events) == [0, 10, 20, 70, 80], describe(events)
            assert [(e.count, at(e)) for e in only(events, "coalesced")] == [(4, 70)]
            assert h.row("tick").missed == 4
            assert_slots_accounted(events, 10)

    run(main())


def test_scheduler__downtime_past_grace_is_missed_the_rest_coalesced(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        _, fn = timed(clock)
        lp = Loop("tick", fn, every=10, misfire_grace=15)
        await run_then_go_down(sqlite_url, clock, lp, 20)
        clock.advance(55)  # now 75: slots 30, 40, 50 are > 15 s late; 60, 70 are not
        async with LoopHarness(sqlite_url, [lp], clock=clock, worker_id="after") as h:
            await settle()
            events = h.journal("tick")
            assert slots(events) == [0, 10, 20, 70], describe(events)
            assert [(e.kind, e.count) for e in events if e.kind in ("missed", "coalesced")] == [
                ("missed", 3),
                ("coalesced", 1),
            ]
            assert_slots_accounted(events, 10)

    run(main())


def test_scheduler__downtime_all_past_grace_is_missed_then_on_time(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        _, fn = timed(clock)
        lp = Loop("tick", fn, every=10, misfire_grace=5)
        await run_then_go_down(sqlite_url, clock, lp, 20)
        clock.advance(57)  # now 77: 30 … 70 all more than 5 s late
        async with LoopHarness(sqlite_url, [lp], clock=clock, worker_id="after") as h:
            await settle()
            events = h.journal("tick")
            missed = only(events, "missed")
            assert [(m.count, at(m)) for m in missed] == [(5, 30)], describe(events)
            assert h.row("tick").next_fire_at == T0 + 80
            await drive(clock, 3)
            events = h.journal("tick")
            assert slots(events) == [0, 10, 20, 80]
            assert_slots_accounted(events, 10)

    run(main())


def test_scheduler__without_coalesce_due_slots_run_one_by_one(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        _, fn = timed(clock)
        lp = Loop("tick", fn, every=10, coalesce=False)
        await run_then_go_down(sqlite_url, clock, lp, 0)
        clock.advance(35)
        async with LoopHarness(sqlite_url, [lp], clock=clock, worker_id="after") as h:
            await drive(clock, 1)
            events = h.journal("tick")
            assert slots(events) == [0, 10, 20, 30], describe(events)
            assert [e.data["reason"] for e in only(events, "iteration_started")] == [
                "on_time",
                "catch_up",
                "catch_up",
                "on_time",
            ]

    run(main())


# -- wall-clock jumps ------------------------------------------------------------------------


def test_scheduler__wall_jump_forward_fires_no_storm(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock)
        async with LoopHarness(sqlite_url, [Loop("tick", fn, every=10)], clock=clock) as h:
            await drive(clock, 5)
            clock.jump_wall(5 * 3600)  # five hours ahead; grace is one hour
            await drive(clock, 40)
            assert len(starts) == 5, describe(h.journal("tick"))  # one per 10 s, as before
            events = h.journal("tick")
            missed, coalesced = only(events, "missed"), only(events, "coalesced")
            assert len(missed) == 1 and len(coalesced) == 1
            # Slots 10 … 18010 came due at once: one fired, the others are accounted for.
            assert missed[0].count + coalesced[0].count == 5 * 360
            assert_slots_accounted(events, 10)

    run(main())


def test_scheduler__wall_jump_back_does_not_stall(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        _, fn = timed(clock)
        lp = Loop("tick", fn, every=10)
        delay = Loop("delay", fn, every=10, mode="fixed_delay")
        async with LoopHarness(sqlite_url, [lp, delay], clock=clock) as h:
            await drive(clock, 5)
            clock.jump_wall(-3600)
            await drive(clock, 40)
            for name in ("tick", "delay"):
                events = h.journal(name)
                assert len(started_slots(events)) == 5, describe(events)
                assert not [e for e in events if e.kind in ("missed", "coalesced")]
            assert_slots_accounted(h.journal("tick"), 10)

    run(main())


def test_scheduler__cron_loop_survives_a_wall_jump_back(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock)
        lp = Loop("minutely", fn, cron="* * * * *")
        async with LoopHarness(sqlite_url, [lp], clock=clock) as h:
            await drive(clock, 60, step=5)
            assert offsets(starts) == [60]
            clock.jump_wall(-3600)
            await drive(clock, 120, step=5)
            assert len(starts) == 3, describe(h.journal("minutely"))
            assert_no_duplicate_slots(h.journal("minutely"))

    run(main())


def test_scheduler__start_at_ahead_is_honoured_despite_the_capped_wait(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock)
        lp = Loop("later", fn, every=10, start_at=T0 + 100, end_at=T0 + 130)
        async with LoopHarness(sqlite_url, [lp], clock=clock) as h:
            await drive(clock, 99)
            assert starts == []
            await drive(clock, 50)
            assert offsets(starts) == [100, 110, 120]
            row = h.row("later")
            assert (row.status, row.reason) == ("stopped", "end_at reached")

    run(main())


# -- failures, retries, timeouts -------------------------------------------------------------


def test_scheduler__retry_then_failure_is_journaled(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        attempts: list[int] = []

        async def flaky(it: Iteration) -> None:
            attempts.append(it.attempt)
            raise ConnectionError(f"attempt {it.attempt}")

        lp = Loop("flaky", flaky, every=60, retry=Retry(attempts=3, backoff="fixed", base=5))
        async with LoopHarness(sqlite_url, [lp], clock=clock) as h:
            await drive(clock, 10)
            assert attempts == [1, 2, 3]
            failed = only(h.journal("flaky"), "iteration_failed")
            assert [(e.attempt, e.error_message) for e in failed] == [
                (3, "ConnectionError: attempt 3"),
            ]
            row = h.row("flaky")
            assert (row.status, row.consecutive_failures) == ("scheduled", 1)

    run(main())


def test_scheduler__timeout_fails_the_iteration(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()

        async def hangs(it: Iteration) -> None:
            await asyncio.Event().wait()

        async with LoopHarness(
            sqlite_url, [Loop("hangs", hangs, every=60, timeout=0.05)], clock=clock
        ) as h:
            await until(lambda: "iteration_failed" in h.kinds("hangs"), what="the timeout")
            failed = only(h.journal("hangs"), "iteration_failed")[0]
            assert failed.error_message == (
                "StepTimeout: loop 'hangs' iteration took longer than 0.05s"
            )

    run(main())


# -- control ---------------------------------------------------------------------------------


def test_scheduler__pause_waiting_loop_then_unpause(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock)
        async with LoopHarness(sqlite_url, [Loop("tick", fn, every=10)], clock=clock) as h:
            await drive(clock, 5)
            h.engine.pause_loop("tick")
            assert h.row("tick").status == "paused"
            await drive(clock, 60)
            assert offsets(starts) == [0]
            h.engine.unpause_loop("tick")
            await drive(clock, 2)  # the worker notices within one poll
            assert offsets(starts) == [0, 66]
            assert h.kinds("tick")[-4:] == [
                "loop_unpaused",
                "loop_rescheduled",
                "iteration_started",
                "iteration_succeeded",
            ]

    run(main())


def test_scheduler__pause_lets_the_running_iteration_finish(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock, 5.0)
        async with LoopHarness(sqlite_url, [Loop("tick", fn, every=10)], clock=clock) as h:
            await drive(clock, 1)
            row = h.engine.pause_loop("tick")
            assert (row.status, row.control) == ("running", "pause")
            await drive(clock, 30)
            assert h.kinds("tick")[-3:] == [
                "iteration_started",
                "iteration_succeeded",
                "loop_paused",
            ]
            assert (h.row("tick").status, len(starts)) == ("paused", 1)

    run(main())


def test_scheduler__stop_cancels_the_running_iteration(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        _, fn = timed(clock, 500.0)
        async with LoopHarness(sqlite_url, [Loop("tick", fn, every=10)], clock=clock) as h:
            await drive(clock, 1)
            h.engine.stop_loop("tick")
            await drive(clock, 2)
            assert h.kinds("tick")[-3:] == [
                "iteration_started",
                "iteration_stopped",
                "loop_stopped",
            ]
            row = h.row("tick")
            assert (row.status, row.consecutive_failures) == ("stopped", 0)

    run(main())


def test_scheduler__control_landing_between_iterations_is_honoured_at_once(
    sqlite_url: str,
) -> None:
    """A pause requested while the loop was being released (too late for the iteration,
    too early to find it waiting) must not wait for the next iteration to end."""

    async def main() -> None:
        clock = SteppedClock()
        starts, fn = timed(clock)
        async with LoopHarness(sqlite_url, [Loop("tick", fn, every=10)], clock=clock) as h:
            await drive(clock, 1)
            h.store.request_loop_control("tick", "pause")
            await drive(clock, 2)
            assert h.row("tick").status == "paused"
            assert len(starts) == 1

    run(main())


# -- recovery and many workers -----------------------------------------------------------


def fire_as_dead_worker(store: LoopStoreMixin, name: str, slot: float) -> None:
    """Fire ``slot`` as a worker on another host whose lease has already run out."""
    row = store.get_loop(name)
    assert row is not None
    event = LoopEvent(
        loop=name,
        kind="iteration_started",
        at=slot,
        slot=slot,
        attempt=1,
        worker="elsewhere:1:dead",
    )
    fired = store.fire_loop(
        name=name,
        follows_seq=row.last_seq,
        worker="elsewhere:1:dead",
        lease_seconds=-60,
        events=[event],
        changes={"last_slot": slot, "last_started_at": slot, "next_fire_at": None},
    )
    assert fired is not None


def test_scheduler__interrupted_iteration_is_not_run_twice(sqlite_url: str) -> None:
    numbers: list[int] = []

    async def main() -> None:
        clock = SteppedClock()
        _, timed_fn = timed(clock)

        async def fn(it: Iteration) -> None:
            numbers.append(it.number)
            await timed_fn(it)

        lp = Loop("tick", fn, every=10)
        await run_then_go_down(sqlite_url, clock, lp, 10)  # fired 0, 10; next 20
        clock.advance(10)
        engine = Engine(sqlite_url, clock=clock)
        assert isinstance(engine.store, LoopStoreMixin)
        fire_as_dead_worker(engine.store, "tick", T0 + 20)  # … and died in it
        engine.close()
        clock.advance(15)  # now 35: slot 30 came due meanwhile
        async with LoopHarness(sqlite_url, [lp], clock=clock, worker_id="after") as h:
            await drive(clock, 1)
            events = h.journal("tick")
            assert slots(events) == [0, 10, 20, 30], describe(events)
            assert [at(e) for e in only(events, "iteration_interrupted")] == [20]
            assert h.row("tick").last_result == "ok"
            assert_slots_accounted(events, 10)

    run(main())
    # The interrupted iteration (slot 20) had number 3: the next is the 4th, not another 3rd.
    assert numbers == [1, 2, 4]


def test_scheduler__live_worker_recovers_a_dead_workers_loop(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        _, fn = timed(clock)
        lp = Loop("tick", fn, every=10)
        async with LoopHarness(sqlite_url, [lp], clock=clock, worker_id="alive") as h:
            await drive(clock, 1)
            # Another worker takes the next slot and dies in it.
            h.engine.pause_loop("tick")
            await settle()
            row = h.row("tick")
            h.store.write_loop(
                name="tick",
                owner=None,
                epoch=row.lease_epoch,
                follows_seq=row.last_seq,
                events=[],
                changes={"status": "scheduled", "next_fire_at": T0 + 10},
            )
            fire_as_dead_worker(h.store, "tick", T0 + 10)
            await drive(clock, 25)
            events = h.journal("tick")
            assert "iteration_interrupted" in h.kinds("tick"), describe(events)
            assert slots(events)[-1] >= 20
            assert h.row("tick").status == "scheduled"
            assert_no_duplicate_slots(events)

    run(main())


def test_scheduler__two_workers_never_fire_a_slot_twice(store_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        starts: list[tuple[str, float]] = []

        async def fn(it: Iteration) -> None:
            starts.append((it.loop, it.slot))
            await clock.sleep(0.5)

        loops = [Loop(f"l{i}", fn, every=2) for i in range(5)]
        async with (
            LoopHarness(store_url, loops, clock=clock, worker_id="a", lease_seconds=5) as a,
            LoopHarness(store_url, loops, clock=clock, worker_id="b", lease_seconds=5),
        ):
            await drive(clock, 40, step=0.5)
            workers = set()
            for lp in loops:
                events = a.journal(lp.name)
                assert len(started_slots(events)) == 21, describe(events)
                assert_slots_accounted(events, 2)
                workers |= {e.worker for e in only(events, "iteration_started")}
            assert workers == {"a", "b"}
            assert len(starts) == len(set(starts)) == 5 * 21

    run(main())


def test_store__a_slot_starts_once_and_writes_are_fenced(store_url: str) -> None:
    clock = SteppedClock()
    engine = Engine(store_url, clock=clock)
    other = Engine(store_url, clock=clock)
    try:
        store, rival = engine.store, other.store
        assert isinstance(store, LoopStoreMixin) and isinstance(rival, LoopStoreMixin)
        row = store.sync_loop(name="l", schedule="every 10s", first_slot=T0, at=T0, worker="a")

        def started(worker: str) -> LoopEvent:
            return LoopEvent(loop="l", kind="iteration_started", at=T0, slot=T0, worker=worker)

        won = store.fire_loop(
            name="l",
            follows_seq=row.last_seq,
            worker="a",
            lease_seconds=30,
            events=[started("a")],
            changes={"last_slot": T0},
        )
        lost = rival.fire_loop(
            name="l",
            follows_seq=row.last_seq,
            worker="b",
            lease_seconds=30,
            events=[started("b")],
            changes={"last_slot": T0},
        )
        assert won is not None and lost is None
        # The same slot again, even from a fresh read, is refused by the unique index.
        assert rival.write_loop(
            name="l",
            owner="a",
            epoch=won.lease_epoch,
            follows_seq=won.last_seq,
            events=[],
            changes={"status": "scheduled", "next_fire_at": T0},
        )
        fresh = rival.get_loop("l")
        assert fresh is not None
        again = rival.fire_loop(
            name="l",
            follows_seq=fresh.last_seq,
            worker="b",
            lease_seconds=30,
            events=[started("b")],
            changes={},
        )
        assert again is None
        # An operator write does not apply while a live worker owns the loop.
        owned = store.fire_loop(
            name="l",
            follows_seq=fresh.last_seq,
            worker="a",
            lease_seconds=30,
            events=[LoopEvent(loop="l", kind="iteration_started", at=T0, slot=T0 + 10)],
            changes={},
        )
        assert owned is not None
        assert not rival.write_loop(
            name="l",
            owner=None,
            epoch=owned.lease_epoch,
            follows_seq=owned.last_seq,
            events=[],
            changes={"status": "paused"},
        )
        assert not rival.write_loop(
            name="l",
            owner="b",
            epoch=owned.lease_epoch,
            follows_seq=owned.last_seq,
            events=[],
            changes={"status": "paused"},
        )
        assert started_slots(store.loop_journal("l")) == [T0, T0 + 10]
        assert rival.running_loop_owners() == {"a"}
    finally:
        engine.close()
        other.close()


def test_store__sync_loops_registers_many_in_batches(store_url: str) -> None:
    from flowloop.store.loops import SYNC_BATCH, LoopSpec

    engine = Engine(store_url)
    try:
        store = engine.store
        assert isinstance(store, LoopStoreMixin)
        count = SYNC_BATCH + 7
        specs = [
            # (A pending slot in the future: one already due is kept by a new schedule.)
            LoopSpec(name=f"l{i:04d}", schedule="every 60s", first_slot=T0 + 10)
            for i in range(count)
        ]
        rows = store.sync_loops(specs, at=T0, worker="w")
        assert [r.name for r in rows] == [s.name for s in specs]
        again = store.sync_loops(
            [*specs[:-1], LoopSpec(name=specs[-1].name, schedule="every 5s", first_slot=T0 + 1)],
            at=T0 + 1,
            worker="w",
        )
        assert [r.last_seq for r in again[:-1]] == [1] * (count - 1)
        assert (again[-1].schedule, again[-1].next_fire_at) == ("every 5s", T0 + 1)
        assert [e.kind for e in store.loop_journal(specs[-1].name)] == [
            "loop_created",
            "loop_rescheduled",
        ]
        assert len(store.list_loops([s.name for s in specs])) == count
    finally:
        engine.close()


# -- the worker: capacity, alerts, workflow loops ------------------------------------------


class WorkerRun:
    """A :class:`Worker` on its own task with a stepped clock."""

    def __init__(self, url: str, loops: list[Loop], clock: SteppedClock, **options: Any) -> None:
        self.engine = Engine(url, clock=clock, poll_seconds=0.01)
        self.worker = Worker(self.engine, loops, grace=1.0, **options)
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> WorkerRun:
        self.task = asyncio.create_task(self.worker.run(self.stop))
        await until(
            lambda: self.worker.scheduler is not None and self.worker.scheduler.ready.is_set(),
            what="the worker to start",
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        self.stop.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, timeout=10)
        self.engine.close()

    def kinds(self, name: str) -> list[str]:
        return [e.kind for e in self.engine.loop_history(name)]


def test_worker__max_failures_pauses_and_alerts_then_unpause_resumes(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        alerts: list[Alert] = []
        healthy = asyncio.Event()

        async def check(it: Iteration) -> None:
            if not healthy.is_set():
                raise RuntimeError(f"down at iteration {it.number}")

        lp = Loop("check", check, every=10, max_failures=3)
        async with WorkerRun(sqlite_url, [lp], clock, alerts=Alerts([alerts.append])) as w:
            for _ in range(4):
                await drive(clock, 10)
                await until(lambda: w.engine.loop("check").status != "running")
            row = w.engine.loop("check")
            assert (row.status, row.consecutive_failures) == ("paused", 3)
            assert row.reason == "3 consecutive failures (max_failures=3)"
            assert w.kinds("check").count("iteration_started") == 3
            assert [(a.level, a.what, a.subject, a.error) for a in alerts] == [
                ("critical", "loop paused", "check", "RuntimeError: down at iteration 3"),
            ]
            assert alerts[0].hint == "flowloop loops check"
            healthy.set()
            w.engine.unpause_loop("check")
            await drive(clock, 2)
            await until(lambda: w.engine.loop("check").last_result == "ok", what="a good run")
            row = w.engine.loop("check")
            assert (row.status, row.consecutive_failures) == ("scheduled", 0)

    run(main())


class Count(BaseModel):
    n: int
    fail: bool = False


def counting_workflow() -> Workflow:
    wf = Workflow("count", context=Count)

    @wf.step(initial=True, next="done", retry=Retry(attempts=1))
    async def bump(ctx: Count) -> None:
        ctx.n += 1
        if ctx.fail:
            raise ValueError("asked to fail")

    wf.final("done")
    return wf


def test_worker__workflow_loop_runs_one_run_per_iteration(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        wf = counting_workflow()
        lp = Loop(
            "count-loop",
            workflow=wf,
            every=10,
            context=lambda it: {"n": it.number * 100, "fail": it.number == 2},
        )
        async with WorkerRun(sqlite_url, [lp], clock) as w:

            def done(count: int) -> Callable[[], bool]:
                return lambda: w.engine.loop("count-loop").iterations == count

            for number in (1, 2, 3):
                await until(done(number - 1))
                await until(lambda: w.engine.loop("count-loop").status == "scheduled")
                await drive(clock, 10 if number > 1 else 0)
                await until(done(number), what=f"iteration {number}")
            runs = sorted(w.engine.runs(workflow="count"), key=lambda r: r.created_at)
            assert [(r.status, r.context.n) for r in runs] == [  # type: ignore[union-attr]
                ("succeeded", 101),
                ("failed", 200),
                ("succeeded", 301),
            ]
            kinds = [k for k in w.kinds("count-loop") if k.startswith("iteration_")]
            assert kinds == [
                "iteration_started",
                "iteration_succeeded",
                "iteration_started",
                "iteration_failed",
                "iteration_started",
                "iteration_succeeded",
            ]
            failed = next(
                e for e in w.engine.loop_history("count-loop") if e.kind == "iteration_failed"
            )
            assert failed.error_message is not None
            assert failed.error_message.startswith(f"IterationFailed: run {runs[1].id} failed")

    run(main())


def test_worker__concurrency_bounds_iterations(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        running: list[str] = []
        most: list[int] = [0]

        def busy(name: str) -> Callable[[Iteration], Awaitable[None]]:
            async def fn(it: Iteration) -> None:
                running.append(name)
                most[0] = max(most[0], len(running))
                await clock.sleep(4)
                running.remove(name)

            return fn

        loops = [Loop(f"l{i}", busy(f"l{i}"), every=10) for i in range(3)]
        async with WorkerRun(sqlite_url, loops, clock, concurrency=1) as w:
            await drive(clock, 16)
            assert most[0] == 1
            for lp in loops:
                assert w.kinds(lp.name).count("iteration_succeeded") >= 1

    run(main())


def test_worker__sync_iteration_cut_off_by_its_timeout_never_runs_twice_at_once(
    sqlite_url: str,
) -> None:
    async def main() -> None:
        clock = SteppedClock()
        release = threading.Event()
        inside: list[int] = []
        most = [0]

        def stuck(it: Iteration) -> None:
            inside.append(it.number)
            most[0] = max(most[0], len(inside))
            release.wait(WAIT_S)
            inside.remove(it.number)

        lp = Loop("stuck", stuck, every=10, timeout=0.05)
        async with WorkerRun(sqlite_url, [lp], clock) as w:

            def iterations(count: int) -> Callable[[], bool]:
                return lambda: w.engine.loop("stuck").iterations == count

            for number in (1, 2):
                await until(iterations(number), what=f"iteration {number} to time out")
                await drive(clock, 10)
            assert (inside, most[0]) == ([1], 1)  # the second waited for the first's thread
            release.set()
            await until(iterations(3), what="iteration 3")
            failed = [
                e.error_message
                for e in w.engine.loop_history("stuck")
                if e.kind == "iteration_failed"
            ]
            assert failed[:2] == ["StepTimeout: loop 'stuck' iteration took longer than 0.05s"] * 2

    run(main())


def test_worker__sync_function_raising_keyboard_interrupt_fails_its_iteration(
    store_url: str,
) -> None:
    """A plain `def` loop function runs in a thread; its KeyboardInterrupt came back through
    the future into the event loop and ended the worker (exit 130 from the CLI). Now the
    iteration fails with RaisedBaseException and the worker goes on."""

    def interrupts(it: Iteration) -> None:
        raise KeyboardInterrupt

    async def main() -> None:
        clock = SteppedClock()
        async with WorkerRun(store_url, [Loop("ki", interrupts, every=10)], clock) as w:
            for number in (1, 2):
                await until(
                    lambda n=number: w.engine.loop("ki").iterations == n,
                    what=f"iteration {number}",
                )
                await drive(clock, 10)
            failed = [e for e in w.engine.loop_history("ki") if e.kind == "iteration_failed"]
            assert len(failed) >= 2
            assert {e.error_message for e in failed} == {
                "RaisedBaseException: loop 'ki' raised KeyboardInterrupt, a BaseException "
                "that would end the worker: raise an Exception"
            }

    try:
        run(main())
    except KeyboardInterrupt:
        pytest.fail("the loop function's KeyboardInterrupt ended the worker")


def test_worker__idle_worker_without_loops_does_not_poll_loops(tmp_path: Path) -> None:
    async def main() -> None:
        clock = SteppedClock()
        async with WorkerRun(f"sqlite:///{tmp_path / 'w.db'}", [], clock) as w:
            assert w.worker.scheduler is not None
            assert w.worker.scheduler.ready.is_set()

    run(main())


def test_loop_maths__slots_are_floats_that_round_trip_the_database(sqlite_url: str) -> None:
    """The unique (loop, slot) index compares floats: a slot must come back bit-identical."""
    engine = Engine(sqlite_url)
    try:
        store = engine.store
        assert isinstance(store, LoopStoreMixin)
        slot = T0 + 0.1 + 0.2
        store.sync_loop(name="f", schedule="every 0.1s", first_slot=slot, at=T0, worker="w")
        row = store.get_loop("f")
        assert row is not None and row.next_fire_at == slot
        assert math.isclose(slot, T0 + 0.3)
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["fixed_rate", "fixed_delay"])
def test_scheduler__journal_reasons_for_every_decision(sqlite_url: str, mode: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        _, fn = timed(clock)
        lp = Loop("tick", fn, every=10, mode=mode, misfire_grace=25)  # type: ignore[arg-type]
        await run_then_go_down(sqlite_url, clock, lp, 0)
        clock.advance(52)
        async with LoopHarness(sqlite_url, [lp], clock=clock, worker_id="after") as h:
            await settle()
            started = only(h.journal("tick"), "iteration_started")[-1]
            assert started.data["reason"] == "coalesced"
            assert started.data["late"] == pytest.approx(52 - at(started))
            kinds = h.kinds("tick")
            assert kinds[-4:-1] == ["missed", "coalesced", "iteration_started"]

    run(main())
