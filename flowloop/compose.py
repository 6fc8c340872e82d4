"""Composition, the pure part: failure routes, child runs, joins, compensations, deadlines.

Everything here is a plain decision over plain data (no database, no ``await``): which
state an error leads to, the id of a child run, whether a join is ``done`` or ``failed``,
which steps a compensating run must undo, the record a deadline sends a run to. The
runtime halves live in :mod:`flowloop.children` and :mod:`flowloop.sagas`.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, Generic, TypeVar

from pydantic import BaseModel

from flowloop import journal as j
from flowloop.errors import DefinitionError, Interrupted
from flowloop.journal import JournalEvent, RunRecord
from flowloop.owed import CompensationLost as CompensationLost
from flowloop.owed import Undo as Undo
from flowloop.owed import VersionOf as VersionOf
from flowloop.owed import compensations_due as compensations_due
from flowloop.owed import stranded_compensations as stranded_compensations
from flowloop.retry import DEFAULT_RETRY, Retry

if TYPE_CHECKING:
    from flowloop.definition import Workflow

ANY_ERROR: Final = "*"
"""The ``on_error`` key that matches every exception (but not an interruption)."""
ERROR_PREFIX: Final = "error:"
"""Error routes are transitions whose event is ``error:<ExceptionName>`` (``error:*``)."""
DEADLINE_EVENT: Final = "deadline"
"""The event of the transition a passed run deadline takes."""
CALL_OUTCOMES: Final = ("succeeded", "failed", "stopped")
MAP_OUTCOMES: Final = ("done", "failed")
CHILD_ID_LENGTH: Final = 32
DEFAULT_MAX_PARALLEL: Final = 16
DEFAULT_MAX_ITEMS: Final = 100_000


# -- failure transitions ------------------------------------------------------------------


ErrorKey = type[BaseException] | str


def error_event(key: ErrorKey) -> str:
    """The transition event of an ``on_error`` key."""
    return ERROR_PREFIX + (key if isinstance(key, str) else key.__name__)


def check_on_error(
    workflow: str, state: str, on_error: Mapping[Any, str] | None
) -> tuple[tuple[ErrorKey, str], ...]:
    """``on_error`` as ordered pairs; DefinitionError for a key that is neither an exception
    class nor ``"*"``, or two classes with one name (their events would collide)."""
    pairs: list[tuple[ErrorKey, str]] = []
    names: dict[str, Any] = {}
    for key, target in (on_error or {}).items():
        if key != ANY_ERROR and not (isinstance(key, type) and issubclass(key, BaseException)):
            raise DefinitionError(
                workflow,
                f"state {state!r}: on_error keys must be exception classes or '*', not {key!r}",
            )
        if not isinstance(target, str):
            raise DefinitionError(
                workflow, f"state {state!r}: on_error target of {key!r} must be a state name"
            )
        event = error_event(key)
        if event in names and names[event] is not key:
            raise DefinitionError(
                workflow, f"state {state!r}: two on_error classes are named {event[6:]!r}"
            )
        names[event] = key
        pairs.append((key, target))
    return tuple(pairs)


def route_error(
    on_error: Sequence[tuple[ErrorKey, str]], error: BaseException, *, idempotent: bool = False
) -> tuple[str, str] | None:
    """``(event, target)`` of the route ``error`` takes: the most specific class among its
    bases that ``on_error`` names, else ``"*"`` (which never takes an :class:`Interrupted`
    of a non-``idempotent`` step: the effect of a cut-off non-idempotent step is unknown,
    so only an explicit route may move on from it; an idempotent one's last attempt cut
    off failed like any attempt). ``None``: no route, the run fails as before."""
    if not on_error:
        return None
    by_class = {key: target for key, target in on_error if not isinstance(key, str)}
    for base in type(error).__mro__:
        if base in by_class:
            return error_event(base), by_class[base]
    if isinstance(error, Interrupted) and not idempotent:
        return None
    for key, target in on_error:
        if key == ANY_ERROR:
            return error_event(ANY_ERROR), target
    return None


@dataclass(frozen=True)
class StepError:
    """The error a step sees as ``step.error``: the last one recorded on its run (the
    previous attempt's, or the one whose ``on_error`` route led here)."""

    type: str
    message: str

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


def step_error(record: RunRecord) -> StepError | None:
    """The run's last error as :class:`StepError` (``None`` when it has none)."""
    if not record.error:
        return None
    kind, sep, message = record.error.partition(": ")
    return StepError(kind, message) if sep else StepError("Error", record.error)


# -- child runs and joins -----------------------------------------------------------------


ChildContext = TypeVar("ChildContext", bound=BaseModel)


@dataclass(frozen=True, kw_only=True)
class ChildResult(Generic[ChildContext]):
    """One child of a ``map`` as ``reduce`` sees it: its item's index, how it ended, its
    final context (a model of the child workflow's context: annotate ``reduce``'s
    argument as ``list[ChildResult[FileJob]]``) and its error, if any."""

    index: int
    status: str
    context: ChildContext
    error: str | None = None
    branch: str | None = None
    """The branch's name (a ``parallel`` state's children), else ``None``."""

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"


@dataclass(frozen=True, kw_only=True)
class CallSpec:
    """A ``call`` state: one child run of ``child``; waits; goes on by its outcome."""

    name: str
    child: Workflow
    context: Callable[[Any], Any]
    on: Mapping[str, str]
    result: Callable[[Any, Any], None] | None = None

    kind: ClassVar[str] = "call"

    def describe(self) -> str:
        return f"calls {self.child.name}"

    def workflows(self) -> list[Workflow]:
        return [self.child]


@dataclass(frozen=True, kw_only=True)
class MapSpec:
    """A ``map`` state: one child run of ``child`` per item, at most ``max_parallel`` at a
    time; joins when every child has ended; ``done`` or ``failed`` by ``tolerate_failures``."""

    name: str
    child: Workflow
    items: Callable[[Any], Iterable[Any]]
    context: Callable[[Any, Any], Any]
    on: Mapping[str, str]
    max_parallel: int = DEFAULT_MAX_PARALLEL
    max_items: int = DEFAULT_MAX_ITEMS
    tolerate_failures: float = 0
    reduce: Callable[[Any, list[ChildResult[Any]]], None] | None = None

    kind: ClassVar[str] = "map"

    def describe(self) -> str:
        parts = [f"maps {self.child.name}", f"max_parallel {self.max_parallel}"]
        if self.tolerate_failures:
            parts.append(f"tolerates {self.tolerate_failures:g}")
        return ", ".join(parts)

    def workflows(self) -> list[Workflow]:
        return [self.child]


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """A ``parallel`` state: one child run per branch (each of its own workflow), all at
    once; joins like a map (``done`` or ``failed`` by ``tolerate_failures``)."""

    name: str
    branches: Mapping[str, tuple[Workflow, Callable[[Any], Any]]]
    on: Mapping[str, str]
    tolerate_failures: float = 0
    reduce: Callable[[Any, list[ChildResult[Any]]], None] | None = None

    kind: ClassVar[str] = "parallel"

    @property
    def child(self) -> Workflow:
        """The first branch's workflow (what a join row names)."""
        return next(iter(self.branches.values()))[0]

    @property
    def max_parallel(self) -> int:
        return len(self.branches)

    def describe(self) -> str:
        return "parallel: " + ", ".join(
            f"{name} ({wf.name})" for name, (wf, _) in self.branches.items()
        )

    def workflows(self) -> list[Workflow]:
        return [wf for wf, _ in self.branches.values()]


Composite = CallSpec | MapSpec | ParallelSpec


class Composing:
    """The call, map and parallel declarations of :class:`~flowloop.definition.Workflow`."""

    def _add_composite(self, spec: Composite, *, initial: bool) -> None:
        raise NotImplementedError  # provided by Workflow

    def call(
        self,
        name: str,
        *,
        child: Workflow,
        context: Callable[[Any], Any],
        on: Mapping[str, str],
        result: Callable[[Any, Any], None] | None = None,
        initial: bool = False,
    ) -> None:
        """Declare a call state: it starts one child run of ``child`` with the context
        ``context(ctx)`` returns, waits (no worker, no thread) until the child ends, and
        goes on by its outcome: ``on={"succeeded": ..., "failed": ..., "stopped": ...}``
        (an outcome left out fails the run). ``result(ctx, child_ctx)`` merges the child's
        final context into this run's before it goes on."""
        self._add_composite(
            CallSpec(name=name, child=child, context=context, on=dict(on), result=result),
            initial=initial,
        )

    def map(
        self,
        name: str,
        *,
        child: Workflow,
        items: Callable[[Any], Any],
        context: Callable[[Any, Any], Any],
        on: Mapping[str, str],
        max_parallel: int = DEFAULT_MAX_PARALLEL,
        max_items: int = DEFAULT_MAX_ITEMS,
        tolerate_failures: float = 0,
        reduce: Callable[[Any, list[ChildResult[Any]]], None] | None = None,
        initial: bool = False,
    ) -> None:
        """Declare a map state (fan-out and join): one child run of ``child`` per item of
        ``items(ctx)``, with the context ``context(ctx, item)``; at most ``max_parallel``
        run at once. When every child has ended, ``reduce(ctx, results)`` folds their
        :class:`ChildResult` list (item order) into this run's context and the run takes
        ``done`` — or ``failed`` when more children failed than ``tolerate_failures`` (a
        count, or a fraction of the items below 1) allows. Every item's context is
        validated before any child is created; more than ``max_items`` items fail the run.
        """
        self._add_composite(
            MapSpec(
                name=name,
                child=child,
                items=items,
                context=context,
                on=dict(on),
                max_parallel=max_parallel,
                max_items=max_items,
                tolerate_failures=tolerate_failures,
                reduce=reduce,
            ),
            initial=initial,
        )

    def parallel(
        self,
        name: str,
        *,
        branches: Mapping[str, tuple[Workflow, Callable[[Any], Any]]],
        on: Mapping[str, str],
        tolerate_failures: float = 0,
        reduce: Callable[[Any, list[ChildResult[Any]]], None] | None = None,
        initial: bool = False,
    ) -> None:
        """Declare a parallel state: one child run per branch, each of its own workflow,
        ``branches={"fraud": (fraud_check, lambda ctx: ...), ...}``, all at once; joins like
        a map (``reduce(ctx, results)``, each result's ``branch`` names it; ``done`` or
        ``failed`` by ``tolerate_failures``)."""
        self._add_composite(
            ParallelSpec(
                name=name,
                branches=dict(branches),
                on=dict(on),
                tolerate_failures=tolerate_failures,
                reduce=reduce,
            ),
            initial=initial,
        )


def check_composite(workflow: str, spec: Composite) -> None:
    """Define-time checks of a call or map state (DefinitionError naming the state)."""
    from flowloop.definition import Workflow  # a runtime import: definition imports us

    where = f"{spec.kind} state {spec.name!r}"
    if isinstance(spec, ParallelSpec):
        if not spec.branches:
            raise DefinitionError(workflow, f"{where}: needs at least one branch")
        for branch, pair in spec.branches.items():
            if not (isinstance(pair, tuple) and len(pair) == 2 and callable(pair[1])):
                raise DefinitionError(
                    workflow, f"{where}: branch {branch!r} must be (workflow, context function)"
                )
            if not isinstance(pair[0], Workflow):
                raise DefinitionError(
                    workflow, f"{where}: branch {branch!r} must name a Workflow, not {pair[0]!r}"
                )
    elif not isinstance(spec.child, Workflow):
        raise DefinitionError(workflow, f"{where}: child must be a Workflow, not {spec.child!r}")
    allowed = CALL_OUTCOMES if isinstance(spec, CallSpec) else MAP_OUTCOMES
    unknown = sorted(set(spec.on) - set(allowed))
    if unknown:
        raise DefinitionError(
            workflow,
            f"{where}: on= accepts {', '.join(allowed)}, not {', '.join(map(repr, unknown))}",
        )
    if allowed[0] not in spec.on:
        raise DefinitionError(workflow, f"{where}: on= needs {allowed[0]!r}")
    if not isinstance(spec, ParallelSpec) and not callable(spec.context):
        raise DefinitionError(workflow, f"{where}: context= must be a function")
    if isinstance(spec, ParallelSpec | MapSpec) and not _tolerance(spec.tolerate_failures):
        raise DefinitionError(
            workflow,
            f"{where}: tolerate_failures={spec.tolerate_failures!r} is a count (0, 1, 2, ...) "
            "or a fraction below 1",
        )
    if isinstance(spec, MapSpec):
        if not callable(spec.items):
            raise DefinitionError(workflow, f"{where}: items= must be a function")
        for option, value in (("max_parallel", spec.max_parallel), ("max_items", spec.max_items)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DefinitionError(
                    workflow, f"{where}: {option}={value!r} must be an integer of at least 1"
                )


def _tolerance(value: object) -> bool:
    """A count of failures (0, 1, 2 …) or a fraction below 1 — not NaN (every run then
    failed at its join), not infinity, not a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return value >= 0 and (float(value).is_integer() or value < 1)


def check_no_call_cycle(parent: Workflow) -> None:
    """A workflow that (through its children) calls itself would start runs forever."""
    stack: list[tuple[Workflow, tuple[str, ...]]] = [(parent, (parent.name,))]
    while stack:
        workflow, path = stack.pop()
        for spec in workflow.composites.values():
            for child in spec.workflows():
                child_path = (*path, child.name)
                if child is parent or child.name == parent.name:
                    raise DefinitionError(
                        parent.name,
                        f"{spec.kind} state {spec.name!r} starts a cycle of calls: "
                        + " -> ".join(child_path),
                    )
                if len(child_path) < 32:
                    stack.append((child, child_path))


def child_id(parent_id: str, state: str, visit: int, index: int = 0) -> str:
    """The id of a parent's child run: derived, never random, so a crash between creating
    it and journaling that it exists can never create a second one."""
    raw = f"{parent_id}\x1f{state}\x1f{visit}\x1f{index}".encode()
    return hashlib.sha256(raw).hexdigest()[:CHILD_ID_LENGTH]


def join_id(parent_id: str, state: str, visit: int) -> str:
    """The id of the join row of one visit of a call or map state."""
    return child_id(parent_id, state, visit, -1)


def tolerated(tolerate: float, total: int) -> int:
    """How many failed children a join of ``total`` still calls ``done``: a count as is, a
    fraction of the total rounded down (0.1 of 25 children: 2)."""
    if tolerate >= 1 or float(tolerate).is_integer():
        return int(tolerate)
    return math.floor(tolerate * total + 1e-9)


def map_outcome(tolerate: float, total: int, failed: int) -> str:
    """``done`` when at most the tolerated number of children did not succeed."""
    return "done" if failed <= tolerated(tolerate, total) else "failed"


def call_outcome(status: str) -> str:
    """The call outcome of a child's final status."""
    return status if status in CALL_OUTCOMES else "failed"


# -- compensation (sagas) -----------------------------------------------------------------
# Which compensations a run owes (across migrations and redeploys): flowloop/owed.py.


def undone(events: Sequence[JournalEvent]) -> list[str]:
    """The states whose compensation succeeded, in the order they ran."""
    return [
        str(event.state)
        for event in events
        if event.kind == j.COMPENSATION_SUCCEEDED and event.state is not None
    ]


def compensation_retry(workflow: Workflow, state: str) -> Retry:
    spec = workflow.steps.get(state)
    return spec.compensate_retry if spec is not None else DEFAULT_RETRY


def compensation_cut_off(
    workflow: Workflow, state: str | None, attempt: int, now: float
) -> tuple[dict[str, Any], str]:
    """The data and message of the ``step_interrupted`` entry of a compensation (of the
    step ``state``) cut off in its ``attempt``: a crash counts against its own
    ``compensate_retry`` as a step's does against its ``retry`` — run again at once while
    attempts are left, else the run parks ``failed`` like a compensation that failed for
    good (one that takes its process down every time must not loop)."""
    retry = compensation_retry(workflow, state) if state is not None else DEFAULT_RETRY
    undo = f"the compensation of {state}" if state is not None else "a compensation"
    if retry.has_attempts_left(attempt):
        return {"retry_at": now}, f"cut off during {undo} (attempt {attempt}); it runs again"
    reason = f"compensation_failed: {state or '?'}: interrupted {attempt} time(s)"
    return {"reason": reason}, (
        f"{reason}, no attempts left (fix it, then `flowloop retry` runs the compensations "
        "still owed)"
    )


# -- deadlines ----------------------------------------------------------------------------


def deadline_passed(record: RunRecord, now: float) -> bool:
    """The run's deadline (if it still has one) is due."""
    return record.deadline is not None and now >= record.deadline


def deadline_event(
    workflow: Workflow, record: RunRecord, *, now: float, worker: str, data: Mapping[str, Any]
) -> JournalEvent:
    """The transition a passed deadline takes: to ``on_deadline``, the context as it was."""
    assert workflow.on_deadline is not None
    return JournalEvent(
        run_id=record.id,
        seq=record.last_seq + 1,
        kind=j.DEADLINE_PASSED,
        at=now,
        state=record.state,
        attempt=record.attempt,
        event=DEADLINE_EVENT,
        next_state=workflow.on_deadline,
        context=record.context,
        error_type="DeadlineExceeded",
        error_message=f"the run's deadline passed in state {record.state!r}",
        worker=worker,
        data=dict(data),
    )
