"""What the loop scheduler writes for each decision, as plain data.

Firing a slot, recording an iteration's outcome, settling an iteration a dead worker left
running: each is one conditional write of a loop row (``changes``) with its journal entries
(``events``). The functions here compute those from the loop, its row and the clock's
reading, and do nothing else (no database, no ``await``); :mod:`flowloop.scheduler` reads
the rows, writes them and keeps the timers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowloop.loops import Loop, Wake
from flowloop.store.loops import LoopEvent, LoopRow

INTERRUPTED_MESSAGE = (
    "its worker went away during this iteration (killed, crashed, or lost its lease); "
    "it is not run twice"
)
LEASE_LOST_MESSAGE = (
    "this worker lost its lease during this iteration (self-fenced); it is not run twice"
)


@dataclass(frozen=True, kw_only=True)
class LoopWrite:
    """One write of a loop row: its new columns and the entries journaled with them."""

    changes: dict[str, Any]
    events: list[LoopEvent] = field(default_factory=list)
    status: str = "scheduled"
    """The loop's status after the write."""
    reason: str | None = None
    """Why it is no longer scheduled (``None`` while it is)."""
    skipped: int = 0
    """Slots skipped because the iteration outlasted them."""
    gave_up: bool = False
    """The loop paused itself after ``max_failures`` failures in a row (an alert)."""


def failures_reason(loop: Loop, failures: int) -> str:
    return f"{failures} consecutive failures (max_failures={loop.max_failures})"


def interrupted(
    loop: Loop, row: LoopRow, *, now: float, worker: str, lease_lost: bool = False
) -> LoopWrite:
    """Settle an iteration left running by a dead worker: journaled as interrupted (never
    run twice: its slot has its ``iteration_started``), the next slot scheduled, or the
    loop paused when that was its ``max_failures``-th failure in a row. ``lease_lost``:
    the worker settling it is the one that held it, and gave it up with its lease."""
    message = LEASE_LOST_MESSAGE if lease_lost else INTERRUPTED_MESSAGE
    slot = row.last_slot if row.last_slot is not None else now
    if row.next_fire_at is not None:
        nxt = row.next_fire_at  # a manual iteration kept the schedule's slot
    elif loop.mode == "fixed_delay":
        nxt, _ = loop.next_slot(slot, started=slot, ended=row.last_started_at or now)
    else:
        nxt = loop.slot_after(slot, anchor=slot)
    failures = row.consecutive_failures + 1
    events = [
        LoopEvent(
            loop=row.name,
            kind="iteration_interrupted",
            at=now,
            slot=slot,
            worker=worker,
            error_type="Interrupted",
            error_message=message,
        )
    ]
    changes: dict[str, Any] = {
        "status": "scheduled",
        "next_fire_at": nxt,
        "last_result": "interrupted",
        "last_error": message,
        "last_ended_at": now,
        # It was the loop's iteration number iterations + 1: the next is the one after.
        "iterations": row.iterations + 1,
        "consecutive_failures": failures,
        "updated_at": now,
    }
    if row.control in ("pause", "stop"):
        # Asked for while the iteration ran: honoured now, not at the next slot.
        target = "paused" if row.control == "pause" else "stopped"
        reason = f"{target} by an operator"
        changes.update(status=target, next_fire_at=None, reason=reason, control=None)
        events.append(
            LoopEvent(
                loop=row.name, kind=f"loop_{target}", at=now, worker=worker, data={"reason": reason}
            )
        )
        return LoopWrite(changes=changes, events=events, status=target, reason=reason)
    if loop.max_failures is None or failures < loop.max_failures:
        return LoopWrite(changes=changes, events=events)
    reason = failures_reason(loop, failures)
    changes.update(status="paused", next_fire_at=None, reason=reason)
    events.append(
        LoopEvent(loop=row.name, kind="loop_paused", at=now, worker=worker, data={"reason": reason})
    )
    return LoopWrite(changes=changes, events=events, status="paused", reason=reason, gave_up=True)


def firing(row: LoopRow, wake: Wake, *, now: float, worker: str) -> LoopWrite:
    """Fire the slot ``wake`` chose: the slots given up or folded into it, then its
    ``iteration_started`` (unique per slot), all in the write that takes the lease."""
    given_up = (("missed", row.next_fire_at, wake.missed), ("coalesced", wake.slot, wake.coalesced))
    events = [
        LoopEvent(loop=row.name, kind=kind, at=now, slot=slot, count=count, worker=worker)
        for kind, slot, count in given_up
        if count
    ]
    events.append(started(row.name, wake.slot, wake.reason, now=now, worker=worker))
    changes = {
        "last_slot": wake.slot,
        "last_started_at": now,
        "next_fire_at": None,
        "updated_at": now,
        "missed": row.missed + wake.missed + wake.coalesced,
    }
    return LoopWrite(changes=changes, events=events)


