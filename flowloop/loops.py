"""Loops: recurring iterations of a function or of a workflow, and the pure maths of when.

A loop fires *slots* (scheduled times, UTC epoch seconds). The functions here decide, from
a slot and the current time, whether to fire, how many slots were missed or skipped, and
which slot comes next. They do no I/O and take the time as an argument.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal
from zoneinfo import ZoneInfo

from cronsim import CronSim, CronSimError
from pydantic import BaseModel

from flowloop.definition import NAME_PATTERN, Workflow
from flowloop.errors import FlowloopError, LoopDefinitionError
from flowloop.retry import NO_RETRY, Retry
from flowloop.specs import NAME_RULE
from flowloop.tz import UnknownTimeZone, describe, in_gap, local, wall_epoch, zone

Mode = Literal["fixed_rate", "fixed_delay"]
MODES: tuple[Mode, ...] = ("fixed_rate", "fixed_delay")
DEFAULT_MISFIRE_GRACE_SECONDS = 3600.0
MAX_COUNTED_SLOTS = 100_000
"""Cron slots are counted one by one; past this many, a gap is not counted further."""


class Idle:
    """The type of :data:`IDLE`."""

    def __repr__(self) -> str:
        return "IDLE"


IDLE = Idle()
"""Nothing to do in this slot: what a loop function returns, or what a workflow loop's
``context`` function returns instead of a context (``None`` means the same), so that no
run is created. The iteration is journaled ``iteration_skipped_idle``: it neither counts
as a failure nor resets the failure count."""


@dataclass(frozen=True, kw_only=True)
class Iteration:
    """What a loop function learns about the iteration it runs."""

    loop: str
    slot: float
    """The scheduled time of this iteration (UTC epoch seconds)."""
    number: int
    attempt: int
    tz: str | None = None
    """The loop's ``tz=`` (None: UTC)."""

    @property
    def scheduled_for(self) -> datetime:
        """The slot as an aware datetime in the loop's zone (UTC for a loop without ``tz=``):
        ``scheduled_for.date()`` is the day on that zone's calendar."""
        return local(self.slot, self.tz)

    @property
    def idempotency_key(self) -> str:
        """Stable for one slot of one loop, across attempts, crashes and workers."""
        return f"loop:{self.loop}:{self.slot:.3f}"


