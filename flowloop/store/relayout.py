"""Downgrades of the journal-first layouts (migrations 0012 and 0013): a running run's row
brought up to its latest entry, spliced contexts written out whole, joined step starts
split into rows of their own — what the previous layouts read."""

from __future__ import annotations

from sqlalchemy import Connection, func, insert, select, update

from flowloop import journal as j
from flowloop.journal import load_data
from flowloop.store.entries import (
    SPLICE_KEY,
    THEN_KEY,
    _readable_then,
    _started,
    decode,
    dumps_sorted,
    stored_from_row,
)
from flowloop.store.schema import journal, runs


def materialize_previous_layout(conn: Connection) -> None:
    """Migration 0012's downgrade: every running run's row brought up to its latest entry,
    every spliced context written out whole (what the previous layout promises)."""
    latest = (
        select(journal.c.run_id, func.max(journal.c.seq).label("seq"))
        .group_by(journal.c.run_id)
        .subquery()
    )
    behind = conn.execute(
        select(runs)
        .join(latest, latest.c.run_id == runs.c.id)
        .where(latest.c.seq > runs.c.last_seq)
    ).all()
    spliced = {
        row.run_id
        for row in conn.execute(
            select(journal.c.run_id).where(journal.c.data.like(f'%"{SPLICE_KEY}"%')).distinct()
        )
    }
    for run_id in spliced:
        rows = conn.execute(
            select(journal).where(journal.c.run_id == run_id).order_by(journal.c.seq)
        ).all()
        for row, event in zip(rows, decode(rows), strict=True):
            if SPLICE_KEY in (row.data or ""):
                conn.execute(
                    update(journal)
                    .where(journal.c.run_id == run_id, journal.c.seq == row.seq)
                    .values(
                        context=event.context, data=dumps_sorted(event.data) if event.data else None
                    )
                )
    for row in behind:
        stored = stored_from_row(row)
        tail = conn.execute(
            select(journal)
            .where(journal.c.run_id == row.id, journal.c.seq > row.last_seq)
            .order_by(journal.c.seq)
        ).all()
        record = stored.record
        for event in decode(tail, record.context):
            record = j.apply(record, event)
        conn.execute(
            update(runs)
            .where(runs.c.id == row.id)
            .values(
                state=record.state,
                context=record.context,
                context_version=record.context_version,
                attempt=record.attempt,
                visits=dumps_sorted(record.visits),
                last_seq=record.last_seq,
                reason=record.reason,
                error=record.error,
                next_run_at=record.next_run_at,
                status=record.status,
                deadline_at=record.deadline,
            )
        )


def split_joined_rows(conn: Connection, *, batch: int = 1000) -> None:
    """Migration 0013's downgrade: every row holding a joined step start becomes two rows
    again (the previous layouts read one entry per row), ``batch`` rows at a time."""
    marker = f'%"{THEN_KEY}"%'
    done: set[tuple[str, int]] = set()  # rows whose data only looks joined (left as is)
    while True:
        found = conn.execute(
            select(journal)
            .where(journal.c.kind == j.STEP_SUCCEEDED, journal.c.data.like(marker))
            .order_by(journal.c.run_id, journal.c.seq)
            .limit(batch + len(done))
        ).all()
        joined = [row for row in found if (row.run_id, row.seq) not in done]
        if not joined:
            return
        for row in joined:
            data = load_data(row.data)
            then = data.pop(THEN_KEY, None)
            if not _readable_then(then):
                done.add((row.run_id, row.seq))
                continue
            conn.execute(
                update(journal)
                .where(journal.c.run_id == row.run_id, journal.c.seq == row.seq)
                .values(data=dumps_sorted(data) if data else None)
            )
            started = _started(dict(row._mapping), then)
            started["data"] = dumps_sorted(started["data"]) if started["data"] else None
            conn.execute(insert(journal).values(**started))
