"""Driving one run and its family in this process until it finishes or waits: what
``engine.run`` does once its run backs off, sleeps or fans out, and what ``engine.drive``
(``flowloop retry``) does for a run already there. Other due runs are left alone: they
are a worker's."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowloop import children, compose
from flowloop.executor import IDLE_HORIZON_SECONDS
from flowloop.holding import (
    HELD,
    claimed_later,
    database_of,
    queued,
    refuse_held_back,
    refuse_held_back_family,
)
from flowloop.lifecycle import CLAIMABLE
from flowloop.store.joins import JoinStoreMixin

if TYPE_CHECKING:
    from flowloop.definition import Workflow
    from flowloop.engine import Engine
    from flowloop.executor import Executor
    from flowloop.runinfo import RunInfo


async def drive_family(
    engine: Engine, executor: Executor, workflow: Workflow, info: RunInfo
) -> RunInfo:
    """Drive the run ``info`` and its live descendants with ``executor`` until the run is
    neither due nor in a call or map state with a descendant due; its RunInfo then. Retry
    backoff and durable sleeps are waited for as ``run_until_idle`` would."""
    run_id = info.id
    family = children.family(engine.store, run_id)
    while True:
        root = engine.store.get_run(run_id) if HELD.get() and len(family) > 1 else None
        if root is not None:
            # (A run of the family the calling runs' slots hold back: refused.)
            refuse_held_back_family(
                engine.store, root, engine._workflow_for, engine.clock.now(), IDLE_HORIZON_SECONDS
            )
        # Waiting for its children, the run's own due time is its deadline at most: not
        # waited for (as a run waiting for an event is returned at once), its children's
        # backoffs and sleeps are. (Waited for, a deadline within the idle horizon held
        # engine.run until it passed, children waiting for events, and the run expired.)
        waits = waits_for_children(engine, workflow, info)
        idle_ids = [member for member in family if member != run_id] if waits else None
        # (A first Ctrl-C lets its children's steps finish, however long they take.)
        await executor.run(until_idle=True, run_ids=family, grace=None, idle_ids=idle_ids)
        before, info = info, engine.get(run_id)
        if executor.handing_back:  # a first Ctrl-C: stop here, the family as it is
            return info
        if info.state not in workflow.composites or info.status not in CLAIMABLE:
            if waits and queued(info, workflow):
                # Gone on from its children, to a retry's backoff or a sleep: waited for.
                family = children.family(engine.store, run_id)
                continue
            return info
        driven, family = set(family), children.family(engine.store, run_id)
        moved = (before.state, before.last_seq) != (info.state, info.last_seq)
        if not moved and driven.issuperset(family):
            # Nothing of its family is due (children waiting for events). (A child that
            # started children of its own meanwhile: drive them too.)
            return info


def waits_for_children(engine: Engine, workflow: Workflow, info: RunInfo) -> bool:
    """The run waits in a call or map state for the children of this visit (their join is
    made). Not yet made, its due time is its own — a sleep into the state ends then, its
    children are made after — and waited for (not returned at once, asleep)."""
    store = engine.store
    if info.state not in workflow.composites or not isinstance(store, JoinStoreMixin):
        return False
    if info.next_run_at is None:  # (no sleep into it: a sleep makes it due at its end)
        return True
    visit = info.visits.get(info.state, 0)
    join_id = compose.join_id(info.id, info.state, visit)
    return store.find_join(join_id, info.id, info.state, visit) is not None


def refuse_a_held_back_run(engine: Engine, workflow: Workflow, run_id: str) -> None:
    """Inside a step of a limited workflow: the run ``run_id`` its own run's (and callers')
    limit slots hold back is refused (HeldBack), as ``engine.run`` refuses one — driven,
    it would wait for a claim that never comes."""
    if not (workflow.limited and HELD.get()):
        return
    stored = engine.store.get_run(run_id)
    if stored is not None and claimed_later(
        stored, workflow, engine.clock.now(), IDLE_HORIZON_SECONDS
    ):
        refuse_held_back(database_of(engine.store), workflow, stored.limit_key, queued=stored.id)
