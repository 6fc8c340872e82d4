"""Recording a loop iteration's outcome: the worker's one fenced write of the loop row,
decided on the request (``pause``, ``stop``, a trigger …) the row holds as read.

An operator's unpause withdraws a pending pause without moving the lease or ``last_seq``,
so the write is also fenced on that request: one that honoured a pause withdrawn since it
was read would leave the loop paused although the unpause was acknowledged. Refused for
that alone, the outcome is decided again on the row as it is now.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from flowloop import loop_slots as slots
from flowloop.loops import Loop
from flowloop.store.loops import LoopRow, LoopStoreMixin

OUTCOME_TRIES: Final = 8
"""Writes of one outcome refused because its request changed meanwhile, before the
worker gives it up as a lost lease (recovery settles the iteration then)."""


def record(
    store: LoopStoreMixin,
    loop: Loop,
    row: LoopRow,
    *,
    slot: float,
    started: float,
    result: str,
    error: str | None,
    attempts: int,
    duration: float,
    manual: bool,
    worker: str,
    now: Callable[[], float],
) -> slots.LoopWrite | None:
    """Write the outcome of the iteration ``row`` (as fired by ``worker``) started: the
    write done, or None when the worker no longer holds the loop (its lease lost or run
    out, the loop settled by another) — nothing written then."""
    for _ in range(OUTCOME_TRIES):
        fresh = store.get_loop(loop.name)
        control = fresh.control if fresh is not None else None
        write = slots.outcome(
            loop,
            row,
            slot=slot,
            started_at=started,
            result=result,
            error=error,
            attempts=attempts,
            duration=duration,
            now=now(),
            control=control,
            manual=manual,
            worker=worker,
        )
        if store.write_loop(
            name=loop.name,
            owner=worker,
            epoch=row.lease_epoch,
            follows_seq=row.last_seq,
            changes=write.changes,
            events=write.events,
            control=control,
        ):
            return write
        again = store.get_loop(loop.name)
        if again is None or again.control == control or not _still_held(again, row, worker):
            return None  # refused for another reason than its request
    return None


def _still_held(now: LoopRow, fired: LoopRow, worker: str) -> bool:
    """The loop is still the iteration ``worker`` fired (``fired``): nobody else wrote it."""
    return (
        now.status == "running"
        and now.owner == worker
        and now.lease_epoch == fired.lease_epoch
        and now.last_seq == fired.last_seq
    )
