"""``flowloop migrate``: move live runs to a newer loaded version of their workflow.

The newer definition declares how the states of an older version map onto its own:
``Workflow(..., version=2, migrates_from={1: {"charge": "bill"}})`` (a state not named
keeps its name). A run moves only when its mapped state exists in the new version and its
context validates there (after the upcasters); each move is one journal entry
(``run_migrated``: who, from, to, the state before), written like an operator's pause.
A run parked for a mismatch is unparked by the move; any other keeps its status.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowloop import journal as j
from flowloop import owed
from flowloop.compose import join_id
from flowloop.errors import DefinitionError, DefinitionMismatch, FlowloopError, InvalidTransition
from flowloop.events import asleep_before, sleep_end, wait_due
from flowloop.lifecycle import LIVE
from flowloop.store.joins import JoinStoreMixin
from flowloop.upcast import ContextMigrationError
from flowloop.verdicts import CONTEXT_MISMATCH, DEFINITION_MISMATCH
from flowloop.versions import versions_of

if TYPE_CHECKING:
    from flowloop.definition import Workflow
    from flowloop.engine import Engine
    from flowloop.journal import RunRecord
    from flowloop.store import StoredRun


@dataclass(frozen=True)
class Moved:
    """One run's outcome: moved (``problem is None``) or left where it is, and why."""

    run_id: str
    from_version: int
    to_version: int
    from_state: str
    state: str
    problem: str | None = None


def migrate_run(engine: Engine, stored: StoredRun, *, to: int, by: str) -> Moved:
    """Move one run to version ``to`` (loaded in ``engine``). Raises FlowloopError saying
    why it cannot move (nothing is changed then)."""
    record = stored.record
    if record.status not in LIVE or record.status == "running" or stored.owner is not None:
        raise InvalidTransition(record.id, record.status, "migrate")
    target = engine.version_of(record.workflow, to)
    if to <= record.version:
        raise FlowloopError(
            f"run {record.id} is on {record.workflow} v{record.version}: migrate moves a run "
            "to a newer version"
        )
    mapping = target.migrates_from.get(record.version)
    if mapping is None:
        raise DefinitionError(
            target.name,
            f"v{to} declares no migrates_from={{{record.version}: {{...}}}}: say how the "
            f"states of v{record.version} map onto v{to} (an empty mapping keeps the names)",
        )
    state = mapping.get(record.state, record.state)
    # (Read only when needed: a migration moves many runs, each journal maybe long.)
    events: Callable[[], list[j.JournalEvent]] = functools.cache(
        lambda: engine.store.journal(record.id)
    )
    old = engine.store.definition(record.fingerprint) or {}
    data: dict[str, Any] = {
        "by": by,
        "from": record.version,
        "to": to,
        "fingerprint": target.fingerprint,
        "from_state": record.state,
    }
    _journal_steps(engine, record, old, target, mapping, data, events)
    sleep_end = _sleep_end(engine, record)
    compensating = sleep_end is None and _compensating(
        engine, record, old, target, state, data, events
    )
    if state not in target.states or (
        target.is_final(state) and sleep_end is None and not compensating
    ):
        # (A run asleep before its state, step.sleep, has not entered it: it may move to
        # a final state, which it enters when its sleep ends.)
        raise DefinitionMismatch(
            record.id,
            f"{DEFINITION_MISMATCH}: state {record.state!r} maps to {state!r}, which "
            f"{target.name} v{to} does not have as a live state; add it to migrates_from",
        )
    join_to = _join_renamed(engine, record, state, target, to)
    try:
        target.load_context(record.context, record.context_version)
    except (FlowloopError, ContextMigrationError) as error:
        problem = getattr(error, "problems", None) or getattr(error, "problem", str(error))
        raise DefinitionMismatch(record.id, f"{CONTEXT_MISMATCH}: {problem}") from None
    if state != record.state:
        # The state left keeps its visit count (journal._migrated): left for another state,
        # it may be entered again; renamed, a later version may bring the name back. Either
        # way its next visit must be a new one — a call or map state's join and children
        # are named by the visit, and an old visit's would be found (or collided with).
        data["kept_visits"] = True
        if record.state not in target.states:
            data["renamed"] = True
        if data.get("renamed") and state in _names_of_this_visit(events(), record.state):
            # Back to a name this very visit had (a rollback of a rename): its count holds
            # the visit already — counted again, a retried step's idempotency_key changed.
            data["same_visit"] = True
    reason = record.reason or ""
    parked = record.status == "paused" and reason.startswith(
        (DEFINITION_MISMATCH, CONTEXT_MISMATCH)
    )
    # Waiting and moved: due now, or at the timeout of the wait it moves to. With no due time
    # (a wait without a timeout, or for its children) it stayed scheduled, never claimed; out
    # of a wait with a timeout it kept that timeout — a step ran that much late. Not a parent
    # whose join goes along to its renamed state: its children's ends make it due (claimed
    # now, it started them again: review).
    undue = (
        record.status == "scheduled"
        and state != record.state
        and join_to is None
        and (record.next_run_at is None or engine._waits_by_stored_definition(record))
    )
    if sleep_end is not None:
        # Asleep before its state (step.sleep): it sleeps on, due when the sleep ends, and
        # enters the state it moves to then (not a wait or final one: just due then).
        # Paused by an operator (or its parent) it stays paused: the entry keeps the sleep
        # for its unpause (journal._migrated reads a due time only with a status).
        data["due"] = sleep_end
        if parked or record.status == "scheduled":
            data["status"] = "scheduled"
        if asleep_before(target, state):
            data[j.ASLEEP] = True
    elif parked or undue:
        data["status"] = "scheduled"
        if state in target.waits:
            wait = target.waits[state]
            data["due"] = (
                wait_due(target, state, events())
                if state == record.state
                else None
                if wait.timeout is None
                else engine.clock.now() + wait.timeout
            )
        else:
            data["due"] = engine.clock.now()
        if record.join is not None and engine.is_held(record.id):
            data["due"] = None  # a map's child held back: its turn makes it due, as before
    if not engine.operate(stored, j.RUN_MIGRATED, state=state, data=data, join_to=join_to):
        raise FlowloopError(f"run {record.id} changed while migrating; try again")
    return Moved(record.id, record.version, to, record.state, state)


