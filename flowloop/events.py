"""Events sent to waiting runs, and the data of entering a state: pure decisions.

A wait state has no step. A run that enters one is released (no worker, no thread) with a
due time only when the state has a timeout. An event sent to it (or the timeout) becomes an
``event_received`` journal entry that moves the run on, exactly like a step's success.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

from pydantic import AliasChoices, BaseModel, ValidationError

from flowloop import journal as j
from flowloop import lifecycle
from flowloop.contexts import context_from
from flowloop.definition import TIMEOUT_EVENT, Workflow, describe_validation
from flowloop.errors import (
    FlowloopError,
    InvalidEvent,
    InvalidTransition,
    MaxVisitsExceeded,
    error_line,
    storable,
)
from flowloop.journal import JournalEvent, RunRecord


class InvalidPayload(FlowloopError):
    """An event's payload does not validate against the model the wait state declares."""


class UnknownPayloadField(InvalidPayload):
    """A payload (a mapping) with a key that no field of the event's payload model takes:
    pydantic dropped it without a word (a misspelt optional field: the event was applied
    without it). ``fields``: the keys refused; ``model``: the model; ``event``: the event.
    Nothing was written; the run still waits."""

    def __init__(self, model: type[BaseModel], event: str, fields: Sequence[str]) -> None:
        from flowloop.definition import payload_keys
        from flowloop.suggest import did_you_mean

        known = payload_keys(model)
        meant = did_you_mean(fields[0], known, n=1, shown=repr)
        hint = f"; {meant}" if meant else ""
        noun = "field" if len(fields) == 1 else "fields"
        super().__init__(
            f"no {noun} {', '.join(map(repr, fields))} in {model.__name__}, the payload of "
            f"{event!r}{hint} (fields: {', '.join(known)})"
        )
        self.model = model
        self.event = event
        self.fields = tuple(fields)


class NeverAccepted(InvalidEvent):
    """An event to keep (``buffer=True``) that no wait state of the workflow accepts: it
    would sit in the run's inbox forever."""

    def __init__(self, workflow: str, event: str, accepted: Iterable[str]) -> None:
        accepted_list = ", ".join(sorted(set(accepted))) or "none"
        FlowloopError.__init__(
            self,
            f"no wait state of workflow {workflow!r} accepts event {event!r}, so it cannot "
            f"be kept for later (its wait states accept: {accepted_list})",
        )
        self.state = ""
        self.event = event


class NotWaiting(InvalidTransition):
    """The run's state accepts the event, but the run cannot take it now (it is paused, or
    asleep before the state: ``step.sleep``)."""

    def __init__(
        self, run_id: str, status: str, state: str, event: str, *, asleep: bool = False
    ) -> None:
        where = (
            f"asleep before state {state!r} (step.sleep)"
            if asleep
            else f"{status} in state {state!r}"
        )
        first = "" if asleep else "unpause it first, or "
        FlowloopError.__init__(
            self,
            f"run {run_id!r} is {where}: it cannot take event {event!r} now ({first}send "
            f"with buffer=True / --buffer to keep the event until it can)",
        )
        self.run_id = run_id
        self.status = status


class EventRefused(FlowloopError):
    """An event sent to a waiting run that its wait state's handler refused: the handler
    raised (its error is the ``__cause__``), or left the context invalid. Nothing was
    written; the run still waits."""

    def __init__(self, state: str, event: str, error: Exception) -> None:
        if isinstance(error, ValidationError):
            why = f"its handler left the context invalid: {describe_validation(error)}"
        else:
            why = f"its handler raised {type(error).__name__}: {error_line(error)}"
        super().__init__(
            f"state {state!r} refused event {event!r}: {why}; the run still waits there"
        )
        self.state = state
        self.event = event


def entering(workflow: Workflow, state: str, now: float, *, delay: float = 0.0) -> dict[str, Any]:
    """The ``data`` of a transition into ``state``: final, due now, due at the wait's
    timeout, or not due at all (a wait without one). A durable ``delay`` (``step.sleep``)
    makes it due only then: a step, call or map state starts then, a compensating state's
    compensations run then; a wait or final state is entered then (``j.ASLEEP``: its
    timeout counts, or the run ends, from the ``sleep_ended`` entry then)."""
    # The entry writes a context: it says which context version (issue 16).
    stamp = workflow.context_stamp()
    if delay and workflow.compensates(state):
        return {"compensate": True, "due": now + delay, **stamp}
    if delay and (workflow.is_final(state) or state in workflow.waits):
        return {"due": now + delay, j.ASLEEP: True, **stamp}
    if workflow.compensates(state):
        return {"compensate": True, **stamp}  # due now: its compensations run before it ends
    if workflow.is_final(state):
        return {"final": True, **stamp}
    wait = workflow.waits.get(state)
    if wait is not None:
        return {"due": None if wait.timeout is None else now + wait.timeout, **stamp}
    return {"due": now + delay, **stamp} if delay else stamp


