"""Flow control shared by every worker: rate limits and circuit breakers (the definitions
and their pure maths), and the checks of a workflow's concurrency settings.

The state of a limit lives in the database (``flowloop/store/limits.py``) and is changed
there in one transaction by the database's clock; the functions here decide, given that
state and the time, what the new state is. They import neither sqlalchemy nor asyncio.

* :class:`RateLimit` — ``RateLimit("payments", 10, per=timedelta(seconds=1))``: the calls
  that take it are spread evenly, one every ``per / limit`` seconds (no burst), so no window
  of length ``per`` ever holds more than ``limit`` of them by the database's clock. A call
  that finds no token free is rescheduled (durably, no worker held) to a slot in the
  limit's queue: the queue keeps the order in which callers arrived.
* :class:`Breaker` — ``Breaker("payments", failures=5, within=timedelta(seconds=60),
  cool_down=timedelta(seconds=30))``: after ``failures`` failed calls within ``within``
  (by any worker) it opens; while open, steps behind it are not called (their runs are
  rescheduled to the end of the cool-down, or fail at once with ``when_open="fail"``);
  after the cool-down one call is let through as a trial: success closes the breaker,
  failure opens it for another cool-down.

The trial is one call, named by its run and the seq of its ``step_started``
(:func:`call_id`), stored with the half-open state: only that call's outcome closes or
reopens the breaker — the outcome of a call let through before the breaker opened, ending
while it is open or half open, changes nothing. While the trial still runs (its run holds
its lease and has journaled nothing after the trial's start) no other call goes through,
however long it takes; once that no longer holds (its worker died and the lease ended,
its call was cut off), the next call after the cool-down is the trial instead.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final, Literal, Protocol

from flowloop.errors import DefinitionError, FlowloopError
from flowloop.retry import human, seconds

LIMIT_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:-]{0,199}$")
RATE_REASON: Final = "rate_limit"
BREAKER_REASON: Final = "breaker_open"
WhenOpen = Literal["reschedule", "fail"]
HALF_OPEN_RECHECK: Final = 1.0
"""Seconds after which a call refused while a breaker's trial runs is tried again."""


class InvalidLimit(FlowloopError):
    """A rate limit, breaker or concurrency setting cannot work; fix the argument named."""


class InvalidConcurrencyKey(FlowloopError):
    """A workflow's ``concurrency_key`` function raised or returned something other than a
    non-empty string for this context: the run was refused and nothing was written."""


def _name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not LIMIT_NAME.match(name):
        raise InvalidLimit(
            f"{kind} name {name!r} must start with an ASCII letter or '_' and hold only "
            "ASCII letters, digits, '_', '.', ':' or '-' (at most 200 characters)"
        )
    return name


def _positive(kind: str, name: str, what: str, value: float | timedelta | None) -> float:
    number = seconds(value) if isinstance(value, timedelta) else value
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0:
        raise InvalidLimit(f"{kind} {name!r}: {what} must be positive, got {value!r}")
    return float(number)


@dataclass(frozen=True)
class RateLimit:
    """At most ``limit`` calls per ``per`` (seconds or a timedelta) across all workers."""

    name: str
    limit: int
    per: float | timedelta = 1.0
    interval: float = field(init=False, compare=False)
    """Seconds between two calls: ``per / limit``."""

    def __post_init__(self) -> None:
        _name("rate limit", self.name)
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise InvalidLimit(
                f"rate limit {self.name!r}: limit must be a whole number of at least 1, "
                f"got {self.limit!r}"
            )
        per = _positive("rate limit", self.name, "per", self.per)
        object.__setattr__(self, "per", per)
        object.__setattr__(self, "interval", per / self.limit)

    def describe(self) -> str:
        per = float(self.per)  # type: ignore[arg-type]
        return f"rate {self.name} {self.limit}/{human(per)}"


@dataclass(frozen=True)
class Breaker:
    """A circuit breaker shared through the database by every worker."""

    name: str
    failures: int = 5
    within: float | timedelta = 60.0
    cool_down: float | timedelta = 30.0
    when_open: WhenOpen = "reschedule"
    """``"reschedule"``: a run whose step is behind the open breaker is due again at the end
    of the cool-down (durably, no worker held); ``"fail"``: the run fails at once."""

    def __post_init__(self) -> None:
        _name("breaker", self.name)
        if (
            isinstance(self.failures, bool)
            or not isinstance(self.failures, int)
            or self.failures < 1
        ):
            raise InvalidLimit(
                f"breaker {self.name!r}: failures must be a whole number of at least 1, "
                f"got {self.failures!r}"
            )
        object.__setattr__(self, "within", _positive("breaker", self.name, "within", self.within))
        object.__setattr__(
            self, "cool_down", _positive("breaker", self.name, "cool_down", self.cool_down)
        )
        if self.when_open not in ("reschedule", "fail"):
            raise InvalidLimit(
                f"breaker {self.name!r}: when_open must be 'reschedule' or 'fail', "
                f"got {self.when_open!r}"
            )

    @property
    def within_s(self) -> float:
        return float(self.within)  # type: ignore[arg-type]

    @property
    def cool_down_s(self) -> float:
        return float(self.cool_down)  # type: ignore[arg-type]

    def describe(self) -> str:
        return f"breaker {self.name}"