def _journal_steps(
    engine: Engine,
    record: RunRecord,
    old: dict[str, Any],
    target: Workflow,
    mapping: Mapping[str, str],
    data: dict[str, Any],
    events: Callable[[], list[j.JournalEvent]],
) -> None:
    """Journal in the move's ``data`` what a run compensating later needs to know of its
    steps when the versions it crossed are no longer loaded: the renames the move applies
    (``renames``), and the steps it may still have to undo that it leaves without a step,
    each with whether the definition that had it declared compensate= (``dropped``)."""
    own = engine._workflows.version(record.workflow, record.version)
    # The run's own definition: as stored under its fingerprint, and that version as loaded
    # (a redeploy since, whose steps the run may have run too).
    states = {*old.get("states", {}), *old.get("finals", ()), *(own.states if own else ())}
    renames = owed.renames_by(mapping, target, states)
    if any(name not in target.states for name in mapping):
        data[owed.RENAMES] = renames
    steps = {
        name
        for name, spec in old.get("states", {}).items()
        if isinstance(spec, dict) and spec.get("kind") == "step"
    } | set(own.steps if own else ())
    # (Decided from the definitions: its journal is read only when a step of its definition
    # has none in the target. A step an earlier move dropped keeps what that one journaled.)
    if all(renames.get(name, name) in target.steps for name in steps):
        return
    versions = versions_of(engine._workflows, record.workflow)
    dropped = owed.dropped_by(target, events(), versions, renames)
    if dropped:
        data[owed.DROPPED] = dropped


def _compensating(
    engine: Engine,
    record: RunRecord,
    old: dict[str, Any],
    target: Workflow,
    state: str,
    data: dict[str, Any],
    events: Callable[[], list[j.JournalEvent]],
) -> bool:
    """Whether the run is compensating (in a compensating final state, live) and moves to
    one of ``target``: it finishes its compensations there. Refused (DefinitionMismatch)
    when a step it still owes the undoing of has no step in ``target`` after the move (its
    journal's migrations and this one, ``data``, renaming it), as a worker would park it
    there: moved, it ended without undoing it."""
    if record.state not in old.get("compensate", ()) or not target.compensates(state):
        return False
    # As the worker will read it: this move journaled after the run's entries.
    moved = j.JournalEvent(
        run_id=record.id,
        seq=record.last_seq + 1,
        kind=j.RUN_MIGRATED,
        at=engine.clock.now(),
        state=state,
        data=data,
    )
    versions = versions_of(engine._workflows, record.workflow)
    lost = owed.stranded_compensations(target, [*events(), moved], versions, moving=True)
    if lost is not None:
        raise DefinitionMismatch(record.id, f"{DEFINITION_MISMATCH}: {lost}")
    return True