class Loop:
    """A recurring job: ``every=`` seconds (or a timedelta) or ``cron=``.

    ``fn`` is a function ``(Iteration) -> Any`` (sync or async) — or give ``workflow=`` and
    ``context=`` (a model, a dict, or a function of the Iteration returning one) to start one
    run of that workflow per iteration; the iteration ends when the run does. A context
    function that returns ``None`` (or :data:`IDLE`) says there is nothing to do: no run is
    created and the iteration is journaled ``iteration_skipped_idle`` (so a loop that polls
    an empty inbox does not fill ``status`` with no-op runs). A loop function may return
    :data:`IDLE` for the same journal entry.

    ``mode``: ``fixed_rate`` (next = slot + every; a slot that comes due while the previous
    iteration still runs is skipped and counted) or ``fixed_delay`` (next = end + every; needs
    ``every=``). An ``every=`` loop's slots form a chain from the first one (``start_at``,
    else the moment the loop is first registered); a cron loop's first slot is its first
    cron time at or after ``start_at`` (given ``end_at`` too, one must come before it: a
    loop that would never fire is refused). After downtime, slots later than ``misfire_grace``
    are journaled as missed; the rest are coalesced into one iteration (``coalesce=True``)
    or fired one by one. Slots at or after ``end_at`` are not the loop's: the slots before
    it are handled so, then the loop stops. ``max_failures`` consecutive failed iterations
    pause the loop and raise an alert.

    ``tz`` (an IANA name such as ``"Europe/Berlin"``; default UTC) reads ``cron=`` on that
    zone's wall clock, a naive ``start_at``/``end_at`` as that zone's wall time, and gives
    ``Iteration.scheduled_for`` in that zone; slots stay UTC epoch seconds. Daylight-saving
    changes follow the policy in :mod:`flowloop.tz`: a fixed wall time that does not exist
    (spring forward) fires at the first time after the gap, one that happens twice (fall
    back) fires once; hourly and finer schedules follow real time.

    Every invalid argument raises :class:`~flowloop.errors.LoopDefinitionError` here, at
    definition time.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any] | None = None,
        *,
        every: float | timedelta | None = None,
        cron: str | None = None,
        tz: str | ZoneInfo | None = None,
        mode: Mode = "fixed_rate",
        workflow: Workflow | None = None,
        context: BaseModel | dict[str, Any] | Callable[[Iteration], Any] | None = None,
        timeout: float | timedelta | None = None,
        retry: Retry | None = None,
        jitter: float | timedelta = 0.0,
        misfire_grace: float | timedelta | None = DEFAULT_MISFIRE_GRACE_SECONDS,
        coalesce: bool = True,
        max_failures: int | None = None,
        start_at: datetime | float | None = None,
        end_at: datetime | float | None = None,
    ) -> None:
        def bad(message: str) -> LoopDefinitionError:
            return LoopDefinitionError(str(name), message)

        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise bad(NAME_RULE)
        if (every is None) == (cron is None):
            raise bad("give exactly one of every= (seconds or a timedelta) or cron=")
        interval = _duration(bad, "every", every)
        if interval is not None and interval <= 0:
            raise bad(f"every={every!r} must be a positive duration")
        if cron is not None and (not isinstance(cron, str) or not _cron_valid(cron)):
            raise bad(f"cron={cron!r} is not a valid cron expression (e.g. '*/5 * * * *')")
        if isinstance(tz, ZoneInfo):
            if tz.key is None:  # (made from a file: it would run on UTC, silently)
                raise bad("tz= is a ZoneInfo without an IANA name; pass the name itself")
            tz = tz.key  # kept by its IANA name (stored, shown)
        if tz is not None:
            if cron is None:
                raise bad("tz= applies to cron= schedules (every= runs in elapsed time)")
            try:
                zone(tz)
            except UnknownTimeZone as error:
                raise bad(str(error)) from None
        if mode not in MODES:
            raise bad(f"mode={mode!r} must be one of {', '.join(MODES)}")
        if mode == "fixed_delay" and interval is None:
            raise bad("mode='fixed_delay' needs every= (a cron schedule is fixed_rate)")
        if (fn is None) == (workflow is None):
            raise bad("give exactly one of a function or workflow=")
        if fn is not None:
            _check_function(bad, fn)
        if workflow is not None and context is None:
            raise bad("a workflow loop needs context= (a model, a dict or a function)")
        timeout_s = _duration(bad, "timeout", timeout)
        if timeout_s is not None and timeout_s <= 0:
            raise bad(f"timeout={timeout!r} must be a positive duration")
        if max_failures is not None and (
            isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 1
        ):
            raise bad(f"max_failures={max_failures!r} must be an integer of at least 1")
        grace = _duration(bad, "misfire_grace", misfire_grace, infinite=True)
        if grace is not None and grace < 0:
            raise bad(f"misfire_grace={misfire_grace!r} must not be negative")
        jitter_s = _duration(bad, "jitter", jitter) or 0.0
        if jitter_s < 0:
            raise bad(f"jitter={jitter!r} must not be negative")
        if retry is not None and not isinstance(retry, Retry):
            raise bad(f"retry={retry!r} must be a flowloop Retry")
        self.name = name
        self.fn = fn
        self.every = interval
        self.cron = cron
        self.tz = tz
        self.mode: Mode = mode
        self.workflow = workflow
        self.context = context
        self.timeout = timeout_s
        self.retry = retry or NO_RETRY
        self.jitter = jitter_s
        self.misfire_grace = None if grace == math.inf else grace
        self.coalesce = coalesce
        self.max_failures = max_failures
        self.start_at = _epoch(bad, "start_at", start_at, tz)
        self.end_at = _epoch(bad, "end_at", end_at, tz)
        if self.start_at is not None and self.end_at is not None:
            if self.end_at <= self.start_at:
                raise bad(_order_problem(start_at, end_at, tz, self.start_at))
            first = self._first_from(self.start_at)
            if first >= self.end_at:  # (a cron loop: every= fires at start_at itself)
                raise bad(
                    f"cron={cron!r} has no time from start_at {describe(self.start_at, tz)} "
                    f"until end_at {describe(self.end_at, tz)} (its first is "
                    f"{describe(first, tz)}), so the loop would never fire: move end_at past "
                    "that time, start_at earlier, or change cron="
                )
        self.is_async = fn is not None and inspect.iscoroutinefunction(fn)
        if workflow is not None:
            workflow.validate()
            if not callable(context) or isinstance(context, BaseModel):
                try:
                    workflow.parse_new_context(context)  # type: ignore[arg-type]
                except FlowloopError as error:
                    message = f"context= does not fit workflow {workflow.name!r}: {error}"
                    raise bad(message) from None

    def __repr__(self) -> str:
        return f"Loop({self.name!r}, {self.schedule})"

    @property
    def schedule(self) -> str:
        """The schedule in words, for listings: ``every 30s (fixed_rate)`` or ``cron */5 …``."""
        if self.cron is not None:
            return f"cron {self.cron}" + (f" ({self.tz})" if self.tz else "")
        return f"every {self.every:g}s ({self.mode})"

    def context_for(self, iteration: Iteration) -> Any:
        if callable(self.context) and not isinstance(self.context, BaseModel):
            return self.context(iteration)
        return self.context

    # -- the maths -------------------------------------------------------------------------

    def slot_after(self, moment: float, *, anchor: float | None = None) -> float:
        """The first slot strictly after ``moment``: the next cron time, or the next point of
        the interval chain that starts at ``anchor`` (a slot of this loop; default
        ``start_at``, else 0). A moment before the anchor gives the anchor itself."""
        if self.cron is not None:
            return _cron_next(self.cron, moment, self.tz)
        every = self._interval()
        base = anchor if anchor is not None else (self.start_at or 0.0)
        if moment < base:
            return base
        steps = math.floor((moment - base) / every) + 1
        slot = base + steps * every
        while slot <= moment:  # float rounding must never give back the same slot
            steps += 1
            slot = base + steps * every
        return slot

    def earliest_slot(self) -> float | None:
        """The first slot ``start_at`` allows (None without one): ``start_at`` itself for
        ``every=`` (the anchor of its chain), the first cron time at or after it for
        ``cron=``. Nothing fires before it, whatever a capped wait says."""
        return None if self.start_at is None else self._first_from(self.start_at)

    def _first_from(self, start: float) -> float:
        if self.cron is None:
            return start
        # A millisecond before it (slots are kept to the millisecond; the cron reader keeps
        # microseconds): a cron time exactly at start is the first.
        slot = self.slot_after(start - 1e-3)
        return slot if slot >= start else self.slot_after(slot)

    def nth_slot(self, slot: float, n: int) -> float:
        """The slot ``n`` places after ``slot`` in its chain (``n = 0``: ``slot``)."""
        if n <= 0:
            return slot
        if self.cron is None:
            return slot + n * self._interval()
        for _ in range(n):
            slot = _cron_next(self.cron, slot, self.tz)
        return slot

    def first_slot(self, now: float) -> float:
        """The slot a newly registered (or unpaused) loop fires first. With ``start_at``
        ahead: the first cron time at or after it, or ``start_at`` itself for ``every=`` (the
        anchor of its chain). Else the next cron time; else now — or, with a past
        ``start_at``, the next point of its grid (so the loop keeps the phase it was given)."""
        if self.start_at is not None and self.start_at >= now:
            return self._first_from(self.start_at)
        if self.cron is not None:
            return self.slot_after(now)
        if self.start_at is not None:
            return self.slot_after(math.nextafter(now, -math.inf), anchor=self.start_at)
        return now

    def latest_slot(self, now: float) -> float:
        """The schedule's last slot at or before ``now``: a cron time, a point of the grid
        from a past ``start_at``; ``now`` itself for an ``every=`` loop without one (its
        chain starts where it is registered) or with ``start_at`` still ahead."""
        if self.cron is not None:
            slot = _cron_prev(self.cron, now, self.tz)
            later = self.slot_after(slot)
            return later if later <= now else slot
        if self.start_at is None or self.start_at > now:
            return now
        return max(self.start_at, self.slot_after(now, anchor=self.start_at) - self._interval())

    def next_slot(self, slot: float, *, started: float, ended: float) -> tuple[float, int]:
        """The slot after an iteration of ``slot`` that started and ended at the given times,
        and how many slots were skipped because the iteration was still running."""
        if self.mode == "fixed_delay":
            return ended + self._interval(), 0
        nxt = self.slot_after(slot, anchor=slot)
        # Only slots that came due *while* the iteration ran are skipped (no overlap); slots
        # already due when it started are catch-up (coalesce=False), which decide() handles.
        if nxt <= started or nxt > ended:
            return nxt, 0
        if self.cron is None:
            last = self.slot_after(ended, anchor=slot)
            return last, round((last - nxt) / self._interval())
        skipped = 0
        while nxt <= ended and skipped < MAX_COUNTED_SLOTS:
            skipped += 1
            nxt = self.slot_after(nxt)
        if nxt <= ended:  # a pathological gap: stop counting, keep the loop alive
            nxt = self.slot_after(ended)
        return nxt, skipped

    def missed_slots(self, slot: float, now: float) -> int:
        """How many slots of the chain from ``slot`` (counting it) are due at ``now``."""
        if now < slot:
            return 0
        if self.cron is None:
            return round((self.slot_after(now, anchor=slot) - slot) / self._interval())
        count, current = 0, slot
        while current <= now and count < MAX_COUNTED_SLOTS:
            count += 1
            current = _cron_next(self.cron, current, self.tz)
        return count

    def finished(self, slot: float) -> bool:
        """Whether ``slot`` is at or after ``end_at`` (not a slot of the loop: it ended)."""
        return self.end_at is not None and slot >= self.end_at

    def over(self, pending: float) -> bool:
        """Whether no slot is left from the ``pending`` one: it — or, if later, the first
        slot ``start_at`` allows — is at or after ``end_at``."""
        if self.end_at is None:
            return False
        earliest = self.earliest_slot()
        return self.finished(pending if earliest is None else max(pending, earliest))

    def horizon(self, now: float) -> float:
        """The latest moment whose slots are the loop's, as of ``now``: ``now``, or just
        before ``end_at`` when that is earlier."""
        if self.end_at is None or now < self.end_at:
            return now
        return math.nextafter(self.end_at, -math.inf)

    def jittered(self, slot: float, rand: random.Random | None = None) -> float:
        if not self.jitter:
            return slot
        return slot + (rand or random).uniform(0.0, self.jitter)

    def wait_cap(self, slot: float) -> float:
        """The longest in-process wait for ``slot``: one period of the schedule (plus jitter).
        A wall clock set back while the worker runs cannot stall the loop longer than this
        (the scheduler keeps ``start_at``, a promise in wall time, regardless)."""
        period = (
            self._interval() if self.cron is None else slot - _cron_prev(self.cron, slot, self.tz)
        )
        return period + self.jitter

    def _interval(self) -> float:
        assert self.every is not None, "an interval loop"
        return self.every


@dataclass(frozen=True)
class Wake:
    """What to do when a loop's slot comes due (pure decision)."""

    fire: bool
    slot: float
    """The slot to fire (or, when not firing, the last slot given up)."""
    missed: int
    """Slots given up because they are later than the misfire grace."""
    reason: str
    """``on_time``, ``coalesced``, ``catch_up`` (one of several due slots, fired one by one),
    ``missed``, or ``ended`` (the slot is at or after ``end_at``: the loop ends, nothing is
    given up)."""
    coalesced: int = 0
    """Due slots within the grace folded into the one fired (``coalesce=True``)."""


