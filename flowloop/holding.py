"""The limit slots held by the runs whose steps are calling this code.

A workflow's ``max_concurrency`` and ``key_limit`` are the cluster's, and a running run
counts against them while its step runs. So a step that starts a run of a limited workflow
and waits for it (``engine.run``, ``await engine.arun``) waits for ever when the slots
that run needs are all held by the very runs waiting for it: the step's own run, and the
runs whose steps called it. The executor notes each limited run it drives in the context
of the run's task (copied into its steps, their threads and the runs they start), and a
call that would wait so is refused at once: a new run before it is written, a run with a
key once made or found (so that the step's retry finds it), named in the message.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowloop.errors import HeldBack
from flowloop.journal import ASLEEP

if TYPE_CHECKING:
    from collections.abc import Callable

    from flowloop.definition import Workflow
    from flowloop.journal import RunRecord
    from flowloop.runinfo import RunInfo
    from flowloop.store.base import StoredRun


@dataclass(frozen=True, slots=True)
class Held:
    """A slot a running run holds: of its workflow, and of its key when it has one."""

    database: str
    workflow: str
    limit_key: str | None


HELD: contextvars.ContextVar[tuple[Held, ...]] = contextvars.ContextVar(
    "flowloop_held_slots", default=()
)
"""The slots held by the runs driving this task's code, the innermost last."""


def database_of(store: Any) -> str:
    """What tells one database from another here: its URL as the store was given it."""
    return str(getattr(store, "url", id(store)))


def context_holding(slot: Held) -> contextvars.Context:
    """A copy of this context in which ``slot`` is held too (a run task's context)."""
    context = contextvars.copy_context()
    context.run(HELD.set, (*HELD.get(), slot))
    return context


def refuse_held_back(
    database: str, workflow: Workflow, limit_key: str | None, *, queued: str | None = None
) -> None:
    """Raise :class:`HeldBack` when a run of ``workflow`` (with ``limit_key``) cannot be
    claimed before the runs calling this code end: their slots fill its limit. ``queued``:
    the run exists already (found by its key, or made by this call), queued."""
    held = [h for h in HELD.get() if h.database == database and h.workflow == workflow.name]
    why = None
    limit = workflow.max_concurrency
    if limit is not None and len(held) >= limit:
        why = f"its max_concurrency={limit} is held by the calling run(s)"
    key_limit = workflow.key_limit
    same_key = sum(h.limit_key == limit_key for h in held) if limit_key is not None else 0
    if why is None and key_limit is not None and same_key >= key_limit:
        why = f"the key_limit={key_limit} of key {limit_key!r} is held by the calling run(s)"
    if why is None:
        return
    then = (
        f"run {queued} is queued and runs once the calling step has ended"
        if queued is not None
        else "start it with engine.start() to run once the step has ended, or raise the limit"
    )
    raise HeldBack(
        f"a step waiting for a run of {workflow.name!r} would wait for ever: {why}; {then}",
        queued=queued,
    )


def queued(record: RunRecord | RunInfo, workflow: Workflow) -> bool:
    """A run ``engine.run`` waits for until a claim takes it: due or backing off, not
    waiting for an event (a run in a call or map state waits for its children's claims; one
    asleep before a wait state, for the claim that ends its sleep)."""
    return record.status in ("scheduled", "retrying") and (
        record.state not in workflow.waits or record.reason == ASLEEP
    )


def claimed_later(stored: StoredRun, workflow: Workflow, now: float, horizon: float) -> bool:
    """A run of ``workflow`` (made, or found by its key) that ``engine.run`` would wait for
    a claim to take: nobody holds it, it is queued, and due within ``horizon`` seconds (the
    wait's; one due later is returned as it is)."""
    record = stored.record
    due = record.next_run_at
    return (
        stored.owner is None
        and record.workflow == workflow.name
        and queued(record, workflow)
        and due is not None
        and due <= now + horizon
    )


def refuse_held_back_family(
    store: Any,
    root: StoredRun,
    workflow_for: Callable[[RunRecord], Workflow | None],
    now: float,
    horizon: float,
) -> None:
    """:func:`refuse_held_back` for every queued live descendant of ``root`` (the runs
    ``engine.run`` drives with a run in a call or map state), of a limited workflow:
    an unlimited workflow's call state starting a child that the calling runs' slots hold
    back waited for ever too. Made only where slots are held; a query per run of the
    family in a call or map state (a map's plain items are not looked into)."""
    database = database_of(store)
    frontier = [root]
    while frontier:
        kids: list[StoredRun] = []
        for parent in frontier:
            workflow = workflow_for(parent.record)
            if workflow is not None and parent.record.state in workflow.composites:
                kids.extend(store.live_children(parent.id))
        for kid in kids:
            workflow = workflow_for(kid.record)
            if workflow is None or not workflow.limited:
                continue
            if claimed_later(kid, workflow, now, horizon):
                refuse_held_back(database, workflow, kid.limit_key, queued=kid.id)
        frontier = kids
