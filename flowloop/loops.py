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
from typing import Any, Literal

from croniter import croniter
from pydantic import BaseModel

from flowloop.definition import NAME_PATTERN, Workflow
from flowloop.errors import DefinitionError
from flowloop.retry import NO_RETRY, Retry, seconds

Mode = Literal["fixed_rate", "fixed_delay"]
MODES: tuple[Mode, ...] = ("fixed_rate", "fixed_delay")
DEFAULT_MISFIRE_GRACE_SECONDS = 3600.0


@dataclass(frozen=True, kw_only=True)
class Iteration:
    """What a loop function learns about the iteration it runs."""

    loop: str
    slot: float
    """The scheduled time of this iteration (UTC epoch seconds)."""
    number: int
    attempt: int

    @property
    def scheduled_for(self) -> datetime:
        return datetime.fromtimestamp(self.slot, UTC)

    @property
    def idempotency_key(self) -> str:
        """Stable for one slot of one loop, across attempts, crashes and workers."""
        return f"loop:{self.loop}:{self.slot:.3f}"


class Loop:
    """A recurring job: ``every=`` seconds (or a timedelta) or ``cron=``.

    ``fn`` is a function ``(Iteration) -> Any`` (sync or async) — or give ``workflow=`` and
    ``context=`` (a model, a dict, or a function of the Iteration returning one) to start one
    run of that workflow per iteration; the iteration ends when the run does.

    ``mode``: ``fixed_rate`` (next = slot + every; a slot that comes due while the previous
    iteration still runs is skipped and counted) or ``fixed_delay`` (next = end + every).
    After downtime, slots later than ``misfire_grace`` are journaled as missed; the rest are
    coalesced into one iteration (``coalesce=True``) or fired one by one. ``max_failures``
    consecutive failed iterations pause the loop and raise an alert.
    """

    def __init__(
        self,
        name: str,
        fn: Callable[..., Any] | None = None,
        *,
        every: float | timedelta | None = None,
        cron: str | None = None,
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
        def bad(message: str) -> DefinitionError:
            return DefinitionError(name, f"loop: {message}")

        if not NAME_PATTERN.match(name):
            raise bad("name must be letters, digits, '_', '.' or '-'")
        if (every is None) == (cron is None):
            raise bad("give exactly one of every= or cron=")
        interval = seconds(every)
        if interval is not None and interval <= 0:
            raise bad(f"every={every!r} must be a positive duration")
        if cron is not None and not croniter.is_valid(cron):
            raise bad(f"cron={cron!r} is not a valid cron expression")
        if mode not in MODES:
            raise bad(f"mode={mode!r} must be one of {', '.join(MODES)}")
        if (fn is None) == (workflow is None):
            raise bad("give exactly one of a function or workflow=")
        if workflow is not None and context is None:
            raise bad("a workflow loop needs context= (a model, a dict or a function)")
        timeout_s = seconds(timeout)
        if timeout_s is not None and timeout_s <= 0:
            raise bad("timeout must be positive")
        if max_failures is not None and max_failures < 1:
            raise bad("max_failures must be at least 1")
        grace = seconds(misfire_grace)
        if grace is not None and grace < 0:
            raise bad("misfire_grace must not be negative")
        jitter_s = seconds(jitter) or 0.0
        if jitter_s < 0:
            raise bad("jitter must not be negative")
        self.name = name
        self.fn = fn
        self.every = interval
        self.cron = cron
        self.mode: Mode = mode
        self.workflow = workflow
        self.context = context
        self.timeout = timeout_s
        self.retry = retry or NO_RETRY
        self.jitter = jitter_s
        self.misfire_grace = grace
        self.coalesce = coalesce
        self.max_failures = max_failures
        self.start_at = _epoch(start_at)
        self.end_at = _epoch(end_at)
        if self.start_at is not None and self.end_at is not None and self.end_at <= self.start_at:
            raise bad("end_at must be after start_at")
        self.is_async = fn is not None and inspect.iscoroutinefunction(fn)
        if workflow is not None:
            workflow.validate()

    def __repr__(self) -> str:
        return f"Loop({self.name!r}, {self.schedule})"

    @property
    def schedule(self) -> str:
        """The schedule in words, for listings: ``every 30s (fixed_rate)`` or ``cron */5 …``."""
        if self.cron is not None:
            return f"cron {self.cron}"
        return f"every {self.every:g}s ({self.mode})"

    def context_for(self, iteration: Iteration) -> Any:
        if callable(self.context) and not isinstance(self.context, BaseModel):
            return self.context(iteration)
        return self.context

    # -- the maths -------------------------------------------------------------------------

    def slot_after(self, moment: float) -> float:
        """The first slot strictly after ``moment``."""
        if self.cron is not None:
            base = datetime.fromtimestamp(moment, UTC)
            return float(croniter(self.cron, base).get_next(float))
        assert self.every is not None
        anchor = self.start_at if self.start_at is not None else 0.0
        if moment < anchor:
            return anchor
        steps = math.floor((moment - anchor) / self.every) + 1
        return anchor + steps * self.every

    def first_slot(self, now: float) -> float:
        """The slot a newly registered loop fires first."""
        if self.start_at is not None and self.start_at >= now:
            return self.start_at
        if self.cron is not None:
            return self.slot_after(now)
        return now

    def next_slot(self, slot: float, *, started: float, ended: float) -> tuple[float, int]:
        """The slot after an iteration of ``slot`` that started and ended at the given wall
        times, and how many slots were skipped because the iteration was still running."""
        if self.mode == "fixed_delay" and self.every is not None:
            return ended + self.every, 0
        nxt = self.slot_after(slot)
        skipped = 0
        # Only slots that came due *while* the iteration ran are skipped (no overlap);
        # slots already due when it started are catch-up, which decide() handles.
        while started < nxt <= ended:
            skipped += 1
            nxt = self.slot_after(nxt)
            if skipped > 1_000_000:  # a pathological gap: stop counting, keep the loop alive
                nxt = self.slot_after(ended)
                break
        return nxt, skipped

    def missed_slots(self, slot: float, now: float) -> int:
        """How many slots, counting ``slot``, came due up to ``now``."""
        if now < slot:
            return 0
        if self.every is not None and self.mode == "fixed_rate":
            return int((now - slot) // self.every) + 1
        count, current = 0, slot
        while current <= now and count < 100_000:
            count += 1
            current = self.slot_after(current)
        return count

    def finished(self, slot: float) -> bool:
        return self.end_at is not None and slot >= self.end_at

    def jittered(self, slot: float, rand: random.Random | None = None) -> float:
        if not self.jitter:
            return slot
        return slot + (rand or random).uniform(0.0, self.jitter)

    def wait_cap(self) -> float | None:
        """The longest in-process wait before a slot: one interval. A wall clock that jumps
        back cannot stall an interval loop longer than this."""
        return self.every


@dataclass(frozen=True)
class Wake:
    """What to do when a loop's slot comes due (pure decision)."""

    fire: bool
    slot: float
    missed: int
    """Slots that will not run (past the grace, or coalesced into this one)."""
    reason: str
    """``on_time``, ``coalesced`` or ``missed``."""


def decide(loop: Loop, slot: float, now: float) -> Wake:
    """Decide what a due slot becomes, given the time now (after downtime: maybe late)."""
    due = loop.missed_slots(slot, now)
    if due <= 1:
        late = now - slot
        if loop.misfire_grace is not None and late > loop.misfire_grace:
            return Wake(False, slot, 1, "missed")
        return Wake(True, slot, 0, "on_time")
    latest = slot
    for _ in range(due - 1):
        latest = loop.slot_after(latest)
    if loop.misfire_grace is not None and now - latest > loop.misfire_grace:
        return Wake(False, latest, due, "missed")
    if loop.coalesce:
        return Wake(True, latest, due - 1, "coalesced")
    return Wake(True, slot, 0, "on_time")


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


def _epoch(value: datetime | float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.timestamp()
    return float(value)
