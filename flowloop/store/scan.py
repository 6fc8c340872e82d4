"""Reading every live run of a workflow in batches, only the columns a deploy check needs.

``flowloop check`` judges each live run (flowloop/verdicts.py); on 100k runs a full
``StoredRun`` per row (visits parsed, every column) costs more than the judging, so this
reads ``id, status, state, fingerprint, context_version, context`` by keyset pages on the
primary key (no OFFSET: each page is an index range, however deep). A running run's row is
a snapshot (flowloop/store/appends.py): those few are read whole, their journal tails folded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from sqlalchemy import Connection, select

from flowloop.lifecycle import LIVE
from flowloop.store.entries import JOURNALED
from flowloop.store.entries import stored_from_row as _stored_from_row
from flowloop.store.schema import runs
from flowloop.store.sql import SQLStore

SCAN_BATCH = 5_000
"""Rows per page: large enough that a round trip is cheap per row, small enough to stream."""


@dataclass(frozen=True, slots=True)
class LiveRun:
    id: str
    status: str
    state: str
    fingerprint: str
    context_version: int
    context: str


def live_runs(
    store: SQLStore,
    workflow: str,
    *,
    statuses: Sequence[str] = tuple(sorted(LIVE)),
    batch: int = SCAN_BATCH,
) -> Iterator[list[LiveRun]]:
    """Pages of the live runs of ``workflow``, in id order."""
    query = (
        select(
            runs.c.id,
            runs.c.status,
            runs.c.state,
            runs.c.fingerprint,
            runs.c.context_version,
            runs.c.context,
        )
        .where(runs.c.workflow == workflow, runs.c.status.in_(list(statuses)))
        .order_by(runs.c.id)
        .limit(batch)
    )
    after: str | None = None
    while True:
        page = query if after is None else query.where(runs.c.id > after)
        with store.engine.connect() as conn:
            rows = [LiveRun(*row) for row in conn.execute(page)]
            rows = _current(store, conn, rows)
        if not rows:
            return
        yield rows
        if len(rows) < batch:
            return
        after = rows[-1].id


def _current(store: SQLStore, conn: Connection, rows: list[LiveRun]) -> list[LiveRun]:
    """``rows`` with the running ones as of their latest journal entry, and contexts kept
    in the journal read from there."""
    running = [row.id for row in rows if row.status == "running" or row.context == JOURNALED]
    if not running:
        return rows
    full = conn.execute(select(runs).where(runs.c.id.in_(running))).all()
    folded = {s.id: s.record for s in store._fold_tails(conn, [_stored_from_row(r) for r in full])}
    out = []
    for row in rows:
        record = folded.get(row.id)
        if record is not None:
            row = LiveRun(
                row.id,
                record.status,
                record.state,
                record.fingerprint,
                record.context_version,
                record.context,
            )
        out.append(row)
    return out
