"""Workflow definitions: explicit states, explicit transitions, a typed context.

A workflow is declared with decorators and validated before its first use: every target
exists, exactly one initial state, every non-final state can reach a final one, no state is
unreachable, final states have no step. The transition table is built once per definition
with the ``transitions`` library (never per run: a ``Machine`` costs far more than a commit).
This module is the builder (:class:`Workflow`); the states' specs and what a step sees are
in :mod:`flowloop.specs`, the checks, the structure and the fingerprint in
:mod:`flowloop.structure`.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import AliasChoices, AliasPath, BaseModel, RootModel, ValidationError
from transitions import Machine

from flowloop import compose, graph, returns, upcast
from flowloop.backpressure import DEFAULT_OVERFLOW_TIMEOUT_SECONDS, Bounds
from flowloop.compose import Composite
from flowloop.contexts import context_from
from flowloop.errors import DefinitionError, InvalidContext, InvalidEvent
from flowloop.flowcontrol import Breaker, RateLimit, check_step_limits, check_workflow_limits
from flowloop.journal import TIMEOUT_EVENT
from flowloop.retry import DEFAULT_RETRY, Retry, seconds
from flowloop.specs import (
    NAME_PATTERN,
    NAME_RULE,
    NEXT_EVENT,
    Sleep,
    Step,
    StepFunction,
    StepSpec,
    Transition,
    WaitSpec,
    check_retry,
    step_spec,
    wait_spec,
)
from flowloop.specs import wants_step as _wants_step
from flowloop.structure import Draft, check_migrates_from, compatible, fingerprint_of

if TYPE_CHECKING:
    import graphviz

# The specs and the structure checks live in flowloop/specs.py and flowloop/structure.py;
# this module keeps the names code has always imported from it.
__all__ = [
    "NAME_PATTERN",
    "NEXT_EVENT",
    "TIMEOUT_EVENT",
    "Sleep",
    "Step",
    "StepFunction",
    "StepSpec",
    "Transition",
    "WaitSpec",
    "Workflow",
    "_wants_step",
    "compatible",
    "describe_validation",
]

F = TypeVar("F", bound=StepFunction)


class Workflow(compose.Composing):
    """A named, versioned state machine over a pydantic context model.

    >>> order = Workflow("order", context=Order, version=1)
    >>> @order.step(initial=True, on={"reserved": "charge", "out_of_stock": "cancelled"})
    ... def reserve(ctx: Order, step: Step) -> str: ...
    >>> order.final("delivered", "cancelled")

    ``key`` names a context field (or a function of the context) that identifies the run in
    business terms (an order id). It is unique per workflow: starting a second run with the
    same key returns the first one (``engine.find(workflow, key=...)`` finds it).

    ``max_inbox``/``inbox_overflow`` bound each run's kept events, ``max_queued``/
    ``queue_overflow`` the runs not yet started, ``overflow_timeout`` how long ``"block"``
    waits: see :mod:`flowloop.backpressure`.
    ``context_version`` numbers the context model; ``migrate={1: v1_to_v2, ...}`` are the
    upcasters (pure functions on JSON objects) that carry an older stored context to it.
    ``migrates_from={1: {"old_state": "new_state"}}`` declares how runs of an older
    ``version`` map onto this one's states (``flowloop migrate``).
    """

    def __init__(
        self,
        name: str,
        *,
        context: type[BaseModel],
        version: int = 1,
        key: str | Callable[[Any], str] | None = None,
        max_concurrency: int | None = None,
        concurrency_key: Callable[[Any], str] | None = None,
        key_limit: int | None = None,
        rate_limit: RateLimit | None = None,
        description: str = "",
        deadline: float | timedelta | None = None,
        on_deadline: str | None = None,
        max_inbox: int | None = None,
        inbox_overflow: str = "reject_newest",
        max_queued: int | None = None,
        queue_overflow: str = "reject_newest",
        overflow_timeout: float | timedelta = DEFAULT_OVERFLOW_TIMEOUT_SECONDS,
        context_version: int = 1,
        migrate: Mapping[int, upcast.Upcaster] | None = None,
        migrates_from: Mapping[int, Mapping[str, str]] | None = None,
    ) -> None:
        if not NAME_PATTERN.match(name):
            raise DefinitionError(name[:40], NAME_RULE)
        if not (isinstance(context, type) and issubclass(context, BaseModel)):
            raise DefinitionError(name, "context must be a pydantic BaseModel subclass")
        # Limits hold for every worker sharing the database (flowloop/store/limits.py).
        check_workflow_limits(
            name,
            max_concurrency=max_concurrency,
            concurrency_key=concurrency_key,
            key_limit=key_limit,
            rate_limit=rate_limit,
        )
        _check_key(name, context, key)
        self.concurrency_key = concurrency_key
        self.key_limit = key_limit
        self.rate_limit = rate_limit
        self.name = name
        self.context = context
        self.version = version
        self.key = key
        self.max_concurrency = max_concurrency
        self.description = description
        self.deadline = seconds(deadline)
        """Seconds a run may take in all (waiting and retrying included), else ``None``."""
        self.on_deadline = on_deadline
        if (self.deadline is None) != (on_deadline is None):
            raise DefinitionError(name, "give deadline= and on_deadline= together")
        if self.deadline is not None and self.deadline <= 0:
            raise DefinitionError(name, "deadline must be positive")
        # Backpressure (flowloop/backpressure.py): not part of the fingerprint.
        self.bounds = Bounds.of(
            name,
            max_inbox=max_inbox,
            inbox_overflow=inbox_overflow,
            max_queued=max_queued,
            queue_overflow=queue_overflow,
            overflow_timeout=overflow_timeout,
        )
        # Deploying a change (see flowloop/upcast.py, flowloop/verdicts.py): the context's
        # version and the upcasters to it; the state mapping from older versions.
        upcast.check_chain(name, context_version, migrate or {})
        self.context_version = context_version
        self.migrate: Mapping[int, upcast.Upcaster] = dict(migrate or {})
        self.migrates_from: Mapping[int, Mapping[str, str]] = {
            int(old): dict(mapping) for old, mapping in (migrates_from or {}).items()
        }
        self._draft = Draft()
        self._frozen = False
        self._table: dict[tuple[str, str], str] = {}
        self._machine: Machine | None = None
        self._fingerprint = ""
        self._record: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"Workflow({self.name!r}, version={self.version})"

    # -- declaring -------------------------------------------------------------------------

    def step(
        self,
        *,
        name: str | None = None,
        initial: bool = False,
        on: Mapping[str, str] | None = None,
        next: str | None = None,
        timeout: float | timedelta | None = None,
        retry: Retry | None = None,
        idempotent: bool = True,
        max_visits: int | None = None,
        rate_limit: RateLimit | None = None,
        breaker: Breaker | None = None,
        on_error: Mapping[type[BaseException] | str, str] | None = None,
        compensate: StepFunction | None = None,
        compensate_retry: Retry | None = None,
    ) -> Callable[[F], F]:
        """Declare a state whose step function returns the event that picks the next state.

        Use ``on={event: next_state}`` when the step chooses between events, or
        ``next="state"`` when it always goes to one state (it may then return ``None``).
        ``rate_limit``/``breaker``: taken before each call of the step (flowloop.flowcontrol).

        ``on_error={ExceptionType: state, "*": state}`` routes an error once the retry
        policy gives up on it (at once for one it does not retry); the most specific class
        wins, ``"*"`` takes the rest. ``StepTimeout`` routes a timeout; ``Interrupted`` (from
        flowloop.errors) routes a step cut off by a crash, which ``"*"`` does only for an
        idempotent step (with no attempts left). ``compensate=fn(ctx, step)`` undoes the
        step's effect when the run later enters a compensating state
        (``final(..., compensate=True)``);
        ``compensate_retry`` is that function's own retry policy.
        """
        check_step_limits(self.name, name or "?", rate_limit, breaker)

        def register(function: F) -> F:
            state = name or function.__name__
            self._new_step_name(state)
            check_retry(self.name, state, "compensate_retry", compensate_retry)
            self._draft.steps[state] = step_spec(
                self.name,
                state,
                function,
                on=on,
                next_state=next,
                timeout=timeout,
                retry=retry,
                idempotent=idempotent,
                max_visits=max_visits,
            )
            if initial:
                self._draft.initial.append(state)
            if on_error or compensate is not None:
                if compensate is not None and not callable(compensate):
                    raise DefinitionError(
                        self.name, f"state {state!r}: compensate= must be a function"
                    )
                self._draft.steps[state] = dataclasses.replace(
                    self._draft.steps[state],
                    on_error=compose.check_on_error(self.name, state, on_error),
                    compensate=compensate,
                    compensate_retry=compensate_retry or DEFAULT_RETRY,
                )
            if rate_limit is not None or breaker is not None:
                spec = self._draft.steps[state]
                self._draft.steps[state] = dataclasses.replace(
                    spec, rate_limit=rate_limit, breaker=breaker
                )
            return function

        return register

    def _new_step_name(self, state: str) -> None:
        self._ensure_open()
        if not NAME_PATTERN.match(state):
            raise DefinitionError(self.name, f"state name {state!r} is not a valid name")
        if state in self.states:  # a step, a wait, a call or map state, a final
            raise DefinitionError(self.name, f"state {state!r} is declared twice")

    def tune_step(
        self, state: str, *, timeout: float | None = None, retry: Retry | None = None
    ) -> None:
        """Change a step's ``timeout`` or ``retry`` (e.g. from configuration), also after the
        workflow is in use: they are not part of the structure (the fingerprint), so every
        stored run of this workflow stays compatible."""
        spec = self._draft.steps.get(state)
        if spec is None:
            raise DefinitionError(self.name, f"has no step {state!r}")
        if timeout is not None and timeout <= 0:
            raise DefinitionError(self.name, f"state {state!r}: timeout must be positive")
        check_retry(self.name, state, "retry", retry)
        self._draft.steps[state] = dataclasses.replace(
            spec,
            timeout=spec.timeout if timeout is None else timeout,
            retry=spec.retry if retry is None else retry,
        )

    def wait(
        self,
        name: str,
        *,
        on: Mapping[str, str],
        timeout: float | timedelta | None = None,
        on_timeout: str | None = None,
        payloads: Mapping[str, type[BaseModel]] | None = None,
        handlers: Mapping[str, Callable[[Any, Any], None]] | None = None,
        initial: bool = False,
        max_visits: int | None = None,
    ) -> None:
        """Declare a wait state: no step runs; ``engine.send(run, event, payload)`` moves the
        run along ``on={event: state}``, or ``timeout`` passes and it goes to ``on_timeout``.

        ``payloads`` validates an event's payload with a pydantic model; ``handlers`` merge
        it into the context: ``handlers={"paid": lambda ctx, payment: ...}``.
        """
        self._ensure_open()
        if not NAME_PATTERN.match(name):
            raise DefinitionError(self.name, f"state name {name!r} is not a valid name")
        if name in self.states:
            raise DefinitionError(self.name, f"state {name!r} is declared twice")
        self._draft.waits[name] = wait_spec(
            self.name,
            name,
            on=on,
            timeout=timeout,
            on_timeout=on_timeout,
            payloads=payloads,
            handlers=handlers,
            max_visits=max_visits,
        )
        if initial:
            self._draft.initial.append(name)

    def final(self, *names: str, compensate: bool = False) -> None:
        """Declare the final states (a run that reaches one has ``succeeded``).

        ``compensate=True``: entering one of these states first runs the compensations of
        every step that succeeded in the run (``compensate=`` on the step), newest first,
        each journaled like a step; the run then ends there (reason ``compensated: ...``)."""
        self._ensure_open()
        for state in names:
            if not NAME_PATTERN.match(state):
                raise DefinitionError(self.name, f"state name {state!r} is not a valid name")
            if state not in self._draft.finals:
                self._draft.finals.append(state)
            if compensate and state not in self._draft.compensating:
                self._draft.compensating.append(state)

    def _add_composite(self, spec: Composite, *, initial: bool) -> None:
        self._ensure_open()
        if not NAME_PATTERN.match(spec.name):
            raise DefinitionError(self.name, f"state name {spec.name!r} is not a valid name")
        if spec.name in self.states:
            raise DefinitionError(self.name, f"state {spec.name!r} is declared twice")
        compose.check_composite(self.name, spec)
        self._draft.composites[spec.name] = spec
        if initial:
            self._draft.initial.append(spec.name)

    def _ensure_open(self) -> None:
        if self._frozen:
            raise DefinitionError(
                self.name, "is already validated and in use; declare every state before using it"
            )

    # -- validating ------------------------------------------------------------------------

    def validate(self) -> Workflow:
        """Check the definition and freeze it. Called on first use; safe to call again."""
        if self._frozen:
            return self
        self._draft.check(self.name, on_deadline=self.on_deadline)
        compose.check_no_call_cycle(self)
        self._machine = self._build_machine()
        self._table = {(t.source, t.event): t.dest for t in self.transitions()}
        check_migrates_from(self.name, self.version, self.states, self.migrates_from)
        self._record = self.definition_record()
        self._fingerprint = fingerprint_of(self._record)
        self._frozen = True
        return self

    def _build_machine(self) -> Machine:
        # Built once per definition: the machine is the source of the transition table and
        # of the diagram; runs never get a Machine of their own.
        states = [{"name": state, "final": state in self._draft.finals} for state in self.states]
        triggers = [
            {"trigger": event, "source": state, "dest": dest}
            for state, targets in self._outgoing().items()
            for event, dest in targets.items()
        ]
        return Machine(
            model=None,
            states=states,
            transitions=triggers,
            initial=self._draft.initial[0],
            auto_transitions=False,
        )

    # -- reading ---------------------------------------------------------------------------

    def _outgoing(self) -> dict[str, dict[str, str]]:
        return self._draft.outgoing()

    @property
    def states(self) -> list[str]:
        """Every state in declaration order: steps, wait, call and map states, finals."""
        return self._draft.states

    @property
    def waits(self) -> Mapping[str, WaitSpec]:
        return self._draft.waits

    @property
    def composites(self) -> Mapping[str, Composite]:
        """The call and map states."""
        return self._draft.composites

    def compensates(self, state: str) -> bool:
        """Entering ``state`` runs the compensations first (``final(..., compensate=True)``)."""
        return state in self._draft.compensating

    @property
    def children(self) -> list[Workflow]:
        """The workflows this one's call and map states start runs of."""
        seen: dict[str, Workflow] = {}
        for spec in self._draft.composites.values():
            for child in spec.workflows():
                seen.setdefault(child.name, child)
        return list(seen.values())

    def max_visits(self, state: str) -> int | None:
        spec = self._draft.steps.get(state) or self._draft.waits.get(state)
        return None if spec is None else spec.max_visits

    @property
    def initial(self) -> str:
        self.validate()
        return self._draft.initial[0]

    @property
    def finals(self) -> tuple[str, ...]:
        return tuple(self._draft.finals)

    @property
    def steps(self) -> Mapping[str, StepSpec]:
        return self._draft.steps

    @property
    def fingerprint(self) -> str:
        """A short hash of what changes behaviour: the structure (states, transitions,
        waits) and the context (its version and its JSON schema without titles and
        descriptions); not of the code: docstrings, step bodies, retry and timeout settings
        leave it unchanged (a body change is deployed as it is; see README, "Changing a
        workflow safely")."""
        self.validate()
        return self._fingerprint

    @property
    def machine(self) -> Machine:
        self.validate()
        assert self._machine is not None
        return self._machine

    def is_final(self, state: str) -> bool:
        return state in self._draft.finals

    def transitions(self) -> list[Transition]:
        """Every declared transition, read back from the ``transitions`` machine in
        declaration order (so diagrams and fingerprints are stable)."""
        machine = self._machine if self._machine is not None else self._build_machine()
        result: list[Transition] = []
        for state, targets in self._outgoing().items():
            for event in targets:
                for t in machine.get_transitions(trigger=event, source=state):
                    result.append(Transition(state, event, t.dest or state))
        return result

    def next_state(self, state: str, event: object) -> str:
        """The state that ``event`` leads to from ``state``; InvalidEvent if undeclared."""
        self.validate()
        if isinstance(event, str):
            dest = self._table.get((state, event))
            if dest is not None:
                return dest
        raise InvalidEvent(state, event, self._outgoing().get(state, {}).keys())

    def event_for(self, state: str, returned: object) -> str:
        """The event a step's return value means: a ``next=`` step returns ``None`` (or
        ``"next"``) and takes ``next``, and may sleep into no event, ``"next"`` or the
        state its ``next=`` names (``step.sleep(3d, "remind")`` before ``next="remind"``);
        an ``on=`` step returns an event, a str. A :class:`Sleep` carries its event.
        Anything else is an :class:`InvalidEvent` that names the mistake
        (flowloop/returns.py); an undeclared str is left to :meth:`next_state`."""
        spec = self._draft.steps[state]
        event = returned.event if isinstance(returned, Sleep) else returned
        if spec.returns_event:
            if isinstance(event, str):
                return event
        elif event is None or (isinstance(event, str) and event == NEXT_EVENT):
            return NEXT_EVENT
        elif isinstance(returned, Sleep) and event == spec.on[NEXT_EVENT]:
            return NEXT_EVENT  # (the sleep names the state it leads to)
        raise returns.bad_return(spec, returned)

    def structure(self) -> dict[str, Any]:
        """The definition as plain data: what a stored run's compatibility is judged on."""
        return self._draft.structure(self.name, on_deadline=self.on_deadline)

    def definition_record(self) -> dict[str, Any]:
        """:meth:`structure` with the context (version, normalized schema): what the
        fingerprint hashes and what the store keeps under it, so ``flowloop check`` can
        compare a stored run's context model with this one."""
        if self._frozen:
            return self._record
        return {
            **self.structure(),
            "context": {
                "version": self.context_version,
                "schema": upcast.schema_of(self.context),
            },
        }

    def on_cycle(self) -> set[str]:
        """States on a cycle (where ``max_visits`` matters)."""
        edges = {state: set(targets.values()) for state, targets in self._outgoing().items()}
        return graph.on_cycle(edges)

    def diagram(self) -> graphviz.Digraph:
        """This workflow drawn with graphviz: states, transitions labelled with their events,
        each step's settings. ``.source`` is the DOT text; ``.pipe(format="svg")`` needs the
        ``dot`` program (``flowloop.render.save`` turns its absence into a RenderError)."""
        from flowloop import render  # lazy: a definition must not need graphviz to load

        return render.workflow_digraph(self)

    # -- contexts --------------------------------------------------------------------------

    def parse_context(self, data: str | bytes | Mapping[str, Any] | BaseModel) -> BaseModel:
        """Validate a context given as JSON text, a mapping or a model instance."""
        try:
            if isinstance(data, BaseModel):  # (a copy: steps never share one)
                return context_from(self.context, data.model_dump())
            if not isinstance(data, (str, bytes, Mapping)):
                raise InvalidContext(
                    self.name, f"expected an object of fields, got {type(data).__name__}"
                )
            return context_from(
                self.context, data if isinstance(data, (str, bytes)) else dict(data)
            )
        except ValidationError as error:
            raise InvalidContext(self.name, describe_validation(error)) from error

    def parse_new_context(self, data: str | bytes | Mapping[str, Any] | BaseModel) -> BaseModel:
        """:meth:`parse_context` of a new run's context, given by a caller: a key that no
        field of the model takes is refused (pydantic dropped a misspelt one without a word,
        and the run started with that field's default) — unless the model says itself what
        becomes of extra keys (``model_config['extra']``) or reads its input its own way (a
        root model, a ``mode="before"`` model validator). An instance of the model is taken
        as it is; one of another model (a subclass of it too) is judged by its fields as the
        mapping of them would be: taken when the model has every one of them, refused when
        it has one the model has not (it was taken, that field's value dropped)."""
        if isinstance(data, BaseModel) and type(data) is not self.context:
            fields = data.model_dump()  # (what parse_context reads of it)
            if not _own_way(self.context):
                # (Its computed fields are no data of its own: nothing is lost without them.)
                computed = type(data).model_computed_fields
                given = [name for name in fields if name not in computed]
                self.check_fields(given, dumped=True, given=type(data))
            return self.parse_context(fields)
        if not _own_way(self.context):
            keys: Iterable[Any] = ()
            if isinstance(data, Mapping):
                keys = data.keys()
            elif isinstance(data, (str, bytes)):
                with contextlib.suppress(ValueError):  # (invalid JSON: validation says so)
                    parsed = json.loads(data)
                    keys = parsed.keys() if isinstance(parsed, dict) else ()
            if keys:
                self.check_fields(keys, dumped=True)
        return self.parse_context(data)

    def check_fields(
        self, names: Iterable[Any], *, dumped: bool = False, given: type | None = None
    ) -> None:
        """InvalidContext naming the ``names`` that no field of the context's model takes (by
        its name, alias or validation alias; with ``dumped``, a computed field's too, which
        a dumped context holds), with the keys it takes (and the class of the instance
        ``given``, whose fields the names are)."""
        model = self.context
        known = {*_input_keys(model), *(model.model_computed_fields if dumped else ())}
        unknown = sorted(str(name) for name in names if name not in known)
        if unknown:
            instead = "" if given is None else f"; the context given is a {given.__name__}"
            raise InvalidContext(
                self.name,
                f"no field(s) {', '.join(map(repr, unknown))} in {model.__name__} "
                f"(fields: {', '.join(_input_keys(model))}){instead}",
            )

    def load_context(self, text: str, version: int = 1) -> BaseModel:
        """A stored context (JSON text written at context ``version``) as this workflow's
        model: the upcasters from ``version`` run first. Raises InvalidContext (it does not
        validate) or ContextMigrationError (it cannot be migrated)."""
        if version == self.context_version:
            try:
                return context_from(self.context, text)
            except ValidationError as error:
                raise InvalidContext(self.name, describe_validation(error)) from error
        try:
            data = json.loads(text)
        except ValueError as error:
            raise InvalidContext(self.name, f"stored context is not JSON: {error}") from error
        if not isinstance(data, dict):
            raise InvalidContext(self.name, "stored context is not a JSON object")
        data = upcast.upcast(
            self.name,
            data,
            from_version=version,
            to_version=self.context_version,
            migrate=self.migrate,
        )
        return self.parse_context(data)

    def context_stamp(self) -> dict[str, Any]:
        """What an entry that writes a context of this workflow adds to its ``data``: its
        context version (nothing for version 1, so such journals stay as they were)."""
        if self.context_version == 1:
            return {}
        return {upcast.VERSION_KEY: self.context_version}

    @property
    def limited(self) -> bool:
        """Claims of this workflow count slots (``max_concurrency`` or ``concurrency_key``)."""
        return self.max_concurrency is not None or self.concurrency_key is not None

    def business_key(self, context: BaseModel) -> str | None:
        if self.key is None:
            return None
        value = getattr(context, self.key) if isinstance(self.key, str) else self.key(context)
        return None if value is None else str(value)


