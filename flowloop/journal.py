"""Journal events and the pure fold that turns a journal into a run's state.

Every change of a run row is the result of :func:`apply` on the journal event recorded
with it, in the same transaction. Replaying a journal from seq 1 with :func:`fold` therefore
reproduces the stored row exactly; :func:`compare` says where it does not.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, replace
from dataclasses import fields as dataclass_fields
from typing import Any, Final

from flowloop import frozen, lifecycle
from flowloop.errors import EXIT_FAILURE, FlowloopError

# Event kinds. The comment says what the event does to the run.
RUN_CREATED: Final = "run_created"  # state, context; status scheduled (due at next_run_at)
STEP_STARTED: Final = "step_started"  # status running, attempt
STEP_SUCCEEDED: Final = "step_succeeded"  # state -> next_state, context; succeeded if final
STEP_FAILED: Final = "step_failed"  # retrying (next_run_at) or failed
STEP_INTERRUPTED: Final = "step_interrupted"  # a step_started with no outcome, found later
RUN_FAILED: Final = "run_failed"  # failed outside a step (unreadable context, ...)
RUN_PAUSED: Final = "run_paused"
RUN_UNPAUSED: Final = "run_unpaused"
RUN_STOPPED: Final = "run_stopped"
RUN_RELEASED: Final = "run_released"  # handed back to the queue (shutdown, lost claim)
RUN_RETRIED: Final = "run_retried"  # an operator's retry, maybe from a past state
EVENT_RECEIVED: Final = "event_received"  # a wait state took an event (or its timeout)
EVENT_REJECTED: Final = "event_rejected"  # a kept event the wait could not take; still waits
RUN_DEFERRED: Final = "run_deferred"  # a rate limit / open breaker: due later, status kept
TURN: Final = "turn"
"""In a ``run_deferred`` entry's data: a map's child held back got its turn (its join wrote
it when a sibling's end made room); a wait it rests in counts its timeout from then."""
TURN_REASON: Final = "its turn came"
CHILDREN_STARTED: Final = "children_started"  # a call/map created its children; waits (no due)
CHILDREN_JOINED: Final = "children_joined"  # every child ended: state -> next_state, context
COMPENSATION_STARTED: Final = "compensation_started"  # status running, attempt
COMPENSATION_SUCCEEDED: Final = "compensation_succeeded"  # context; still running
COMPENSATION_FAILED: Final = "compensation_failed"  # retrying (next_run_at) or failed
RUN_COMPENSATED: Final = "run_compensated"  # every compensation ran: succeeded, reason
DEADLINE_PASSED: Final = "deadline_passed"  # state -> on_deadline; the deadline is spent
EVENT_DROPPED: Final = "event_dropped"  # a kept event dropped for max_inbox; only the seq
RUN_DEBOUNCED: Final = "run_debounced"  # a later start of a burst: context, due (admission.py)
RUN_MIGRATED: Final = "run_migrated"  # moved to a newer version: version, fingerprint, state
SLEEP_ENDED: Final = "sleep_ended"  # a step.sleep before a wait/final state ended: enters it
ASLEEP: Final = "asleep"
"""In a step's success into a wait or final state, true when ``step.sleep`` delays it: the
run rests there scheduled, due when the sleep ends, with this as its reason (it takes no
event, its timeout does not count, it does not end) until ``sleep_ended`` enters the state."""

TIMEOUT_EVENT: Final = "timeout"
"""The event a wait state takes when its ``timeout`` passes (an ``event_received`` entry
names it like any other event)."""

CONTEXT_VERSION: Final = "cv"
"""The ``data`` key of an entry that writes a context: the context's version (absent: 1)."""

KINDS: Final = (
    RUN_CREATED,
    STEP_STARTED,
    STEP_SUCCEEDED,
    STEP_FAILED,
    STEP_INTERRUPTED,
    RUN_FAILED,
    RUN_PAUSED,
    RUN_UNPAUSED,
    RUN_STOPPED,
    RUN_RELEASED,
    RUN_RETRIED,
    EVENT_RECEIVED,
    EVENT_REJECTED,
    RUN_DEFERRED,
    CHILDREN_STARTED,
    CHILDREN_JOINED,
    COMPENSATION_STARTED,
    COMPENSATION_SUCCEEDED,
    COMPENSATION_FAILED,
    RUN_COMPENSATED,
    DEADLINE_PASSED,
    RUN_DEBOUNCED,
    EVENT_DROPPED,
    RUN_MIGRATED,
    SLEEP_ENDED,
)
TRANSITIONS: Final = (STEP_SUCCEEDED, EVENT_RECEIVED, CHILDREN_JOINED, DEADLINE_PASSED)
"""Kinds that move a run to ``next_state`` (as does a ``step_failed`` or
``step_interrupted`` that carries one: an ``on_error`` route)."""
MOVES_ON: Final = (*TRANSITIONS, STEP_FAILED, STEP_INTERRUPTED)
"""Kinds of the entries that may move a run on: a failure when it names a next state."""
BEGINS: Final = (STEP_STARTED, CHILDREN_STARTED)
"""Kinds of the entries a run begins with: its first step's start, or its first call's or
map's children (both written by an executor). What may come before does not begin it: a
debounce, a rate limit's or breaker's deferral, a pause, a release, a migration, a passed
deadline, an event taken (maybe in its sender's process) or a kept one rejected. A
debounced start merges only into a run that has not begun; ``flowloop_runs_started``
counts a run at its first."""


@dataclass(frozen=True, kw_only=True)
class JournalEvent:
    """One boundary in a run's history. ``context`` is JSON text (the context after the
    event) and is only set by events that change the context."""

    run_id: str
    seq: int
    kind: str
    at: float
    state: str | None = None
    attempt: int = 0
    event: str | None = None
    next_state: str | None = None
    context: str | None = None
    duration: float | None = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None
    retryable: bool | None = None
    worker: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)


