"""Event-loop stall detection: an async step that blocks (``time.sleep``, a synchronous
driver, heavy CPU work) stops every other run, the heartbeat and the lease renewals.

A timer on the event loop notes the time every :data:`TICK_SECONDS`; a daemon thread
checks that note. When the loop has not ticked for ``threshold`` seconds, the thread logs
one WARNING *while the stall lasts*, naming the async steps running at that moment and the
line the loop's thread is executing. When the loop runs again, the ticker measures the
whole stall, logs it at INFO and tells its listeners (the worker's metrics). The same
note tells the lease renewer whether the loop is alive (:meth:`LoopWatchdog.last_tick`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final, Protocol

log = logging.getLogger("flowloop.watchdog")

STORE_DIR: Final = Path(__file__).resolve().parent / "store"
STORE_FRAMES: Final = 40
"""How deep to look for flowloop's store under the loop thread's innermost frame (the
driver and SQLAlchemy sit in between)."""
DEFAULT_STALL_SECONDS: Final = 0.5
"""An event loop that does not run for this long is stalled (a WARNING names the steps)."""
TICK_SECONDS: Final = 0.05
"""How often the ticker notes the time on the event loop (and the thread looks at it)."""

IDLE_WAIT_SECONDS: Final = 1.0
"""The longest the thread sleeps while nothing is watched before it looks again."""

StallListener = Callable[[float, list[str]], None]
"""Called on the event loop after a stall with (its length in seconds, the steps named)."""


class RunningStep(Protocol):
    """What the watchdog reads of a running async step (:class:`flowloop.Step` fits, and
    the run's record when no Step was built for the function)."""

    @property
    def run_id(self) -> str: ...
    @property
    def workflow(self) -> str: ...
    @property
    def state(self) -> str: ...
    @property
    def attempt(self) -> int: ...


def describe(step: RunningStep) -> str:
    return f"{step.workflow}.{step.state} (run {step.run_id}, attempt {step.attempt})"


class LoopWatchdog:
    """Watches one event loop for stalls; ``running`` maps run ids to the async steps in
    flight (the executor keeps it). Start it on the loop with :meth:`start`."""

    def __init__(
        self,
        running: Mapping[str, RunningStep],
        *,
        threshold: float = DEFAULT_STALL_SECONDS,
    ) -> None:
        self.running = running
        self.threshold = threshold
        self.listeners: list[StallListener] = []
        self.stalls = 0
        """Stalls seen so far (each is also logged and passed to the listeners)."""
        self._last = time.monotonic()
        self._warned_for: float | None = None
        self._named: list[str] = []
        self._loop_thread: int | None = None
        self._ticker: asyncio.TimerHandle | None = None
        self._ticker_loop: asyncio.AbstractEventLoop | None = None
        """The loop ``_ticker`` is pending on: kept between watches of it."""
        self._tick_before = self._last
        """The ``before`` of the pending tick (when it was scheduled)."""
        self._thread: threading.Thread | None = None
        self._users = 0
        self._watching = False
        self._closed = threading.Event()
        self._ring = threading.Event()
        """The thread's doorbell out of idling: set by :meth:`start` (when not set already:
        setting takes a lock, and ``Engine.run`` starts per run), cleared by the thread when
        it finds nothing watched. An engine keeps one watchdog per calling thread."""
        self._inline: float | None = None
        """Since when (monotonic) a plain ``def`` step runs on the loop's thread on purpose
        (:meth:`excused`): the loop is busy in a step, not wedged."""
        self._excused_at = 0.0

    def start(self) -> None:
        """Begin watching the running event loop. Calls nest: each :meth:`start` needs its
        :meth:`stop`; watching ends with the last one. The thread is started once and
        kept (until :meth:`close`): ``Engine.run`` starts and stops watching per run."""
        self._users += 1
        if self._users > 1:
            return
        self._loop_thread = threading.get_ident()
        self._last = now = time.monotonic()
        loop = asyncio.get_running_loop()
        if self._ticker is not None and self._ticker_loop is loop:
            # The tick an earlier watch left pending (stop keeps it: a timer made and
            # cancelled per ``Engine.run`` is most of what watching costs a run) measures
            # from now on; due earlier than a new one would be, it finds no stall.
            self._tick_before = now
        else:
            if self._ticker is not None:  # left pending on another loop: it would tick
                self._ticker.cancel()  # there besides the new one once that loop runs
            self._schedule_tick(loop, now)
        self._watching = True
        if not self._ring.is_set():  # after ``_watching``: the thread looks at it once more
            self._ring.set()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="flowloop-watchdog", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        """End one :meth:`start`. A stall that lasts until watching ends is measured then,
        as the next tick would have measured it: under ``Engine.run`` an ``async def`` step
        awaited in the run's own task that blocks the loop may leave it no turn before the
        run ends."""
        self._users = max(0, self._users - 1)
        if self._users:
            return
        # The pending tick's own test, made now (not during an inline step: excused);
        # watching ends first, so the thread cannot warn of this stall again meanwhile.
        measured = self._watching and self._inline is None
        lag = self._stall(self._tick_before, time.monotonic()) if measured else None
        # The pending tick is kept for the next start on this loop (a tick that comes
        # while nothing is watched ends there: see _tick).
        self._watching = False
        if lag is not None:
            self._stalled(lag)

    def close(self) -> None:
        """Stop watching and let the thread end (within a tick)."""
        self._users = 0
        self._end_watching()
        self._closed.set()
        self._ring.set()

    def _end_watching(self) -> None:
        self._watching = False
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = self._ticker_loop = None

    def last_tick(self) -> float | None:
        """When (monotonic) the event loop last ran the ticker, or None while not watching
        (no evidence either way). Read from other threads: the lease renewer renews only
        while the loop has ticked recently (flowloop/leasethread.py)."""
        if self._inline is not None:
            return time.monotonic()  # in a step, alive: as a step's thread would be
        return self._last if self._watching else None

    def excuse(self) -> None:
        """Before a plain ``def`` step run on the loop's thread on purpose (``Engine.run``
        drives one run on a loop of its own): no stall warning, and the leases are renewed
        for as long as it runs, as they are for a step in a thread — until
        :meth:`end_excuse`, which must follow (``finally``)."""
        self._inline = time.monotonic()

    def end_excuse(self) -> None:
        self._last = self._excused_at = time.monotonic()
        self._inline = None

    def _schedule_tick(self, loop: asyncio.AbstractEventLoop, before: float) -> None:
        # A timer, not a task: it costs no event-loop turn, and a stop leaves it pending for
        # the next start on its loop (Engine.run watches per run).
        self._tick_before = before
        self._ticker_loop = loop
        self._ticker = loop.call_later(TICK_SECONDS, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop, ``TICK_SECONDS`` after ``_tick_before`` was noted (later if it
        stalled; earlier when a start took over a pending tick). While nothing is watched
        it measures nothing and schedules no next one (the next start does)."""
        if not self._watching:
            self._ticker = self._ticker_loop = None
            return
        before = self._tick_before
        now = time.monotonic()
        self._last = now
        self._schedule_tick(loop, now)
        lag = self._stall(before, now)
        if lag is not None:
            self._stalled(lag)

    def _stall(self, before: float, now: float) -> float | None:
        """How long the loop stalled, seen at ``now`` by the tick scheduled at ``before``;
        ``None``: no stall (under the threshold, or a plain ``def`` step ran inline on
        purpose meanwhile)."""
        lag = now - before - TICK_SECONDS
        return lag if lag >= self.threshold and self._excused_at <= before else None

    def _stalled(self, lag: float) -> None:
        named, self._named, self._warned_for = self._named, [], None
        if not named:  # too short for the thread to have looked: name what runs now
            named = [describe(step) for step in list(self.running.values())]
        self.stalls += 1
        log.info(
            "event loop was blocked for %.2fs (async step(s): %s)",
            lag,
            ", ".join(named) or "none running",
            extra={"event": "loop_stall", "lag": lag, "steps": named},
        )
        for listener in self.listeners:
            try:
                listener(lag, named)
            except Exception:  # a listener must never break the event loop
                log.exception("stall listener failed")

    def _watch(self) -> None:
        while not self._closed.wait(TICK_SECONDS):
            if not self._watching:
                self._idle()
                continue
            if self._inline is not None:
                continue
            last = self._last
            blocked = time.monotonic() - last
            if blocked < self.threshold or self._warned_for == last:
                continue
            self._warned_for = last  # one warning per stall
            self._named = [describe(step) for step in list(self.running.values())]
            where, in_store = self._where()
            if in_store or not self._named:
                # flowloop's own database call (a write lock another process holds, a slow
                # commit): no async step is to blame, and the advice below would mislead.
                log.warning(
                    "event loop blocked for %.2fs so far%s: waiting for the database (another "
                    "process holding its write lock, or a slow commit)",
                    blocked,
                    where,
                    extra={"event": "loop_stall", "lag": blocked, "steps": self._named},
                )
                continue
            log.warning(
                "event loop blocked for %.2fs so far%s; async step(s) running: %s — a "
                "blocking call in `async def` stops every run on this worker: await it, "
                "use asyncio.to_thread, or make the step a plain `def`",
                blocked,
                where,
                ", ".join(self._named),
                extra={"event": "loop_stall", "lag": blocked, "steps": self._named},
            )

    def _idle(self) -> None:
        """Sleep while nothing is watched, until a start rings (at most
        ``IDLE_WAIT_SECONDS``, a bound should a ring ever be missed)."""
        self._ring.clear()
        if not self._watching:  # a start between the test and the clear set it first
            self._ring.wait(IDLE_WAIT_SECONDS)

    def _where(self) -> tuple[str, bool]:
        """`` at FILE:LINE in FUNCTION`` for the loop thread's innermost frame, and whether
        that frame is inside flowloop's store (a database call, not a user's step)."""
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "", False
        last = traceback.extract_stack(frame, limit=1)[-1]
        in_store = any(
            Path(summary.filename).parent == STORE_DIR
            for summary in traceback.extract_stack(frame, limit=STORE_FRAMES)
        )
        return f" at {last.filename}:{last.lineno} in {last.name}", in_store