def _sleep_end(engine: Engine, record: RunRecord) -> float | None:
    """When the sleep (``step.sleep``) the run rests in before its state ends (it has not
    entered or begun the state yet), else ``None``: scheduled there asleep (reason
    ``asleep``, or due later in a state not a wait), or paused while so (its journal tells;
    the version it is on says whether its state is a wait, whose due time is a timeout's)."""
    flagged = record.reason == j.ASLEEP or record.status == "paused"
    later = record.next_run_at is not None and record.next_run_at > engine.clock.now()
    if not flagged and (record.status != "scheduled" or not later):
        return None  # (due now, or waiting without a due time: not asleep)
    wait = engine._waits_by_stored_definition(record)
    if wait and not flagged:
        return None  # (waiting there: its due time is its timeout's)
    return sleep_end(record.state, engine.store.journal(record.id), wait=wait)


def _join_renamed(
    engine: Engine, record: RunRecord, state: str, target: Workflow, to: int
) -> str | None:
    """The join a run moved to ``state`` takes along: that of the call or map state it is in,
    when ``target`` renamed that state (the visit count moves with the name). Its children
    report to it, and under the new name its claim finds it instead of starting them all
    again — a succeeded child's work run twice. A renamed state that starts runs of another
    workflow cannot take them: refused."""
    store = engine.store
    if (
        state == record.state
        or record.state in target.states
        or not isinstance(store, JoinStoreMixin)
    ):
        return None
    visit = record.visit(record.state)
    join = store.find_join(join_id(record.id, record.state, visit), record.id, record.state, visit)
    spec = target.composites.get(state)
    if join is None or spec is None:
        return None
    if spec.child.name != join.child_workflow:
        raise DefinitionMismatch(
            record.id,
            f"{DEFINITION_MISMATCH}: its {record.state!r} has child runs of "
            f"{join.child_workflow!r}; v{to} renames it {state!r}, which starts runs of "
            f"{spec.child.name!r}: migrate it once it has left {record.state!r}",
        )
    return join.id


def _names_of_this_visit(events: Sequence[j.JournalEvent], state: str) -> set[str]:
    """The names the run's visit of ``state`` had before renames since it entered it, whose
    counts hold that visit: each one a migration renamed (``renamed``) with its count kept
    (``kept_visits``). A move between states a version has, or an older entry (which moved
    the count away), began a visit of its own: the walk ends there."""
    names, current = set(), state
    for index in range(len(events) - 1, -1, -1):
        event = events[index]
        if event.kind == j.RUN_MIGRATED:
            source = event.data.get("from_state")
            if event.state == current and isinstance(source, str) and source != current:
                if not (event.data.get("kept_visits") and event.data.get("renamed")):
                    break  # a move between states (or an older entry): a visit of its own
                names.add(source)
                current = source
        elif event.kind == j.RUN_RETRIED:
            # Retried in the state it was in: the same visit (journal.apply counts none).
            before = events[index - 1] if index else None
            if before is None or (before.next_state or before.state) != event.state:
                break
        elif event.next_state is not None or event.kind == j.RUN_CREATED:
            break  # the transition (or the start) that began the visit
    return names


def migrate_all(engine: Engine, workflow: str, *, to: int, by: str) -> list[Moved]:
    """Move every live run of ``workflow`` below version ``to``; a run that cannot move is
    listed with its problem and left as it is (the others still move)."""
    from flowloop.store.scan import live_runs
    from flowloop.store.sql import SQLStore

    if not isinstance(engine.store, SQLStore):
        raise FlowloopError("migrate needs a SQL store")
    engine.version_of(workflow, to)  # refuse at once when that version is not loaded
    ids = [run.id for page in live_runs(engine.store, workflow) for run in page]
    results = []
    for run_id in ids:
        stored = engine.store.get_run(run_id)
        if stored is None or stored.record.version >= to:
            continue
        record = stored.record
        try:
            results.append(migrate_run(engine, stored, to=to, by=by))
        except FlowloopError as error:
            results.append(
                Moved(record.id, record.version, to, record.state, record.state, str(error))
            )
    return results