def keeping_context(data: dict[str, Any], record: RunRecord) -> dict[str, Any]:
    """``data`` (of :func:`entering`) for an entry that keeps the run's context as it was
    (an ``on_error`` route, a passed deadline): it says the version of that context, the
    run's, not the definition's. (It said the definition's: a version-1 context then read
    as version 2 was not upcast — a run stuck, its worker's task dead, or parked.)"""
    data.pop(j.CONTEXT_VERSION, None)
    if record.context_version != 1:
        data[j.CONTEXT_VERSION] = record.context_version
    return data


def check_visits(workflow: Workflow, record: RunRecord, target: str) -> None:
    limit = workflow.max_visits(target)
    if limit is not None and record.visit(target) >= limit:
        raise MaxVisitsExceeded(
            f"state {target!r} would be visited {record.visit(target) + 1} times "
            f"(max_visits={limit})"
        )


def accepted(workflow: Workflow, state: str) -> list[str]:
    """Events a state accepts from outside (none unless it is a wait state)."""
    wait = workflow.waits.get(state)
    return [] if wait is None else list(wait.on)


def accepts(workflow: Workflow, record: RunRecord, event: str) -> bool:
    """Whether the run, as it is now, can take ``event`` (it waits in a state that accepts
    it; the timeout is only ever fired by a worker)."""
    return (
        record.status == "scheduled"
        and record.reason != j.ASLEEP  # (asleep before the state: not there yet)
        and event in accepted(workflow, record.state)
    )


def check_bufferable(
    workflow: Workflow, event: str, payload: str | None, *, state: str | None = None
) -> None:
    """Refuse, before it is stored, an event that could never be taken later: one no wait
    state accepts, or whose payload no accepting state's model validates (``state``: the
    run waits there and accepts it now, so its model decides)."""
    if state is not None and event in accepted(workflow, state):
        _payload(workflow.waits[state].payloads.get(event), event, payload)
        return
    takers = [wait for wait in workflow.waits.values() if event in wait.on]
    if not takers:
        raise NeverAccepted(
            workflow.name, event, (e for wait in workflow.waits.values() for e in wait.on)
        )
    first: InvalidPayload | None = None
    for wait in takers:
        try:
            _payload(wait.payloads.get(event), event, payload)
            return
        except InvalidPayload as error:
            first = first or error
    assert first is not None
    raise first


def check_payload_keys(
    workflow: Workflow,
    event: str,
    payload: Any,
    *,
    state: str | None = None,
    buffer: bool = False,
) -> None:
    """Refuse (:class:`UnknownPayloadField`) a payload mapping with a key that no field of
    the event's payload model takes (:func:`~flowloop.definition.payload_keys`: an aliased
    field's alias, its name only when the model validates by name too). ``state``: the run
    waits there and accepts the event now, so its model decides; else, with ``buffer``
    (kept for later), the models of every wait state that takes it: refused only when none
    takes the key, so not when one of them has no model (any payload goes). A model that
    says itself what becomes of extra keys (``extra="allow"``, a root model, a raw-input
    validator) takes them as before. Anything else wrong (the event not taken now, by no
    state) is left to the send to say. (The rule of ``engine.send``, the dashboard's send
    and ``flowloop send --data``.)"""
    from flowloop.definition import unknown_payload_keys

    if not isinstance(payload, Mapping) or not payload:
        return
    if state is not None and event in accepted(workflow, state):
        waits = [workflow.waits[state]]
    elif buffer:
        waits = [wait for wait in workflow.waits.values() if event in wait.on]
    else:
        return  # (not taken now: the send says why)
    if not waits or any(event not in wait.payloads for wait in waits):
        return  # (none takes it: the send says so; one without a model takes any payload)
    models = [wait.payloads[event] for wait in waits]
    unknown = [unknown_payload_keys(model, payload) for model in models]
    if all(unknown):
        raise UnknownPayloadField(models[0], event, unknown[0])


ENTRIES: Final = (j.RUN_CREATED, j.RUN_DEBOUNCED, j.RUN_RETRIED, j.SLEEP_ENDED)
"""Kinds that enter the state they name (``state``), not moving the run from another."""


