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
        first_slot=after_iteration(loop, row, now),
        keep_due=loop.coalesce,
        latest_slot=None if loop.coalesce else loop.latest_slot(now),
    )
    [fresh] = store.sync_loops([spec], at=now, worker=worker)
    if fresh.schedule != loop.schedule:
        return None
    log.info("loop %s: rescheduled to %s", loop.name, loop.schedule)
    return fresh


def after_iteration(loop: Loop, row: LoopRow, now: float) -> float:
    """The first slot of ``loop``'s (new) schedule after the iteration the change waited
    for, as if it had run under it: the next slot after its end (those that came due while
    it ran would have been overlaps) — of the chain from its slot (an ``every=`` loop's),
    the next cron time, or its end plus ``every`` (``fixed_delay``); never before
    ``start_at``. Not ``now``, as for a newly registered loop: an ``every=`` loop fired
    again right after the iteration ended. (A resync seen late, past that slot: the slot
    is due, and handled as any due slot.)"""
    slot, started, ended = row.last_slot, row.last_started_at, row.last_ended_at
    if slot is None or started is None or ended is None or ended < started:
        return loop.first_slot(now)  # (no iteration recorded to go on from)
    if loop.mode == "fixed_delay":
        nxt, _ = loop.next_slot(slot, started=started, ended=ended)
    else:  # (an every= chain from the slot, or from start_at: its grid's phase kept)
        nxt = loop.slot_after(ended, anchor=slot if loop.start_at is None else loop.start_at)
    earliest = loop.earliest_slot()
    return nxt if earliest is None else max(nxt, earliest)


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
