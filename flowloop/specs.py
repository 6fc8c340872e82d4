"""What a workflow definition is made of: the states' specs and what a step sees.

:class:`Step` is what a step function learns about the attempt it runs (and
:meth:`Step.sleep` its durable timer); :class:`StepSpec` and :class:`WaitSpec` are the
declared step and wait states, :class:`Transition` one declared way out of a state. Plain
frozen dataclasses, built (and their options checked) by :func:`step_spec` and
:func:`wait_spec` for :class:`flowloop.definition.Workflow`; the runtime reads them.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

from pydantic import BaseModel

from flowloop import compose
from flowloop.compose import StepError
from flowloop.errors import DefinitionError
from flowloop.flowcontrol import Breaker, RateLimit
from flowloop.journal import TIMEOUT_EVENT
from flowloop.retry import DEFAULT_RETRY, Retry, human, seconds

NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,199}$")
NAME_RULE: Final = (
    "name must start with an ASCII letter or '_' and hold only ASCII letters, digits, '_', "
    "'.' or '-' (at most 200 characters)"
)
"""Names of workflows, states and loops: at most 200 characters (flowloop.limits)."""
NEXT_EVENT = "next"
"""The event a ``next=`` step takes implicitly when it returns ``None``."""

StepFunction = Callable[..., Any]


@dataclass(frozen=True, kw_only=True)
class Step:
    """What a step function learns about the step it is running.

    ``idempotency_key`` is the same for every attempt of one visit of one state of one run,
    across retries and crashes: pass it to external systems so they apply an effect once.
    """

    run_id: str
    workflow: str
    state: str
    attempt: int
    visit: int
    seq: int
    worker: str
    error: StepError | None = None
    """The last error recorded on the run: the previous attempt's on a retry, or the one
    whose ``on_error`` route led to this state (``None``: none)."""
    compensating: bool = False
    """True while this is a step's compensation (its undo) running, not the step."""

    notes: list[str] = field(default_factory=list, compare=False, repr=False)
    """What :meth:`note` was told, in order."""

    def note(self, text: str) -> None:
        """Say in a few words what this attempt did (``a.csv bytes 85-1,210, rows 2-19``):
        journaled with the step's success (``data["note"]``) and shown by ``flowloop
        history``, so a reader sees the work without opening every context."""
        self.notes.append(text)

    @property
    def idempotency_key(self) -> str:
        key = f"{self.run_id}:{self.state}:{self.visit}"
        return f"{key}:undo" if self.compensating else key

    def sleep(self, delay: float | timedelta, event: str | None = None) -> Sleep:
        """A durable timer: ``return step.sleep(timedelta(days=3), "remind")`` takes ``event``
        (``None`` for a ``next=`` step) but starts the next state only after ``delay``:
        the run rests scheduled until then (a wait state's timeout counts, and its events
        are taken, only from then; a final state ends the run then). The due time is
        stored; no worker or thread waits meanwhile, and a restarted worker fires it on
        time, or at once if overdue."""
        delay_s = seconds(delay) or 0.0
        if delay_s < 0:
            raise ValueError("step.sleep: delay must not be negative")
        return Sleep(delay=delay_s, event=event)


