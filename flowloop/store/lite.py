"""Reading a SQLite flowloop database through the stdlib driver, without SQLAlchemy.

``flowloop status``, ``history`` and ``replay`` only read, yet importing SQLAlchemy alone
was most of their cold start (issue 13: ~0.64 s of a 0.78 s ``status`` on a slow 2-core
VM). :class:`LiteStore` is the reads a :class:`~flowloop.reading.Reader` and those
commands make — a run, a listing, a journal, a definition, the breakers, backpressure and
a run's family — as plain SQL on ``sqlite3``. It decodes rows with the same functions as
:class:`~flowloop.store.sql.SQLStore` (flowloop/store/entries.py): journaled contexts read
back from their latest whole one, a running run's tail folded onto its row's snapshot.

It opens only a plain SQLite file whose schema is at :data:`~flowloop.store.base.SCHEMA_HEAD`
(:meth:`LiteStore.open` answers ``None`` for anything else): a missing or foreign file, an
old schema or a URL with options is opened by ``SQLStore`` as before, which says what is
wrong. Each call is one read transaction (``BEGIN``: one snapshot, never the write lock).
tests/integration/test_lite_store.py holds every read equal to ``SQLStore``'s.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Final

from flowloop.backpressure import DROPPED_REASON, usage_by_workflow
from flowloop.errors import StoreError
from flowloop.ids import prefix_bounds
from flowloop.journal import EVENT_DROPPED, JournalEvent
from flowloop.lifecycle import HELD
from flowloop.store.base import SCHEMA_HEAD, VERSION_TABLE, BreakerRow, RunFilter, StoredRun
from flowloop.store.entries import (
    JOURNAL_FIELDS,
    JOURNALED,
    SPLICE_KEY,
    Decoder,
    context_of,
    definition_structure,
    stored_from_mapping,
    until,
    with_contexts,
    with_tails,
)
from flowloop.store.urls import sqlite_url

BUSY_TIMEOUT_S: Final = 30.0
"""How long a read waits out a lock: the store's (flowloop.store.dialect.BUSY_TIMEOUT_MS)."""
PROBE_TIMEOUT_S: Final = 1.0
"""How long the check of the schema revision waits out a lock: a file that stays locked is
opened by SQLStore, which waits the whole timeout itself (not twice as long)."""
RUNS: Final = "flowloop_runs"
JOURNAL: Final = "flowloop_journal"
JOURNAL_ROWS: Final = f"SELECT {', '.join(JOURNAL_FIELDS)} FROM {JOURNAL}"
TAIL_ROWS: Final = f"{JOURNAL_ROWS} WHERE run_id = ? AND seq > ? ORDER BY seq"
"""A running run's entries after its row's snapshot: one key range of the journal."""
RETRYABLE: Final = JOURNAL_FIELDS.index("retryable")

# A journaled context as of ``:seq``: the run's rows with a context from its latest whole
# one at or before it (journaled.py's _since_whole; seq 1, the creation, is always whole).
CONTEXT_ROWS: Final = f"""
SELECT run_id, seq, context, data FROM {JOURNAL}
WHERE run_id = :run_id AND seq <= :seq AND context IS NOT NULL
  AND seq >= coalesce((
    SELECT max(seq) FROM {JOURNAL}
    WHERE run_id = :run_id AND seq <= :seq AND context IS NOT NULL
      AND (data IS NULL OR data NOT LIKE :splice)), 1)
ORDER BY seq"""
SPLICED: Final = f'%"{SPLICE_KEY}"%'


def _journal_row(row: Sequence[Any]) -> tuple[Any, ...]:
    """A journal row as SQLAlchemy reads it: ``retryable`` is a Boolean column, stored by
    SQLite as 0/1."""
    values = tuple(row)
    flag = values[RETRYABLE]
    if flag is None:
        return values
    return (*values[:RETRYABLE], bool(flag), *values[RETRYABLE + 1 :])


def _connect(uri: str) -> sqlite3.Connection | None:
    try:
        return sqlite3.connect(
            uri,
            uri=True,
            timeout=PROBE_TIMEOUT_S,
            isolation_level=None,  # transactions are LiteStore's own BEGINs
        )
    except sqlite3.Error:
        return None


def _at_head(conn: sqlite3.Connection) -> bool:
    """Whether ``conn``'s database is flowloop's at :data:`SCHEMA_HEAD` (closed if not)."""
    try:
        revisions = conn.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchall()
    except sqlite3.Error:
        revisions = []
    if revisions == [(SCHEMA_HEAD,)]:
        return True
    conn.close()
    return False