def giving_up(loop: Loop, row: LoopRow, wake: Wake, *, now: float, worker: str) -> LoopWrite:
    """Give up the due slots ``wake`` found past the misfire grace (none fires): journaled
    ``missed``, and the loop goes on with its next slot — or, when that is at or after
    ``end_at``, stops in the same write (the slots before it are accounted for)."""
    assert row.next_fire_at is not None, "a scheduled loop"
    nxt = loop.slot_after(now, anchor=row.next_fire_at)
    events = [
        LoopEvent(
            loop=row.name,
            kind="missed",
            at=now,
            slot=row.next_fire_at,
            count=wake.missed,
            worker=worker,
        )
    ]
    changes: dict[str, Any] = {
        "next_fire_at": nxt,
        "missed": row.missed + wake.missed,
        "updated_at": now,
    }
    if not loop.finished(nxt):
        return LoopWrite(changes=changes, events=events)
    reason = "end_at reached"
    events.append(
        LoopEvent(
            loop=row.name, kind="loop_stopped", at=now, worker=worker, data={"reason": reason}
        )
    )
    changes.update(status="stopped", reason=reason, next_fire_at=None)
    return LoopWrite(changes=changes, events=events, status="stopped", reason=reason)


def started(name: str, slot: float, reason: str, *, now: float, worker: str) -> LoopEvent:
    """The ``iteration_started`` entry of ``slot`` (``reason``: why it fires now)."""
    return LoopEvent(
        loop=name,
        kind="iteration_started",
        at=now,
        slot=slot,
        attempt=1,
        worker=worker,
        data={"reason": reason, "late": round(now - slot, 3)},
    )


def outcome(
    loop: Loop,
    row: LoopRow,
    *,
    slot: float,
    started_at: float,
    result: str,
    error: str | None,
    attempts: int,
    duration: float,
    now: float,
    control: str | None,
    manual: bool,
    worker: str,
) -> LoopWrite:
    """Record an iteration's ``result`` (``ok``, ``failed``, ``skipped_idle``, ``stopped``,
    ``cancelled``): its entry, the slots it outlasted, and where the loop goes next — the
    next slot, or paused/stopped (an operator's ``control``, ``max_failures``, ``end_at``).
    ``manual``: a trigger or backfill iteration, which leaves the schedule alone."""
    # fixed_rate measures the iteration on the monotonic clock (a wall jump during it is
    # not an overlap); fixed_delay waits `every` after the end, whatever the wall says.
    ended = now if loop.mode == "fixed_delay" else started_at + duration
    nxt, skipped = loop.next_slot(slot, started=started_at, ended=ended)
    if manual:
        # A manual iteration leaves the schedule alone: its next slot stays (and fires
        # after it, late if it came due meanwhile, under the misfire policy).
        nxt, skipped = (row.next_fire_at if row.next_fire_at is not None else nxt), 0
    elif skipped and loop.end_at is not None:
        # Slots at or after end_at are not the loop's: an iteration outlasting end_at
        # skipped only the ones before it.
        skipped = loop.missed_slots(loop.slot_after(slot, anchor=slot), loop.horizon(ended))
    # Shutdown and operator stops are nobody's failure: the count stays as it was.
    failures = {"ok": 0, "failed": row.consecutive_failures + 1}.get(
        result, row.consecutive_failures
    )
    kind = {"ok": "iteration_succeeded", "failed": "iteration_failed"}.get(
        result, "iteration_" + result
    )
    events = [
        LoopEvent(
            loop=loop.name,
            kind=kind,
            at=now,
            slot=slot,
            attempt=attempts,
            duration=duration,
            error_message=error,
            worker=worker,
        )
    ]
    if skipped:
        events.append(
            LoopEvent(
                loop=loop.name,
                kind="skipped_overlap",
                at=now,
                slot=loop.slot_after(slot, anchor=slot),
                count=skipped,
                worker=worker,
            )
        )
    status, reason, gave_up = "scheduled", None, False
    if result == "stopped" or control == "stop":
        status, reason = "stopped", "stopped by an operator"
    elif control == "pause":
        status, reason = "paused", "paused by an operator"
    elif loop.max_failures is not None and failures >= loop.max_failures:
        status, reason, gave_up = "paused", failures_reason(loop, failures), True
    elif loop.end_at is not None and nxt >= loop.end_at:
        status, reason = "stopped", "end_at reached"
    if status != "scheduled":
        events.append(
            LoopEvent(
                loop=loop.name,
                kind=f"loop_{status}",
                at=now,
                worker=worker,
                data={"reason": reason},
            )
        )
    changes: dict[str, Any] = {
        "status": status,
        "reason": reason,
        "next_fire_at": nxt if status == "scheduled" else None,
        "last_ended_at": now,
        "last_result": result,
        "last_error": error,
        "iterations": row.iterations + 1,
        "consecutive_failures": failures,
        "skipped": row.skipped + skipped,
        "updated_at": now,
    }
    if status != "scheduled":
        # Only a write that honours (or supersedes) a request clears it: a pause that
        # arrived after the row was read must survive this write.
        changes["control"] = None
    return LoopWrite(
        changes=changes,
        events=events,
        status=status,
        reason=reason,
        skipped=skipped,
        gave_up=gave_up,
    )