def entry_into(state: str, events: Sequence[JournalEvent]) -> JournalEvent | None:
    """The entry by which the run last entered ``state``: a transition or an ``on_error``
    route into it (any entry with it as ``next_state``), its creation, a later start of its
    debounce burst (a creation again: context and due time) or an operator's retry there,
    the end of a sleep before it, or a migration that set its due time; a migration that
    renamed the state is followed to the entry into the old name."""
    looking = state
    for event in reversed(events):
        if event.kind == j.RUN_MIGRATED and event.state == looking:
            if "due" in event.data:
                return event
            looking = str(event.data.get("from_state", looking))
            continue
        begun = event.kind in ENTRIES or is_turn(event)
        if event.next_state == looking or (begun and event.state == looking):
            return event
    return None


def is_turn(event: JournalEvent) -> bool:
    """The entry that says a map's child held back got its turn (written by its join when
    a sibling's end makes room, flowloop/store/joins.py): a wait it rests in counts its
    timeout from then, not from its creation."""
    return event.kind == j.RUN_DEFERRED and bool(event.data.get(j.TURN))


def wait_due(workflow: Workflow, state: str, events: Sequence[JournalEvent]) -> float | None:
    """When the run's wait in ``state`` times out (``None``: it has no timeout): the due
    time stored when the run last entered ``state`` (:func:`entry_into`), or that entry's
    time plus the timeout. An unpaused run goes back to waiting with it, so it is not timed
    out early."""
    wait = workflow.waits.get(state)
    if wait is None or wait.timeout is None:
        return None
    entry = entry_into(state, events)
    if entry is None:
        return float("-inf")  # no entry found: treat as overdue (the timeout fires)
    if is_turn(entry):
        return entry.at + wait.timeout  # a map's child held back: from its turn
    if entry.data.get(j.ASLEEP):  # (not waiting yet: from the end of its sleep)
        return float(entry.data["due"]) + wait.timeout
    # (A creation's due is its run_at plus the timeout; none for a map's child held back,
    # whose turn's entry then counts.)
    due = entry.data.get("due")
    return float(due) if due is not None else entry.at + wait.timeout


def stored_wait_due(state: str, events: Sequence[JournalEvent]) -> tuple[bool, float | None]:
    """The due time the run's last entry into the wait state ``state`` stored (its timeout's;
    ``None``: it has none), read from the journal alone, without the definition: whether
    that entry tells it (a creation without one does not: a map's child held back), and
    the due time."""
    entry = entry_into(state, events)
    if entry is None or "due" not in entry.data or is_turn(entry) or entry.data.get(j.ASLEEP):
        # (A turn's due is when it came, an unended sleep's when it ends: the timeout is
        # the definition's.)
        return False, None
    due = entry.data["due"]
    if entry.kind == j.RUN_CREATED and due is None:
        return False, None
    return True, None if due is None else float(due)


def asleep_until(state: str, events: Sequence[JournalEvent]) -> float | None:
    """When the sleep (``step.sleep``) before the run's wait or final state ``state`` ends,
    while the run has not entered it yet; else ``None``."""
    entry = entry_into(state, events)
    if entry is None or not entry.data.get(j.ASLEEP):
        return None
    return float(entry.data["due"])


BEGUN: Final = (j.STEP_STARTED, j.CHILDREN_STARTED, j.COMPENSATION_STARTED)
"""Kinds that begin a step, call, map or compensating state: a sleep before it is over."""


def sleep_end(state: str, events: Sequence[JournalEvent], *, wait: bool) -> float | None:
    """When the sleep (``step.sleep``) before the run's state ``state`` ends while the run
    has not entered it yet, else ``None``. Before a wait (``wait``) or final state the
    entry into it says so (``asleep``: :func:`asleep_until`); before a step, call, map or
    compensating state it is the due time of the success into it (or of a migration that
    kept a sleep) while nothing has begun there since — a step, its children, its
    compensations. (A due time written under an older version, a migration since, may be
    a wait's timeout: not taken for a sleep.) A debounced run's window before its first
    step is no sleep: a rate limit or breaker may have deferred the run since, and an
    unpause finds the window's end, or the deferral's, by :func:`due_before_pause`. Nor is
    the sleep's end once a claim after it moved the run's due time — a rate limit or
    breaker deferred it (``run_deferred``), a release handed it back due at another time:
    the sleep is over, and that due time (and reason) is the run's."""
    entry = entry_into(state, events)
    due = None if entry is None else entry.data.get("due")
    if entry is None or not isinstance(due, (int, float)):
        return None
    if any(e.seq > entry.seq and _moved_due(e, due) for e in events):
        return None
    if entry.data.get(j.ASLEEP):
        trusted = True
    elif wait:
        return None  # (a wait's due time is its timeout's)
    elif entry.kind == j.STEP_SUCCEEDED:
        trusted = not any(e.kind == j.RUN_MIGRATED and e.seq > entry.seq for e in events)
    else:
        trusted = entry.kind == j.RUN_MIGRATED
    if not trusted or any(e.kind in BEGUN and e.seq > entry.seq for e in events):
        return None
    return float(due)


