"""The ``worker`` line of ``flowloop status RUN`` and its ``--json`` fields: which worker
holds the run and whether its lease still runs, by the database's clock (the clock leases
are judged by).

A worker frozen (SIGSTOP, a long GC pause), cut off from the database or dead stops
renewing its leases; its runs still read ``running`` until another worker's recovery
sweep takes them over. Without this line an operator could not tell such a run from a
healthy one (fault audit)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

from flowloop.cli.support import iso8601
from flowloop.clock import iso
from flowloop.runinfo import RunInfo


@dataclass(frozen=True)
class Lease:
    """Who holds an unfinished run and until when, judged by the database's clock."""

    owner: str
    expires_at: float | None
    expired: bool

    def words(self) -> str:
        """``OWNER (lease until …)``, or that it ran out without a renewal."""
        if self.expires_at is None:
            return self.owner
        if not self.expired:
            return f"{self.owner} (lease until {iso(self.expires_at)})"
        return (
            f"{self.owner} (lease ran out at {iso(self.expires_at)}, not renewed: that worker "
            "is frozen, cut off from the database or gone; the next recovery sweep of a live "
            "worker takes the run over)"
        )

    def as_json(self) -> dict[str, Any]:
        """What ``status RUN --json`` says of it (see :func:`lease_json`)."""
        return {
            "worker": self.owner,
            "lease_expires_at": iso8601(self.expires_at),
            "lease_expires_at_epoch": self.expires_at,
            "lease_expired": self.expired,
        }


NO_LEASE: Final = {
    "worker": None,
    "lease_expires_at": None,
    "lease_expires_at_epoch": None,
    "lease_expired": False,
}
"""``status RUN --json``'s lease fields of a run no worker holds."""


def lease_of(store: Any, info: RunInfo) -> Lease | None:
    """The lease of an unfinished run some worker holds, else ``None``."""
    if info.owner is None or info.finished:
        return None
    stored = store.get_run(info.id)
    if stored is None or stored.owner is None:  # released since it was read
        return None
    until = stored.lease_expires_at
    if until is None:
        return Lease(stored.owner, None, expired=False)
    # The SQLite reader (flowloop.store.lite) has no db_now: SQLite's clock is this host's.
    now = store.db_now() if hasattr(store, "db_now") else time.time()
    return Lease(stored.owner, until, expired=until < now)


def lease_line(store: Any, info: RunInfo) -> str | None:
    """``worker    …`` for an unfinished run some worker holds, else ``None``."""
    lease = lease_of(store, info)
    return None if lease is None else f"worker    {lease.words()}"


def lease_json(store: Any, info: RunInfo) -> dict[str, Any]:
    """The same facts as :func:`lease_line`, for ``status RUN --json``: ``worker`` (or
    null), ``lease_expires_at`` (ISO-8601, or null; ``_epoch`` beside it) and
    ``lease_expired`` (it ran out unrenewed)."""
    lease = lease_of(store, info)
    return dict(NO_LEASE) if lease is None else lease.as_json()
