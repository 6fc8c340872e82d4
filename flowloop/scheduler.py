"""The loop scheduler: a timer heap of due slots, fire decisions, overlap and misfire policy.

Waiting loops cost one heap entry each and no work: the scheduler sleeps until the earliest
deadline (monotonic clock, so a wall-clock jump neither fires a storm nor stalls it) or until
an operator changes a loop (one counter polled per ``poll_seconds``).

Each iteration is journaled before it runs (``iteration_started``, unique per slot) and
after (``iteration_succeeded``/``iteration_failed`` plus the next slot), like a run's steps.
Every decision that is not "fire this slot on time" is a journal entry with its count:
``missed``, ``coalesced``, ``skipped_overlap``, ``iteration_interrupted``, ``loop_paused`` …
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from flowloop import loop_calls, loop_deploys, loop_leases, loop_outcomes, outagelog
from flowloop import loop_slots as slots
from flowloop.alerts import Alert
from flowloop.clock import Clock
from flowloop.executor import (
    OUTAGE_BACKOFF_START,
    backoff_cap,
    error_line,
    owner_is_dead_here,
)
from flowloop.loop_calls import TimedCalls
from flowloop.loop_requests import MANUAL, TRIGGER, BackfillEnd, manual_firing
from flowloop.loops import IDLE, Iteration, Loop, decide
from flowloop.store.loops import ANY_CONTROL, LoopEvent, LoopRow, LoopSpec, LoopStoreMixin
from flowloop.store.outage import is_outage

log = logging.getLogger("flowloop.loops")

DEFAULT_CONTROL_POLL_SECONDS: Final = 1.0
RECOVERY_EVERY_SECONDS: Final = 10.0
"""How often a worker looks for loops left running by a dead worker (one small query)."""
CAPACITY_RETRY_SECONDS: Final = 0.05
"""How soon a due loop waiting for a free slot of ``max_concurrency`` is tried again."""

RunIteration = Callable[[Loop, Iteration], Awaitable[Any]]


@dataclass
class Capacity:
    """The worker's global concurrency, shared by run steps and loop iterations."""

    limit: int
    loops_busy: int = 0
    runs_busy: Callable[[], int] = field(default=lambda: 0)

    def free(self) -> int:
        return self.limit - self.loops_busy - self.runs_busy()


@dataclass
class _Running:
    task: asyncio.Task[None]
    stop_requested: bool = False
    lease_lost: bool = False
    """The heartbeat found the lease gone: the iteration is abandoned, nothing recorded."""
    settling: bool = False
    """Its function, cut off, still runs: the loop is held until it ends (nothing to cancel)."""