def decide(loop: Loop, slot: float, now: float) -> Wake:
    """Decide what a due slot becomes, given the time now (after downtime: maybe late).

    Due slots later than the misfire grace are given up (``missed``); of the rest, the
    latest fires with the others coalesced into it, or (``coalesce=False``) the earliest
    fires and the others follow one by one. Only slots before ``end_at`` count: after
    downtime past it, the slots before it are decided so, and the loop ends once they are
    done (a ``slot`` at or after it is ``ended``)."""
    if loop.finished(slot):
        return Wake(False, slot, 0, "ended")
    horizon = loop.horizon(now)
    due = loop.missed_slots(slot, horizon)
    if due <= 1:
        if loop.misfire_grace is not None and now - slot > loop.misfire_grace:
            return Wake(False, slot, 1, "missed")
        return Wake(True, slot, 0, "on_time")
    latest = loop.nth_slot(slot, due - 1)
    past = 0
    if loop.misfire_grace is not None:
        # Slots strictly more than the grace late.
        late = math.nextafter(now - loop.misfire_grace, -math.inf)
        past = loop.missed_slots(slot, min(late, horizon))
    if past >= due:
        return Wake(False, latest, due, "missed")
    if loop.coalesce:
        coalesced = due - past - 1
        return Wake(True, latest, past, "coalesced" if coalesced else "on_time", coalesced)
    return Wake(True, loop.nth_slot(slot, past), past, "catch_up")


