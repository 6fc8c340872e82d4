"""A run's trace context, as stored in its ``run_created`` entry (pure; no OpenTelemetry).

A run is one trace span; its id is chosen when the run is created and journaled with it
(``data["trace"]``), so every process that later executes, recovers or finishes the run —
after a crash, on any worker — puts its spans in the same trace, under the same run span.
The run span's parent is the caller's span when the run was started inside one (a W3C
``traceparent`` carrier). A run journaled without a trace context (created while tracing
was off) gets one derived from its id, the same in every process.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from flowloop.errors import FlowloopError

TRACE_KEY: Final = "trace"
"""Where ``run_created``'s data keeps the trace context."""
TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
_TRACEPARENT_RE: Final = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE: Final = "0" * 32
_ZERO_SPAN: Final = "0" * 16


class InvalidTraceContext(FlowloopError):
    """A trace context that is not a W3C ``traceparent``: pass ``{"traceparent":
    "00-<32 hex>-<16 hex>-<2 hex>"}`` (what ``opentelemetry.propagate.inject`` writes)."""


@dataclass(frozen=True, kw_only=True)
class RunTrace:
    """The trace a run belongs to, and its own span in it."""

    trace_id: str
    """32 lowercase hex digits."""
    span_id: str
    """The run span's id: 16 lowercase hex digits."""
    parent_id: str | None = None
    """The caller's span the run was started in, if any."""
    sampled: bool = True
    tracestate: str | None = None

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {"trace_id": self.trace_id, "span_id": self.span_id}
        if self.parent_id is not None:
            data["parent_id"] = self.parent_id
        if not self.sampled:
            data["sampled"] = False
        if self.tracestate:
            data["tracestate"] = self.tracestate
        return data

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> RunTrace:
        return cls(
            trace_id=str(data["trace_id"]),
            span_id=str(data["span_id"]),
            parent_id=data.get("parent_id"),
            sampled=bool(data.get("sampled", True)),
            tracestate=data.get("tracestate"),
        )

    @property
    def traceparent(self) -> str:
        """The run span as a W3C ``traceparent`` (to hand to a system a step calls)."""
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


def _span_id() -> str:
    while True:
        value = secrets.token_hex(8)
        if value != _ZERO_SPAN:
            return value


def new_run_trace(carrier: Mapping[str, str] | None = None) -> RunTrace:
    """A trace context for a new run: a child of the ``traceparent`` in ``carrier`` if one is
    given, else the root of a new trace. Raises InvalidTraceContext for a malformed one."""
    if carrier is not None and (isinstance(carrier, str | bytes) or not hasattr(carrier, "get")):
        raise InvalidTraceContext(
            f"trace_context must be a mapping of headers, not {type(carrier).__name__}: pass "
            '{"traceparent": "00-<32 hex>-<16 hex>-<2 hex>"}'
        )
    if carrier:
        header = _header(carrier, TRACEPARENT)
        match = _TRACEPARENT_RE.match(header.strip().lower()) if isinstance(header, str) else None
        if match is None or match.group(1) == "ff":
            raise InvalidTraceContext(
                f"trace_context {_shown(carrier)!r} has no valid W3C traceparent "
                '(expected {"traceparent": "00-<32 hex>-<16 hex>-<2 hex>"})'
            )
        version, trace_id, parent_id, flags = match.groups()
        if trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
            raise InvalidTraceContext(f"trace_context {header!r}: an all-zero id is invalid")
        del version
        return RunTrace(
            trace_id=trace_id,
            span_id=_span_id(),
            parent_id=parent_id,
            sampled=bool(int(flags, 16) & 1),
            tracestate=_tracestate(carrier) or None,
        )
    trace_id = secrets.token_hex(16)
    return RunTrace(trace_id=trace_id if trace_id != _ZERO_TRACE else "1" * 32, span_id=_span_id())


def _header(carrier: Mapping[str, str], name: str) -> str | None:
    """The header ``name`` of ``carrier``, its name matched case-insensitively (HTTP's are:
    a framework's dict of a request's headers may say ``Traceparent``). Any object with
    ``get`` serves — ``http.server``'s and ``wsgiref``'s headers are no Mapping, and their
    own ``get`` ignores case already."""
    value = carrier.get(name)
    if value is None and hasattr(carrier, "items"):
        value = next((v for k, v in carrier.items() if str(k).lower() == name), None)
    return value


def _tracestate(carrier: Mapping[str, str]) -> str | None:
    """The ``tracestate`` header; several (an email Message's headers keep each) are one
    list, joined with commas as W3C Trace Context says (``get`` gave the first only)."""
    get_all = getattr(carrier, "get_all", None)
    if callable(get_all):
        values = [str(value) for value in get_all(TRACESTATE) or ()]
        if values:
            return ",".join(values)
    return _header(carrier, TRACESTATE)


def _shown(carrier: Mapping[str, str]) -> Any:
    """The carrier as a message shows it."""
    try:
        return dict(carrier)
    except (TypeError, ValueError):
        return carrier


def derived_run_trace(run_id: str) -> RunTrace:
    """The trace of a run journaled without one: derived from its id, so every process
    agrees on it without a write."""
    digest = hashlib.sha256(f"flowloop-trace:{run_id}".encode()).hexdigest()
    trace_id, span_id = digest[:32], digest[32:48]
    return RunTrace(
        trace_id=trace_id if trace_id != _ZERO_TRACE else "1" * 32,
        span_id=span_id if span_id != _ZERO_SPAN else "1" * 16,
    )


def run_trace(run_id: str, created_data: Mapping[str, Any]) -> RunTrace:
    """The trace of a run, from its ``run_created`` data (or derived from its id)."""
    stored = created_data.get(TRACE_KEY)
    if isinstance(stored, Mapping):
        try:
            return RunTrace.from_data(stored)
        except (KeyError, TypeError, ValueError):
            pass  # unreadable: fall back to the derived trace, never fail a run over it
    return derived_run_trace(run_id)


def stored_trace(first_entries: Sequence[Any]) -> RunTrace | None:
    """The trace a run journaled in its ``run_created`` entry (the first of
    ``first_entries``, journal events), or ``None`` when it journaled none (tracing off)."""
    if not first_entries:
        return None
    stored = getattr(first_entries[0], "data", {}).get(TRACE_KEY)
    if not isinstance(stored, Mapping):
        return None
    try:
        return RunTrace.from_data(stored)
    except (KeyError, TypeError, ValueError):
        return None


def child_run_trace(parent: RunTrace, child_id: str) -> RunTrace:
    """A child run's trace: its parent's trace, under the parent's run span; its own span id
    derived from its id, so a fan-out re-done after a crash journals the same one."""
    return RunTrace(
        trace_id=parent.trace_id,
        span_id=derived_run_trace(child_id).span_id,
        parent_id=parent.span_id,
        sampled=parent.sampled,
        tracestate=parent.tracestate,
    )