@dataclass(frozen=True)
class Sleep:
    """What ``step.sleep`` returns: an event to take after a stored delay."""

    delay: float
    event: str | None = None


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """One state that has a step function."""

    name: str
    fn: StepFunction
    on: Mapping[str, str]
    is_async: bool
    timeout: float | None
    retry: Retry
    idempotent: bool
    max_visits: int | None
    returns_event: bool
    """False for ``next=`` steps: whatever they return, they take ``next``."""
    wants_step: bool
    """The function takes ``(ctx, step)``; otherwise just ``(ctx)``."""
    rate_limit: RateLimit | None = None
    breaker: Breaker | None = None
    on_error: tuple[tuple[compose.ErrorKey, str], ...] = ()
    """``(exception class or "*", state)`` routes taken once the retry policy gives up."""
    compensate: StepFunction | None = None
    """Undoes this step's effect ``(ctx, step)`` when the run takes a compensating path."""
    compensate_retry: Retry = DEFAULT_RETRY

    def describe(self) -> str:
        """Compact settings for diagrams: retry, timeout, idempotency, max visits, limits."""
        parts = [self.retry.describe()]
        parts.extend(g.describe() for g in (self.rate_limit, self.breaker) if g is not None)
        if self.timeout is not None:
            parts.append(f"timeout {human(self.timeout)}")
        if not self.idempotent:
            parts.append("not idempotent")
        if self.max_visits is not None:
            parts.append(f"max {self.max_visits} visits")
        return ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class WaitSpec:
    """A state with no step: it advances on an event sent from outside, or on its timeout."""

    name: str
    on: Mapping[str, str]
    timeout: float | None
    on_timeout: str | None
    payloads: Mapping[str, type[BaseModel]]
    handlers: Mapping[str, Callable[[Any, Any], None]]
    max_visits: int | None = None

    @property
    def transitions(self) -> dict[str, str]:
        """Every way out, the timeout included."""
        out = dict(self.on)
        if self.on_timeout is not None:
            out[TIMEOUT_EVENT] = self.on_timeout
        return out

    def describe(self) -> str:
        parts = [f"waits for {', '.join(self.on)}"]
        if self.timeout is not None:
            parts.append(f"timeout {human(self.timeout)}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Transition:
    source: str
    event: str
    dest: str


# -- declaring: each spec checked on its own (Workflow checks names and the whole machine) --


def check_retry(workflow: str, state: str, option: str, value: object) -> None:
    """DefinitionError unless ``value`` (a step's ``option``) is a Retry or None: anything
    else failed only when the step did, and took the worker down with it."""
    if value is not None and not isinstance(value, Retry):
        raise DefinitionError(
            workflow,
            f"state {state!r}: {option}={value!r} must be a flowloop Retry, "
            f"e.g. {option}=Retry(attempts=3)",
        )


def step_spec(
    workflow: str,
    state: str,
    function: StepFunction,
    *,
    on: Mapping[str, str] | None,
    next_state: str | None,
    timeout: float | timedelta | None,
    retry: Retry | None,
    idempotent: bool,
    max_visits: int | None,
) -> StepSpec:
    """A step state's spec (``Workflow.step``); DefinitionError naming ``workflow`` when
    its options contradict each other."""
    if (on is None) == (next_state is None):
        raise DefinitionError(
            workflow, f"state {state!r} needs exactly one of on={{event: state}} or next="
        )
    transitions = dict(on) if on is not None else {NEXT_EVENT: str(next_state)}
    if not transitions:
        raise DefinitionError(workflow, f"state {state!r} declares no transition")
    timeout_s = seconds(timeout, f"{workflow}: state {state!r} timeout")
    if timeout_s is not None and timeout_s <= 0:
        raise DefinitionError(workflow, f"state {state!r}: timeout must be positive")
    check_retry(workflow, state, "retry", retry)
    if max_visits is not None and max_visits < 1:
        raise DefinitionError(workflow, f"state {state!r}: max_visits must be at least 1")
    return StepSpec(
        name=state,
        fn=function,
        on=transitions,
        is_async=inspect.iscoroutinefunction(function),
        timeout=timeout_s,
        retry=retry or DEFAULT_RETRY,
        idempotent=idempotent,
        max_visits=max_visits,
        returns_event=on is not None,
        wants_step=wants_step(workflow, state, function),
    )


def wait_spec(
    workflow: str,
    name: str,
    *,
    on: Mapping[str, str],
    timeout: float | timedelta | None,
    on_timeout: str | None,
    payloads: Mapping[str, type[BaseModel]] | None,
    handlers: Mapping[str, Callable[[Any, Any], None]] | None,
    max_visits: int | None,
) -> WaitSpec:
    """A wait state's spec (``Workflow.wait``); DefinitionError naming ``workflow`` when
    its options contradict each other."""
    if not on:
        raise DefinitionError(workflow, f"wait state {name!r} accepts no event")
    if TIMEOUT_EVENT in on:
        raise DefinitionError(
            workflow, f"wait state {name!r}: use on_timeout= for the {TIMEOUT_EVENT!r} event"
        )
    timeout_s = seconds(timeout, f"{workflow}: state {name!r} timeout")
    if (timeout_s is None) != (on_timeout is None):
        raise DefinitionError(
            workflow, f"wait state {name!r}: give timeout= and on_timeout= together"
        )
    if timeout_s is not None and timeout_s <= 0:
        raise DefinitionError(workflow, f"wait state {name!r}: timeout must be positive")
    for label, mapping in (("payloads", payloads or {}), ("handlers", handlers or {})):
        unknown = sorted(set(mapping) - set(on))
        if unknown:
            raise DefinitionError(
                workflow,
                f"wait state {name!r}: {label} for undeclared event(s) {', '.join(unknown)}",
            )
    for event, model in (payloads or {}).items():
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            raise DefinitionError(
                workflow,
                f"wait state {name!r}: payload of {event!r} must be a pydantic BaseModel "
                f"subclass, not {model!r}",
            )
    for event, handler in (handlers or {}).items():
        if not callable(handler):
            raise DefinitionError(
                workflow, f"wait state {name!r}: handler of {event!r} is not callable"
            )
    if max_visits is not None and max_visits < 1:
        raise DefinitionError(workflow, f"wait state {name!r}: max_visits must be at least 1")
    return WaitSpec(
        name=name,
        on=dict(on),
        timeout=timeout_s,
        on_timeout=on_timeout,
        payloads=dict(payloads or {}),
        handlers=dict(handlers or {}),
        max_visits=max_visits,
    )


def wants_step(workflow: str, state: str, function: StepFunction) -> bool:
    """Whether the step is called as (ctx, step) rather than (ctx); a function that cannot
    be called either way (a third required parameter, a required keyword-only one, none at
    all) fails here, at definition, instead of on every attempt at run time."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return True
    for wanted in (2, 1):
        try:
            signature.bind(*range(wanted))
        except TypeError:
            continue
        return wanted == 2
    required = [
        p.name
        for p in signature.parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    raise DefinitionError(
        workflow,
        f"step {state!r} must take (ctx) or (ctx, step); its function requires "
        f"({', '.join(required)}): give the others defaults or drop them",
    )
