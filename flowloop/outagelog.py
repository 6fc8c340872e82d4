"""What a worker logs through a database outage: the first failure of each part of it once
as a warning, what caused it in words, a reminder a minute, and a line when the database
answers again.

Before, the claim loop, the committer, the heartbeat and the loop scheduler each logged a
warning at every retry — 67 to 203 lines in 40 s of outage from one worker — a read-only
database and a locked SQLite file were both "database unreachable", and nothing said when
it was over (fault audit).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Final

from flowloop.store.outage import sqlite_code, sqlstate

log = logging.getLogger("flowloop")

REMINDER_SECONDS: Final = 60.0
"""How often a part still failing says so again at WARNING (DEBUG in between)."""


def cause(error: BaseException) -> str:
    """The outage in words: "read-only", "locked", "full" or "unreachable"."""
    state = sqlstate(error)
    if state == "25006":
        return "read-only"
    if state in ("53100",) or sqlite_code(error) == 13:  # SQLITE_FULL
        return "full"
    if sqlite_code(error) in (5, 6):  # SQLITE_BUSY, SQLITE_LOCKED
        return "locked"
    return "unreachable"


class Part:
    """One part of a worker (``claims``, ``writes``, ``heartbeat``, ``loops``) of one
    executor or scheduler: its own outage state (two engines in one process, on different
    databases, do not end each other's outages: review)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()  # (the heartbeat's part is told from its thread)
        self._down_since: float | None = None
        self._warned_at: float | None = None

    def failed(self) -> int:
        """The part failed for an outage: the level to log it at — WARNING the first time
        and once a minute, DEBUG otherwise."""
        now = time.monotonic()
        with self._lock:
            if self._down_since is None:
                self._down_since = now
            if self._warned_at is not None and now - self._warned_at < REMINDER_SECONDS:
                return logging.DEBUG
            self._warned_at = now
        return logging.WARNING

    def answered(self) -> None:
        """The part worked again: said once (WARNING, so that it shows wherever the
        outage's first line did), with how long it was out."""
        if self._down_since is None:  # (the usual case: one attribute read)
            return
        with self._lock:
            since, self._down_since, self._warned_at = self._down_since, None, None
        if since is not None:
            log.warning(
                "%s: the database answers again (out for %.1fs)",
                self.name,
                time.monotonic() - since,
            )
