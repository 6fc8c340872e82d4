"""Building blocks for the loop tests: a clock the test moves, a scheduler harness on a real
database, bounded waits, and the journal invariants every loop must keep.

Nothing here sleeps and hopes. Time moves only when a test calls ``clock.advance`` (or
``drive``); ``settle`` lets the event loop run every task that is ready (loop iterations in
these tests are ``async`` functions, so no thread runs behind the loop's back); waits for
something another process or thread does are ``until``: polled, with a deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import inspect
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any

from polling import poll

from flowloop import Engine, FakeClock
from flowloop.alerts import Alert
from flowloop.loops import Iteration, Loop
from flowloop.scheduler import Capacity, Scheduler
from flowloop.store.loops import LoopEvent, LoopRow, LoopStoreMixin

T0 = 1_800_000_000.0
"""Where test clocks start (a multiple of every interval and cron period used here)."""
SETTLE_TURNS = 50
"""Event-loop turns that let a chain of ready tasks (wake → fire → iterate → record) run."""
WAIT_S = 10.0
"""The most a bounded wait waits before the test fails."""


class SteppedClock(FakeClock):
    """A :class:`FakeClock` whose ``sleep`` waits until the test moves time past its end.

    ``advance`` moves the wall and monotonic clocks and wakes the sleepers that are due;
    ``jump_wall`` moves only the wall clock (an NTP step or an operator), so it wakes nobody.
    """

    def __init__(self, start: float = T0) -> None:
        super().__init__(start, auto_advance=False)
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.monotonic() + seconds, next(self._order), future))
        await future

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        while self._sleepers and self._sleepers[0][0] <= self.monotonic():
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)


async def settle(turns: int = SETTLE_TURNS) -> None:
    """Let every task that is ready run (no time passes on the test clock)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def drive(clock: SteppedClock, seconds: float, *, step: float = 1.0) -> None:
    """Move time forward ``seconds`` in ``step``s, letting the scheduler act after each."""
    await settle()
    moved = 0.0
    while moved < seconds - 1e-9:
        delta = min(step, seconds - moved)
        clock.advance(delta)
        moved += delta
        await settle()


async def until(
    condition: Callable[[], object], *, timeout: float = WAIT_S, what: str = "condition"
) -> None:
    """Wait (bounded, in real time) until ``condition()`` is true."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.005)


def wait_for(
    condition: Callable[[], object],
    *,
    timeout: float = WAIT_S,
    what: str = "condition",
    describe: Callable[[], str] | None = None,
) -> None:
    """:func:`until` for plain (non-async) tests that watch another process; ``describe``
    adds what those processes said to the failure."""
    poll(condition, timeout=timeout, what=what, every=0.02, describe=describe)


class LoopHarness:
    """A :class:`Scheduler` on a real database, run as a task; ``async with`` starts and
    stops it. Iterations call the loop's function directly (async or not)."""

    def __init__(
        self,
        url: str,
        loops: Sequence[Loop],
        *,
        clock: SteppedClock,
        worker_id: str = "w1",
        concurrency: int = 4,
        grace: float = 0.5,
        lease_seconds: float = 30.0,
    ) -> None:
        self.engine = Engine(url, clock=clock, worker_id=worker_id)
        store = self.engine.store
        assert isinstance(store, LoopStoreMixin)
        self.store: LoopStoreMixin = store
        self.clock = clock
        self.grace = grace
        self.alerts: list[Alert] = []
        self.scheduler = Scheduler(
            store,
            {loop.name: loop for loop in loops},
            clock=clock,
            worker_id=worker_id,
            run_iteration=self._run,
            capacity=Capacity(concurrency),
            lease_seconds=lease_seconds,
            alert=self.alerts.append,
        )
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _run(self, loop: Loop, iteration: Iteration) -> Any:
        assert loop.fn is not None
        result = loop.fn(iteration)
        if inspect.isawaitable(result):
            return await result
        return result

    async def __aenter__(self) -> LoopHarness:
        self._task = asyncio.create_task(self.scheduler.run(self._stop, grace=self.grace))
        await until(
            lambda: self.scheduler.ready.is_set() or self._task.done(),  # type: ignore[union-attr]
            what="the scheduler to start",
        )
        if self._task.done():
            self._task.result()  # raise what went wrong
        await settle()
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
        self.engine.close()

    async def stop(self) -> None:
        if self._task is None:
            return
        self._stop.set()
        await asyncio.wait_for(self._task, timeout=WAIT_S)
        self._task = None

    def row(self, name: str) -> LoopRow:
        return self.engine.loop(name)

    def journal(self, name: str) -> list[LoopEvent]:
        return self.engine.loop_history(name)

    def kinds(self, name: str) -> list[str]:
        return [event.kind for event in self.journal(name)]


# -- journal invariants --------------------------------------------------------------------


def started_slots(events: Iterable[LoopEvent]) -> list[float]:
    return [e.slot for e in events if e.kind == "iteration_started" and e.slot is not None]


def assert_no_duplicate_slots(events: Sequence[LoopEvent]) -> None:
    """No slot of a loop ever starts twice (whichever worker fired it)."""
    counts = Counter(started_slots(events))
    twice = sorted(slot for slot, n in counts.items() if n > 1)
    assert not twice, f"slots started more than once: {twice}"


ACCOUNTING_KINDS = ("skipped_overlap", "coalesced", "missed")


def assert_slots_accounted(events: Sequence[LoopEvent], every: float) -> None:
    """For a fixed_rate interval loop: between two consecutive ``iteration_started``, every
    slot of the chain that did not start is counted by a ``skipped_overlap``, ``coalesced``
    or ``missed`` entry — no slot is lost without a journal entry saying why, and none
    is counted twice."""
    assert_no_duplicate_slots(events)
    previous: float | None = None
    counted = 0
    for event in events:
        if event.kind in ("loop_rescheduled", "loop_unpaused"):
            previous, counted = None, 0  # the operator restarted the chain
        elif event.kind in ACCOUNTING_KINDS:
            counted += event.count
        elif event.kind == "iteration_started":
            assert event.slot is not None
            if previous is not None:
                gap = round((event.slot - previous) / every) - 1
                assert gap == counted, (
                    f"slot {event.slot:.3f} (seq {event.seq}) follows {previous:.3f}: "
                    f"{gap} slot(s) between, {counted} accounted for by the journal"
                )
            previous, counted = event.slot, 0


def describe(events: Sequence[LoopEvent]) -> str:
    """The journal, one line per entry, for assertion messages."""
    return "\n".join(
        f"{e.seq:>3} {e.kind:<22} slot={e.slot} count={e.count} {e.error_message or ''}"
        f" {dict(e.data) or ''}"
        for e in events
    )


def loop_row(**fields: Any) -> LoopRow:
    """A loop row as the store returns it: scheduled, never fired, no lease; ``fields``
    override any column."""
    row = LoopRow(
        name="feed",
        schedule="every 30s (fixed_delay)",
        status="scheduled",
        next_fire_at=None,
        last_slot=None,
        last_started_at=None,
        last_ended_at=None,
        last_result=None,
        last_error=None,
        iterations=0,
        consecutive_failures=0,
        skipped=0,
        missed=0,
        reason=None,
        owner=None,
        lease_expires_at=None,
        lease_epoch=0,
        control=None,
        last_seq=0,
        updated_at=0.0,
    )
    return dataclasses.replace(row, **fields)