# -- workflow settings, checked when the workflow is declared ---------------------------


def check_workflow_limits(
    workflow: str,
    *,
    max_concurrency: object,
    concurrency_key: object,
    key_limit: object,
    rate_limit: object,
) -> None:
    """DefinitionError for a setting that cannot work (named in the message)."""
    for what, value in (("max_concurrency", max_concurrency), ("key_limit", key_limit)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DefinitionError(
                workflow, f"{what} must be a whole number of at least 1, got {value!r}"
            )
    if concurrency_key is not None and not callable(concurrency_key):
        raise DefinitionError(
            workflow, "concurrency_key must be a function of the context returning a string"
        )
    if key_limit is not None and concurrency_key is None:
        raise DefinitionError(workflow, "key_limit needs concurrency_key= (what a key is)")
    if rate_limit is not None and not isinstance(rate_limit, RateLimit):
        raise DefinitionError(workflow, f"rate_limit must be a RateLimit, not {rate_limit!r}")


def check_step_limits(workflow: str, state: str, rate_limit: object, breaker: object) -> None:
    if rate_limit is not None and not isinstance(rate_limit, RateLimit):
        raise DefinitionError(
            workflow, f"step {state!r}: rate_limit must be a RateLimit, not {rate_limit!r}"
        )
    if breaker is not None and not isinstance(breaker, Breaker):
        raise DefinitionError(
            workflow, f"step {state!r}: breaker must be a Breaker, not {breaker!r}"
        )


def concurrency_key_of(workflow: str, function: Callable[[Any], object], context: Any) -> str:
    """The key a run of ``workflow`` with ``context`` holds; InvalidConcurrencyKey when the
    function raises or returns anything but a non-empty string (up to 400 characters)."""
    try:
        value = function(context)
    except Exception as error:
        raise InvalidConcurrencyKey(
            f"workflow {workflow!r}: concurrency_key raised {type(error).__name__}: {error}; "
            "the run was not started"
        ) from error
    if not isinstance(value, str) or not value or len(value) > 400:
        raise InvalidConcurrencyKey(
            f"workflow {workflow!r}: concurrency_key must return a non-empty string of at "
            f"most 400 characters, got {type(value).__name__} {value!r}; "
            "the run was not started"
        )
    return value


class Keyed(Protocol):
    """What :func:`limit_key_of` reads of a workflow (a :class:`~flowloop.Workflow`)."""

    @property
    def name(self) -> str: ...

    @property
    def concurrency_key(self) -> Callable[[Any], str] | None: ...


def limit_key_of(workflow: Keyed, context: Any) -> str | None:
    """The per-key limit key a new run of ``workflow`` with ``context`` holds, None when
    the workflow declares no ``concurrency_key``. Every way a run is created uses this
    one function (``engine.start``, ``start_many``, child runs of call and map states), so
    ``key_limit`` counts them all alike. Raises InvalidConcurrencyKey."""
    if workflow.concurrency_key is None:
        return None
    return concurrency_key_of(workflow.name, workflow.concurrency_key, context)


# -- rate limits: the bucket maths -------------------------------------------------------


@dataclass(frozen=True)
class Bucket:
    """A rate limit's stored state (times by the database's clock).

    ``last_grant``: when the last call was let through; ``queue_end``: the slot after the
    last one handed out to a rescheduled caller (``<= now``: nobody queued)."""

    last_grant: float | None
    queue_end: float


@dataclass(frozen=True)
class Decision:
    granted: bool
    due: float
    """Granted: the time of the grant; else when to come back."""
    bucket: Bucket


def take(
    limit: RateLimit, bucket: Bucket, now: float, *, queued: bool, lead: float = 0.0
) -> Decision:
    """Whether a call may go, and the bucket after it.

    A call is granted when ``interval`` has passed since the last grant — or will have
    within ``lead`` seconds: it is then granted for that instant, and the caller waits
    until it (grants stay exactly ``interval`` apart instead of each adding the latency
    of its caller) — and either nobody is queued or the caller is a queued one coming
    back (``queued``: its run was rescheduled by this limit). Otherwise a new caller gets
    the next free slot of the queue (the queue grows by one slot) and a queued one comes
    back at the first instant it may be granted (the queue keeps its length): callers are
    served in arrival order and a burst is rescheduled once, each to its own slot."""
    earliest = now if bucket.last_grant is None else bucket.last_grant + limit.interval
    if earliest <= now + lead and (queued or bucket.queue_end <= now):
        at = max(earliest, now)
        return Decision(True, at, Bucket(at, bucket.queue_end))
    if queued:
        return Decision(False, max(earliest, now), bucket)
    slot = max(earliest, bucket.queue_end, now)
    return Decision(False, slot, Bucket(bucket.last_grant, slot + limit.interval))


def take_all(
    limits: Sequence[RateLimit],
    buckets: Sequence[Bucket],
    now: float,
    *,
    queued: set[str],
    lead: float = 0.0,
) -> tuple[bool, float, list[Bucket]]:
    """:func:`take` of several limits at once, all or nothing: granted only when each one
    grants (then each bucket records the grant, at the latest instant one of them grants
    it); else the latest due of those refusing, and only the refusing limits queue the
    caller."""
    decisions = [
        take(limit, bucket, now, queued=limit.name in queued, lead=lead)
        for limit, bucket in zip(limits, buckets, strict=True)
    ]
    if all(d.granted for d in decisions):
        at = max(d.due for d in decisions)
        return True, at, [Bucket(at, d.bucket.queue_end) for d in decisions]
    due = max(d.due for d in decisions if not d.granted)
    kept = [bucket if d.granted else d.bucket for d, bucket in zip(decisions, buckets, strict=True)]
    return False, due, kept


# -- breakers: the state machine -----------------------------------------------------------

BreakerStatus = Literal["closed", "open", "half_open"]


def call_id(run_id: str, seq: int) -> str:
    """The name of one call of a step: its run and the seq of its ``step_started``."""
    return f"{run_id}:{seq}"


def parse_call(call: str | None) -> tuple[str, int] | None:
    """``(run id, seq)`` of a :func:`call_id`; ``None`` for anything else (a trial stored
    by an earlier version named its worker)."""
    run_id, _, seq = (call or "").rpartition(":")
    if not run_id or not seq.isdigit():
        return None
    return run_id, int(seq)


@dataclass(frozen=True)
class BreakerState:
    """A breaker's stored state. ``until``: open — end of the cool-down; half open — when
    to look whether the trial still runs (the cool-down after it began, then every
    :data:`HALF_OPEN_RECHECK` seconds while it does): before, every other call is refused
    without a look."""

    status: BreakerStatus = "closed"
    failures: tuple[float, ...] = ()
    until: float | None = None
    trial: str | None = None
    """The trial call while half open (:func:`call_id`)."""


@dataclass(frozen=True)
class Admission:
    """The answer to "may a step behind this breaker be called now"."""

    allowed: bool
    trial: bool = False
    due: float | None = None
    """Not allowed: when the cool-down (or the running trial) ends."""
    state: BreakerState = field(default_factory=BreakerState)
    change: str | None = None
    """A transition to journal (``half_opened``), else ``None``."""


def admit(
    breaker: Breaker, state: BreakerState, now: float, call: str, trial_runs: bool = False
) -> Admission:
    """May ``call`` (:func:`call_id`) be made now? ``trial_runs``: half open past
    ``until``, whether the trial still runs (its run holds its lease and has journaled
    nothing since the trial's ``step_started``)."""
    if state.status == "closed":
        return Admission(True, state=state)
    if state.status == "half_open" and state.trial == call:
        # The trial again: its step_started was never written (the same run and seq).
        return Admission(True, trial=True, state=state)
    assert state.until is not None
    if now < state.until:
        # Open: back at the end of the cool-down. Half open: soon, to learn how the trial went.
        due = state.until if state.status == "open" else min(state.until, now + HALF_OPEN_RECHECK)
        return Admission(False, due=due, state=state)
    if state.status == "half_open" and trial_runs:
        # The trial outlasts the cool-down and still runs: nobody else goes through; the
        # next to ask after a while looks again.
        later = BreakerState("half_open", (), now + HALF_OPEN_RECHECK, state.trial)
        return Admission(False, due=later.until, state=later)
    # Cool-down over (or the trial no longer runs: its worker died, it was cut off): this
    # call is the trial.
    trial = BreakerState("half_open", (), now + breaker.cool_down_s, call)
    return Admission(True, trial=True, state=trial, change="half_opened")


def failed(
    breaker: Breaker, state: BreakerState, now: float, call: str | None
) -> tuple[BreakerState, str | None]:
    """The state after ``call`` failed (``None``: a call not named), and ``"opened"`` when
    this failure opens it. Counted while closed; while open or half open only the trial's
    failure changes anything (a call let through before it opened is ending)."""
    if state.status == "half_open":
        if call is None or call != state.trial:
            return state, None
        return BreakerState("open", (), now + breaker.cool_down_s), "opened"
    if state.status == "open":
        return state, None  # a call let through before it opened, ending now
    recent = (*(t for t in state.failures if t > now - breaker.within_s), now)
    if len(recent) >= breaker.failures:
        return BreakerState("open", (), now + breaker.cool_down_s), "opened"
    return BreakerState("closed", recent[-breaker.failures :]), None


def succeeded(state: BreakerState, call: str | None) -> tuple[BreakerState, str | None]:
    """The state after ``call`` succeeded: the trial's success closes the breaker; any
    other call's changes nothing."""
    if state.status == "half_open" and call is not None and state.trial == call:
        return BreakerState("closed"), "closed"
    return state, None
