"""Debounced and throttled starts: the engine's side of flowloop/admission.py (the policy)
and flowloop/store/admission.py (the SQL)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from flowloop import admission
from flowloop import journal as j
from flowloop.store.admission import AdmissionStoreMixin
from flowloop.store.base import NewRun, StoredRun

if TYPE_CHECKING:
    from flowloop.definition import Workflow
    from flowloop.engine import Engine


def admitted_start(
    engine: Engine,
    workflow: Workflow,
    context: BaseModel | Mapping[str, Any] | str,
    *,
    key: str | None,
    priority: int,
    debounce: float | timedelta | None,
    throttle: tuple[int, float | timedelta] | None,
    trace_context: Mapping[str, str] | None,
) -> StoredRun:
    """Start under ``debounce`` or ``throttle`` (see :mod:`flowloop.admission`). Every
    argument is checked before anything is written."""
    if debounce is not None and throttle is not None:
        raise admission.AdmissionError("give debounce= or throttle=, not both")
    window = None if debounce is None else admission.seconds_of(debounce, "debounce")
    limit = None if throttle is None else admission.throttle_of(throttle)
    store = engine.store
    if not isinstance(store, AdmissionStoreMixin):
        raise admission.AdmissionError("this store does not support debounce or throttle")
    now = engine.clock.now()
    new = engine._new_run(
        workflow,
        context,
        key=key,
        idempotency_key=None,
        priority=priority,
        run_at=None if window is None else now + window,
        owner=None,
        trace_context=trace_context,
    )
    group = admission.admission_key(key if key is not None else new.record.key)
    if window is not None:
        marker = admission.debounce_marker(workflow.name, group)
        stored, _ = store.debounce_start(
            _keyless(new, marker, group), marker, due=now + window, now=now, key=group
        )
        return stored
    assert limit is not None
    prefix = admission.throttle_prefix(workflow.name, group)
    stored_or_none, retry_at = store.throttled_start(
        _keyless(new, prefix + new.record.id, group),
        prefix,
        since=now - limit.period,
        decide=lambda times: admission.throttle_verdict(times, limit, now),
    )
    if stored_or_none is None:
        raise admission.StartThrottled(
            workflow.name, group, limit.limit, limit.period, retry_at - now
        )
    return stored_or_none


def _keyless(new: NewRun, idempotency_key: str, group: str) -> NewRun:
    """``new`` without a business key (a key's bursts and throttled runs recur), its
    admission key kept in the journal."""
    [created] = new.events
    created = dataclasses.replace(
        created, data={**created.data, "key": None, "admission_key": group}
    )
    return dataclasses.replace(
        new, record=j.create(created), events=[created], idempotency_key=idempotency_key
    )
