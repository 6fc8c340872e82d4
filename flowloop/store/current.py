"""Run rows as of their latest journal entry, for readers that do not go through the store
(the dashboard's queries, ``flowloop.heat``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, select

from flowloop.store.appends import read_tails, record_columns
from flowloop.store.entries import JOURNALED, folded, stored_from_row
from flowloop.store.journaled import resolve
from flowloop.store.schema import runs


def current_rows(conn: Connection, rows: Sequence[Any]) -> list[dict[str, Any]]:
    """Raw run rows (``select(runs)`` mappings, any columns including ``id``, ``status``
    and ``last_seq``) as of their latest journal entry: for readers that do not go through
    the store (the dashboard's queries). A running run's row is a snapshot; its tail's
    fold replaces the record's columns. A context kept in the journal is read from there."""
    out = [dict(row) for row in rows]
    behind = [r["id"] for r in out if r.get("status") == "running" or r.get("context") == JOURNALED]
    if not behind:
        return out
    full = conn.execute(select(runs).where(runs.c.id.in_(behind))).all()
    stored = resolve(conn, [stored_from_row(row) for row in full])
    running = {s.id: s.record.last_seq for s in stored if s.record.status == "running"}
    tails = read_tails(conn, running)
    latest = {}
    for s in stored:
        # Always the fresh snapshot (folded): ``rows`` came from an earlier statement and
        # may be older than it (a release in between); the fresh row is never older.
        tail = tails.get(s.id)
        latest[s.id] = record_columns(folded(s, tail).record if tail else s.record)
    for found in out:
        columns = latest.get(found["id"])
        if columns is None:
            continue
        for name, value in columns.items():
            if name in found:
                found[name] = value
    return out