class Scheduler:
    def __init__(
        self,
        store: LoopStoreMixin,
        loops: Mapping[str, Loop],
        *,
        clock: Clock,
        worker_id: str,
        run_iteration: RunIteration,
        capacity: Capacity,
        lease_seconds: float = 30.0,
        poll_seconds: float = DEFAULT_CONTROL_POLL_SECONDS,
        alert: Callable[[Alert], None] | None = None,
    ) -> None:
        self.store = store
        self._outage = outagelog.Part("loops")
        self.loops = dict(loops)
        self.clock = clock
        self.worker_id = worker_id
        self.run_iteration = run_iteration
        self.capacity = capacity
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.alert = alert
        self._heap: list[tuple[float, int, str, int]] = []
        self._generation: dict[str, int] = {}
        self._counter = itertools.count()
        self._rows: dict[str, LoopRow] = {}
        self._running: dict[str, _Running] = {}
        self._waiting: deque[str] = deque()  # due, but max_concurrency is taken
        self._manual: set[str] = set()  # running a trigger or backfill iteration
        self._unsynced: set[str] = set()  # a new schedule waits for another worker's iteration
        self._timed = TimedCalls(functools.partial(loop_outcomes.held, self))
        self._unrecorded: dict[str, Callable[[], None]] = {}  # outcomes to write again
        self._leases = loop_leases.LoopLeases(self)  # renewed off the loop, fenced on it
        self._changes = -1
        self._wake = asyncio.Event()
        self.ready = asyncio.Event()
        """Set once every loop is registered and armed."""
        self.fired = 0
        self.iteration_listeners: list[Callable[[str, str, float, int], None]] = []
        """Called with (loop, outcome, duration, slots skipped) after an iteration's outcome
        is recorded (metrics)."""
        self.lease_lost: list[Callable[[str, str], None]] = []
        """Called with (loop, why) when this worker lost a loop's lease."""

    # -- the heap --------------------------------------------------------------------------

    def _schedule(self, row: LoopRow, *, retarget: bool = True) -> None:
        """(Re)arm a loop's timer from its row. A stale heap entry is ignored when popped."""
        if row.name in self._unsynced and self._resync(row):
            return
        self._rows[row.name] = row
        generation = self._generation.get(row.name, 0) + 1
        self._generation[row.name] = generation
        loop = self.loops[row.name]
        if row.status == "scheduled" and row.next_fire_at is None and retarget:
            # Unpaused by an operator: the next slot is the loop's first from now (none at or
            # after end_at: then it is over).
            first = loop.first_slot(self.clock.now())
            if loop.over(first):
                self._end(row)
            else:
                self._operator_write(row, "loop_rescheduled", {"next_fire_at": first})
            return
        if row.status == "scheduled" and row.control in MANUAL:
            self._push(row.name, 0.0)  # an operator asked for a manual iteration
            return
        if row.status == "running" and row.name not in self._running:
            # Another worker runs it: look again when its next slot is due (to compete for
            # it), or within a lease, to take over from a worker that died.
            self._push(row.name, min(self._until_next(loop, row), self.lease_seconds))
            return
        if row.status != "scheduled" or row.next_fire_at is None:
            return
        if loop.over(row.next_fire_at):
            self._push(row.name, 0.0)  # no slot of it is left: it stops now, not at that slot
            return
        delay = loop.jittered(row.next_fire_at) - self.clock.now()
        # A wall clock set back must not stall the loop: wait at most one period.
        self._push(row.name, min(delay, loop.wait_cap(row.next_fire_at)))

    def _resync(self, row: LoopRow) -> bool:
        """Apply this worker's schedule of the loop, deferred at start (a deploy): True when
        it did and the loop is armed from the new row."""
        if row.schedule == self.loops[row.name].schedule:
            self._unsynced.discard(row.name)  # (applied by another worker)
            return False
        fresh = loop_deploys.resync(
            self.store, self.loops[row.name], row, clock=self.clock, worker=self.worker_id
        )
        if fresh is None:
            return False
        self._unsynced.discard(row.name)
        self._schedule(fresh)
        return True

    def _until_next(self, loop: Loop, row: LoopRow) -> float:
        now = self.clock.now()
        if row.last_slot is not None:
            expected = loop.slot_after(row.last_slot, anchor=row.last_slot)
            if expected > now:
                return expected - now
        return self.poll_seconds

    def _push(self, name: str, delay: float) -> None:
        deadline = self.clock.monotonic() + max(0.0, delay)
        heapq.heappush(self._heap, (deadline, next(self._counter), name, self._generation[name]))
        self._wake.set()

    def _pop_due(self) -> list[str]:
        now = self.clock.monotonic()
        due: list[str] = []
        while self._heap and self._heap[0][0] <= now:
            _, _, name, generation = heapq.heappop(self._heap)
            if self._generation.get(name) == generation:
                due.append(name)
        return due

    def _seconds_to_next(self) -> float | None:
        while self._heap and self._generation.get(self._heap[0][2]) != self._heap[0][3]:
            heapq.heappop(self._heap)
        if not self._heap:
            return None
        return max(0.0, self._heap[0][0] - self.clock.monotonic())

    # -- main loop -------------------------------------------------------------------------

    async def start(self) -> None:
        """Recover interrupted iterations and arm every loop from the store."""
        self._recover()
        now = self.clock.now()
        specs = [
            LoopSpec(
                name=loop.name,
                schedule=loop.schedule,
                first_slot=loop.first_slot(now),
                keep_due=loop.coalesce,
                latest_slot=None if loop.coalesce else loop.latest_slot(now),
            )
            for loop in self.loops.values()
        ]
        for row in self.store.sync_loops(specs, at=now, worker=self.worker_id):
            if loop_deploys.deferred(row, self.loops[row.name]):
                self._unsynced.add(row.name)  # another worker's iteration runs: after it
            self._schedule(row)
        self._changes = self.store.loop_changes()
        if self.loops:
            loop_deploys.say_undefined(self.store, set(self.loops))

    async def run(self, stop: asyncio.Event, *, grace: float = 30.0) -> None:
        backoff = 0.0
        while True:
            # A worker starting while the database refuses writes waits for it.
            try:
                await self.start()
                break
            except Exception as error:
                if not is_outage(error):
                    raise
                cap = backoff_cap(self.lease_seconds)
                backoff = min(cap, max(OUTAGE_BACKOFF_START, backoff * 2))
                log.log(
                    self._outage.failed(),
                    "loops: database %s at start (%s); retrying in %.1fs",
                    outagelog.cause(error),
                    error_line(error),
                    backoff,
                )
                await self._sleep(backoff, stop)
                if stop.is_set():
                    return
        self.ready.set()
        if not self.loops:
            await stop.wait()  # nothing to schedule: no polling either
            return
        heartbeat = asyncio.create_task(loop_leases.heartbeat(self))
        last_poll = last_recovery = self.clock.monotonic()
        try:
            while not stop.is_set():
                if self.clock.monotonic() - last_poll >= self.poll_seconds:
                    last_poll = self.clock.monotonic()
                    self._poll_changes()
                    loop_outcomes.write_pending(self._unrecorded)
                if self.clock.monotonic() - last_recovery >= RECOVERY_EVERY_SECONDS:
                    last_recovery = self.clock.monotonic()
                    self._recover_quietly()
                for name in self._take_waiting():
                    self._wake_quietly(name)
                for name in self._pop_due():
                    self._wake_quietly(name)
                wait = self._seconds_to_next()
                wait = self.poll_seconds if wait is None else min(wait, self.poll_seconds)
                if self._waiting:
                    wait = min(wait, CAPACITY_RETRY_SECONDS)
                await self._sleep(wait, stop)
            await self._drain(grace)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            self._leases.close()
            self._timed.forget()

    async def _sleep(self, seconds: float, stop: asyncio.Event) -> None:
        self._wake.clear()
        sleeper = asyncio.ensure_future(self.clock.sleep(seconds))
        waiters = [
            sleeper,
            asyncio.ensure_future(self._wake.wait()),
            asyncio.ensure_future(stop.wait()),
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _drain(self, grace: float) -> None:
        tasks = {name: running.task for name, running in self._running.items()}
        await loop_calls.finish_within(self._timed, tasks, grace)
        loop_outcomes.write_pending(self._unrecorded, last=True)  # (still held: one more try)

    def _take_waiting(self) -> list[str]:
        taken: list[str] = []
        while self._waiting and self.capacity.free() - len(taken) > 0:
            taken.append(self._waiting.popleft())
        return taken

    def _wake_quietly(self, name: str) -> None:
        try:
            self._wake_loop(name)
            # (Said by a write that worked: on a read-only standby the polls read on.)
            self._outage.answered()
        except Exception as error:  # a database hiccup must not stop every other loop
            self._failed(error, "loop %s: could not fire (%s); trying again", name)
            if name in self._generation:
                self._push(name, self.poll_seconds)

    def _failed(self, error: Exception, message: str, *args: object) -> None:
        """Log a database call that failed: an outage at the outage log's level (said
        once, then quieter), anything else a WARNING; ``message`` ends with the error."""
        level = self._outage.failed() if is_outage(error) else logging.WARNING
        log.log(level, message, *args, error_line(error))

    def _recover_quietly(self) -> None:
        try:
            self._recover()
        except Exception as error:
            log.warning("could not recover interrupted loops: %s", error_line(error))

    def _poll_changes(self) -> None:
        try:
            changes = self.store.loop_changes()
            if changes == self._changes:
                return
            rows = self.store.list_loops(list(self.loops))
        except Exception as error:  # (the counter not taken: read again at the next poll)
            self._failed(error, "loops: could not poll loop changes: %s")
            return
        self._changes = changes
        for row in rows:
            try:
                self._changed(row)
            except Exception as error:
                # A write reacting to it (a deferred schedule, a request) failed: the others
                # go on, the next poll reads all again (before, it ended the worker).
                self._changes = -1
                self._failed(error, "loop %s: could not apply a change (%s); retrying", row.name)

    def _changed(self, row: LoopRow) -> None:
        """React to ``row`` as read after an operator's change (of this loop or another)."""
        running = self._running.get(row.name)
        if running is not None:
            if row.control == "stop" and not running.stop_requested:
                running.stop_requested = True
                if not running.settling:
                    self._timed.cancelling(row.name, stop=True)
                    running.task.cancel()
            return
        if row.status == "scheduled" and row.control in ("pause", "stop"):
            # A request that reached the loop between two iterations: honour it now.
            self._apply_control(row)
            return
        previous = self._rows.get(row.name)
        if (
            previous is None
            or previous.last_seq != row.last_seq
            or previous.status != row.status
            or previous.control != row.control
        ):
            self._schedule(row)

    def _notify_lease_lost(self, name: str, why: str) -> None:
        for hook in self.lease_lost:
            try:
                hook(name, why)
            except Exception:  # a hook must never stop the scheduler
                log.exception("lease-lost hook failed")

    def stopping(self, name: str) -> bool:
        """An operator asked to stop ``name`` while its iteration runs."""
        running = self._running.get(name)
        return running is not None and running.stop_requested

    # -- recovery --------------------------------------------------------------------------

    def _recover(self) -> None:
        """Settle iterations left running by a dead worker: journaled as interrupted, never
        run twice (their slot has its ``iteration_started``); the loop goes on with the next
        slot, which the misfire policy then fires, coalesces or gives up."""
        dead = [
            owner
            for owner in self.store.running_loop_owners()
            if owner != self.worker_id and owner_is_dead_here(owner)
        ]
        self.store.expire_loop_leases(sorted(dead))
        for row in self.store.interrupted_loops():
            loop = self.loops.get(row.name)
            if loop is None or row.name in self._running:
                continue
            # Still ours: this worker lost the lease (frozen, cut off) and abandoned it.
            write = slots.interrupted(
                loop,
                row,
                now=self.clock.now(),
                worker=self.worker_id,
                lease_lost=row.owner == self.worker_id,
            )
            if not self.store.write_loop(
                name=row.name,
                owner=None,
                epoch=row.lease_epoch,
                follows_seq=row.last_seq,
                changes=write.changes,
                events=write.events,
                control=row.control,  # (a pause withdrawn since: read at the next sweep)
            ):
                continue  # another worker settled it first
            slot = write.events[0].slot
            log.warning("loop %s: iteration of slot %.3f was interrupted", row.name, slot)
            self._alerts(loop, write, "Interrupted", 0)
            fresh = self.store.get_loop(row.name)
            if fresh is not None and row.name in self._generation:
                self._schedule(fresh)

    # -- one slot --------------------------------------------------------------------------

    def _wake_loop(self, name: str) -> None:
        row = self._rows.get(name)
        if row is None or name in self._running:
            return
        if row.status == "running":
            # Lost this slot to another worker earlier: see where the loop is now.
            fresh = self.store.get_loop(name)
            if fresh is not None:
                self._schedule(fresh)
            return
        if row.status != "scheduled" or row.next_fire_at is None:
            return
        if row.control in ("pause", "stop"):
            self._apply_control(row)
            return
        loop = self.loops[name]
        now = self.clock.now()
        if row.control in MANUAL and now < row.next_fire_at:
            self._fire_manual(loop, row, now)  # a due slot of the schedule goes first
            return
        if loop.over(row.next_fire_at):
            # Its next slot (or the first start_at allows) is at or after end_at — end_at
            # moved earlier since the row was written: no slot is left, it stops now (not
            # when that slot comes, shown meanwhile as the loop's next).
            self._end(row)
            return
        earliest = loop.earliest_slot()
        if earliest is not None and now < earliest:
            # start_at is a promise in wall time (a cron loop's: its first cron time at or
            # after it). A slot before it (start_at moved later since the row was written)
            # moves to it; a capped wait ending early re-arms.
            if row.next_fire_at < earliest:
                self._operator_write(
                    row,
                    "loop_rescheduled",
                    {"next_fire_at": earliest},
                    slot=earliest,
                    data={"reason": "start_at is later than the slot"},
                )
            else:
                self._schedule(row)
            return
        wake = decide(loop, row.next_fire_at, now)  # only slots before end_at
        if wake.reason == "ended":
            self._end(row)
            return
        if not wake.fire:
            log.warning("loop %s: %d slot(s) missed past the misfire grace", name, wake.missed)
            given_up = slots.giving_up(loop, row, wake, now=now, worker=self.worker_id)
            self._write(row, given_up.changes, given_up.events)
            return
        if self.capacity.free() <= 0:
            # Full: fire as soon as a slot frees; slots passing meanwhile are coalesced.
            if name not in self._waiting:
                self._waiting.append(name)
            return
        write = slots.firing(row, wake, now=now, worker=self.worker_id)
        sent = self._leases.now()  # (before the request: the lease starts after it)
        fired = self.store.fire_loop(
            name=name,
            follows_seq=row.last_seq,
            worker=self.worker_id,
            lease_seconds=self.lease_seconds,
            events=write.events,
            changes=write.changes,
        )
        if fired is None:
            fresh = self.store.get_loop(name)
            if fresh is not None and fresh.status == "scheduled" and fresh.last_seq == row.last_seq:
                # Owned by a live worker that has not moved it on yet: look again later.
                self._push(name, self.poll_seconds)
            elif fresh is not None:
                self._schedule(fresh)
            return
        self._rows[name] = fired
        self._leases.fired(name, sent)
        self.fired += 1
        self.capacity.loops_busy += 1
        task = asyncio.create_task(self._iterate(loop, fired, wake.slot, now))
        self._running[name] = _Running(task)

    def _fire_manual(self, loop: Loop, row: LoopRow, now: float) -> None:
        """Fire the iteration an operator asked for (flowloop/loop_requests.py); the row
        keeps the schedule's next slot."""
        if self.capacity.free() <= 0:
            if row.name not in self._waiting:
                self._waiting.append(row.name)
            return
        firing = manual_firing(self.store, loop, row, now)
        if isinstance(firing, BackfillEnd):
            self._operator_write(
                row,
                "backfill_finished",
                {"control": None},
                count=firing.ran,
                data={"reason": firing.reason},
            )
            return
        slot, reason = firing
        event = slots.started(row.name, slot, reason, now=now, worker=self.worker_id)
        sent = self._leases.now()
        fired = self.store.fire_loop(
            name=row.name,
            follows_seq=row.last_seq,
            worker=self.worker_id,
            lease_seconds=self.lease_seconds,
            events=[event],
            changes={
                "last_slot": slot,
                "last_started_at": now,
                "updated_at": now,
                # A trigger is used up once its iteration is journaled; a backfill stays
                # until its last slot (a crash goes on with the slots not yet started).
                "control": None if row.control == TRIGGER else row.control,
            },
        )
        if fired is None:
            self._push(row.name, self.poll_seconds)  # changed meanwhile: look again
            return
        self._rows[row.name] = fired
        self._leases.fired(row.name, sent)
        self._manual.add(row.name)
        self.fired += 1
        self.capacity.loops_busy += 1
        task = asyncio.create_task(self._iterate(loop, fired, slot, now))
        self._running[row.name] = _Running(task)

    def _end(self, row: LoopRow) -> None:
        self._operator_write(
            row,
            "loop_stopped",
            {"status": "stopped", "reason": "end_at reached", "next_fire_at": None},
            data={"reason": "end_at reached"},
        )

    def _apply_control(self, row: LoopRow) -> None:
        target = "paused" if row.control == "pause" else "stopped"
        reason = f"{target} by an operator"
        self._operator_write(
            row,
            f"loop_{target}",
            {"status": target, "next_fire_at": None, "control": None, "reason": reason},
            data={"reason": reason},
            on_request=True,  # (an unpause since the read withdrew it: refused)
        )

    def _operator_write(
        self,
        row: LoopRow,
        kind: str,
        changes: dict[str, Any],
        *,
        slot: float | None = None,
        count: int = 0,
        data: dict[str, Any] | None = None,
        on_request: bool = False,
    ) -> None:
        now = self.clock.now()
        event = LoopEvent(
            loop=row.name,
            kind=kind,
            at=now,
            slot=slot,
            count=count,
            worker=self.worker_id,
            data=data or {},
        )
        self._write(row, {**changes, "updated_at": now}, [event], on_request=on_request)

    def _write(
        self,
        row: LoopRow,
        changes: dict[str, Any],
        events: list[LoopEvent],
        *,
        on_request: bool = False,
    ) -> None:
        """Write a loop row the worker does not hold (fenced on the row as read, and on its
        request too with ``on_request``) and re-arm its timer from what the store has then."""
        ok = self.store.write_loop(
            name=row.name,
            owner=None,
            epoch=row.lease_epoch,
            follows_seq=row.last_seq,
            changes=changes,
            events=events,
            control=row.control if on_request else ANY_CONTROL,
        )
        self._changes += 1 if ok else 0  # our own bump: no need to re-read every loop
        fresh = self.store.get_loop(row.name)
        if fresh is not None:
            self._schedule(fresh, retarget=False)
        if not ok:
            log.info("loop %s changed concurrently; re-read it", row.name)

    async def _iterate(self, loop: Loop, row: LoopRow, slot: float, started: float) -> None:
        number = row.iterations + 1
        outcome, error, attempts = "ok", None, 0
        log.info(
            "loop %s iteration %d started (slot %.3f)",
            loop.name,
            number,
            slot,
            extra={
                "loop": loop.name,
                "iteration": number,
                "slot": slot,
                "event": "iteration_started",
            },
        )
        started_mono = self.clock.monotonic()
        running = self._running.get(loop.name)
        try:
            try:
                outcome, error, attempts = await self._attempts(loop, row, slot, number)
            except asyncio.CancelledError:
                stopped = running is not None and running.stop_requested
                outcome = "stopped" if stopped else "cancelled"
                error = "stopped by an operator" if stopped else "worker shutting down"
                if raised := self._timed.raised(loop.name):  # (in its cleanup: kept)
                    error = f"{error}; its function raised as it ended: {raised}"
            if running is not None and outcome != "cancelled" and not running.lease_lost:
                # Its function cut off but still running: the loop stays held (lease renewed,
                # a slot of max_concurrency taken) until it ends, fired by no worker meanwhile.
                running.settling = True
                await self._timed.ended(loop.name)
        except asyncio.CancelledError:
            pass  # (the worker stops, or lost the lease: the function is left behind)
        finally:
            self._running.pop(loop.name, None)
            runaway = self._timed.running(loop.name)  # (left behind: counted until it ends)
            if runaway is None:
                self._free_slot()
            else:
                runaway.add_done_callback(lambda _: self._free_slot())
        duration = self.clock.monotonic() - started_mono
        if running is not None and running.lease_lost:
            self._manual.discard(loop.name)
            loop_outcomes.say_abandoned(loop.name, number, duration)
            return
        manual = loop.name in self._manual
        self._manual.discard(loop.name)
        self._record_quietly(loop, row, slot, started, outcome, error, attempts, duration, manual)

    def _record_quietly(self, loop: Loop, row: LoopRow, slot: float, *args: Any) -> None:
        try:
            self._record_outcome(loop, row, slot, *args)
        except Exception as failure:
            again = functools.partial(self._record_quietly, loop, row, slot, *args)
            loop_outcomes.unwritten(self, loop.name, slot, failure, again)

    def _free_slot(self) -> None:
        self.capacity.loops_busy -= 1
        self._wake.set()  # a slot of max_concurrency is free again

    async def _attempts(
        self, loop: Loop, row: LoopRow, slot: float, number: int
    ) -> tuple[str, str | None, int]:
        attempt = 1
        while True:
            iteration = Iteration(
                loop=loop.name, slot=slot, number=number, attempt=attempt, tz=loop.tz
            )
            try:
                call = functools.partial(self.run_iteration, loop, iteration)
                # (In a task of its own, timeout= or not: a stop or the drain cuts it off.)
                result = await self._timed.call(call, name=loop.name, timeout=loop.timeout)
                return ("skipped_idle" if result is IDLE else "ok"), None, attempt
            except asyncio.CancelledError:
                raise
            except Exception as error:
                message = f"{type(error).__name__}: {error_line(error)}"
                if not loop.retry.should_retry(error, attempt):
                    return "failed", message, attempt
                log.info("loop %s attempt %d failed: %s; retrying", loop.name, attempt, message)
                await self.clock.sleep(loop.retry.delay(attempt))
                attempt += 1

    def _record_outcome(
        self,
        loop: Loop,
        row: LoopRow,
        slot: float,
        started: float,
        outcome: str,
        error: str | None,
        attempts: int,
        duration: float,
        manual: bool,
    ) -> None:
        write = loop_outcomes.record(
            self.store,
            loop,
            row,
            slot=slot,
            started=started,
            result=outcome,
            error=error,
            attempts=attempts,
            duration=duration,
            manual=manual,
            worker=self.worker_id,
            now=self.clock.now,
        )
        if write is loop_outcomes.Refused.LOST:
            found = loop_outcomes.lost(self, loop.name, row, slot)
            if found is not None:  # (written after all: told, as it would have been)
                self._finished(loop, row, found, slot, outcome, error, attempts, duration)
            return
        if isinstance(write, loop_outcomes.Refused):
            loop_outcomes.say_refused(loop.name, write)
            # (Its request keeps changing: the loop is still this worker's.)
            args = (started, outcome, error, attempts, duration, manual)
            self._unrecorded[loop.name] = functools.partial(
                self._record_quietly, loop, row, slot, *args
            )
            return
        self._finished(loop, row, write, slot, outcome, error, attempts, duration)
        try:
            updated = self.store.get_loop(loop.name)
            if (
                updated is not None
                and updated.status == "scheduled"
                and updated.control in ("pause", "stop")
            ):
                # A request that landed while this iteration was being recorded.
                self._apply_control(updated)
            elif updated is not None:
                self._schedule(updated)
        except Exception as failure:
            # The outcome is recorded; re-arming (a read, a deferred schedule, a request)
            # failed: look again within a poll (the row held is the running one: re-read).
            self._failed(failure, "loop %s: could not re-arm (%s); trying again", loop.name)
            self._push(loop.name, self.poll_seconds)

    def _finished(
        self, loop: Loop, row: LoopRow, write: slots.LoopWrite, slot: float, *args: Any
    ) -> None:
        """A recorded outcome (``outcome, error, attempts, duration``): said, alerted."""
        outcome, error, attempts, duration = args
        loop_outcomes.say_finished(
            loop,
            row,
            write,
            slot=slot,
            outcome=outcome,
            error=error,
            attempts=attempts,
            duration=duration,
            listeners=self.iteration_listeners,
        )
        self._alerts(loop, write, error, row.skipped)

    def _alerts(self, loop: Loop, write: slots.LoopWrite, error: str | None, before: int) -> None:
        if self.alert is not None:
            loop_outcomes.alert(self.alert, loop, write, error, before)

    @property
    def running(self) -> Sequence[str]:
        return list(self._running)