def _moved_due(event: JournalEvent, due: float) -> bool:
    """Whether ``event`` set the run's due time to other than ``due``: a deferral, or a
    release due at another time (one due then, a shutdown's, keeps the sleep)."""
    if event.kind == j.RUN_DEFERRED:
        return True
    return event.kind == j.RUN_RELEASED and event.data.get("due", event.at) != due


def due_before_pause(
    events: Sequence[JournalEvent], *, waited: Callable[[str, str], bool] | None = None
) -> tuple[float | None, str | None]:
    """When a paused run was due before the pause it is in (the first of its pauses since
    it was last unpaused), and its reason then, read from the journal without the
    definition: the row its entries fold to just before that pause — due at its creation's
    ``run_at``, a failure's ``retry_at``, a deferral's (a rate limit, an open breaker: its
    reason says so, and a rate limit serves it in its queue's turn by it), a debounce's,
    an earlier unpause's; at once (``None``, or a time past) when it was due then, or ran.
    A later start of its debounce burst taken while it was paused (``run_debounced``: the
    row stays undue) makes it due when that start's window ends, as it would have unpaused.
    Its deadline is left out: the unpause's entry is held to it again, and a due time
    only the deadline's (a call or map state waiting for its children, a map's child held
    back: the store makes them due, not the journal) is not taken for the run's own.
    Paused in a wait state (``waited(fingerprint, state)``: whether the definition it was
    on then has ``state`` as a wait) and migrated since to another state or version, its
    due time then was the wait's timeout: not the run's any more, it is due at once, as a
    migration makes a waiting run it moves out of its wait (flowloop/migration.py).
    ``(None, None)`` when the journal cannot be folded."""
    record: j.RunRecord | None = None
    before: j.RunRecord | None = None
    try:
        for event in events:
            if record is None:
                record = j.create_without_deadline(event)
                continue
            if event.kind == j.RUN_PAUSED and record.status != "paused":
                before = record
            elif event.kind == j.RUN_DEBOUNCED and record.status == "paused" and before is not None:
                before = dataclasses.replace(before, next_run_at=event.data.get("due", event.at))
            record = j.apply(record, event)
    except j.FoldError:
        return None, None
    if record is None or record.status != "paused" or before is None:
        return None, None
    if before.status not in lifecycle.CLAIMABLE:
        return None, None  # (running when paused: due at once)
    moved = (before.state, before.fingerprint) != (record.state, record.fingerprint)
    if moved and waited is not None and waited(before.fingerprint, before.state):
        return None, None  # (its wait's timeout, the wait left: due at once)
    reason = None if before.reason == j.ASLEEP else before.reason
    return before.next_run_at, reason


def asleep_before(workflow: Workflow, state: str) -> bool:
    """Whether a sleep before ``state`` is journaled ``asleep`` (a wait or final state, not a
    compensating one: the run enters it by ``sleep_ended``), rather than just due then."""
    if workflow.compensates(state):
        return False
    return state in workflow.waits or workflow.is_final(state)


def slept_past_deadline(record: RunRecord, events: Sequence[JournalEvent]) -> bool:
    """Whether a run in a compensating state, its deadline passed, is still asleep before
    the state (``step.sleep``): :func:`asleep_past` of its state and deadline. The deadline
    then moves it to ``on_deadline``, as it does any sleeping run; compensations begun (or
    due) before it are not cut off."""
    return asleep_past(record.state, record.deadline, events)


def asleep_past(state: str, deadline: float | None, events: Sequence[JournalEvent]) -> bool:
    """Whether a run in ``state`` (a compensating one) is asleep before it until
    ``deadline`` or later: the entry into it is due no sooner than the deadline and no
    compensation has begun since (the engine's rule, :func:`slept_past_deadline`; the
    CLI and dashboard say by it where the deadline moves such a run: flowloop/dues.py)."""
    entry = entry_into(state, events)
    if entry is None or deadline is None:
        return False
    due = entry.data.get("due")
    if not isinstance(due, (int, float)) or due < deadline:
        return False
    return not any(e.kind == j.COMPENSATION_STARTED and e.seq > entry.seq for e in events)


