"""Manual loop iterations: ``trigger`` (one iteration now) and ``backfill`` (missed slots of
a past range). Pure: the request, the slots a backfill runs, which comes next.

An operator's request is durable: the loop row's ``control`` says ``trigger`` or
``backfill`` (a backfill's range is kept beside it in ``flowloop_meta``), and the worker
that runs the loop honours it like a pause — never while an iteration of the loop runs
(the no-overlap rule holds for manual iterations too), and a slot of the schedule that is
due takes its turn first. Each manual iteration is journaled ``iteration_started`` with
``reason`` ``manual`` or ``backfill``; a backfill ends with ``backfill_finished`` (its
count the slots it ran, its reason what of the range did not run: slots past ``--max``, or
slots in the future, left to the schedule). A range wholly in the future is refused. A slot
that already has an ``iteration_started`` is never run again, so a backfill interrupted by
a crash goes on where it stopped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol

from flowloop.clock import iso
from flowloop.errors import FlowloopError

TRIGGER: Final = "trigger"
BACKFILL: Final = "backfill"
MANUAL: Final = (TRIGGER, BACKFILL)
"""The ``control`` values that ask for a manual iteration."""
DEFAULT_BACKFILL_MAX: Final = 100
"""Slots one backfill runs at most unless told otherwise (``--max``)."""
BACKFILL_MAX_LIMIT: Final = 10_000
"""The most slots one backfill request may ask for: a bound on a mistyped range."""
REQUEST_KEY_PREFIX: Final = "loop_backfill:"
"""``flowloop_meta`` key of a loop's pending backfill range."""


class LoopRequestRefused(FlowloopError):
    """A manual iteration cannot be asked for now; the message says why and what to do."""


