"""Debounced and throttled starts: the engine's side of flowloop/admission.py (the policy)
and flowloop/store/admission.py (the SQL)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from flowloop import admission, backpressure
from flowloop import journal as j
from flowloop.errors import KeyTaken
from flowloop.runinfo import StartedRuns
from flowloop.store.admission import AdmissionStoreMixin
from flowloop.store.base import InboxEvent, NewRun, StoredRun

if TYPE_CHECKING:
    from flowloop.definition import Workflow
    from flowloop.engine import Engine

T = TypeVar("T")


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
        recurring=True,
    )
    group = admission.admission_key(key if key is not None else new.record.key)
    if window is not None:
        marker = admission.debounce_marker(workflow.name, group)
        # Due as this start's own run would be: one window from now, or (its first state a
        # wait) when the wait's timeout passes counted from then (none without a timeout).
        due = new.events[0].data["due"]
        with engine._making(new):
            stored, made = store.debounce_start(
                _keyless(new, marker, group), marker, due=due, now=now, key=group
            )
        if not made:
            engine._unmade(new)  # merged into the run the burst already has
        return stored
    assert limit is not None
    prefix = admission.throttle_prefix(workflow.name, group)
    with engine._making(new):
        stored_or_none, retry_at = store.throttled_start(
            _keyless(new, prefix + new.record.id, group),
            prefix,
            since=now - limit.period,
            decide=lambda times: admission.throttle_verdict(times, limit, now),
        )
    if stored_or_none is None:
        engine._unmade(new)
        raise admission.StartThrottled(
            workflow.name, group, limit.limit, limit.period, retry_at=retry_at, now=now
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


# -- backpressure (flowloop/backpressure.py) ----------------------------------------------


def _blocking(timeout: float, attempt: Callable[[], T | None]) -> tuple[T | None, float]:
    """``attempt()`` until it gives a result or ``timeout`` seconds have passed (polling)."""
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    while True:
        result = attempt()
        if result is not None or time.monotonic() >= deadline:
            return result, time.monotonic() - started
        time.sleep(min(backpressure.BLOCK_POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def bounded_start(engine: Engine, workflow: Workflow, new: NewRun) -> tuple[StoredRun, bool]:
    """Create ``new`` under its workflow's ``max_queued`` and ``queue_overflow``."""
    bounds = workflow.bounds
    assert bounds.max_queued is not None
    store = engine.store
    assert isinstance(store, AdmissionStoreMixin)
    limit = bounds.max_queued

    def attempt() -> tuple[StoredRun, bool] | None:
        return store.start_bounded(
            new,
            limit,
            drop_oldest=bounds.queue_overflow == "drop_oldest",
            now=engine.clock.now(),
            worker=engine.worker_id,
        )

    if bounds.queue_overflow != "block":
        created = attempt()
        if created is None:
            raise backpressure.queue_full(workflow.name, bounds)
        return created
    created, waited = _blocking(bounds.overflow_timeout, attempt)
    if created is None:
        raise backpressure.queue_full(workflow.name, bounds, waited=waited)
    return created


def bounded_many(
    engine: Engine,
    workflow: Workflow,
    news: Sequence[NewRun],
    *,
    progress: Callable[[int, int], None] | None = None,
) -> StartedRuns:
    """:meth:`Engine.start_many` under the workflow's ``max_queued``: one run at a time, as
    :meth:`Engine.start` creates one (a batch's transaction would pass the bound by). The
    runs created before a refusal stay; the error says how many."""
    infos, created = [], 0
    for done, new in enumerate(news):
        try:
            with engine._making(new):
                stored, made = bounded_start(engine, workflow, new)
        except BaseException as error:
            for rest in news[done + 1 :]:  # never made: their traces are not kept
                engine._unmade(rest)
            if not isinstance(error, backpressure.QueueFull):
                raise
            raise backpressure.QueueFull(
                f"{error} ({created} run(s) of {len(news)} were created before it, "
                f"{done - created} found by their key)"
            ) from None
        if not made:
            engine._unmade(new)
        created += made
        infos.append(engine._info(stored))
        if progress is not None:
            progress(done + 1, len(news))
    return StartedRuns(tuple(infos), created)


def keep_bounded(engine: Engine, workflow: Workflow, message: InboxEvent) -> str:
    """Keep ``message`` under its workflow's ``max_inbox`` and ``inbox_overflow``
    (``"buffered"`` or ``"duplicate"``), or raise :class:`~flowloop.backpressure.InboxFull`."""
    bounds = workflow.bounds
    assert bounds.max_inbox is not None
    store = engine.store
    assert isinstance(store, AdmissionStoreMixin)
    limit = bounds.max_inbox

    def attempt() -> str | None:
        result = store.keep_bounded(
            message,
            limit,
            drop_oldest=bounds.inbox_overflow == "drop_oldest",
            now=engine.clock.now(),
            worker=message.sender or engine.worker_id,
        )
        return None if result in ("full", "busy") else result

    # drop_oldest waits (briefly) for a worker holding the run to let go of it.
    timeout = 0.0 if bounds.inbox_overflow == "reject_newest" else bounds.overflow_timeout
    result, waited = _blocking(timeout, attempt)
    if result is None:
        raise backpressure.inbox_full(
            message.run_id, bounds, waited=waited if bounds.inbox_overflow == "block" else None
        )
    return result


def refuse_foreign(stored: StoredRun, workflow: Workflow, new: NewRun) -> None:
    """A run found by ``new``'s idempotency key (keys are unique across workflows) must
    be a run of ``workflow``: another's would be returned, driven and waited for as this
    one's (its states judged by the wrong definition)."""
    found = stored.record.workflow
    if found != workflow.name and new.idempotency_key is not None:
        raise KeyTaken(new.idempotency_key, stored.id, found, workflow.name)
