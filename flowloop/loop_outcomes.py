"""Recording a loop iteration's outcome: the worker's one fenced write of the loop row,
decided on the request (``pause``, ``stop``, a trigger …) the row holds as read.

An operator's unpause withdraws a pending pause without moving the lease or ``last_seq``,
so the write is also fenced on that request: one that honoured a pause withdrawn since it
was read would leave the loop paused although the unpause was acknowledged. Refused for
that alone, the outcome is decided again on the row as it is now.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from flowloop import loop_slots as slots
from flowloop.alerts import Alert, loop_alerts, loop_held_alert
from flowloop.clock import iso
from flowloop.errors import error_line
from flowloop.loops import Loop
from flowloop.store.loops import LoopEvent, LoopRow, LoopStoreMixin
from flowloop.store.outage import is_outage

if TYPE_CHECKING:
    from flowloop.scheduler import Scheduler

log = logging.getLogger("flowloop.loops")

OUTCOME_TRIES: Final = 8
"""Writes of one outcome refused because its request changed meanwhile, before the
worker leaves it for its next poll (the loop still held: its lease renewed meanwhile)."""

LOST_UNRECORDED: Final = "lost its lease; the outcome was not recorded"
OUTCOME_LOOKBACK: Final = 50
"""Journal entries of a loop read back to find whether its refused outcome was written."""


class Refused(enum.Enum):
    """Why :func:`record` wrote nothing."""

    LOST = "lost"
    """The worker no longer holds the loop (its lease lost or run out, settled by another)."""
    CONTENDED = "contended"
    """Its request changed before each of :data:`OUTCOME_TRIES` writes: still held, the
    outcome is to be written again later (before, given up as a lost lease: recovery
    journaled the iteration interrupted, whatever its outcome)."""


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
) -> slots.LoopWrite | Refused:
    """Write the outcome of the iteration ``row`` (as fired by ``worker``) started: the
    write done, or why nothing was written (:class:`Refused`)."""
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
            return Refused.LOST  # refused for another reason than its request
    return Refused.CONTENDED


def _still_held(now: LoopRow, fired: LoopRow, worker: str) -> bool:
    """The loop is still the iteration ``worker`` fired (``fired``): nobody else wrote it."""
    return (
        now.status == "running"
        and now.owner == worker
        and now.lease_epoch == fired.lease_epoch
        and now.last_seq == fired.last_seq
    )


def lost(scheduler: Scheduler, name: str, row: LoopRow, slot: float) -> slots.LoopWrite | None:
    """The write of loop ``name``'s outcome (of ``slot``, the iteration ``row`` fired) was
    refused, the loop no longer this worker's: said, unless an earlier write of it had
    committed after all (it raised: a connection lost during its COMMIT — before, this
    said "lost its lease"); either way the loop is armed again from its row as it is now
    (before, it was not: this worker never fired it again). The write found, as the
    journal shows it (for its listeners and alerts: before, none were told), or None."""
    found = None
    try:
        journal = scheduler.store.loop_journal(name, limit=OUTCOME_LOOKBACK)
        after = next((e for e in journal if e.seq == row.last_seq + 1), None)
        written = (
            after is not None
            and after.worker == scheduler.worker_id
            and after.slot == slot
            and after.kind.startswith("iteration_")
            and after.kind != "iteration_interrupted"
        )
        if written:
            assert after is not None
            found = _as_written(after, journal)
            log.info(
                "loop %s: its iteration's outcome was written after all (the write that "
                "raised had committed)",
                name,
                extra={"loop": name, "event": "outcome_written_after_all"},
            )
        else:
            say_refused(name, Refused.LOST)
            scheduler._notify_lease_lost(name, LOST_UNRECORDED)
        fresh = scheduler.store.get_loop(name)
        if fresh is not None and name in scheduler._generation:
            scheduler._schedule(fresh)
    except Exception as failure:  # (a read, a deferred schedule: looked at again soon)
        scheduler._failed(failure, "loop %s: could not re-arm (%s); trying again", name)
        if name in scheduler._generation:
            scheduler._push(name, scheduler.poll_seconds)
    return found


def _as_written(entry: LoopEvent, journal: Sequence[LoopEvent]) -> slots.LoopWrite:
    """The outcome's write whose first journal entry is ``entry`` (an ``iteration_*``),
    rebuilt from the entries journaled with it (same worker, same time): the slots it
    skipped, the loop's status after it, whether it paused the loop (``max_failures``)."""
    same = [
        e for e in journal if e.seq > entry.seq and e.worker == entry.worker and e.at == entry.at
    ]
    skipped = sum(e.count for e in same if e.kind == "skipped_overlap")
    ended = next((e for e in same if e.kind.startswith("loop_")), None)
    status = ended.kind.removeprefix("loop_") if ended is not None else "scheduled"
    reason = None if ended is None else ended.data.get("reason")
    gave_up = status == "paused" and reason != "paused by an operator"
    return slots.LoopWrite(
        changes={},
        events=[entry, *same],
        status=status,
        reason=reason,
        skipped=skipped,
        gave_up=gave_up,
    )


def say_refused(name: str, refused: Refused) -> None:
    if refused is Refused.LOST:
        log.warning(
            "loop %s: lost its lease; this worker did not record its outcome",
            name,
            extra={"loop": name, "event": "lease_lost"},
        )
    else:
        log.warning(
            "loop %s: its request changed before each of %d writes of the iteration's "
            "outcome; writing it again at the next poll (the loop still held)",
            name,
            OUTCOME_TRIES,
            extra={"loop": name, "event": "outcome_contended"},
        )