def _check_key(workflow: str, model: type[BaseModel], key: object) -> None:
    """DefinitionError unless ``key`` names a field (or property) of ``model`` or is a
    function: a misspelt name failed only when a run started, with a traceback."""
    if key is None or callable(key):
        return
    if not isinstance(key, str):
        raise DefinitionError(workflow, f"key={key!r} must be a field name or a function")
    if key in model.model_fields or key in model.model_computed_fields:
        return
    if (
        hasattr(model, key)  # a property, a cached_property, any attribute of the class
        or key in model.__private_attributes__
        or model.model_config.get("extra") == "allow"  # (extras are read as attributes)
        or any(
            "__getattr__" in vars(cls)
            for cls in model.__mro__
            if not cls.__module__.startswith("pydantic")
        )
    ):
        return  # (a model that answers attributes its own way: trusted, as before)
    fields = ", ".join(model.model_fields) or "none"
    raise DefinitionError(
        workflow,
        f"key={key!r} is not a field of {model.__name__} (fields: {fields}); name a field "
        "or pass a function of the context",
    )


@functools.cache
def _own_way(model: type[BaseModel]) -> bool:
    """Whether ``model`` decides itself what becomes of keys no field takes: extra keys
    configured, a root model, a model validator that sees the raw input."""
    if model.model_config.get("extra") is not None or issubclass(model, RootModel):
        return True
    decorators = model.__pydantic_decorators__
    validators: list[Any] = [*decorators.model_validators.values()]
    validators += decorators.root_validators.values()
    # (A v1-style @root_validator(pre=True) is filed apart, as a root validator "before".)
    return any(validator.info.mode in ("before", "wrap") for validator in validators)


