"""OpenTelemetry traces of runs: one span per run, one per step attempt, joined across
crashes, resumes and workers (``pip install 'flowloop[otel]'``).

:func:`instrument` adds a listener to an engine. The executor calls it after each committed
boundary, and it turns the journal entries into spans with their recorded times — nothing
runs inside a step, and nothing is exported for work that was not committed:

* a **step attempt** span ends when the attempt's outcome is journaled (``step_succeeded``,
  ``step_failed``, or ``step_interrupted`` when a later process finds the attempt cut off by
  a crash: status error, ``flowloop.interrupted = true``); it starts at its
  ``step_started``;
* the **run** span (start: ``run_created``, end: the boundary that finishes the run) is
  exported by whichever process finishes the run, with span events for retries, waits,
  timers, events received, interruptions, pauses and stops read from the journal.

The run span's id is chosen when the run is created and journaled with it
(:mod:`flowloop.tracecontext`), so attempt spans written by any process — before a crash,
after a resume, on another worker — name it as their parent before it exists. The run span
is a child of the span the run was started in: ``engine.start(..., trace_context=carrier)``,
or the current OpenTelemetry span when none is given.

This module is the only one that imports OpenTelemetry; flowloop never imports it unless
:func:`instrument` is called, so an engine without tracing pays nothing for it.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from flowloop.errors import FlowloopError, MissingExtra

try:
    from opentelemetry import trace as api
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import Tracer as SdkTracer
    from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    from opentelemetry.util.types import AttributeValue
except ModuleNotFoundError as missing:
    raise MissingExtra("flowloop.tracing needs OpenTelemetry", missing.name, "otel") from None

from flowloop import journal as j
from flowloop.definition import TIMEOUT_EVENT, Workflow
from flowloop.journal import JournalEvent, RunRecord
from flowloop.lifecycle import FINISHED
from flowloop.tracecontext import RunTrace, new_run_trace, run_trace

if TYPE_CHECKING:
    from flowloop.engine import Engine

log = logging.getLogger("flowloop.tracing")

SCOPE: Final = "flowloop"
"""The instrumentation scope of every span."""

# Attribute names.
WORKFLOW: Final = "flowloop.workflow"
VERSION: Final = "flowloop.version"
RUN_ID: Final = "flowloop.run_id"
STATE: Final = "flowloop.state"
ATTEMPT: Final = "flowloop.attempt"
OUTCOME: Final = "flowloop.outcome"
EVENT: Final = "flowloop.event"
NEXT_STATE: Final = "flowloop.next_state"
STATUS: Final = "flowloop.status"
INTERRUPTED: Final = "flowloop.interrupted"
ERROR_TYPE: Final = "error.type"

MAX_TRACKED_RUNS: Final = 10_000
"""Runs whose trace this process keeps in memory between boundaries (past it: forgotten,
read back from the journal when needed)."""
_OUTCOMES: Final = frozenset({j.STEP_SUCCEEDED, j.STEP_FAILED, j.STEP_INTERRUPTED})
_PROPAGATOR: Final = TraceContextTextMapPropagator()


def _ns(at: float) -> int:
    return int(at * 1e9)


class _StoredIds(IdGenerator):
    """Random ids, except while a span whose ids were journaled is being started."""

    def __init__(self, fallback: IdGenerator) -> None:
        self.fallback = fallback
        self.forced: contextvars.ContextVar[tuple[int | None, int] | None] = contextvars.ContextVar(
            "flowloop_forced_ids", default=None
        )

    def generate_span_id(self) -> int:
        forced = self.forced.get()
        return forced[1] if forced is not None else self.fallback.generate_span_id()

    def generate_trace_id(self) -> int:
        forced = self.forced.get()
        if forced is not None and forced[0] is not None:
            return forced[0]
        return self.fallback.generate_trace_id()

    @contextmanager
    def use(self, trace_id: int | None, span_id: int) -> Iterator[None]:
        token = self.forced.set((trace_id, span_id))
        try:
            yield
        finally:
            self.forced.reset(token)


def current_carrier() -> dict[str, str] | None:
    """The current OpenTelemetry span as a W3C carrier, or ``None`` outside any span."""
    if not api.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def _flags(trace: RunTrace) -> api.TraceFlags:
    return api.TraceFlags(api.TraceFlags.SAMPLED if trace.sampled else api.TraceFlags.DEFAULT)


def _remote(trace_id: str, span_id: str, trace: RunTrace) -> Context:
    state = api.TraceState.from_header([trace.tracestate]) if trace.tracestate else None
    parent = api.SpanContext(
        trace_id=int(trace_id, 16),
        span_id=int(span_id, 16),
        is_remote=True,
        trace_flags=_flags(trace),
        trace_state=state,
    )
    return api.set_span_in_context(api.NonRecordingSpan(parent))


SpanEvent = tuple[str, dict[str, AttributeValue], float]
"""A span event: name, attributes, time (epoch seconds)."""


@dataclass
class _Run:
    """What this process knows of a run it traces."""

    trace: RunTrace
    parent: Context
    """The context the run's attempt spans are children of (the run span)."""
    created_at: float | None = None
    """Set when this process saw the run created: then, while every boundary since was seen
    here too (``seen`` follows the journal's seq), the run span needs no journal read."""
    seen: int = 0
    events: list[SpanEvent] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.created_at is not None