def new_event(fields: Mapping[str, Any]) -> JournalEvent:
    """``JournalEvent(**fields)`` for the executor's hot path (flowloop/frozen.py: 1.2 us
    against the generated ``__init__``'s 3.7; two events per step boundary)."""
    return frozen.build(JournalEvent, fields)


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """The part of a run row that the journal determines."""

    id: str
    workflow: str
    version: int
    fingerprint: str
    key: str | None
    status: str
    state: str
    context: str
    attempt: int
    visits: Mapping[str, int]
    next_run_at: float | None
    last_seq: int
    reason: str | None
    error: str | None
    context_version: int = 1
    """The context version ``context`` was written with (its entry's ``data["cv"]``)."""
    deadline: float | None = None
    """When the whole run's deadline passes (``None``: it has none, or it was spent)."""
    join: str | None = None
    """The join row this run reports its end to (a child of a call or map), else ``None``."""

    def visit(self, state: str) -> int:
        return self.visits.get(state, 0)

    @property
    def run_id(self) -> str:
        """:attr:`id`, by the name :class:`flowloop.Step` gives it: the loop watchdog names
        a running async step from either."""
        return self.id


class FoldError(FlowloopError):
    """A journal that cannot be folded (a bug or a tampered database); the message names
    the run and the row (``flowloop history RUN`` shows every readable row)."""

    exit_code = EXIT_FAILURE


UNREADABLE: Final = "unreadable"
"""The key of a journal row's ``data`` when the stored text was not a JSON object: the row
is still shown (with the reason under ``reason``), and folding it raises FoldError."""


def control_entry(action: str) -> tuple[str, dict[str, Any]]:
    """The kind and data of the entry honouring the request ``action`` (one of
    :data:`~flowloop.lifecycle.CONTROLS`): a pause its parent's cascaded says so."""
    if action not in lifecycle.CONTROLS:
        raise ValueError(f"not a control request: {action!r}")
    if action == lifecycle.STOP:
        return RUN_STOPPED, {}
    if action == lifecycle.PARENT_PAUSE:
        return RUN_PAUSED, {"reason": lifecycle.PARENT_PAUSED}
    return RUN_PAUSED, {}