def say_finished(
    loop: Loop,
    row: LoopRow,
    write: slots.LoopWrite,
    *,
    slot: float,
    outcome: str,
    error: str | None,
    attempts: int,
    duration: float,
    listeners: Sequence[Callable[[str, str, float, int], None]],
) -> None:
    """Log a recorded iteration and tell the iteration listeners (metrics)."""
    log.info(
        "loop %s iteration %d %s in %.1f ms",
        loop.name,
        row.iterations + 1,
        outcome,
        duration * 1000,
        extra={
            "loop": loop.name,
            "iteration": row.iterations + 1,
            "slot": slot,
            "event": "iteration_finished",
            "outcome": outcome,
            "duration": duration,
            "attempt": attempts,
            "error": error,
            "skipped": write.skipped,
        },
    )
    for listener in listeners:
        try:
            listener(loop.name, outcome, duration, write.skipped)
        except Exception:  # metrics must never stop the scheduler
            log.exception("iteration listener failed")


def say_abandoned(name: str, number: int, duration: float) -> None:
    """The heartbeat fenced this worker off the iteration: whatever it did, nothing is
    written for it (the write would be refused anyway, or land only because no other
    worker has recovered the loop yet); recovery journals it interrupted."""
    log.info(
        "loop %s iteration %d abandoned after %.1f ms: lost its lease; not recorded",
        name,
        number,
        duration * 1000,
        extra={"loop": name, "iteration": number, "event": "iteration_abandoned"},
    )


def alert(
    send: Callable[[Alert], None],
    loop: Loop,
    write: slots.LoopWrite,
    error: str | None,
    skipped_before: int,
) -> None:
    """Raise the alerts a recorded outcome (or an interruption) calls for."""
    for each in loop_alerts(
        loop.name,
        paused=write.reason if write.gave_up else None,
        error=error,
        skipped_before=skipped_before,
        skipped_now=write.skipped,
    ):
        send(each)


def held(scheduler: Scheduler, name: str, why: str) -> None:
    """Loop ``name``'s function was abandoned still running (it did not end within ``why``:
    its grace, ``1s of its timeout (5s)``): the loop stays held
    until it ends, its failure not yet counted. Made visible: the row's note (read by
    ``flowloop loops`` and the dashboard's loop page; the outcome's write replaces it) and
    a critical alert.

    The note is one fenced write on the event loop, as every database call of the
    scheduler is (the outcome's :func:`record`, a slot's fire): bounded by the store's
    timeouts, which the worker's lease sets (SQLite's busy timeout, a sixth of the lease;
    PostgreSQL's statement and network timeouts, flowloop.store.dialect), so it holds the
    loop no longer than any of them. Failed (an outage), the alert is raised all the same.

    No journal entry: one would move the loop's ``last_seq``, on which the iteration's
    outcome is fenced, and the note and alert already say it (``flowloop loops``, the
    dashboard, the alert; the journal shows the iteration started and not ended)."""
    note = (
        f"held: its function did not end within {why} at {iso(scheduler.clock.now())}; "
        "its failure, max_failures and a stop or pause wait for its end"
    )
    row = scheduler._rows.get(name)
    if row is not None:
        try:
            if not scheduler.store.write_loop(
                name=name,
                owner=scheduler.worker_id,
                epoch=row.lease_epoch,
                follows_seq=row.last_seq,
                changes={"reason": note},
                events=[],
                release=False,
            ):
                return  # (its lease lost: the loop is not held by this worker any more)
        except Exception as error:
            log.warning("loop %s: could not note that it is held: %s", name, error)
    if scheduler.alert is not None:
        scheduler.alert(loop_held_alert(name, note))


def unwritten(
    scheduler: Scheduler, name: str, slot: float, failure: Exception, again: Callable[[], None]
) -> None:
    """The write of loop ``name``'s outcome (of ``slot``) raised ``failure``. An outage (a
    lock not granted in time, the server gone): kept for the next poll, like an outcome
    whose request kept changing — the loop still held, its lease renewed meanwhile (before,
    the outcome was forgotten: the lease ran out and recovery journaled the iteration, even
    one that succeeded, interrupted). Anything else: said; the lease runs out and recovery
    journals the iteration interrupted."""
    if is_outage(failure):
        scheduler._unrecorded[name] = again
        scheduler._failed(
            failure,
            "loop %s: could not record the iteration of slot %.3f; writing it again at the "
            "next poll (the loop still held): %s",
            name,
            slot,
        )
        return
    log.error(
        "loop %s: could not record the iteration of slot %.3f: %s", name, slot, error_line(failure)
    )


def write_pending(pending: dict[str, Callable[[], None]], *, last: bool = False) -> None:
    """Write again the outcomes left for a later poll (their request kept changing, or the
    database did not answer); ``last``: the worker stops, so those refused once more are
    dropped (said)."""
    for name, write_again in list(pending.items()):
        del pending[name]
        write_again()
    if last:
        for name in pending:
            log.warning(
                "loop %s: its iteration's outcome could not be written before the worker "
                "stopped (its request kept changing, or the database did not answer); "
                "dropped: recovery journals the iteration interrupted",
                name,
                extra={"loop": name, "event": "outcome_dropped"},
            )
        pending.clear()
