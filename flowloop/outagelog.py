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

_lock = threading.Lock()
_down_since: dict[str, float] = {}  # part of the worker -> when it first failed
_warned_at: dict[str, float] = {}


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


def failed(part: str) -> int:
    """``part`` (the claims, the writes, the heartbeat, the loops) failed for an outage:
    the level to log it at — WARNING the first time and once a minute, DEBUG otherwise."""
    now = time.monotonic()
    with _lock:
        _down_since.setdefault(part, now)
        last = _warned_at.get(part)
        if last is not None and now - last < REMINDER_SECONDS:
            return logging.DEBUG
        _warned_at[part] = now
    return logging.WARNING


def answered(part: str) -> None:
    """``part`` worked again: said once (WARNING, so that it shows wherever the outage's
    first line did), with how long it was out."""
    if part not in _down_since:  # (the usual case: one lookup)
        return
    with _lock:
        since = _down_since.pop(part, None)
        _warned_at.pop(part, None)
    if since is not None:
        log.warning(
            "%s: the database answers again (out for %.1fs)", part, time.monotonic() - since
        )
