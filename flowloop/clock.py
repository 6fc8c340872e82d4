"""Time, injected everywhere so tests move it instead of sleeping.

Wall time (``now``) is UTC epoch seconds and is what gets persisted; ``monotonic`` is for
in-process intervals and timeouts, so a wall-clock jump neither fires nor stalls anything.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Wall time: UTC seconds since the epoch."""

    def monotonic(self) -> float:
        """A clock that never goes back, for intervals inside one process."""

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of this clock's time."""


class SystemClock:
    """The real clocks."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        import asyncio  # here: `flowloop status` formats times with iso() and runs no loop

        await asyncio.sleep(max(0.0, seconds))


class FakeClock:
    """A clock that only moves when told to (or, with ``auto_advance``, when slept on).

    ``sleep`` with ``auto_advance=True`` jumps time forward at once, which makes retry
    backoff and timers deterministic and instant in tests.
    """

    def __init__(
        self, start: float | datetime = 1_800_000_000.0, *, auto_advance: bool = True
    ) -> None:
        self._wall = _epoch(start)
        self._mono = 0.0
        self.auto_advance = auto_advance

    def now(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float | timedelta) -> None:
        """Move both clocks forward by ``seconds`` (or a ``timedelta``)."""
        delta = seconds.total_seconds() if isinstance(seconds, timedelta) else float(seconds)
        if delta < 0:
            raise ValueError("FakeClock.advance: time cannot go back (use jump_wall)")
        self._wall += delta
        self._mono += delta

    def set(self, when: float | datetime) -> None:
        """Move both clocks forward to ``when`` (epoch seconds or an aware datetime)."""
        self.advance(max(0.0, _epoch(when) - self._wall))

    def utcnow(self) -> datetime:
        """The wall time as an aware UTC datetime."""
        return datetime.fromtimestamp(self._wall, UTC)

    def jump_wall(self, seconds: float) -> None:
        """Move only the wall clock (forwards or backwards), as NTP or an operator might."""
        self._wall += seconds

    async def sleep(self, seconds: float) -> None:
        if self.auto_advance and seconds > 0:
            self.advance(seconds)
        import asyncio  # (see SystemClock.sleep)

        await asyncio.sleep(0)


def _epoch(when: float | datetime) -> float:
    """Epoch seconds of ``when``; a naive datetime is refused (read in the machine's local
    zone, it would make a test pass on one machine and fail on another)."""
    if not isinstance(when, datetime):
        return float(when)
    if when.tzinfo is None or when.utcoffset() is None:
        raise ValueError(
            f"FakeClock: naive datetime {when.isoformat()}: give it a zone (tzinfo=UTC)"
        )
    return when.timestamp()


def utc(ts: float | None) -> datetime | None:
    """Epoch seconds to an aware UTC datetime (``None`` stays ``None``)."""
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def iso(ts: float | None) -> str:
    """Epoch seconds as a short ISO-8601 UTC string for people ("-" for none)."""
    if ts is None:
        return "-"
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