def loop(
    *,
    every: float | timedelta | None = None,
    cron: str | None = None,
    name: str | None = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], Loop]:
    """Decorator: turn a function ``(Iteration) -> Any`` into a :class:`Loop`."""

    def make(fn: Callable[..., Any]) -> Loop:
        return Loop(name or fn.__name__, fn, every=every, cron=cron, **options)

    return make


def _epoch(
    bad: Callable[[str], LoopDefinitionError],
    label: str,
    value: datetime | float | None,
    tz: str | None,
) -> float | None:
    """UTC epoch seconds of ``value``: a naive datetime is wall time in ``tz`` (the loop's
    zone, under the DST policy of :mod:`flowloop.tz`; UTC when None)."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return wall_epoch(value, tz)
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"{label}={value!r} must be a datetime or UTC epoch seconds")
    return float(value)


def _order_problem(
    start: datetime | float | None, end: datetime | float | None, tz: str | None, moment: float
) -> str:
    """Why ``end_at`` is not after ``start_at`` (``moment``: start_at's epoch), in words. Naive
    times typed in order can still meet in a spring-forward gap, both moved to its end:
    that is said (02:30 and 02:45 on Berlin's spring-forward night are both 03:00)."""
    plain = "end_at must be after start_at"
    if not isinstance(start, datetime) or not isinstance(end, datetime):
        return plain
    if start.tzinfo is not None or end.tzinfo is not None or start >= end:
        return plain  # (not in order as typed, or not both wall times)
    inside = [label for label, wall in (("start_at", start), ("end_at", end)) if in_gap(wall, tz)]
    became = local(moment, tz).strftime("%H:%M")
    day = f"the daylight-saving gap of {tz} on {start:%Y-%m-%d}"
    if inside == ["start_at", "end_at"]:
        what = f"start_at {_clock(start)} and end_at {_clock(end)} fall in {day} (both "
        what += f"become {became})"
    elif inside == ["start_at"]:  # (end_at is the gap's end itself)
        what = f"start_at {_clock(start)} falls in {day} (it becomes {became}, as end_at is)"
    else:
        return plain  # (e.g. a fall-back hour read with fold=)
    return f"{what}: {plain}; give an end_at after {became}"


def _clock(wall: datetime) -> str:
    """``02:30`` (``02:30:15`` with seconds) of a naive wall time."""
    return wall.strftime("%H:%M:%S" if wall.second or wall.microsecond else "%H:%M")


def _duration(
    bad: Callable[[str], LoopDefinitionError],
    label: str,
    value: float | timedelta | None,
    *,
    infinite: bool = False,
) -> float | None:
    """Seconds from a number or a timedelta; anything else (text, NaN, ±inf) is an error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise bad(f"{label}={value!r} must be seconds (a number) or a timedelta")
    # Not retry.seconds: it refuses infinity, which some loop options allow.
    result = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if math.isnan(result) or (math.isinf(result) and not (infinite and result > 0)):
        raise bad(f"{label}={value!r} must be a finite duration")
    return result


def _check_function(bad: Callable[[str], LoopDefinitionError], fn: Callable[..., Any]) -> None:
    if not callable(fn):
        raise bad(f"{fn!r} is not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: trust it
    try:
        signature.bind(None)
    except TypeError:
        raise bad(
            f"function {getattr(fn, '__name__', fn)!r} must take one argument (the Iteration)"
        ) from None


CRON_ALIASES: Final = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
"""The usual cron shorthands (cronsim parses five fields only)."""


def _cron_fields(expression: str) -> str:
    expanded = CRON_ALIASES.get(expression.strip().lower(), expression)
    if len(expanded.split()) != 5:
        # Six fields mean seconds to some parsers and years to others: refuse the doubt
        # (sub-minute schedules are every=).
        raise ValueError("a cron expression has five fields (minute hour day month weekday)")
    return expanded


def _cron_valid(expression: str) -> bool:
    try:
        CronSim(_cron_fields(expression), datetime.fromtimestamp(0, UTC))
    except (ValueError, CronSimError):
        return False
    return True


def _cron_next(expression: str, moment: float, tz: str | None = None) -> float:
    """The first time strictly after ``moment`` the expression matches, read on the wall
    clock of ``tz`` (None: UTC) under the DST policy of :mod:`flowloop.tz`."""
    start = datetime.fromtimestamp(moment, UTC if tz is None else zone(tz))
    times = CronSim(_cron_fields(expression), start)
    for _ in range(4):
        # A wall-time schedule is read on the naive local clock: from inside the second
        # pass of a fall-back hour, the next match can be its first pass, already behind
        # us. The next one after it is the next real slot (no slot ever fires twice).
        slot = next(times).timestamp()
        if slot > moment:
            return slot
    raise AssertionError(f"cron {expression!r} does not move past {moment}")  # pragma: no cover


def _cron_prev(expression: str, moment: float, tz: str | None = None) -> float:
    start = datetime.fromtimestamp(moment, UTC if tz is None else zone(tz))
    return next(CronSim(_cron_fields(expression), start, reverse=True)).timestamp()
