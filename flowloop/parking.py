"""Parking, at a worker's start, the waiting runs that the deployed definition cannot take.

A run waiting for an event without a timeout is never claimed: nothing would tell that its
wait state (or its context) no longer fits a newly deployed definition until someone sends
it an event. So a worker, when it starts, looks once at the waiting runs without a due
time whose definition is not one it has loaded, judges each (flowloop/verdicts.py, as
``flowloop check`` does) and parks those that cannot go on — ``paused`` with the reason —
in one fenced write each, as an operator's pause. The runs a worker claims are judged at
claim time instead.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy import TextClause, bindparam, text

from flowloop import journal as j
from flowloop.definition import Workflow
from flowloop.journal import JournalEvent, RunRecord
from flowloop.store import Boundary, Fence, Store, StoredRun
from flowloop.store.sql import SQLStore
from flowloop.verdicts import judge
from flowloop.versions import Registry, workflow_for

log = logging.getLogger("flowloop")

PARK_BATCH = 1_000


def loaded_fingerprints(workflows: Mapping[str, Workflow]) -> dict[str, list[str]]:
    """Each loaded workflow's name and the fingerprints of its loaded versions."""
    return {
        name: [
            w.fingerprint
            for w in (
                workflows.versions(name) if isinstance(workflows, Registry) else [workflows[name]]
            )
        ]
        for name in list(workflows)
    }


def _stranded_query(*, postgres: bool) -> TextClause:
    """A workflow's runs waiting without a due time and without an owner whose definition
    is none of ``loaded`` (a list). On SQLite by the partial index of such runs, said: the
    planner preferred the workflow's index, and read every queued run of the workflow,
    those asleep included (50,000 asleep: 6 ms a look, at every ``run_until_idle``)."""
    indexed = "" if postgres else " INDEXED BY ix_flowloop_runs_waiting"
    return text(
        f"SELECT id FROM flowloop_runs{indexed} WHERE workflow = :name"
        " AND status = 'scheduled' AND next_run_at IS NULL AND owner IS NULL"
        " AND fingerprint NOT IN :loaded LIMIT :batch"
    ).bindparams(bindparam("loaded", expanding=True))


def park_stranded_waits(
    store: SQLStore, workflows: Mapping[str, Workflow], *, worker: str, now: float
) -> int:
    """Park the waiting runs (no due time, no owner) that the loaded definitions cannot
    take; returns how many."""
    parked = 0
    stranded: list[str] = []
    # One read transaction for every workflow (BEGIN, not BEGIN IMMEDIATE, on SQLite): the
    # look finds nothing almost always, and must not take the write lock to find it.
    with store._read() as conn:
        query = _stranded_query(postgres=store._postgres)
        for name, fingerprints in loaded_fingerprints(workflows).items():
            found = conn.execute(query, {"name": name, "loaded": fingerprints, "batch": PARK_BATCH})
            stranded += [row.id for row in found]
    for run_id in stranded:
        stored = store.get_run(run_id)
        if stored is None or stored.owner is not None or stored.problem is not None:
            continue
        record = stored.record
        workflow = workflow_for(workflows, record)
        verdict = judge(
            workflow,
            state=record.state,
            fingerprint=record.fingerprint,
            context=record.context,
            context_version=record.context_version,
            old=store.definition(record.fingerprint),
        )
        if verdict.goes_on or verdict.outcome != "paused":
            continue
        reason = verdict.reason or ""
        if park(store, stored, reason=reason, message=verdict.message, now=now, worker=worker):
            parked += 1
    return parked


def park(
    store: Store,
    stored: StoredRun,
    *,
    reason: str,
    message: str | None,
    now: float,
    worker: str,
) -> bool:
    """Park ``stored`` (a run no worker holds) ``paused`` with ``reason``, in one write
    fenced on its lease epoch, as an operator's pause: nothing it has (its kept events
    included) is lost, ``flowloop unpause`` continues it. Whether it was parked (not:
    another writer moved it first). Only a ``scheduled`` run, not asleep, as ``stored``
    holds it: the write follows its ``last_seq``, so a pause or a stop an operator wrote
    after that read refuses it; one written before it is never overwritten (a second
    ``run_paused`` with this reason) nor folded into an error (a stopped run)."""
    event = halt_entry(
        stored.record, j.RUN_PAUSED, reason=reason, message=message, now=now, worker=worker
    )
    if not write_waiting(store, stored, event):
        return False
    log.warning("run %s parked: %s", stored.id, reason)
    return True


def halt_entry(
    record: RunRecord,
    kind: str,
    *,
    reason: str,
    message: str | None,
    now: float,
    worker: str,
    **data: Any,
) -> JournalEvent:
    """The entry that stops the run where it is, in its state — ``run_paused`` (parked),
    ``run_failed``, ``run_released`` — with ``reason`` (and ``data``) and ``message`` (its
    error), after the run's last entry. How a worker's start, a sweep, a claim and
    recovery park or fail a run (flowloop/kept.py, flowloop/recovery.py)."""
    return JournalEvent(
        run_id=record.id,
        seq=record.last_seq + 1,  # after the tail's last entry (entries.folded)
        kind=kind,
        at=now,
        state=record.state,
        error_message=message,
        worker=worker,
        data={"reason": reason, **data},
    )


def write_waiting(store: Store, stored: StoredRun, event: JournalEvent) -> bool:
    """Write ``event`` on ``stored``, a run no worker holds, ``scheduled`` and not asleep
    as read, in one write fenced on that read (its lease epoch, no owner, ``last_seq``);
    whether it was written (not: it is held, paused, stopped, asleep, or another writer
    moved it first)."""
    record = stored.record
    if stored.owner is not None or record.status != "scheduled" or record.reason == j.ASLEEP:
        return False
    boundary = Boundary(
        events=[event], record=j.apply(record, event), fence=Fence(None, stored.lease_epoch)
    )
    return store.write([boundary])[0]
