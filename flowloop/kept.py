"""Events kept for a waiting run (its inbox) and handed over once it accepts them."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from sqlalchemy.exc import TimeoutError as PoolTimeout

from flowloop.definition import Workflow
from flowloop.errors import error_line, storable
from flowloop.events import accepted, accepts, receive, reject_kept, wait_due
from flowloop.journal import (
    ASLEEP,
    RUN_FAILED,
    RUN_PAUSED,
    RUN_RELEASED,
    JournalEvent,
    RunRecord,
)
from flowloop.parking import halt_entry, park, write_waiting
from flowloop.store import Boundary, Fence, InboxEvent, Store, StoredRun
from flowloop.store.inbox import InboxStoreMixin
from flowloop.store.joins import JoinStoreMixin
from flowloop.store.outage import is_outage
from flowloop.verdicts import Verdict, judge
from flowloop.versions import Registry, workflow_for

if TYPE_CHECKING:
    from flowloop.executor import Executor

log = logging.getLogger("flowloop")

INVALID_ROW: Final = "invalid_row"
"""The reason a run whose row cannot be read fails with (as a claim fails it)."""


@dataclass
class HandOver:
    """How far one :func:`deliver_pending` went, also when it raised: the events that
    left the inbox, and the ``last_seq`` of the run as it last read it."""

    taken: int = 0
    seq: int | None = None


def deliver_pending(
    store: Store,
    workflows: Mapping[str, Workflow],
    run_id: str,
    *,
    now: float,
    worker: str,
    park_refused: bool = False,
    done: HandOver | None = None,
) -> int:
    """Hand a waiting run the oldest buffered events its current state accepts, one after
    another (each may lead to another wait); one it cannot take is rejected (journaled, out
    of the inbox) and the next is tried. Returns how many left the inbox (also counted in
    ``done``, which says how far it went when it raises).
    ``park_refused``: the recovery sweep's hand-over, which would otherwise find the run
    again at every look (a wait without a timeout is never claimed): a run the loaded
    definition cannot take is parked (as a claim parks it; its kept events stay kept),
    and one whose row cannot be read (``stored.problem``) is failed ``invalid_row``, as a
    claim fails it (:func:`fail_unreadable`), not left as it is."""
    done = HandOver() if done is None else done
    while True:
        pending = store.pending_events(run_id)
        if not pending:  # the usual case: one read, nothing kept for this run
            return done.taken
        stored = store.get_run(run_id)
        if stored is None or stored.record.workflow not in workflows:
            return done.taken
        done.seq = stored.record.last_seq
        workflow = workflow_for(workflows, stored.record)
        record = stored.record
        if not _waiting(store, workflow, stored):
            return done.taken  # taken by a worker, paused, stopped, gone on, asleep, held
        if stored.problem is not None:
            # Its row cannot be read: nothing may move it on (it would be written back
            # without what could not be read). Failed as a claim fails it, once, when asked.
            if park_refused:
                fail_unreadable(store, stored, now=now, worker=worker)
            return done.taken
        refused = refusal(store, workflow, record)
        if refused is not None:
            # A definition that would park it: a claim or a start parks it (a wait
            # without a timeout is never claimed: the sweep parks it, when asked).
            if park_refused:
                _park(store, stored, refused, now=now, worker=worker)
            return done.taken
        message = next((m for m in pending if accepts(workflow, record, m.event)), None)
        if message is None:
            return done.taken
        entry, after = take_kept(workflow, record, message, now=now, worker=worker)
        boundary = Boundary(events=[entry], record=after, fence=Fence(None, stored.lease_epoch))
        if store.deliver(message, boundary) != "applied":
            return done.taken
        done.taken += 1


def _waiting(store: Store, workflow: Workflow, stored: StoredRun) -> bool:
    """Whether ``stored`` waits, free, in a wait state of ``workflow``: no worker holds it,
    it is ``scheduled`` (not paused or stopped by an operator meanwhile), not asleep
    before the state, and not a map's child held back for its turn (handed over when its
    turn comes). What a sweep may hand kept events to, or park: a write based on
    ``stored`` is fenced on its ``last_seq``, so a change after this read refuses it."""
    record = stored.record
    if (
        stored.owner is not None
        or record.status != "scheduled"
        or record.reason == ASLEEP
        or not accepted(workflow, record.state)
    ):
        return False
    # (Held only ever turns open: a child read open stays so.)
    return not (
        record.join is not None and isinstance(store, JoinStoreMixin) and store.is_held(record.id)
    )


def refusal(
    store: Store, workflow: Workflow, record: RunRecord, *, validate: bool = False
) -> Verdict | None:
    """Why ``workflow`` (the loaded definition the run would follow) may not take the run
    on — its own, or one the run's may move to (flowloop/verdicts.py) — else ``None``: a
    sender is refused (DefinitionMismatch) and a claim parks the run otherwise, and so a
    sweep's hand-over must not move it under it. ``validate``: its own definition, with
    the context version unchanged, validates the stored context too (else trusted)."""
    if (
        not validate
        and record.fingerprint == workflow.fingerprint
        and record.context_version == workflow.context_version
    ):
        return None
    same = record.fingerprint == workflow.fingerprint
    verdict = judge(
        workflow,
        state=record.state,
        fingerprint=record.fingerprint,
        context=record.context,
        context_version=record.context_version,
        old=None if same else store.definition(record.fingerprint),
    )
    return None if verdict.goes_on else verdict


def _park(store: Store, stored: StoredRun, verdict: Verdict, *, now: float, worker: str) -> bool:
    """End the wait of a run the loaded definition refuses as a claim ends it
    (flowloop/recovery.py, ``Recovery._checked``): parked with the verdict's reason, or
    failed when the verdict fails it (a context that is not a JSON object:
    ``invalid_context``; ``flowloop retry`` after a repair takes it up again)."""
    reason = verdict.reason or "definition_mismatch"
    if verdict.outcome == "failed":
        message = verdict.message or reason
        return _fail(store, stored, reason=reason, message=message, now=now, worker=worker)
    return park(store, stored, reason=reason, message=verdict.message, now=now, worker=worker)


def fail_unreadable(store: Store, stored: StoredRun, *, now: float, worker: str) -> bool:
    """Fail a waiting run whose row or journal tail cannot be read (``stored.problem``) as
    a claim fails it (flowloop/recovery.py): ``run_failed``, reason ``invalid_row``, the
    problem as its error. Its kept events stay kept. Whether it was written."""
    problem = stored.problem or INVALID_ROW
    return _fail(store, stored, reason=INVALID_ROW, message=problem, now=now, worker=worker)


def _fail(
    store: Store, stored: StoredRun, *, reason: str, message: str, now: float, worker: str
) -> bool:
    """``run_failed`` with ``reason`` for a waiting run no worker holds, as a claim fails
    it, in one write fenced on the row as read (``last_seq``, no owner), as
    :func:`~flowloop.parking.park`; whether it was written."""
    event = halt_entry(
        stored.record, RUN_FAILED, reason=reason, message=message, now=now, worker=worker
    )
    if not write_waiting(store, stored, event):
        return False
    log.error("run %s failed: %s: %s", stored.id, reason, message)
    return True


def take_kept(
    workflow: Workflow, record: RunRecord, message: InboxEvent, *, now: float, worker: str
) -> tuple[JournalEvent, RunRecord]:
    """The journal entry for a kept event offered to a waiting run that accepts it:
    ``event_received``, or ``event_rejected`` when the state cannot take it after all (its
    handler raised, …) — a kept event never fails the run it was sent to. A stored
    context that no longer validates is the run's problem, not the event's: it raises."""
    workflow.load_context(record.context, record.context_version)
    try:
        return receive(
            workflow,
            record,
            message.event,
            message.payload,
            now=now,
            worker=worker,
            extra={"buffered_at": message.sent_at},
        )
    except Exception as error:
        log.warning(
            "run %s: kept event %r rejected in state %s: %s",
            record.id,
            message.event,
            record.state,
            error_line(error),
            extra={"run": record.id, "event": "event_rejected"},
        )
        return reject_kept(
            record, message.event, error, sent_at=message.sent_at, now=now, worker=worker
        )


def try_deliver_pending(
    store: Store,
    workflows: Mapping[str, Workflow],
    run_id: str,
    *,
    now: float,
    worker: str,
) -> int | None:
    """:func:`deliver_pending` that logs instead of raising: how many left the inbox, also
    when it failed after handing some over (the run moved: its caller wakes it, a sender
    looks again); ``None``: it failed before handing any (e.g. the run's context no longer
    loads). The run stays waiting; the next send, claim or recovery sweep retries (the
    sweep parks it if it keeps failing)."""
    done = HandOver()
    try:
        return deliver_pending(store, workflows, run_id, now=now, worker=worker, done=done)
    except Exception as error:
        log.warning("run %s: could not deliver buffered events: %s", run_id, error_line(error))
        return done.taken or None


STRANDED_BATCH = 500
HAND_OVER_TRIES: Final = 3
"""Tries in a row — a sweep's look (:func:`hand_over_stranded`) or a claim's
(:func:`failed_on_claim`) — at which handing a run its kept events may fail before the
run is parked (``kept_events_failed``, the error in its journal): the error was retried
at every recovery sweep (or claim), for ever, and said once. An outage does not count,
nor does a pool's timeout (the pool busy, not the run failing); a try that hands the run
anything over starts the count again, also when it fails after that. Counted in the
journal (:func:`failed_in_a_row`), not in a worker's memory: a fleet of workers that
each live for fewer sweeps than that gets there too."""
KEPT_EVENTS_FAILED: Final = "kept_events_failed"
KEPT_FAILED: Final = "kept_failed"
"""The ``data`` key of the ``run_released`` entry a failed try writes: how many in a row."""
HANDING_FAILED: Final = "its kept events could not be handed over"
RETRY_HAND_OVER_SECONDS: Final = 10.0
"""How long a claim whose hand-over failed leaves the run before it is due again (about a
recovery sweep's spacing: claimed again at once, it would use its tries up in a moment)."""
SLOW_LOOK_SECONDS: Final = 0.05
LOOK_SPACING: Final = 100.0
LONGEST_LOOK_GAP: Final = 300.0
"""A look for stranded kept events that took longer than :data:`SLOW_LOOK_SECONDS` puts
the next one off by :data:`LOOK_SPACING` times as long: it reads every event kept and not
taken — those kept for a later state, and those of runs that ended without taking them,
stay until prune — and a worker looks at every recovery sweep, on its event loop. Never
put off longer than :data:`LONGEST_LOOK_GAP` (a look slow for a stall of the database, or
for handing over many runs at once, would otherwise put the next off for an hour)."""


@dataclass
class StrandedLooks:
    """One worker's looks for stranded kept events (:func:`look_for_stranded`): the runs
    whose handing over failed at earlier looks (how many in a row), and when the next look
    may be made."""

    failing: dict[str, int] = field(default_factory=dict)
    next_at: float = 0.0
    """By ``time.monotonic``; 0: at the next sweep."""


def look_for_stranded(
    store: Store,
    workflows: Mapping[str, Workflow],
    looks: StrandedLooks,
    *,
    now: float,
    worker: str,
) -> int:
    """:func:`hand_over_stranded` at a worker's recovery sweep, spaced out after a slow
    look, and logged, not raised, when it fails for another cause than an outage (it
    helps runs a dead worker left: the sweep and the worker go on without it)."""
    started = time.monotonic()
    if started < looks.next_at:
        return 0
    try:
        handed = hand_over_stranded(store, workflows, now=now, worker=worker, failing=looks.failing)
    except Exception as error:
        if is_outage(error):
            raise
        log.warning("the look for stranded kept events failed: %s", error_line(error))
        handed = 0
    took = time.monotonic() - started
    gap = min(took * LOOK_SPACING, LONGEST_LOOK_GAP)
    looks.next_at = started + gap if took > SLOW_LOOK_SECONDS else 0.0
    return handed


def accepting(workflows: Mapping[str, Workflow]) -> list[tuple[str, str, str]]:
    """(workflow, wait state, event) of every loaded version of ``workflows``: the kept
    events a run waiting there takes (a superset: :func:`deliver_pending` decides, with
    the run's own version)."""
    found: set[tuple[str, str, str]] = set()
    for name, newest in workflows.items():
        versions = workflows.versions(name) if isinstance(workflows, Registry) else [newest]
        for workflow in versions:
            for state, wait in workflow.waits.items():
                found.update((name, state, event) for event in wait.on)
    return sorted(found)


def hand_over_stranded(
    store: Store,
    workflows: Mapping[str, Workflow],
    *,
    now: float,
    worker: str,
    failing: dict[str, int] | None = None,
) -> int:
    """Hand the events kept for waiting runs that accept them now, at a worker's start and
    at each of its recovery sweeps (flowloop/executor.py): the worker that entered the wait
    (or let go of the run) hands them over right after its commit, and one killed in
    between left them kept for a run that nobody claims — a wait without a timeout waited
    for ever (or until some process started), one with a timeout took them only then.
    When nothing is stranded this is one read of the kept events' partial index that finds
    nothing (:meth:`~flowloop.store.inbox.InboxStoreMixin.kept_for_free_runs`). Returns
    how many left the inbox.

    A run the loaded definition cannot take (its state or context no longer fits) is
    parked, as a claim parks it — and one a claim fails is failed as it fails it: a
    context that is not even a JSON object (``invalid_context``), a row that cannot be
    read (``invalid_row``) — a wait without a timeout is never claimed, so it would wait
    for ever, retried at every look; with a timeout, its claim would fail it when the
    timeout fires, and the look must not end it otherwise. Their events stay kept
    (``flowloop unpause`` after a fix hands them over to a parked run, ``flowloop retry``
    to a failed one). ``failing``: the runs whose
    handing over failed (raised) at earlier looks, and at how many in a row (updated):
    failing again, each is logged at DEBUG, not at every sweep's WARNING, and at
    :data:`HAND_OVER_TRIES` the run is parked, the error in its journal — the look found
    it again at every sweep, for ever."""
    if not isinstance(store, InboxStoreMixin):
        return 0
    takers = accepting(workflows)
    handed, after, seen = 0, "", set[str]()
    while True:
        found = store.kept_for_free_runs(takers, after=after, limit=STRANDED_BATCH)
        seen.update(found)
        for run_id in found:
            handed += _hand_over(store, workflows, run_id, now=now, worker=worker, failing=failing)
        if len(found) < STRANDED_BATCH:
            break
        after = found[-1]
    if failing is not None:
        for gone in failing.keys() - seen:  # (gone on, stopped or parked: forgotten)
            del failing[gone]
    if handed:
        log.warning(
            "handed %d kept event(s) to waiting runs no worker held (a worker may have "
            "stopped before handing them over)",
            handed,
        )
    return handed


def _hand_over(
    store: Store,
    workflows: Mapping[str, Workflow],
    run_id: str,
    *,
    now: float,
    worker: str,
    failing: dict[str, int] | None,
) -> int:
    """One stranded run's kept events handed over (how many), or its failure counted,
    logged and, when it is the run's to fix or repeats, the run parked."""
    remembered = 0 if failing is None else failing.get(run_id, 0)  # (for the log only)
    tries = remembered
    done = HandOver()
    try:
        deliver_pending(
            store, workflows, run_id, now=now, worker=worker, park_refused=True, done=done
        )
    except Exception as error:
        counted = not done.taken and not is_outage(error) and not isinstance(error, PoolTimeout)
        if counted:  # the journal's count (anything journaled since starts it again); this
            so_far = _failed_so_far(store, run_id)  # worker's own when it cannot be read
            tries = (remembered if so_far is None else so_far) + 1
        first = tries == 1 if counted else remembered == 0  # (said once, then at DEBUG)
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "run %s: could not deliver buffered events: %s", run_id, error_line(error))
        if done.taken:
            pass  # it took some (it moved on): a look that handed it over, not a failed one
        elif not counted:
            return 0  # the database's (or a pool busy with other work), not the run's
        else:
            parked = _park_failing(
                store, workflows, run_id, error, tries=tries, seen=done.seq, now=now, worker=worker
            )
            if failing is not None:
                failing[run_id] = tries
                if parked:
                    del failing[run_id]
            return 0
    if failing is not None:
        failing.pop(run_id, None)
    return done.taken


