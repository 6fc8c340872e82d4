"""The ``worker`` line of ``flowloop status RUN``: which worker holds the run and whether
its lease still runs, by the database's clock (the clock leases are judged by).

A worker frozen (SIGSTOP, a long GC pause), cut off from the database or dead stops
renewing its leases; its runs still read ``running`` until another worker's recovery
sweep takes them over. Without this line an operator could not tell such a run from a
healthy one (fault audit)."""

from __future__ import annotations

import time
from typing import Any

from flowloop.clock import iso
from flowloop.runinfo import RunInfo


def lease_words(owner: str, lease_expires_at: float | None, now: float) -> str:
    """``OWNER (lease until …)``, or that it ran out without a renewal. Times, not
    countdowns: the same run read twice (the SQLite reader, the store's) reads the same."""
    if lease_expires_at is None:
        return owner
    if lease_expires_at >= now:
        return f"{owner} (lease until {iso(lease_expires_at)})"
    return (
        f"{owner} (lease ran out at {iso(lease_expires_at)}, not renewed: that worker is "
        "frozen, cut off from the database or gone; the next recovery sweep of a live "
        "worker takes the run over)"
    )


def lease_line(store: Any, info: RunInfo) -> str | None:
    """``worker    …`` for an unfinished run some worker holds, else ``None``."""
    if info.owner is None or info.finished:
        return None
    stored = store.get_run(info.id)
    if stored is None or stored.owner is None:  # released since it was read
        return None
    # The SQLite reader (flowloop.store.lite) has no db_now: SQLite's clock is this host's.
    now = store.db_now() if hasattr(store, "db_now") else time.time()
    return f"worker    {lease_words(stored.owner, stored.lease_expires_at, now)}"
