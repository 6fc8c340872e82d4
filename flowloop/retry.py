"""Retry policy: pure maths of when to try again and whether to.

No I/O, no clock: the caller passes the attempt number and a random source.
"""

from __future__ import annotations

import math
import random
import types
import typing
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from flowloop.errors import FlowloopError

Backoff = Literal["fixed", "linear", "exponential"]
BACKOFFS: tuple[Backoff, ...] = ("fixed", "linear", "exponential")

DEFAULT_ATTEMPTS = 3
DEFAULT_BASE_SECONDS = 1.0
DEFAULT_CAP_SECONDS = 300.0


def human(value: float) -> str:
    """A duration for people: ``0.5s``, ``90s``, ``15m``, ``2h``, ``3d``."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if value >= size and value % size == 0:
            return f"{value / size:g}{unit}"
    return f"{value:g}s"


MAX_DURATION_SECONDS = 10 * 365 * 86400.0
"""The longest duration flowloop takes (ten years): anything longer is a typo, and event
loops and databases overflow on infinite or astronomically long waits."""


def seconds(value: float | timedelta | None, what: str = "duration") -> float | None:
    """A duration given as seconds or a timedelta, as seconds; FlowloopError naming
    ``what`` when it is not a finite number of at most ten years (NaN, infinity, 1e400)."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        result = value.total_seconds()
    else:
        try:
            result = float(value)
        except (TypeError, ValueError, OverflowError):
            raise FlowloopError(f"{what} {value!r} is not a number of seconds") from None
    if not math.isfinite(result) or abs(result) > MAX_DURATION_SECONDS:
        raise FlowloopError(
            f"{what} {value!r} is not a finite duration of at most 10 years (in seconds)"
        )
    return result


def _exception_classes(value: object) -> tuple[type[BaseException], ...] | None:
    """``value`` — an exception class, a union of them, a tuple or list of those (nested) —
    as a flat tuple of classes; ``None`` when anything in it is not an exception class."""
    if isinstance(value, type):
        return (value,) if issubclass(value, BaseException) else None
    if isinstance(value, types.UnionType):
        value = typing.get_args(value)
    if not isinstance(value, tuple | list):
        return None
    flat: list[type[BaseException]] = []
    for item in value:
        classes = _exception_classes(item)
        if classes is None:
            return None
        flat.extend(classes)
    return tuple(flat)


@dataclass(frozen=True, kw_only=True)
class Retry:
    """How often a step is tried and how long to wait between tries.

    ``attempts`` counts every try including the first (``attempts=1``: never retried).
    A crash in the middle of a step counts as an attempt too, so a step that kills its
    process every time ends ``failed`` instead of looping forever.

    The delay before attempt ``n + 1`` (after attempt ``n`` failed) is ``base`` (fixed),
    ``base * n`` (linear) or ``base * 2 ** (n - 1)`` (exponential), capped at ``cap``, then
    spread by ``± jitter`` (a fraction, 0.1 = 10 %). ``cap`` not given: 5 minutes, or
    ``base`` when that is longer; given, not below ``base`` (``cap=0`` retries at once).

    An exception is retried when it is an instance of one of ``on`` and of none of
    ``giving_up_on``.
    """

    attempts: int = DEFAULT_ATTEMPTS
    backoff: Backoff = "exponential"
    base: float | timedelta = DEFAULT_BASE_SECONDS
    cap: float | timedelta | None = None
    jitter: float = 0.0
    on: tuple[type[BaseException], ...] = field(default=(Exception,))
    giving_up_on: tuple[type[BaseException], ...] = field(default=())

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise FlowloopError(f"Retry(attempts={self.attempts!r}): attempts must be an integer")
        if self.attempts < 1:
            raise FlowloopError(f"Retry(attempts={self.attempts}): attempts must be at least 1")
        if self.backoff not in BACKOFFS:
            raise FlowloopError(
                f"Retry(backoff={self.backoff!r}): backoff must be one of {', '.join(BACKOFFS)}"
            )
        seconds(self.base, "Retry(base=...):")
        seconds(self.cap, "Retry(cap=...):")
        if self.base_seconds < 0 or self.cap_seconds < 0:
            raise FlowloopError("Retry: base and cap must not be negative")
        if self.cap is not None and 0 < self.cap_seconds < self.base_seconds:
            # (cut silently, a 10-minute base waited 5: a typo or a forgotten cap)
            raise FlowloopError(
                f"Retry(base={human(self.base_seconds)}, cap={human(self.cap_seconds)}): cap is "
                f"below base, so every delay would be {human(self.cap_seconds)}; raise cap "
                "with base (cap=0 retries at once)"
            )
        if not isinstance(self.jitter, int | float) or not 0.0 <= self.jitter <= 1.0:
            raise FlowloopError(f"Retry(jitter={self.jitter!r}): jitter is a fraction in [0, 1]")
        for name in ("on", "giving_up_on"):
            # What isinstance takes (a class, a union, tuples of them, nested) is taken, as
            # a flat tuple; a name or an instance failed only when a step raised, and took
            # the worker down.
            value = getattr(self, name)
            classes = _exception_classes(value)
            if classes is None:
                raise FlowloopError(
                    f"Retry({name}={value!r}): {name} takes exception classes, "
                    f"e.g. {name}=(TimeoutError, ConnectionError)"
                )
            object.__setattr__(self, name, classes)

    @property
    def base_seconds(self) -> float:
        return seconds(self.base) or 0.0

    @property
    def cap_seconds(self) -> float:
        if self.cap is None:
            return max(DEFAULT_CAP_SECONDS, self.base_seconds)
        return seconds(self.cap) or 0.0

    def is_retryable(self, error: BaseException) -> bool:
        """Whether this kind of error may be retried at all (ignores the attempt budget)."""
        if isinstance(error, self.giving_up_on):
            return False
        return isinstance(error, self.on)

    def should_retry(self, error: BaseException, attempt: int) -> bool:
        """Whether attempt ``attempt`` (1-based) failing with ``error`` earns another try."""
        return attempt < self.attempts and self.is_retryable(error)

    def has_attempts_left(self, attempt: int) -> bool:
        return attempt < self.attempts

    def delay(self, attempt: int, rand: random.Random | None = None) -> float:
        """Seconds to wait after attempt ``attempt`` (1-based) failed."""
        base = self.base_seconds
        n = max(1, attempt)
        if self.backoff == "fixed":
            raw = base
        elif self.backoff == "linear":
            raw = base * n
        else:
            raw = base * 2.0 ** min(n - 1, 62)
        capped = min(raw, self.cap_seconds)
        if self.jitter and capped > 0:
            spread = capped * self.jitter
            capped += (rand or random).uniform(-spread, spread)
        return max(0.0, capped)

    def describe(self) -> str:
        """A compact summary for diagrams and listings, counting every try:
        ``5 attempts, exponential 0.5s..30s``, ``4 attempts, 2s apart``, ``no retry``."""
        if self.attempts == 1:
            return "no retry"
        if self.backoff == "fixed":
            delay = human(min(self.base_seconds, self.cap_seconds))
            text = f"{self.attempts} attempts, {delay} apart"
        else:
            text = (
                f"{self.attempts} attempts, {self.backoff} "
                f"{human(self.base_seconds)}..{human(self.cap_seconds)}"
            )
        if self.jitter:
            text += f" ±{self.jitter:.0%}"
        return text


DEFAULT_RETRY = Retry()
NO_RETRY = Retry(attempts=1)