def _park_failing(
    store: Store,
    workflows: Mapping[str, Workflow],
    run_id: str,
    error: Exception,
    *,
    tries: int,
    seen: int | None,
    now: float,
    worker: str,
) -> bool:
    """Park a waiting run whose kept events could not be handed over: at once when the
    loaded definition, validating its context, refuses it (a claim would park it so: a
    validator changed, …; or fail it, as it fails it: a context that is not a JSON object,
    ``invalid_context`` — a wait without a timeout is never claimed), else at its
    :data:`HAND_OVER_TRIES`-th failed try in a row (``kept_events_failed``); before that,
    the failure is counted in its journal (:func:`failure_entry`). A run whose row cannot
    be read is failed ``invalid_row`` at once instead (:func:`fail_unreadable`). Only the
    run as the failed hand-over read it (``seen``, its ``last_seq``; ``None``: not read)
    and still waiting (:func:`_waiting`): not one that went on, nor one an operator paused
    or stopped meanwhile. Whether it was parked (or failed); a failure to park is logged (the next
    look tries again)."""
    try:
        stored = store.get_run(run_id)
        if stored is None or stored.record.workflow not in workflows:
            return False
        if seen is not None and stored.record.last_seq != seen:
            return False  # it moved since: not the run that failed (the next look sees)
        workflow = workflow_for(workflows, stored.record)
        if not _waiting(store, workflow, stored):
            return False
        if stored.problem is not None:
            return fail_unreadable(store, stored, now=now, worker=worker)
        verdict = refusal(store, workflow, stored.record, validate=True)
        if verdict is not None:
            return _park(store, stored, verdict, now=now, worker=worker)
        due = stored.record.next_run_at
        entry = failure_entry(stored.record, error, tries=tries, due=due, now=now, worker=worker)
        written = write_waiting(store, stored, entry)
        if written and entry.kind == RUN_PAUSED:
            log.warning("run %s parked: %s", run_id, KEPT_EVENTS_FAILED)
        return written and entry.kind == RUN_PAUSED
    except Exception as failed:
        log.warning("run %s: could not park it: %s", run_id, error_line(failed))
        return False