class RunTracing:
    """The listener :func:`instrument` installs (see the module docstring)."""

    def __init__(self, engine: Engine, tracer: api.Tracer) -> None:
        self.engine = engine
        self.tracer = tracer
        if not isinstance(tracer, SdkTracer):
            raise FlowloopError(
                "flowloop tracing needs the OpenTelemetry SDK's TracerProvider (it journals "
                "each run's span id and must give the run span that id): set one with "
                "opentelemetry.trace.set_tracer_provider(TracerProvider(...)) or pass "
                "tracer_provider="
            )
        self._ids = _StoredIds(tracer.id_generator or RandomIdGenerator())
        tracer.id_generator = self._ids
        self._started: dict[str, JournalEvent] = {}
        """The ``step_started`` this process committed for each run, until its outcome."""
        self._runs: dict[str, _Run] = {}

    def new_run(self, run_id: str, carrier: Mapping[str, str] | None) -> dict[str, Any]:
        """The trace context a new run journals (``Engine.trace_new``): a child of
        ``carrier``, else of the current span, else a new trace."""
        trace = new_run_trace(carrier if carrier is not None else current_carrier())
        if run_id not in self._runs:  # (an id a run has already: its trace stays)
            self._remember(run_id, trace)
        return trace.to_data()

    def forget(self, run_id: str) -> None:
        """The trace :meth:`new_run` made for a run that was not made after all."""
        self._runs.pop(run_id, None)

    def _remember(self, run_id: str, trace: RunTrace, created_at: float | None = None) -> _Run:
        if len(self._runs) > MAX_TRACKED_RUNS:  # runs that never finish here must not pile up
            self._runs.clear()
        run = self._runs[run_id] = _Run(
            trace=trace,
            parent=_remote(trace.trace_id, trace.span_id, trace),
            created_at=created_at,
        )
        return run

    # -- the listener ----------------------------------------------------------------------

    def __call__(self, record: RunRecord, events: Sequence[JournalEvent]) -> None:
        if not events:
            return
        run = self._runs.get(record.id)
        if events[0].kind == j.RUN_CREATED:
            trace = run_trace(record.id, events[0].data)
            run = self._remember(record.id, trace, created_at=events[0].at)
        elif run is not None and run.complete and events[0].seq != run.seen + 1:
            run.created_at = None  # boundaries written elsewhere: read the journal at the end
        for event in events:
            if event.kind == j.STEP_STARTED:
                self._started[event.run_id] = event
            elif event.kind in _OUTCOMES:
                self._attempt(record, event)
            if run is not None and run.complete:
                run.events.extend(
                    (name, attributes, event.at)
                    for name, attributes in self._events_of(record.workflow, event)
                )
        if run is not None:
            run.seen = events[-1].seq
        if record.status in FINISHED:
            self._started.pop(record.id, None)
            self._finish(record, events[-1], run)
            self._runs.pop(record.id, None)

    def _trace(self, run_id: str) -> _Run:
        known = self._runs.get(run_id)
        if known is not None:
            return known
        created = next(iter(self.engine.store.journal(run_id, until_seq=1)), None)
        return self._remember(run_id, run_trace(run_id, created.data if created else {}))

    def _workflow(self, name: str) -> Workflow | None:
        return self.engine.workflows.get(name)

    def _start_of(self, outcome: JournalEvent) -> JournalEvent | None:
        started = self._started.pop(outcome.run_id, None)
        if started is not None and started.state == outcome.state:
            return started
        if outcome.kind != j.STEP_INTERRUPTED and outcome.duration is not None:
            return None  # the outcome's duration places the start
        # Started by another process (the one a crash cut off): read it back.
        for event in reversed(self.engine.store.journal(outcome.run_id, until_seq=outcome.seq)):
            if event.kind == j.STEP_STARTED:
                return event
        return None

    def _base(self, record: RunRecord) -> dict[str, AttributeValue]:
        return {WORKFLOW: record.workflow, VERSION: record.version, RUN_ID: record.id}

    def _attempt(self, record: RunRecord, outcome: JournalEvent) -> None:
        parent = self._trace(record.id).parent
        started = self._start_of(outcome)
        start = started.at if started is not None else outcome.at - (outcome.duration or 0.0)
        state = outcome.state or record.state
        attributes = self._base(record)
        attributes.update({STATE: state, ATTEMPT: outcome.attempt or record.attempt or 1})
        retry_at = outcome.data.get("retry_at")
        if outcome.kind == j.STEP_SUCCEEDED:
            attributes[OUTCOME] = "succeeded"
            if outcome.event is not None:
                attributes[EVENT] = outcome.event
            if outcome.next_state is not None:
                attributes[NEXT_STATE] = outcome.next_state
        elif outcome.kind == j.STEP_INTERRUPTED:
            attributes.update(
                {OUTCOME: "interrupted", INTERRUPTED: True, ERROR_TYPE: "Interrupted"}
            )
        else:
            attributes[OUTCOME] = "retried" if retry_at is not None else "failed"
            attributes[ERROR_TYPE] = outcome.error_type or "Error"
        span = self.tracer.start_span(
            f"flowloop.step {record.workflow}.{state}",
            context=parent,
            kind=api.SpanKind.INTERNAL,
            attributes=attributes,
            start_time=_ns(start),
        )
        if outcome.kind != j.STEP_SUCCEEDED:
            message = f"{outcome.error_type}: {outcome.error_message}"
            span.add_event(
                "exception",
                {
                    "exception.type": outcome.error_type or "Error",
                    "exception.message": outcome.error_message or "",
                    **({"exception.stacktrace": outcome.traceback} if outcome.traceback else {}),
                },
                timestamp=_ns(outcome.at),
            )
            span.set_status(api.Status(api.StatusCode.ERROR, message))
        for name, event_attributes in self._events_of(record.workflow, outcome):
            span.add_event(name, event_attributes, timestamp=_ns(outcome.at))
        span.end(end_time=_ns(outcome.at))

    def _events_of(
        self, workflow_name: str, event: JournalEvent
    ) -> list[tuple[str, dict[str, AttributeValue]]]:
        """The span events one journal entry stands for: retries, waits, timers, received
        events, interruptions, pauses and stops."""
        kind, data = event.kind, event.data
        state = event.state or ""
        found: list[tuple[str, dict[str, AttributeValue]]] = []
        if kind in (j.STEP_FAILED, j.STEP_INTERRUPTED) and data.get("retry_at") is not None:
            found.append(
                (
                    "flowloop.retry",
                    {STATE: state, ATTEMPT: event.attempt, "flowloop.retry_at": data["retry_at"]},
                )
            )
        if kind == j.STEP_INTERRUPTED:
            found.append(("flowloop.interrupted", {STATE: state, ATTEMPT: event.attempt}))
        if kind in (j.STEP_SUCCEEDED, j.EVENT_RECEIVED) and event.next_state is not None:
            workflow = self._workflow(workflow_name)
            due = data.get("due")
            if kind == j.EVENT_RECEIVED:
                name = "flowloop.timeout" if event.event == TIMEOUT_EVENT else "flowloop.event"
                found.append(
                    (name, {STATE: state, EVENT: event.event or "", NEXT_STATE: event.next_state})
                )
            if (
                workflow is not None
                and event.next_state in workflow.waits
                and not data.get(j.ASLEEP)  # (asleep before it: a timer, then the wait)
            ):
                attributes: dict[str, AttributeValue] = {STATE: event.next_state}
                if due is not None:
                    attributes["flowloop.timeout_at"] = due
                found.append(("flowloop.wait", attributes))
            elif due is not None and due > event.at and not data.get("final"):
                found.append(("flowloop.timer", {STATE: event.next_state, "flowloop.due": due}))
        if kind == j.SLEEP_ENDED and "due" in data:  # (a final state's has none)
            # The sleep before a wait state ended: the wait begins (its timeout, if any).
            began: dict[str, AttributeValue] = {STATE: state}
            if data.get("due") is not None:
                began["flowloop.timeout_at"] = data["due"]
            found.append(("flowloop.wait", began))
        if kind in (j.RUN_PAUSED, j.RUN_UNPAUSED, j.RUN_STOPPED, j.RUN_RETRIED, j.RUN_FAILED):
            found.append((f"flowloop.{kind}", {STATE: state}))
        return found

    def _finish(self, record: RunRecord, last: JournalEvent, run: _Run | None) -> None:
        attributes = self._base(record)
        attributes.update({STATUS: record.status, STATE: record.state})
        if record.error:
            attributes[ERROR_TYPE] = record.error.split(":", 1)[0]
        if run is not None and run.created_at is not None:
            # Every boundary of the run was seen here: no need to read its journal back.
            self._run_span(record, run.trace, run.created_at, last.at, attributes, run.events)
            return
        journal = self.engine.store.journal(record.id)
        if not journal:
            return
        trace = run_trace(record.id, journal[0].data)
        reruns = [event for event in journal if event.kind == j.RUN_RETRIED]
        since = reruns[-1].seq if reruns else 0
        events = [
            (name, event_attributes, event.at)
            for event in journal
            if event.seq >= since
            for name, event_attributes in self._events_of(record.workflow, event)
        ]
        if reruns:
            # The run span ended at the first finish; an operator's retry is its own span.
            span = self.tracer.start_span(
                f"flowloop.rerun {record.workflow}",
                context=_remote(trace.trace_id, trace.span_id, trace),
                attributes=attributes,
                start_time=_ns(reruns[-1].at),
            )
            self._end(span, record, events, last.at)
            return
        self._run_span(record, trace, journal[0].at, last.at, attributes, events)

    def _run_span(
        self,
        record: RunRecord,
        trace: RunTrace,
        start: float,
        end: float,
        attributes: dict[str, AttributeValue],
        events: Sequence[SpanEvent],
    ) -> None:
        """The run span, with the id journaled when the run was created."""
        if trace.parent_id is not None:
            context, root_trace = _remote(trace.trace_id, trace.parent_id, trace), None
        else:
            context, root_trace = Context(), int(trace.trace_id, 16)
        with self._ids.use(root_trace, int(trace.span_id, 16)):
            span = self.tracer.start_span(
                f"flowloop.run {record.workflow}",
                context=context,
                attributes=attributes,
                start_time=_ns(start),
            )
        self._end(span, record, events, end)

    def _end(
        self, span: api.Span, record: RunRecord, events: Sequence[SpanEvent], end: float
    ) -> None:
        for name, attributes, at in events:
            span.add_event(name, attributes, timestamp=_ns(at))
        if record.status != "succeeded":
            span.set_status(api.Status(api.StatusCode.ERROR, record.error or record.status))
        span.end(end_time=_ns(end))