def receive(
    workflow: Workflow,
    record: RunRecord,
    event: str,
    payload: str | None,
    *,
    now: float,
    worker: str,
    extra: dict[str, Any] | None = None,
) -> tuple[JournalEvent, RunRecord]:
    """The ``event_received`` entry for ``event`` (or the timeout) in the run's wait state,
    with the payload validated and merged by the state's handler, and the record after it."""
    wait = workflow.waits.get(record.state)
    if wait is None or event not in wait.transitions:
        raise InvalidEvent(record.state, event, accepted(workflow, record.state))
    target = wait.transitions[event]
    check_visits(workflow, record, target)
    ctx = workflow.load_context(record.context, record.context_version)
    if event != TIMEOUT_EVENT:
        value = _payload(wait.payloads.get(event), event, payload)
        handler = wait.handlers.get(event)
        if handler is not None:
            handler(ctx, value)
    context = ctx.model_dump_json()
    context_from(workflow.context, context)
    data = {**entering(workflow, target, now), **(extra or {})}
    received = JournalEvent(
        run_id=record.id,
        seq=record.last_seq + 1,
        kind=j.EVENT_RECEIVED,
        at=now,
        state=record.state,
        event=event,
        next_state=target,
        context=context,
        worker=worker,
        data=data,
    )
    return received, j.apply(record, received)


def reject_kept(
    record: RunRecord,
    event: str,
    error: Exception,
    *,
    sent_at: float,
    now: float,
    worker: str,
) -> tuple[JournalEvent, RunRecord]:
    """The ``event_rejected`` entry for a kept (buffered) event the run's wait state cannot
    take — its handler raised, its payload does not fit this state's model, … The sender
    is long gone, so the event leaves the inbox with the reason in the journal and the run
    keeps waiting (for its other kept events, new ones, or its timeout)."""
    text = str(error).strip()
    rejected = JournalEvent(
        run_id=record.id,
        seq=record.last_seq + 1,
        kind=j.EVENT_REJECTED,
        at=now,
        state=record.state,
        event=event,
        error_type=type(error).__name__,
        error_message=storable(text.splitlines()[0]) if text else None,
        worker=worker,
        data={"buffered_at": sent_at},
    )
    return rejected, j.apply(record, rejected)


def _payload(model: Any, event: str, payload: str | None) -> Any:
    if payload is None:
        raw: Any = None
    else:
        try:
            raw = json.loads(payload)
        except json.JSONDecodeError as error:
            raise InvalidPayload(f"payload of event {event!r} is not JSON: {error}") from None
    if model is None:
        return raw
    try:
        return model.model_validate(raw if raw is not None else {})
    except ValidationError as error:
        raise InvalidPayload(
            f"payload of event {event!r} is invalid: {describe_validation(error)}"
        ) from None


def payload_json(payload: BaseModel, declared: Sequence[type[BaseModel]]) -> dict[str, Any]:
    """``payload`` as the JSON object a send journals: dumped by field name, as always,
    unless the models ``declared`` for the event (its wait states' ``payloads=``) do not
    all take that: a model with aliases is validated by alias, and its by-name dump lost
    those fields (``Field required``). Then the first of: keyed by each field's validation
    alias, dumped by alias, that they all take. No model declared: by name (a handler
    gets the dict)."""
    by_name = payload.model_dump(mode="json")
    if not declared:
        return by_name
    model = type(payload)
    for dumped in (
        by_name,
        _by_validation_alias(model, by_name),
        payload.model_dump(mode="json", by_alias=True),
    ):
        try:
            for taker in declared:
                taker.model_validate(dumped)
        except Exception:  # (a validator's own error too: try the next keys)
            continue
        return dumped
    return by_name


def _by_validation_alias(model: type[BaseModel], by_name: dict[str, Any]) -> dict[str, Any]:
    """``by_name`` with each field's key the first name it is validated by (its validation
    alias, else its alias, else its name; a path alias keeps the name)."""
    keyed = dict(by_name)
    for name, field in model.model_fields.items():
        if name not in keyed:
            continue
        key = field.validation_alias if field.validation_alias is not None else field.alias
        if isinstance(key, AliasChoices):
            key = key.choices[0]
        if isinstance(key, str) and key != name:
            keyed[key] = keyed.pop(name)
    return keyed


def declared_payloads(workflow: Workflow, event: str) -> list[type[BaseModel]]:
    """The payload models ``workflow``'s wait states declare for ``event``."""
    found = (wait.payloads.get(event) for wait in workflow.waits.values())
    return list(dict.fromkeys(model for model in found if model is not None))
