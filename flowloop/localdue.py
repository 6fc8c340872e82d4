"""Due times of runs this process handed back, kept on its monotonic clock too.

Retries, durable sleeps and wait timeouts are stored as wall-clock due times
(``next_run_at``), and claims compare them with the wall clock. When the wall clock is set
back (NTP, an operator) by an hour, a retry due in 3 s would wait an hour. The process that
wrote the due time knows how far ahead it was, so it also notes the instant by its
monotonic clock; once that instant has passed, it claims the run as due whatever the wall
clock says now (loops cap their waits the same way, see Loop.wait_cap).

Only this process's own runs are covered: another worker judges a run by the wall clock
(and by the database clock for leases) — set the clocks of all hosts by NTP.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from flowloop.clock import Clock


class LocalDue:
    """``run id -> (monotonic due, wall due)`` for runs handed back with a due time."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._due: dict[str, tuple[float, float]] = {}

    def note(self, run_id: str, wall_due: float | None) -> None:
        if wall_due is None:
            self._due.pop(run_id, None)
            return
        ahead = max(0.0, wall_due - self.clock.now())
        self._due[run_id] = (self.clock.monotonic() + ahead, wall_due)

    def forget(self, run_ids: Iterable[str]) -> None:
        for run_id in run_ids:
            self._due.pop(run_id, None)

    def overdue(self, among: Sequence[str] | None = None) -> tuple[list[str], float]:
        """Runs due by the monotonic clock (limited to ``among``), and the wall time to
        claim them at (the latest of their stored due times, or now if that is later)."""
        mono = self.clock.monotonic()
        allowed = None if among is None else set(among)
        ids = [
            run_id
            for run_id, (due, _) in self._due.items()
            if due <= mono and (allowed is None or run_id in allowed)
        ]
        at = max([self.clock.now(), *(self._due[run_id][1] for run_id in ids)])
        return ids, at

    def next_wait(self, among: Sequence[str] | None = None) -> float | None:
        """Seconds until the next noted run is due by the monotonic clock."""
        allowed = None if among is None else set(among)
        dues = [
            due for run_id, (due, _) in self._due.items() if allowed is None or run_id in allowed
        ]
        return None if not dues else max(0.0, min(dues) - self.clock.monotonic())