def unknown_payload_keys(model: type[BaseModel], keys: Iterable[Any]) -> list[str]:
    """The ``keys`` that no field of ``model`` takes from an event's payload (see
    :func:`payload_keys`), sorted; none when the model decides itself what becomes of extra
    keys (``extra=`` configured, a root model, a raw-input validator): pydantic drops the
    others silently."""
    if _own_way(model):
        return []
    known = payload_keys(model)
    return sorted(str(key) for key in keys if key not in known)


@functools.cache
def payload_keys(model: type[BaseModel]) -> tuple[str, ...]:
    """The keys ``model.model_validate`` takes from a mapping — a payload is validated as
    pydantic does by default, by alias: an aliased field's alias (its validation alias's
    choices, a path's first key, when it has one), its name only when the model validates
    by name too (``populate_by_name``/``validate_by_name``); a field without an alias by
    its name. In the fields' order, for messages. (A context is validated by name as
    well: :func:`_input_keys`.)"""
    config = model.model_config
    by_name = bool(config.get("validate_by_name") or config.get("populate_by_name"))
    by_alias = config.get("validate_by_alias", True) is not False
    keys: dict[str, None] = {}
    for name, field in model.model_fields.items():
        alias = field.validation_alias if field.validation_alias is not None else field.alias
        if alias is None or by_name or not by_alias:
            keys[name] = None
        if alias is None or not by_alias:
            continue
        for choice in alias.choices if isinstance(alias, AliasChoices) else [alias]:
            key = choice.path[0] if isinstance(choice, AliasPath) and choice.path else choice
            if isinstance(key, str):
                keys[key] = None
    return tuple(keys)


@functools.cache
def _input_keys(model: type[BaseModel]) -> tuple[str, ...]:
    """The keys ``model`` takes from a mapping: its fields' names (contexts are validated
    by name too), aliases and validation aliases (each choice; a path's first key)."""
    keys: dict[str, None] = {}  # (in the fields' order, for messages)
    for name, field in model.model_fields.items():
        keys[name] = None
        for alias in (field.alias, field.validation_alias):
            for choice in alias.choices if isinstance(alias, AliasChoices) else [alias]:
                key = choice.path[0] if isinstance(choice, AliasPath) and choice.path else choice
                if isinstance(key, str):
                    keys[key] = None
    return tuple(keys)


def describe_validation(error: ValidationError) -> str:
    """A pydantic error on one line: ``field: problem; other: problem``."""
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(root)"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)