def failed_in_a_row(entries: Sequence[JournalEvent]) -> int:
    """How many tries in a row to hand the run its kept events failed, by its journal
    (``entries``): the count its last entry holds when that is a failed try's
    ``run_released`` (:func:`failure_entry`), else 0 — anything else journaled since (an
    event handed over, an unpause, …) starts the count again."""
    last = entries[-1] if entries else None
    if last is None or last.kind != RUN_RELEASED:
        return 0
    return int(last.data.get(KEPT_FAILED, 0))


def _readable_journal(store: Store, run_id: str) -> list[JournalEvent] | None:
    """The run's journal, ``None`` when it cannot be read (logged)."""
    try:
        return store.journal(run_id)
    except Exception as error:
        log.warning("run %s: its journal could not be read: %s", run_id, error_line(error))
        return None


def _journal(store: Store, run_id: str) -> list[JournalEvent]:
    """The run's journal, empty when it cannot be read (logged): counted from 0."""
    return _readable_journal(store, run_id) or []


def _failed_so_far(store: Store, run_id: str) -> int | None:
    """:func:`failed_in_a_row` of the run's journal (``None``: it cannot be read, logged)."""
    entries = _readable_journal(store, run_id)
    return None if entries is None else failed_in_a_row(entries)


def failure_entry(
    record: RunRecord, error: Exception, *, tries: int, due: float | None, now: float, worker: str
) -> JournalEvent:
    """The entry a failed try to hand ``record`` its kept events writes, its ``tries``-th
    in a row: at :data:`HAND_OVER_TRIES`, the run parked (``run_paused``,
    ``kept_events_failed``, the error in it; ``flowloop unpause`` tries again); before,
    ``run_released`` counting it (:data:`KEPT_FAILED`), due at ``due``, the error in it
    (``flowloop history`` shows it). Its events stay kept either way."""
    line = error_line(error)
    if tries >= HAND_OVER_TRIES:
        message = storable(f"{HANDING_FAILED} at {tries} tries in a row: {line}")
        reason = KEPT_EVENTS_FAILED
        return halt_entry(
            record, RUN_PAUSED, reason=reason, message=message, now=now, worker=worker
        )
    message = storable(f"{HANDING_FAILED} (try {tries} in a row): {line}")
    return halt_entry(
        record,
        RUN_RELEASED,
        reason=HANDING_FAILED,
        message=message,
        now=now,
        worker=worker,
        due=due,
        **{KEPT_FAILED: tries},
    )


