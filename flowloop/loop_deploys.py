"""What a deploy changes about loops, as a worker starting sees it: a loop whose schedule
the new code changed (applied at once, or — while another worker runs an iteration of it —
once that iteration has ended: a write under it would fence that worker off its outcome),
and the loops of the database the worker does not define (another worker's, or removed
from the code)."""

from __future__ import annotations

import logging

from flowloop.clock import Clock
from flowloop.loops import Loop
from flowloop.store.loops import LoopRow, LoopSpec, LoopStoreMixin

log = logging.getLogger("flowloop.loops")

NAMED_AT_MOST = 10
"""Loops not defined here named by the start's log line (the rest counted)."""


def resync(
    store: LoopStoreMixin, loop: Loop, row: LoopRow, *, clock: Clock, worker: str
) -> LoopRow | None:
    """Give the loop of ``row`` this worker's schedule, deferred at start: the row written
    (``loop_rescheduled``), or None while an iteration still runs (or the loop changed
    meanwhile: tried again when its row is seen next)."""
    if row.status == "running":
        return None
    now = clock.now()
    spec = LoopSpec(
        name=loop.name,
        schedule=loop.schedule,
        first_slot=loop.first_slot(now),
        keep_due=loop.coalesce,
    )
    [fresh] = store.sync_loops([spec], at=now, worker=worker)
    if fresh.schedule != loop.schedule:
        return None
    log.info("loop %s: rescheduled to %s", loop.name, loop.schedule)
    return fresh


def deferred(row: LoopRow, loop: Loop) -> bool:
    """Whether ``row``, as registered, still has another schedule than ``loop`` (another
    worker runs an iteration of it): said in the log."""
    if row.schedule == loop.schedule:
        return False
    log.info("loop %s: %s once %s's iteration ends", row.name, loop.schedule, row.owner)
    return True


def say_undefined(store: LoopStoreMixin, names: set[str]) -> None:
    """Log the loops of the database, stopped ones aside, that are not in ``names``."""
    others = [r.name for r in store.list_loops() if r.name not in names and r.status != "stopped"]
    if not others:
        return
    shown = ", ".join(others[:NAMED_AT_MOST])
    if len(others) > NAMED_AT_MOST:
        shown += f" and {len(others) - NAMED_AT_MOST} more"
    log.info(
        "loops in the database this worker does not define (another worker's, or removed "
        "from the code: `flowloop stop NAME` ends one): %s",
        shown,
    )