def instrument(engine: Engine, *, tracer_provider: api.TracerProvider | None = None) -> RunTracing:
    """Trace ``engine``'s runs with OpenTelemetry (the global tracer provider unless given;
    it must be the SDK's). Call it before the engine runs anything: a worker, or a
    ``run_until_idle`` in progress, keeps the listeners it started with (the executors
    ``engine.run`` keeps per thread are reached). Runs started from now on record the
    caller's current span (or ``trace_context=``) as their parent. Returns the listener.

    Raises FlowloopError when the provider is not the OpenTelemetry SDK's."""
    with engine._listening:  # one listener, however many threads instrument at once
        for listener in engine.listeners:
            if isinstance(listener, RunTracing):
                return listener  # instrumented already: a second would double every span
        provider = tracer_provider or api.get_tracer_provider()
        from flowloop import __version__

        tracing = RunTracing(engine, provider.get_tracer(SCOPE, __version__))
        engine.listen(tracing, direct=True)  # executors kept already by threads too
        engine.trace_new = tracing.new_run
        engine.trace_forget = tracing.forget
    return tracing


def carrier_of(trace: Mapping[str, Any]) -> dict[str, str]:
    """The W3C carrier of a stored run trace (``run_created``'s ``data["trace"]``)."""
    return {"traceparent": RunTrace.from_data(trace).traceparent}