async def failed_on_claim(
    executor: Executor, workflow: Workflow, record: RunRecord, fence: Fence, error: Exception
) -> None:
    """A claim's hand-over of the kept events to the waiting run it holds raised
    (flowloop/stepping.py, ``_end_wait``): handled as a sweep's look handles it
    (:func:`_hand_over`) — an outage or a pool's timeout raises on; else the try is
    counted in the journal and the run let go — due at its timeout, not earlier, and again
    :data:`RETRY_HAND_OVER_SECONDS` later when that has come (none without a timeout: the
    sweep's looks try again) — or parked ``kept_events_failed`` at the
    :data:`HAND_OVER_TRIES`-th failure in a row (a claim or a look). Its events stay kept.
    Before, the drive died with the error and the run stayed held until its lease ran
    out, then was claimed and failed again, for ever. (A context its definition no longer
    validates is not one of these: the claim judged it, validating, and parked it.)"""
    if is_outage(error) or isinstance(error, PoolTimeout):
        raise error
    now, worker = executor.clock.now(), executor.worker_id
    entries = _journal(executor.store, record.id)
    tries = failed_in_a_row(entries) + 1
    level = logging.WARNING if tries == 1 else logging.DEBUG
    log.log(level, "run %s: could not deliver buffered events: %s", record.id, error_line(error))
    due = wait_due(workflow, record.state, entries)  # (-inf: not read, overdue)
    if due is not None and due <= now:
        due = now + RETRY_HAND_OVER_SECONDS
    entry = failure_entry(record, error, tries=tries, due=due, now=now, worker=worker)
    if await executor._finish(record, fence, [entry]) and entry.kind == RUN_PAUSED:
        log.warning("run %s parked: %s", record.id, KEPT_EVENTS_FAILED)
