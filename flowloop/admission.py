"""Admission of new runs: debounce and throttle of starts (pure policy, no I/O).

* **Debounce** (``engine.start(wf, ctx, key=K, debounce=30)``): a burst of starts with one
  key becomes one run with the last context. The first start creates the run due
  ``window`` from now; each later start within the window (while that run has not begun
  its first step) replaces its context and pushes its due time to ``window`` after this
  start — journaled ``run_debounced`` with the new context, so replay still equals the
  row. Paused by an operator before its first step, the run takes the start and stays
  paused (unpaused, it is due when the last start's window ends); a run whose first state
  is a wait takes it while it has taken no event (its timeout counts from the window's
  end). Once the run has begun (:data:`BEGAN`), or was claimed, stopped or failed first,
  the next start with the key opens a new burst (a new run).
  A debounced run keeps no business key (bursts recur); its key is in its journal.
* **Throttle** (``throttle=(n, period)``): at most ``n`` runs started with one key per
  ``period`` (a sliding window of run creation times, counted in the database, so it holds
  across processes). Over it, the start is **refused**: :class:`StartThrottled` says when
  the next one is allowed; nothing is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

from flowloop import journal as j
from flowloop.errors import EXIT_FAILURE, FlowloopError
from flowloop.retry import MAX_DURATION_SECONDS

DEBOUNCE_PREFIX: Final = "debounce:"
THROTTLE_PREFIX: Final = "throttle:"
BEGAN: Final = (
    j.STEP_STARTED,
    j.CHILDREN_STARTED,
    j.COMPENSATION_STARTED,
    j.EVENT_RECEIVED,
    j.DEADLINE_PASSED,
)
"""Entries by which a debounced run has begun: its first step (call, map, compensating
state) started, or its first state, a wait, took an event or its timeout, or its deadline
moved it on. From then on it collects no more starts."""
COLLECTS: Final = ("scheduled", "paused")


class AdmissionError(FlowloopError):
    """A debounce or throttle argument is wrong; the message names it."""


class StartThrottled(FlowloopError):
    """A start over its throttle: wait until ``retry_at`` (UTC epoch seconds), that is
    ``retry_in`` seconds from the refusal."""

    exit_code = EXIT_FAILURE

    def __init__(
        self, workflow: str, key: str, limit: int, period: float, *, retry_at: float, now: float
    ):
        self.workflow = workflow
        self.key = key
        self.retry_at = retry_at
        self.retry_in = max(0.0, retry_at - now)
        super().__init__(
            f"start of {workflow!r} with key {key!r} refused: throttle of {limit} per "
            f"{duration_text(period)} reached; try again in {duration_text(self.retry_in)} "
            "or later"
        )


def duration_text(seconds: float) -> str:
    """``40s``, ``0.5s``, ``1m 30s``, ``1h``, ``1d 3h 46m 40s``: not ``3.6e+03s``."""
    if seconds < 60:
        return f"{seconds:.3g}s"
    rest, parts = round(seconds), []
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)):
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return " ".join(parts)


@dataclass(frozen=True)
class Throttle:
    limit: int
    period: float


def seconds_of(value: float | timedelta, label: str) -> float:
    """A positive, finite duration in seconds, or an :class:`AdmissionError`."""
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        result = float(value)
    else:
        raise AdmissionError(f"{label}={value!r} must be seconds or a timedelta")
    if not math.isfinite(result) or not 0 < result <= MAX_DURATION_SECONDS:
        raise AdmissionError(f"{label}={value!r} must be a positive duration of at most 10 years")
    return result


def throttle_of(value: tuple[int, float | timedelta]) -> Throttle:
    """``(n, period)`` checked: ``n`` a positive integer, ``period`` a positive duration."""
    if not isinstance(value, tuple) or len(value) != 2:
        raise AdmissionError(f"throttle={value!r} must be (n, period), e.g. (10, 60)")
    limit, period = value
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise AdmissionError(f"throttle={value!r}: n must be a positive integer")
    return Throttle(limit, seconds_of(period, "throttle period"))


def admission_key(key: object) -> str:
    """The key a debounce or throttle groups by: a non-empty string."""
    if not isinstance(key, str) or not key:
        raise AdmissionError(
            f"debounce= and throttle= group starts by key: give key= (a non-empty string) "
            f"or a workflow key field, not {key!r}"
        )
    return key


def debounce_marker(workflow: str, key: str) -> str:
    """The idempotency key of the run that collects a burst (unique while it collects)."""
    return f"{DEBOUNCE_PREFIX}{workflow}:{key}"


def collecting(status: str, owner: str | None, began: bool) -> bool:
    """Whether the run holding a burst's marker takes a later start of the burst (its
    context and due time): it has not begun (``began``: an entry of :data:`BEGAN`), no
    worker holds it, and it is scheduled (waiting in its first state, too) or paused by an
    operator (it stays paused). Stopped, failed or claimed before it began, the next start
    opens a new burst."""
    return status in COLLECTS and owner is None and not began


def throttle_prefix(workflow: str, key: str) -> str:
    """Every run started under a throttle has an idempotency key with this prefix."""
    return f"{THROTTLE_PREFIX}{workflow}:{key}:"


def throttle_verdict(
    created: list[float], throttle: Throttle, now: float
) -> tuple[bool, float | None]:
    """Whether a start is admitted given the creation times of the key's runs within the
    period, and if not, the first moment one would be (the oldest leaves the window)."""
    recent = sorted(at for at in created if at > now - throttle.period)
    if len(recent) < throttle.limit:
        return True, None
    return False, recent[len(recent) - throttle.limit] + throttle.period
