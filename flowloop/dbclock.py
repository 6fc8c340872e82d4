"""The wall clock corrected by the measured offset to the database server's clock.

Due times (retries, sleeps, wait timeouts, scheduled starts) are stored as wall-clock
instants and compared with a worker's ``now`` when it claims. Each host's own clock would
make a worker 90 s ahead fire other workers' retries 90 s early, and one 90 s behind leave
new runs unclaimed for 90 s. Leases were already judged by the database's clock; with this
clock, due times are too: every worker measures its offset to the database (half the round
trip is the uncertainty) and adds it to ``time.time()``.

The offset is measured when the engine opens its store and again at every recovery sweep
(at most every 10 s); an offset smaller than :data:`SKEW_IGNORED` (or than the round
trip) is taken as none, so a host in sync never jitters. A deployment thus tolerates any
skew between hosts, within the round trip plus the drift between two measurements.

Between two measurements the time goes on from the last one by the time since boot
(``CLOCK_BOOTTIME``, which counts a suspend; the monotonic clock elsewhere), not by the
host's wall clock: a wall clock that jumps (``date -s``, NTP stepping a clock far
off, a VM restored from a snapshot) moves nothing until the next measurement sees it and
says so. Adding the last offset to ``time.time()`` instead made a worker whose clock
jumped an hour ahead claim and run, for up to 10 s, every run due within that hour.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from flowloop.clock import Clock, SystemClock

log = logging.getLogger("flowloop")

SKEW_IGNORED: Final = 0.5
"""Seconds of offset to the database's clock taken as none."""


_BOOTTIME: Final[int | None] = getattr(time, "CLOCK_BOOTTIME", None)


def _boottime() -> float:
    """Seconds since boot, a suspend included (Linux); elsewhere the monotonic clock."""
    if _BOOTTIME is None:
        return time.monotonic()
    return time.clock_gettime(_BOOTTIME)


class DatabaseClock:
    """:class:`~flowloop.clock.SystemClock` plus the offset to ``db_now()``."""

    def __init__(self, db_now: Callable[[], float], base: Clock | None = None) -> None:
        self.base = base or SystemClock()
        self.offset = 0.0
        self._db_now = db_now
        # The real clocks: a suspend counts (CLOCK_BOOTTIME; the monotonic clock stops while
        # the host sleeps, and every due time computed after a wake was that much early).
        self._elapsed = _boottime if isinstance(self.base, SystemClock) else self.base.monotonic
        self._anchor_at = (self.base.now(), self._elapsed())
        """``now()`` is the first at the instant the second was read, and goes on from there
        (one tuple, replaced whole: another thread never reads half of a new anchor)."""

    def refresh(self) -> float:
        """Measure the offset again (a database call; raises what it raises)."""
        before = self.base.now()
        elapsed_before = self._elapsed()
        server = self._db_now()
        after = self.base.now()
        elapsed_after = self._elapsed()
        if abs((after - before) - (elapsed_after - elapsed_before)) > SKEW_IGNORED:
            # The wall clock stepped during the measurement (its span is not the time that
            # passed): the midpoint of its readings is nobody's time — taken, a jump of an
            # hour measured no offset (too uncertain) and set this clock half an hour on,
            # and runs due within that half hour ran. Kept as it was; the next sweep
            # measures again.
            log.debug("clock offset not measured: the host's clock stepped meanwhile")
            return self.offset
        elapsed = (elapsed_before + elapsed_after) / 2
        measured = server - (before + after) / 2
        offset = measured if abs(measured) > max(SKEW_IGNORED, after - before) else 0.0
        if abs(offset - self.offset) > SKEW_IGNORED:
            log.warning(
                "this host's clock is %+.1fs off the database's; due times follow the "
                "database's clock (fix the host's NTP)",
                -offset,
                extra={"event": "clock_skew", "offset": offset},
            )
        self.offset = offset
        self._anchor_at = ((before + after) / 2 + offset, elapsed)
        return offset

    def now(self) -> float:
        wall, at = self._anchor_at
        return wall + (self._elapsed() - at)

    def monotonic(self) -> float:
        return self.base.monotonic()

    async def sleep(self, seconds: float) -> None:
        await self.base.sleep(seconds)