EXPORTERS: Final = ("console", "otlp", "none")
"""What ``OTEL_TRACES_EXPORTER`` may name for :func:`instrument_from_env`."""


def instrument_from_env(engine: Engine) -> RunTracing:
    """:func:`instrument` with the global tracer provider — set up here from the standard
    ``OTEL_*`` environment when the application has not set one: ``OTEL_TRACES_EXPORTER``
    ``console`` (spans as JSON on stderr; the default), ``otlp`` (needs
    ``opentelemetry-exporter-otlp``) or ``none``; ``OTEL_SERVICE_NAME`` names the service.
    What the provider holds is exported when the process exits."""
    import atexit
    import os
    import sys

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
        SpanExporter,
    )

    current = api.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return instrument(engine, tracer_provider=current)
    name = (os.environ.get("OTEL_TRACES_EXPORTER") or "console").split(",")[0].strip().lower()
    if name not in EXPORTERS:
        raise FlowloopError(
            f"OTEL_TRACES_EXPORTER={name!r} is not supported here; use one of "
            f"{', '.join(EXPORTERS)} (or set up a TracerProvider in your own code)"
        )
    provider = TracerProvider(resource=Resource.create())
    if name == "console":
        exporter: SpanExporter = ConsoleSpanExporter(out=sys.stderr)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise FlowloopError(
                "OTEL_TRACES_EXPORTER=otlp needs pip install opentelemetry-exporter-otlp-proto-http"
            ) from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    api.set_tracer_provider(provider)
    atexit.register(provider.shutdown)
    return instrument(engine, tracer_provider=provider)