class LiteStore:
    """The reads of runs on a SQLite flowloop database at the current schema (a
    :class:`~flowloop.store.base.RunSource`, and what the reading commands show besides)."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn

    @classmethod
    def open(cls, path: Path) -> LiteStore | None:
        """The database at ``path``, or ``None`` when it is not a flowloop database at
        :data:`SCHEMA_HEAD` that can be read (``SQLStore`` then opens it as before).

        Two looks. First read-only (``mode=ro``): a file that is not ours is not changed —
        a read-write connection would checkpoint its WAL into it on closing. Only a file
        whose version table says the head is then opened as ``SQLStore`` opens it,
        read-write (its last connection tidies the WAL away on closing, as before), and
        checked again."""
        # The file SQLAlchemy's driver would open: an absolute path made by text (a
        # symlinked directory followed by `..` stays what the user typed).
        absolute = Path(os.path.abspath(path))
        if not absolute.is_file():
            return None
        probe = _connect(f"{absolute.as_uri()}?mode=ro")
        if probe is None or not _at_head(probe):
            return None
        probe.close()
        conn = _connect(f"{absolute.as_uri()}?mode=rw")
        if conn is None or not _at_head(conn):
            return None
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        except sqlite3.Error:
            conn.close()
            return None
        return cls(path, conn)

    def close(self) -> None:
        self._conn.close()

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        """One read transaction; a driver error becomes a StoreError of one line, worded
        as the CLI words SQLAlchemy's (flowloop/store/outage.py)."""
        conn = self._conn
        try:
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                if conn.in_transaction:
                    with suppress(sqlite3.Error):  # it only read: nothing to keep
                        conn.execute("ROLLBACK")
        except sqlite3.Error as error:
            from flowloop.store import outage  # (SQLAlchemy: on this rare path only)

            raise StoreError(outage.describe(error, sqlite_url(self.path))) from error

    # -- runs ------------------------------------------------------------------------------

    def get_run(self, run_id: str) -> StoredRun | None:
        with self._read() as conn:
            found = self._runs(conn, f"SELECT * FROM {RUNS} WHERE id = ?", (run_id,))
        return found[0] if found else None

    def run_ids_with_prefix(self, prefix: str, *, limit: int) -> list[str]:
        if not prefix:
            return []
        low, high = prefix_bounds(prefix)
        sql = f"SELECT id FROM {RUNS} WHERE id >= ? AND id < ? ORDER BY id LIMIT ?"
        with self._read() as conn:
            rows = conn.execute(sql, (low, high, limit)).fetchall()
        return [row[0] for row in rows if row[0].startswith(prefix)]

    def find_runs(self, where: RunFilter) -> list[StoredRun]:
        terms: list[str] = []
        params: list[Any] = []
        if where.workflow is not None:
            terms.append("workflow = ?")
            params.append(where.workflow)
        if where.statuses:
            terms.append(f"status IN ({', '.join('?' for _ in where.statuses)})")
            params.extend(where.statuses)
        if where.key is not None:
            terms.append("key = ?")
            params.append(where.key)
        if where.after is not None:
            created, run_id = where.after
            terms.append("(created_at < ? OR (created_at = ? AND id > ?))")
            params.extend((created, created, run_id))
        condition = f" WHERE {' AND '.join(terms)}" if terms else ""
        sql = f"SELECT * FROM {RUNS}{condition} ORDER BY created_at DESC, id LIMIT ?"
        with self._read() as conn:
            return self._runs(conn, sql, (*params, where.limit))

    def _runs(self, conn: sqlite3.Connection, sql: str, params: Sequence[Any]) -> list[StoredRun]:
        """The runs ``sql`` selects (whole rows), each as of its latest journal entry."""
        cursor = conn.execute(sql, params)
        cursor.row_factory = sqlite3.Row
        stored = [stored_from_mapping(row) for row in cursor]
        journaled = {s.id: s.record.last_seq for s in stored if s.record.context == JOURNALED}
        if journaled:
            contexts = {
                run_id: context_of(
                    conn.execute(CONTEXT_ROWS, {"run_id": run_id, "seq": seq, "splice": SPLICED}),
                    seq,
                )
                for run_id, seq in journaled.items()
            }
            stored = with_contexts(stored, contexts)
        # One query per running run, as SQLStore reads journaled contexts on SQLite: each
        # is one index range of an in-process database, with no round trip to save.
        tails: dict[str, list[tuple[Any, ...]]] = {}
        for s in stored:
            if s.record.status == "running":
                rows = conn.execute(TAIL_ROWS, (s.id, s.record.last_seq))
                tail = [_journal_row(row) for row in rows]
                if tail:
                    tails[s.id] = tail
        return with_tails(stored, tails) if tails else stored

    def journal(self, run_id: str, *, until_seq: int | None = None) -> list[JournalEvent]:
        sql = f"{JOURNAL_ROWS} WHERE run_id = ?"
        params: tuple[Any, ...] = (run_id,)
        if until_seq is not None:
            sql += " AND seq <= ?"
            params = (run_id, until_seq)
        with self._read() as conn:
            rows = conn.execute(f"{sql} ORDER BY seq", params).fetchall()
        decoder = Decoder(strict=False)
        events = [event for row in rows for event in decoder.values(_journal_row(row))]
        return until(events, until_seq)

    def definition(self, fingerprint: str) -> dict[str, Any] | None:
        sql = "SELECT structure FROM flowloop_definitions WHERE fingerprint = ?"
        with self._read() as conn:
            row = conn.execute(sql, (fingerprint,)).fetchone()
        return definition_structure(None if row is None else row[0], fingerprint)

    def knows_workflow(self, workflow: str) -> bool:
        """Whether a run of ``workflow`` (by an index) or a stored definition of it is here."""
        sql = (
            f"SELECT EXISTS (SELECT 1 FROM {RUNS} WHERE workflow = ?) "
            "OR EXISTS (SELECT 1 FROM flowloop_definitions WHERE name = ?)"
        )
        with self._read() as conn:
            return bool(conn.execute(sql, (workflow, workflow)).fetchone()[0])

    def workflow_names(self) -> set[str]:
        """Every workflow this database knows: a stored definition's or a run's."""
        sql = f"SELECT name FROM flowloop_definitions UNION SELECT workflow FROM {RUNS}"
        with self._read() as conn:
            return {str(row[0]) for row in conn.execute(sql)}

    # -- what `flowloop status` shows beside the runs --------------------------------------

    def breakers(self) -> list[BreakerRow]:
        columns = ", ".join(BreakerRow.COLUMNS)
        with self._read() as conn:
            rows = conn.execute(f"SELECT {columns} FROM flowloop_breakers ORDER BY name")
            return [BreakerRow.of(*row) for row in rows]

    def backpressure_usage(self) -> dict[str, dict[str, int]]:
        """As :meth:`~flowloop.store.admission.AdmissionStoreMixin.backpressure_usage`."""
        by_workflow = " GROUP BY workflow"
        with self._read() as conn:
            queued = conn.execute(
                f"SELECT workflow, count(*) FROM {RUNS} "
                f"WHERE status = 'scheduled' AND last_seq = 1{by_workflow}"
            ).fetchall()
            kept = conn.execute(
                f"SELECT r.workflow, count(*) FROM flowloop_inbox i JOIN {RUNS} r "
                "ON r.id = i.run_id WHERE i.consumed_seq IS NULL "
                "AND r.status NOT IN ('failed', 'stopped', 'succeeded') "
                "GROUP BY r.workflow, i.run_id"
            ).fetchall()
            dropped_events = conn.execute(
                f"SELECT r.workflow, count(*) FROM {JOURNAL} j JOIN {RUNS} r "
                "ON r.id = j.run_id WHERE j.kind = ? GROUP BY r.workflow",
                (EVENT_DROPPED,),
            ).fetchall()
            dropped_runs = conn.execute(
                f"SELECT workflow, count(*) FROM {RUNS} "
                f"WHERE status = 'stopped' AND reason LIKE ?{by_workflow}",
                (f"{DROPPED_REASON}%",),
            ).fetchall()
        return usage_by_workflow(queued, kept, dropped_events, dropped_runs)

    def parent_of(self, run_id: str) -> str | None:
        with self._read() as conn:
            row = conn.execute(f"SELECT parent_id FROM {RUNS} WHERE id = ?", (run_id,)).fetchone()
        return None if row is None or row[0] is None else str(row[0])

    def child_counts(self, parent_id: str) -> dict[str, int]:
        """As :meth:`~flowloop.store.joins.JoinStoreMixin.child_counts` ("held" apart)."""
        held = f"join_state = '{HELD}' AND status = 'scheduled'"
        shown = f"CASE WHEN {held} THEN '{HELD}' ELSE status END"
        sql = f"SELECT {shown}, count(*) FROM {RUNS} WHERE parent_id = ? GROUP BY 1"
        with self._read() as conn:
            return {row[0]: int(row[1]) for row in conn.execute(sql, (parent_id,))}

    def is_held(self, run_id: str) -> bool:
        """As :meth:`~flowloop.store.joins.JoinStoreMixin.is_held`."""
        with self._read() as conn:
            row = conn.execute(f"SELECT join_state FROM {RUNS} WHERE id = ?", (run_id,)).fetchone()
        return row is not None and row[0] == HELD

    def held_among(self, run_ids: Sequence[str]) -> set[str]:
        """As :meth:`~flowloop.store.joins.JoinStoreMixin.held_among`."""
        if not run_ids:
            return set()
        marks = ", ".join("?" for _ in run_ids)
        sql = (
            f"SELECT id FROM {RUNS} WHERE id IN ({marks}) "
            f"AND join_state = '{HELD}' AND status = 'scheduled'"
        )
        with self._read() as conn:
            return {str(row[0]) for row in conn.execute(sql, tuple(run_ids))}

    def kept_count(self, run_id: str) -> int:
        """As :meth:`~flowloop.store.inbox.InboxStoreMixin.kept_count`."""
        sql = "SELECT count(*) FROM flowloop_inbox WHERE run_id = ? AND consumed_seq IS NULL"
        with self._read() as conn:
            return int(conn.execute(sql, (run_id,)).fetchone()[0])