@dataclass(frozen=True)
class BackfillRequest:
    """Run the slots in ``[start, end]`` (UTC epoch seconds) that never started, oldest
    first, at most ``limit`` of them."""

    start: float
    end: float
    limit: int = DEFAULT_BACKFILL_MAX
    asked_at: float = 0.0
    """When it was asked for: the backfill iterations journaled since count to ``limit``."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.start) and math.isfinite(self.end)):
            raise LoopRequestRefused("backfill: --from and --to must be times")
        if self.end < self.start:
            raise LoopRequestRefused("backfill: --to is before --from")
        if isinstance(self.limit, bool) or not 1 <= self.limit <= BACKFILL_MAX_LIMIT:
            raise LoopRequestRefused(
                f"backfill: --max={self.limit!r} must be between 1 and {BACKFILL_MAX_LIMIT}"
            )

    def to_json(self) -> str:
        return json.dumps(
            {"start": self.start, "end": self.end, "limit": self.limit, "at": self.asked_at}
        )

    @classmethod
    def from_json(cls, text: str) -> BackfillRequest:
        data: dict[str, Any] = json.loads(text)
        return cls(float(data["start"]), float(data["end"]), int(data["limit"]), float(data["at"]))


def first_unstarted(
    loop: Any,
    request: BackfillRequest,
    *,
    now: float,
    started: Iterable[float],
    anchor: float | None = None,
) -> float | None:
    """The oldest slot of ``loop`` (a :class:`~flowloop.loops.Loop`) in the request's range,
    not in the future, that has never started (None: nothing left). An interval loop's
    slots are the points of the chain through ``anchor`` (a slot of the loop; default its
    ``start_at``, else the epoch)."""
    done = {round(slot, 3) for slot in started}
    end = min(request.end, now)
    slot = _first_slot(loop, request.start, anchor)
    for _ in range(len(done) + 1):  # each pass but the last steps over a started slot
        if slot > end:
            return None
        if round(slot, 3) not in done:
            return float(slot)
        slot = loop.slot_after(slot, anchor=slot)
    return None


def _first_slot(loop: Any, start: float, anchor: float | None) -> float:
    """The first slot of ``loop`` at or after ``start`` (an interval loop's chain runs
    through ``anchor``; default its ``start_at``, else the epoch)."""
    if loop.cron is not None:
        # A millisecond before the start (slots are kept to the millisecond): one float ulp
        # was undone by the cron reader's datetime, which keeps microseconds, and a slot
        # falling exactly on --from was left out.
        slot = float(loop.slot_after(start - 1e-3))
        return float(loop.slot_after(slot)) if slot < start else slot
    if anchor is None:
        anchor = loop.start_at or 0.0
    return float(anchor + math.ceil((start - anchor) / loop.every) * loop.every)


def slots_left(
    loop: Any,
    request: BackfillRequest,
    *,
    now: float,
    started: Iterable[float],
    anchor: float | None = None,
) -> tuple[int, int]:
    """What a finished backfill leaves of its range: the slots not in the future that never
    started (``--max`` ran out first), and the slots in the future (left to the schedule;
    none at or past the loop's ``end_at``). Each counted up to :data:`BACKFILL_MAX_LIMIT`."""
    done = {round(slot, 3) for slot in started}
    due = later = 0
    slot = _first_slot(loop, request.start, anchor)
    for _ in range(len(done) + 2 * BACKFILL_MAX_LIMIT):
        if slot > request.end or loop.finished(slot):
            break
        if slot > now:
            later += 1
        elif round(slot, 3) not in done:
            due += 1
        if max(due, later) >= BACKFILL_MAX_LIMIT:
            break
        slot = loop.slot_after(slot, anchor=slot)
    return due, later


def _slots(n: int) -> str:
    return f"{n if n < BACKFILL_MAX_LIMIT else f'{n} or more'} slot{'s' if n != 1 else ''}"


def finished_reason(ran: int, limit: int, due: int, later: int) -> str:
    """The ``backfill_finished`` entry's reason: what ran, and what of the range did not
    (never "every slot has run" when some did not)."""
    if ran >= limit and due:
        said = f"--max {limit} reached: {_slots(due)} of the range not run (backfill again)"
    else:
        said = (
            "every slot of the range has run"
            if not later
            else "every due slot of the range has run"
        )
    if later:
        said += f"; {_slots(later)} later left to the schedule"
    return said


class RequestStore(Protocol):
    """What :func:`manual_firing` reads (the loop store)."""

    def loop_run_request(self, name: str) -> str | None: ...

    def loop_started_slots(
        self, name: str, start: float, end: float
    ) -> list[tuple[float, float, str | None]]: ...


@dataclass(frozen=True)
class BackfillEnd:
    """A backfill with nothing more to run: its ``backfill_finished`` entry's reason, and
    the slots it ran."""

    reason: str
    ran: int


def manual_firing(
    store: RequestStore, loop: Any, row: Any, now: float
) -> tuple[float, str] | BackfillEnd:
    """The slot and journal reason of the manual iteration ``row.control`` asks for:
    ``(now, "manual")`` for a trigger, the oldest slot of the backfill range that never
    started for a backfill — a :class:`BackfillEnd` when the backfill has nothing left to
    run."""
    if row.control == TRIGGER:
        return now, "manual"
    text = store.loop_run_request(row.name)
    if text is None:
        return BackfillEnd("its range is no longer stored (withdrawn?)", 0)
    request = BackfillRequest.from_json(text)
    started = store.loop_started_slots(row.name, request.start, request.end)
    ran = sum(1 for _, at, reason in started if reason == "backfill" and at >= request.asked_at)
    anchor = row.next_fire_at if row.next_fire_at is not None else row.last_slot
    slots = [s for s, _, _ in started]
    if ran < request.limit:
        slot = first_unstarted(loop, request, now=now, started=slots, anchor=anchor)
        if slot is not None:
            return slot, "backfill"
    due, later = slots_left(loop, request, now=now, started=slots, anchor=anchor)
    return BackfillEnd(finished_reason(ran, request.limit, due, later), ran)


class RequestWriter(Protocol):
    def request_loop_run(self, name: str, action: str, request: str | None = None) -> bool: ...


def ask(
    store: RequestWriter,
    row: Any,
    action: str,
    request: BackfillRequest | None = None,
    *,
    now: float,
) -> None:
    """Record an operator's trigger or backfill for the loop ``row`` (a LoopRow), or raise
    :class:`LoopRequestRefused` saying why it cannot be taken now (nothing written)."""
    if row.status not in ("scheduled", "running"):
        raise LoopRequestRefused(
            f"loop {row.name!r} is {row.status}: unpause it first (`flowloop unpause {row.name}`)"
        )
    if row.control is not None:
        raise LoopRequestRefused(
            f"loop {row.name!r} already has a {row.control} request pending; wait until its "
            f"worker has taken it (`flowloop loops {row.name}`), or withdraw it "
            f"(`flowloop {row.control} {row.name} --withdraw`)"
        )
    if request is not None and request.start > now:
        raise LoopRequestRefused(
            f"backfill: --from {iso(request.start)} is in the future: future slots are left "
            "to the loop's schedule (backfill a past range)"
        )
    text = None if request is None else replace(request, asked_at=now).to_json()
    if not store.request_loop_run(row.name, action, text):
        raise LoopRequestRefused(
            f"loop {row.name!r} changed meanwhile; look at `flowloop loops {row.name}` and "
            "try again"
        )