def holds_context(record: RunRecord, text: str, version: int) -> bool:
    """Whether ``record``'s context is ``text`` itself (the same object, not an equal
    copy) at context ``version``: a parse of ``text`` at ``version`` can stand for it,
    without parsing it again."""
    return record.context is text and record.context_version == version


def load_data(text: str | None) -> dict[str, Any]:
    """A journal row's ``data`` column as a dict; a damaged one (not JSON, not an object)
    becomes ``{"unreadable": True, "reason": …}`` instead of making the whole journal
    unreadable."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if isinstance(value, dict):
        return value
    shown = text if len(text) <= 60 else text[:57] + "..."
    return {UNREADABLE: True, "reason": f"unreadable row: data is not a JSON object: {shown!r}"}


def _readable(event: JournalEvent) -> None:
    if event.data.get(UNREADABLE) is True:
        raise FoldError(
            f"run {event.run_id} seq {event.seq} ({event.kind}): its data is not JSON; "
            "the journal cannot be replayed past it (see `flowloop history`)"
        )


def _status(record: RunRecord, dest: str, event: JournalEvent) -> str:
    if not lifecycle.allowed(record.status, dest):
        raise FoldError(
            f"run {record.id} seq {event.seq} {event.kind}: "
            f"lifecycle does not allow {record.status} -> {dest}"
        )
    return dest


def create(event: JournalEvent) -> RunRecord:
    """The record a ``run_created`` event starts."""
    if event.kind != RUN_CREATED or event.state is None or event.context is None:
        raise FoldError(f"run {event.run_id}: journal must start with {RUN_CREATED}")
    _readable(event)
    data = event.data
    due = data.get("due", event.at)
    deadline = data.get("deadline")
    if deadline is not None:  # due by its deadline at the latest (a run starting to wait)
        due = deadline if due is None else min(due, deadline)
    return frozen.build(  # RunRecord(...) without its generated __init__ (once per run)
        RunRecord,
        {
            "id": event.run_id,
            "workflow": str(data["workflow"]),
            "version": int(data["version"]),
            "fingerprint": str(data["fingerprint"]),
            "key": data.get("key"),
            "status": "scheduled",
            "state": event.state,
            "context": event.context,
            "attempt": 0,
            "visits": {event.state: 1},
            "next_run_at": due,
            "last_seq": event.seq,
            "reason": None,
            "error": None,
            "context_version": int(data.get(CONTEXT_VERSION, 1)),
            "deadline": deadline,
            "join": data.get("join"),
        },
    )


def create_without_deadline(event: JournalEvent) -> RunRecord:
    """:func:`create` as if the run had no deadline: due when its creation says, not held
    to the deadline (what a run's own entries make it wait for: flowloop/dues.py,
    events.due_before_pause)."""
    data = {k: v for k, v in event.data.items() if k != "deadline"}
    return create(replace(event, data=data))


def _moved(record: RunRecord, event: JournalEvent, change: dict[str, Any]) -> None:
    """A transition: the run enters ``next_state`` (final: succeeded; else scheduled, due
    at the entry's ``due``, or now)."""
    assert event.next_state is not None
    final = bool(event.data.get("final"))
    visits = dict(record.visits)
    visits[event.next_state] = visits.get(event.next_state, 0) + 1
    change.update(
        status=_status(record, "succeeded" if final else "scheduled", event),
        state=event.next_state,
        context=event.context if event.context is not None else record.context,
        # An entry that writes a context says its version; one that does not (or a
        # version-1 workflow's) keeps the run's.
        context_version=int(event.data.get(CONTEXT_VERSION, record.context_version)),
        attempt=0,
        visits=visits,
        next_run_at=None if final else event.data.get("due", event.at),
        reason=ASLEEP if event.data.get(ASLEEP) else None,
        error=None,
    )


def apply(record: RunRecord, event: JournalEvent) -> RunRecord:
    """The record after ``event``. Pure: the executor and replay both use it."""
    if event.seq != record.last_seq + 1:
        raise FoldError(
            f"run {record.id}: seq {event.seq} follows {record.last_seq} (a journal row is "
            "missing; see `flowloop history`)"
        )
    if event.data and UNREADABLE in event.data:
        _readable(event)
    kind = event.kind
    change: dict[str, Any] = {"last_seq": event.seq}
    if kind == STEP_STARTED:
        change.update(
            status=_status(record, "running", event), attempt=event.attempt, next_run_at=None
        )
    elif kind in (STEP_SUCCEEDED, EVENT_RECEIVED, CHILDREN_JOINED):
        assert event.next_state is not None and event.context is not None
        _moved(record, event, change)
    elif kind in (STEP_FAILED, STEP_INTERRUPTED, DEADLINE_PASSED) and event.next_state:
        # An on_error route (or a passed deadline): the run moves on, the error kept for
        # the state it enters to see.
        _moved(record, event, change)
        if event.error_type:
            change["error"] = f"{event.error_type}: {event.error_message}"
        if kind == DEADLINE_PASSED:
            change["deadline"] = None
    elif kind in (STEP_FAILED, STEP_INTERRUPTED, COMPENSATION_FAILED):
        retry_at = event.data.get("retry_at")
        error = f"{event.error_type}: {event.error_message}" if event.error_type else None
        if retry_at is not None:
            change.update(
                status=_status(record, "retrying", event),
                next_run_at=retry_at,
                error=error,
                reason=None,
            )
        else:
            change.update(
                status=_status(record, "failed", event),
                next_run_at=None,
                error=error,
                reason=event.data.get("reason", "error"),
            )
    elif kind == CHILDREN_STARTED:
        # Waits for its children: due only when the join completes (the store sets it).
        change.update(status=_status(record, "scheduled", event), next_run_at=None)
    elif kind == COMPENSATION_STARTED:
        change.update(
            status=_status(record, "running", event), attempt=event.attempt, next_run_at=None
        )
    elif kind == COMPENSATION_SUCCEEDED:
        assert event.context is not None
        # Its version, as a transition's (absent: the run's — as entries written before
        # said nothing, and a version-1 context says nothing).
        version = int(event.data.get(CONTEXT_VERSION, record.context_version))
        change.update(context=event.context, context_version=version, attempt=0)
    elif kind == RUN_COMPENSATED:
        change.update(
            status=_status(record, "succeeded", event),
            next_run_at=None,
            reason=event.data.get("reason", "compensated"),
            error=None,
        )
    elif kind == RUN_FAILED:
        change.update(
            status=_status(record, "failed", event),
            next_run_at=None,
            reason=event.data.get("reason", "error"),
            error=event.error_message,
        )
    elif kind == RUN_PAUSED:
        change.update(
            status=_status(record, "paused", event),
            next_run_at=None,
            reason=event.data.get("reason", "paused"),
        )
    elif kind == RUN_UNPAUSED:
        change.update(
            status=_status(record, "scheduled", event),
            # A run waiting in a wait state keeps its timeout's due time (or none); one
            # asleep before its state sleeps on; one deferred is due then again, its
            # deferral's reason kept (a rate limit's queue serves it in its turn).
            next_run_at=event.data.get("due", event.at),
            reason=ASLEEP if event.data.get(ASLEEP) else event.data.get("reason"),
        )
    elif kind == RUN_STOPPED:
        change.update(
            status=_status(record, "stopped", event),
            next_run_at=None,
            reason=event.data.get("reason", "stopped"),
        )
    elif kind == RUN_RELEASED:
        change.update(
            status=_status(record, "scheduled", event),
            next_run_at=event.data.get("due", event.at),
        )
    elif kind == RUN_RETRIED:
        assert event.state is not None and event.context is not None
        visits = dict(record.visits)
        if event.state != record.state:
            visits[event.state] = visits.get(event.state, 0) + 1
        change.update(
            status=_status(record, "scheduled", event),
            state=event.state,
            context=event.context,
            context_version=int(event.data.get(CONTEXT_VERSION, 1)),
            attempt=0,
            visits=visits,
            # Due now, or (retried in a wait state) at its timeout, or not at all.
            next_run_at=event.data.get("due", event.at),
            reason=None,
            error=None,
        )
    elif kind == RUN_DEFERRED and event.data.get(TURN):
        # A map's child got its turn: due now, its status and reason kept (a child paused
        # by its parent stays "parent paused", for the parent's unpause to find).
        change.update(next_run_at=event.data["due"])
    elif kind == RUN_DEFERRED:
        # The step was not called (flowloop/gates.py): nothing but when and why changes.
        change.update(next_run_at=event.data["due"], reason=event.data.get("reason"))
    elif kind == RUN_DEBOUNCED:
        assert event.context is not None
        change["context"] = event.context
        # The later start's context version (absent: the run's, as entries written before).
        change["context_version"] = int(event.data.get(CONTEXT_VERSION, record.context_version))
        if record.status != "paused":  # (paused: due only when unpaused, at this due time)
            change["next_run_at"] = event.data.get("due", event.at)
    elif kind == SLEEP_ENDED:
        # The sleep before the run's state is over: it enters it now (ends in a final one).
        final = bool(event.data.get("final"))
        change.update(
            status=_status(record, "succeeded" if final else "scheduled", event),
            next_run_at=None if final else event.data.get("due", event.at),
            reason=None,
        )
    elif kind == RUN_MIGRATED:
        assert event.state is not None
        change.update(_migrated(record, event))
    elif kind not in (
        EVENT_REJECTED,
        EVENT_DROPPED,
    ):  # a rejected or dropped kept event changes nothing but the seq
        raise FoldError(f"run {record.id} seq {event.seq}: unknown event kind {kind!r}")
    if record.deadline is not None and change.get("deadline", 1) is not None:
        # A run with a deadline is due by it at the latest (waiting, sleeping, retrying).
        status = change.get("status", record.status)
        if status in lifecycle.CLAIMABLE:
            due = change.get("next_run_at", record.next_run_at)
            change["next_run_at"] = record.deadline if due is None else min(due, record.deadline)
    # dataclasses.replace re-runs __init__ through a generic path (~7 us, twice per step);
    # a frozen dataclass without __post_init__ can be copied field by field instead.
    new = object.__new__(RunRecord)
    new.__dict__.update(record.__dict__)
    new.__dict__.update(change)
    return new


_EVENT_DEFAULTS: Final = {
    spec.name: spec.default
    for spec in dataclass_fields(JournalEvent)
    if spec.default is not MISSING
}
"""A new event's fields before its own are set (``data`` has a factory: always given)."""


def _made(fields: Mapping[str, Any]) -> JournalEvent:
    """A :class:`JournalEvent` from fields this module names itself (every required one and
    ``data``), its dict filled at once: :func:`new_event` without the checks a caller's
    typo needs."""
    event = object.__new__(JournalEvent)
    made = vars(event)
    made.update(_EVENT_DEFAULTS)
    made.update(fields)
    return event


_NOT_STRAIGHT_ON: Final = frozenset({"final", "compensate", "due", UNREADABLE})
"""Keys of a success's data that make it another boundary than :func:`went_on`'s."""


def went_on(
    record: RunRecord,
    *,
    at: float,
    worker: str,
    event: str,
    next_state: str,
    context: str,
    duration: float,
    data: Mapping[str, Any],
    started: Mapping[str, Any],
) -> tuple[JournalEvent, JournalEvent, RunRecord]:
    """The usual boundary of a run going on: its running step's success into a step due at
    once, and that step's start, both ``at``. Returns the two events and the record after
    them: what :func:`apply` gives for the one and then the other (the tests hold it to
    that), built in one copy of the record instead of two. ``data`` is the success's (no
    ``final``, ``compensate`` or ``due``: an end, a compensation or a durable sleep is not
    this boundary), ``started`` the start's."""
    if record.status != "running" or not data.keys().isdisjoint(_NOT_STRAIGHT_ON):
        raise ValueError(
            f"run {record.id}: went_on takes a running step's success into a step due now "
            f"(status {record.status}, data {sorted(data)})"
        )
    seq = record.last_seq + 1
    run_id = record.id
    succeeded = _made(
        {
            "run_id": run_id,
            "seq": seq,
            "kind": STEP_SUCCEEDED,
            "at": at,
            "state": record.state,
            "attempt": record.attempt,
            "event": event,
            "next_state": next_state,
            "context": context,
            "duration": duration,
            "worker": worker,
            "data": data,
        }
    )
    start = _made(
        {
            "run_id": run_id,
            "seq": seq + 1,
            "kind": STEP_STARTED,
            "at": at,
            "state": next_state,
            "attempt": 1,
            "worker": worker,
            "data": started,
        }
    )
    visits = dict(record.visits)
    visits[next_state] = visits.get(next_state, 0) + 1
    after = object.__new__(RunRecord)
    fields = vars(after)
    fields.update(vars(record))
    fields.update(
        last_seq=seq + 1,
        status="running",
        state=next_state,
        context=context,
        context_version=int(data.get(CONTEXT_VERSION, record.context_version)),
        attempt=1,
        visits=visits,
        next_run_at=None,
        reason=None,
        error=None,
    )
    return succeeded, start, after


def _migrated(record: RunRecord, event: JournalEvent) -> dict[str, Any]:
    """``flowloop migrate``: the run follows version ``to`` (its fingerprint) from the
    mapped state on; a parked run is unparked (``status``/``due`` in the data)."""
    assert event.state is not None
    data = event.data
    visits = dict(record.visits)
    if event.state != record.state:  # the state mapped to counts the visit on
        # With ``kept_visits`` (every such entry written now), the state left keeps its
        # count too: a call or map state's join and children are named by its visit, and a
        # run migrated out of one and back found its earlier visit's join again — renamed
        # away and brought back by a later version, it collided with it. (Without it, as
        # entries were written before: replays still match the rows written then.)
        left = visits.get(record.state, 0) if data.get("kept_visits") else None
        moved = visits.pop(record.state, 0) if left is None else left
        if not data.get("same_visit"):  # (back to a name whose count holds this visit)
            visits[event.state] = visits.get(event.state, 0) + moved
    change: dict[str, Any] = {
        "version": int(data["to"]),
        "fingerprint": str(data["fingerprint"]),
        "state": event.state,
        "visits": visits,
    }
    if "status" in data:
        change.update(
            status=_status(record, str(data["status"]), event),
            next_run_at=data.get("due"),
            reason=ASLEEP if data.get(ASLEEP) else None,  # (moved asleep: sleeps on)
            error=None,
        )
    return change


def fold(events: Iterable[JournalEvent], *, until_seq: int | None = None) -> RunRecord:
    """Replay a journal from seq 1 (up to and including ``until_seq``)."""
    record: RunRecord | None = None
    for event in events:
        if until_seq is not None and event.seq > until_seq:
            break
        record = create(event) if record is None else apply(record, event)
    if record is None:
        raise FoldError("empty journal")
    return record


COMPARED_FIELDS: Final = (
    "status",
    "state",
    "context",
    "context_version",
    "attempt",
    "visits",
    "last_seq",
)


def compare(folded: RunRecord, stored: RunRecord) -> list[str]:
    """Differences between a folded journal and the stored row, one line each."""
    diffs = []
    for name in COMPARED_FIELDS:
        a, b = getattr(folded, name), getattr(stored, name)
        if name == "visits":
            a, b = dict(a), dict(b)
        if a != b:
            diffs.append(f"{name}: journal says {a!r}, row says {b!r}")
    return diffs
