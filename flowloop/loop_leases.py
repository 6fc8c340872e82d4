"""The loop leases a worker holds, as its own clock counts them: when each was last
renewed (or taken by a fire), so that a worker whose renewals fail — cut off from the
database while another worker is not (a partition) — gives its iterations up before
their leases end there, and another worker, recovering the loop, fires it beside them."""

from __future__ import annotations

import time
from collections.abc import Iterable


class LeaseClock:
    """When each loop lease of this worker was last sent (a fire, a renewal), on the
    monotonic clock: the database counts the lease from a moment after that."""

    def __init__(self, lease_seconds: float) -> None:
        self.lease_seconds = lease_seconds
        self._sent: dict[str, float] = {}

    def now(self) -> float:
        return time.monotonic()

    def sent(self, names: Iterable[str], at: float | None = None) -> None:
        """A lease of each of ``names`` was asked for (fired, renewed) at ``at`` (now)."""
        moment = self.now() if at is None else at
        for name in names:
            self._sent[name] = moment

    def kept(self, names: Iterable[str], period: float) -> set[str]:
        """Of ``names`` (their renewal failed), those whose lease still holds until the
        next renewal, ``period`` from now: the others may be another worker's by then."""
        deadline = self.now() + period
        return {
            name
            for name in names
            if name in self._sent and deadline < self._sent[name] + self.lease_seconds
        }

    def only(self, names: Iterable[str]) -> None:
        """Forget the leases not among ``names`` (their iterations ended)."""
        wanted = set(names)
        for name in [name for name in self._sent if name not in wanted]:
            del self._sent[name]
