"""The write path: a step boundary is one fenced append to the journal.

Contract (the journal protocol's, see flowloop/store/base.py):

* **The journal is the sequencer.** A boundary's entries go in at ``follows_seq + 1 …``
  only if no entry of the run is at or after that seq (a probe of the primary key, in the
  same statement) — two writers that read the same seq cannot both append. PostgreSQL
  backs the probe with the key itself: a concurrent duplicate fails and is a refusal.
* **The fence is in the same statement.** The insert selects from the run row: it
  applies only while the writer's owner and epoch hold and its lease has not ended by the
  database's clock (an unowned writer: while nobody validly owns the run). No read first.
* **The run row is a queue/lease row.** A boundary that leaves a running run running under
  its owner (a step's outcome and the next step's start, the usual case) touches no run
  row at all: its status is ``running`` already, its due time is none, its lease is
  renewed by the heartbeat. Every other boundary — the first start after a claim, a
  release, an end, a pause or stop, a new due time — also writes the row, in the same
  transaction, with the record as of that boundary (the row's snapshot, ``last_seq``).
* A live run's state and context are therefore its row's snapshot plus its journal after
  the snapshot's seq (a range of the primary key): :meth:`AppendStoreMixin._fold_tails`.

One boundary costs one commit; a batch (group commit, bulk recovery) costs one too, through
``executemany`` of the same statements — no savepoint unless a fence refuses one of them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Connection,
    and_,
    bindparam,
    exists,
    insert,
    or_,
    select,
    union_all,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.exc import IntegrityError

from flowloop import journal as j
from flowloop.journal import RunRecord
from flowloop.store import recordsets
from flowloop.store.base import Boundary, StoredRun
from flowloop.store.dialect import restart_idle_timer
from flowloop.store.entries import (
    ERROR_FIELDS,
    JOURNAL_FIELDS,
    RUN_ID,
    SEQ,
    ContextCache,
    encode,
    encode_joined,
    errorless,
    event_row,
    joinable,
    row_context,
    visits_text,
    with_tails,
)
from flowloop.store.journaled import given_runs, resolve
from flowloop.store.raw import Raw
from flowloop.store.recordsets import Value
from flowloop.store.schema import journal, runs

RUNNING_FROM: Final = frozenset(
    {
        j.STEP_SUCCEEDED,
        j.STEP_FAILED,
        j.STEP_INTERRUPTED,
        j.COMPENSATION_SUCCEEDED,
        j.COMPENSATION_FAILED,
    }
)
"""Kinds that only follow a running step: a boundary opening with one was running before."""
ERRORLESS: Final = "errorless"
"""SQLite's raw statements: the owned append with :data:`ERROR_FIELDS` as NULL literals."""
RECORD_COLUMNS: Final = (
    "status",
    "state",
    "context",
    "context_version",
    "version",
    "fingerprint",
    "attempt",
    "visits",
    "next_run_at",
    "last_seq",
    "reason",
    "error",
    "deadline_at",
)

ROW_PARAMS: Final = tuple([f"p_{name}" for name in RECORD_COLUMNS])
"""The parameters of a row write's :data:`RECORD_COLUMNS`, in their order."""


def append_only(boundary: Boundary) -> bool:
    """A boundary that leaves the run row as it is: a running run stays running under the
    same owner (the row says ``running``, no due time, the owner's lease)."""
    return (
        boundary.fence.owner is not None
        and not boundary.release
        and not boundary.clear_control
        and boundary.record.status == "running"
        and bool(boundary.events)
        and boundary.events[0].kind in RUNNING_FROM
    )


def record_columns(record: RunRecord) -> dict[str, Any]:
    return {
        "status": record.status,
        "state": record.state,
        "context": record.context,
        "context_version": record.context_version,
        # A run moved to another version of its workflow (flowloop migrate) changes these.
        "version": record.version,
        "fingerprint": record.fingerprint,
        "attempt": record.attempt,
        "visits": visits_text(record.visits),  # (an unreadable one as it was)
        "next_run_at": record.next_run_at,
        "last_seq": record.last_seq,
        "reason": record.reason,
        "error": record.error,
        "deadline_at": record.deadline,
    }


def stored_columns(record: RunRecord) -> dict[str, Any]:
    """:func:`record_columns` as a run row stores them: a long context is the journal's
    (:func:`~flowloop.store.entries.row_context`; readers take it back from there,
    flowloop/store/journaled.py)."""
    columns = record_columns(record)
    columns["context"] = row_context(record.context)
    return columns


class _Retry(Exception):
    """The optimistic batch was refused in part: undo it and go boundary by boundary."""


def _row_writes(boundaries: Sequence[Boundary]) -> list[Boundary] | None:
    """Those that write their run's row too; ``None``: one run's row twice (one by one)."""
    writes = [b for b in boundaries if not append_only(b)]
    return writes if len({b.run_id for b in writes}) == len(writes) else None


def _executemany(
    cursor: Any, stmt: Raw, params: Sequence[Any], *, postgres: bool, nulls: bool
) -> bool:
    """``stmt`` per parameter set on a driver cursor; whether each changed one row. ``nulls``
    (SQLite): ``None`` values as ``NULL`` literals (:meth:`Raw.bound_many`). PostgreSQL:
    its idle-in-transaction timer restarted, as SQLAlchemy does (dialect.py)."""
    if postgres or not nulls:
        cursor.executemany(stmt.sql, [stmt.args(one) for one in params])
        changed = cursor.rowcount
        if postgres:
            restart_idle_timer(cursor.connection)
    else:
        changed = 0
        for sql, args in stmt.bound_many([stmt.args(one) for one in params]):
            cursor.executemany(sql, args)
            changed += cursor.rowcount
    return bool(changed == len(params))


class AppendStoreMixin:
    """The journal-first write path of :class:`~flowloop.store.sql.SQLStore`."""

    now_sql: ColumnElement[float]
    _postgres: bool
    _dbapi_error: type[Exception]
    _lease_for_write: float
    _contexts: ContextCache  # the store's own (SQLStore.__init__); the statements are shared
    _pg_cache: dict[tuple[str, bool, int], Raw]

    def _write(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _driver(self) -> AbstractContextManager[Any]:  # provided by SQLStore
        raise NotImplementedError

    def _executed_pg(self, raw: Any, stmt: Raw, params: Mapping[str, Any]) -> Any:
        raise NotImplementedError  # provided by SQLStore

    def _execute_alone(self, sql: str, args: Any) -> int:  # provided by SQLStore
        raise NotImplementedError

    def _immediate(self, body: Callable[[Any], tuple[bool, bool]]) -> bool:
        raise NotImplementedError  # provided by ImmediateStoreMixin

    # -- statements ------------------------------------------------------------------------

    def _fence(self, owned: bool, value: Value = bindparam) -> ColumnElement[bool]:
        if owned:
            # The owner's fencing token: its id, its epoch, and a lease still running by
            # the database's clock (an expired lease writes nothing, even before a takeover).
            return and_(
                runs.c.id == value("f_id"),
                runs.c.owner == value("f_owner"),
                runs.c.lease_epoch == value("f_epoch"),
                runs.c.lease_expires_at >= self.now_sql,
            )
        return and_(
            runs.c.id == value("f_id"),
            runs.c.lease_epoch == value("f_epoch"),
            or_(runs.c.owner.is_(None), runs.c.lease_expires_at < self.now_sql),
        )

    @staticmethod
    def _at_end(run_id: Any, seq: Any) -> ColumnElement[bool]:
        """No entry of the run at or after ``seq``: an append goes at the end, once. (A row
        holding a joined start, entries.THEN_KEY, is keyed by its first seq: every reader
        splits it, so no writer follows its first seq alone — a damaged one fails the fold,
        see Decoder. Probing the row before ``seq`` too cost ~30 us per boundary.)"""
        later = journal.alias("later")
        return ~exists(select(later.c.seq).where(later.c.run_id == run_id, later.c.seq >= seq))

    def _build_appends(self) -> None:
        values = [  # named as the columns: a journal row is its own parameters
            bindparam(column.name, type_=column.type).label(column.name)
            for column in journal.columns
        ]
        self._append_stmt = {
            owned: insert(journal)
            .from_select(
                list(JOURNAL_FIELDS),
                select(*values)
                .select_from(runs)
                .where(self._fence(owned), self._at_end(bindparam("run_id"), bindparam("seq")))
                # PostgreSQL: hold the run row while the fence is judged (a claim's FOR
                # UPDATE SKIP LOCKED passes it by); renewals are not blocked. SQLite: no-op.
                .with_for_update(read=True, key_share=True),
            )
            # An INSERT's rowcount is kept only on request (SQLAlchemy 2.1); it is the verdict.
            .execution_options(preserve_rowcount=True)
            for owned in (True, False)
        }
        self._row_stmt = self._row_statements(bindparam)
        self._raw: dict[Any, Raw] | None = None
        """SQLite: the statements of a single boundary's write, compiled for the driver."""
        self._raw_batch: dict[Any, Raw] | None = None
        """Both dialects: the same statements for a batch's executemany on the driver."""
        self._raw_rows: dict[Any, Raw] | None = None
        """PostgreSQL: a batch's statements, each run once on its rows' JSON (recordsets.py)."""

    def _row_statements(self, value: Value) -> dict[tuple[str, bool], Any]:
        """The run row's write of a boundary, by kind and whether it clears the control
        request (:func:`_row_kind`), with each field's ``value`` (a parameter, or a column
        of a batch's rows). One that clears it applies only while the row holds the
        request the writer saw (``Boundary.seen_control``)."""
        row: dict[str, Any] = {name: value(f"p_{name}") for name in RECORD_COLUMNS}
        at = value("p_at")
        released = {"owner": None, "lease_expires_at": None}
        seen = runs.c.control.is_not_distinct_from(value("f_control"))
        by_kind = {
            "owned": update(runs)
            .where(self._fence(True, value))
            .values(**row, updated_at=at, lease_expires_at=self.now_sql + value("p_lease")),
            "owned_release": update(runs)
            .where(self._fence(True, value))
            .values(**row, updated_at=at, **released),
            "unowned": update(runs)
            .where(self._fence(False, value))
            .values(**row, updated_at=at, **released),
        }
        return {
            (kind, clear): stmt.where(seen).values(control=None) if clear else stmt
            for kind, stmt in by_kind.items()
            for clear in (False, True)
        }

    def _row_statement(self, boundary: Boundary) -> Any:
        return self._row_stmt[_row_kind(boundary)]

    def _prepare_raw(self, dialect: Any) -> None:
        """The boundary writes compiled once, run on the driver's cursor (through
        SQLAlchemy's execution machinery each statement costs more Python than the database
        needs to run it): on SQLite a single boundary's and a batch's, on PostgreSQL a
        batch's (a single boundary there is one statement of its own, ``_pg_statement``)."""
        raw: dict[Any, Raw] = {}
        for owned in (True, False):
            raw[owned] = Raw.of(self._append_stmt[owned], dialect)
        for key, stmt in self._row_stmt.items():
            raw[key] = Raw.of(stmt, dialect)
        self._raw_batch = raw
        if dialect.name == "postgresql":
            self._raw_rows = {
                key: Raw.of(stmt, dialect)
                for built in (
                    recordsets.appends(self._fence, self._at_end),
                    recordsets.row_writes(self._row_statements, RECORD_COLUMNS),
                )
                for key, stmt in built.items()
            }
        if dialect.name == "sqlite":
            # and the owned append with the columns a success leaves empty as NULL literals
            self._raw = {**raw, ERRORLESS: raw[True].with_nulls(ERROR_FIELDS)}

    # -- parameters ------------------------------------------------------------------------

    def _fence_params(self, boundary: Boundary) -> dict[str, Any]:
        params: dict[str, Any] = {"f_id": boundary.run_id, "f_epoch": boundary.fence.epoch}
        if boundary.fence.owner is not None:
            params["f_owner"] = boundary.fence.owner
        return params

    def _row_params(self, boundary: Boundary) -> dict[str, Any]:
        # stored_columns' values in RECORD_COLUMNS' order (tests/unit/test_row_params.py),
        # named at C speed (not a comprehension formatting each name per call)
        params = dict(zip(ROW_PARAMS, stored_columns(boundary.record).values(), strict=True))
        params.update(self._fence_params(boundary))
        params["p_at"] = boundary.events[-1].at if boundary.events else 0.0
        if boundary.fence.owner is not None and not boundary.release:
            params["p_lease"] = self._lease_for_write
        if boundary.clear_control:
            params["f_control"] = boundary.seen_control
        return params

    def _append_params(self, boundary: Boundary, rows: Sequence[dict[str, Any]]) -> list[Any]:
        """``rows`` (fresh from :func:`encode`) with the fence's parameters added in place."""
        fence = self._fence_params(boundary)
        for row in rows:
            row.update(fence)
        return list(rows)

    def _encode(self, boundaries: Sequence[Boundary]) -> list[list[dict[str, Any]]]:
        cache = self._contexts
        # The usual boundary (a success and the next start, one row) without the general
        # loop, as a boundary written alone is encoded (_append_joined_sqlite).
        return [
            [encode_joined(events[0], events[1], cache)]
            if len(events) == 2 and joinable(events[0], events[1])
            else encode(events, cache)
            for events in (boundary.events for boundary in boundaries)
        ]

    def _settle(self, boundaries: Sequence[Boundary], applied: Sequence[bool]) -> None:
        """The context cache after a write: refused runs forgotten (their next write starts
        from a whole context), runs that let go forgotten too (another worker goes on)."""
        for boundary, ok in zip(boundaries, applied, strict=True):
            if not ok or boundary.release or boundary.record.status != "running":
                self._contexts.forget(boundary.run_id)

    # -- writing ---------------------------------------------------------------------------

    def _write_appends(self, boundaries: Sequence[Boundary]) -> list[bool]:
        """:meth:`Store.write` for boundaries that report no child's end."""
        if len(boundaries) == 1 and self._raw is not None:
            usual = self._append_joined_sqlite(boundaries[0])
            if usual is not None:
                return [usual]
        encoded = self._encode(boundaries)
        applied: list[bool] = [False] * len(boundaries)
        try:
            if len(boundaries) == 1 and self._raw is not None:
                applied = [self._write_one_sqlite(boundaries[0], encoded[0])]
            elif len(boundaries) == 1 and self._postgres and boundaries[0].events:
                applied = [self._write_one_pg(boundaries[0], encoded[0])]
            else:
                applied = self._write_batch(boundaries, encoded)
        finally:
            # Refused or failed (an exception leaves ``applied`` all False): forgotten.
            self._settle(boundaries, applied)
        return applied

    def _write_batch(
        self, boundaries: Sequence[Boundary], encoded: Sequence[Sequence[dict[str, Any]]]
    ) -> list[bool]:
        """Optimistically all at once (one executemany per statement); if any fence refused,
        undo and apply them one by one, in order."""
        try:
            writes = _row_writes(boundaries) if self._raw_batch is not None else None
            if writes is not None:
                if self._write_batch_driver(boundaries, encoded, writes):
                    return [True] * len(boundaries)
            else:
                with self._write() as conn:
                    self._apply_all(conn, boundaries, encoded)
                return [True] * len(boundaries)
        except (_Retry, IntegrityError):
            pass
        with self._write() as conn:
            return self._apply(conn, boundaries, encoded)

    def _write_batch_driver(
        self,
        boundaries: Sequence[Boundary],
        encoded: Sequence[Sequence[dict[str, Any]]],
        writes: Sequence[Boundary],
    ) -> bool:
        """:meth:`_apply_all` on the driver's cursor in one transaction (SQLite: the lean one
        of :meth:`_immediate`); ``writes``: the boundaries that write their row too. False
        (rolled back): a fence refused, go one by one; a unique violation (a concurrent
        writer took a seq) raises IntegrityError, wrapped, for the same."""
        assert self._raw_batch is not None
        # SQLite: a success's append with NULL literals for its empty error columns.
        sqlite = self._raw is not None
        raw_stmts = self._raw if self._raw is not None else self._raw_batch
        by_fence: dict[Any, list[Any]] = {}
        for boundary, rows in zip(boundaries, encoded, strict=True):
            owned: Any = boundary.fence.owner is not None
            if owned and sqlite and all(map(errorless, boundary.events)):
                owned = ERRORLESS
            by_fence.setdefault(owned, []).extend(self._append_params(boundary, rows))
        groups: dict[tuple[str, bool], list[Boundary]] = {}
        for boundary in writes:
            groups.setdefault(_row_kind(boundary), []).append(boundary)

        def body(cursor: Any) -> tuple[bool, bool]:
            applied = all(
                self._executed_batch(cursor, raw_stmts, owned, params)
                for owned, params in by_fence.items()
            ) and all(
                self._executed_batch(cursor, raw_stmts, kind, [self._row_params(b) for b in group])
                for kind, group in groups.items()
            )
            return applied, applied

        if sqlite:
            return self._immediate(body)
        with self._driver() as driver:
            try:
                applied = body(driver.cursor())[0]
            except BaseException:
                with contextlib.suppress(Exception):
                    driver.rollback()
                raise
            driver.commit() if applied else driver.rollback()
            return applied

    def _executed_batch(
        self, cursor: Any, raw_stmts: Mapping[Any, Raw], key: Any, params: Sequence[Any]
    ) -> bool:
        """The statement ``key`` for each of ``params`` on the driver's cursor: on
        PostgreSQL once per part of the rows' JSON (recordsets.py); whether each changed
        one row."""
        if self._raw_rows is not None:
            parts = recordsets.rows_json_parts(params)
            if parts is not None:
                stmt = self._raw_rows[key]
                for rows, count in parts:  # (one, unless its rows are long)
                    cursor.execute(stmt.sql, stmt.args({"rows": rows}))
                    if cursor.rowcount != count:
                        return False
                return True
        nulls = key != ERRORLESS  # (a success's rows, the usual ones, have none)
        return _executemany(cursor, raw_stmts[key], params, postgres=self._postgres, nulls=nulls)

    def _apply_all(
        self,
        conn: Connection,
        boundaries: Sequence[Boundary],
        encoded: Sequence[Sequence[dict[str, Any]]],
    ) -> None:
        by_fence: dict[bool, list[Any]] = {}
        for boundary, rows in zip(boundaries, encoded, strict=True):
            by_fence.setdefault(boundary.fence.owner is not None, []).extend(
                self._append_params(boundary, rows)
            )
        sane = conn.dialect.supports_sane_multi_rowcount
        for owned, params in by_fence.items():
            stmt = self._append_stmt[owned]
            if sane:
                if conn.execute(stmt, params).rowcount != len(params):
                    raise _Retry
            elif any(conn.execute(stmt, one).rowcount != 1 for one in params):
                raise _Retry
        writes = [b for b in boundaries if not append_only(b)]
        if not sane or len({b.run_id for b in writes}) != len(writes):
            # One run twice: in order, one by one.
            for boundary in writes:
                changed = conn.execute(self._row_statement(boundary), self._row_params(boundary))
                if changed.rowcount != 1:
                    raise _Retry
            return
        groups: dict[tuple[str, bool], list[Boundary]] = {}
        for boundary in writes:
            groups.setdefault(_row_kind(boundary), []).append(boundary)
        for group in groups.values():
            params = [self._row_params(b) for b in group]
            if conn.execute(self._row_statement(group[0]), params).rowcount != len(group):
                raise _Retry

    def _apply(
        self,
        conn: Connection,
        boundaries: Sequence[Boundary],
        encoded: Sequence[Sequence[dict[str, Any]]] | None = None,
    ) -> list[bool]:
        """Apply boundaries one by one in ``conn``'s transaction, each judged alone in a
        savepoint (a refused one changes nothing). Returns, per boundary, whether it was
        applied. The path of composition and inbox writes, and of a refused batch."""
        if encoded is None:
            # Inside a caller's transaction that may still roll back after this: whole
            # contexts, and the runs' cached contexts dropped (no splice on a lost base).
            encoded = [[event_row(e) for e in b.events] for b in boundaries]
            for boundary in boundaries:
                self._contexts.forget(boundary.run_id)
        applied = []
        for boundary, rows in zip(boundaries, encoded, strict=True):
            savepoint = conn.begin_nested()
            try:
                ok = self._apply_one(conn, boundary, rows)
            except IntegrityError:  # PostgreSQL: a concurrent writer took the seq
                ok = False
            if ok:
                savepoint.commit()
            else:
                savepoint.rollback()
            applied.append(ok)
        return applied

    def _apply_whole(self, conn: Connection, boundary: Boundary) -> bool:
        """One boundary that its transaction stands or falls with, without a savepoint
        (:meth:`_apply` judges each of several alone, in one each): on False (refused) the
        caller rolls the whole transaction back. A fan-out and a child's end are written so;
        the savepoint was a tenth of a call's transactions' time."""
        rows = [event_row(e) for e in boundary.events]
        self._contexts.forget(boundary.run_id)  # as _apply: whole contexts, no splice
        try:
            return self._apply_one(conn, boundary, rows)
        except IntegrityError:  # PostgreSQL: a concurrent writer took the seq
            return False

    def _apply_one(
        self, conn: Connection, boundary: Boundary, rows: Sequence[dict[str, Any]]
    ) -> bool:
        """One boundary: its first entry decides (fence and seq), the rest follow it; then
        the row, when the boundary writes it. False: undo (the caller's savepoint)."""
        stmt = self._append_stmt[boundary.fence.owner is not None]
        params = self._append_params(boundary, rows)
        if params:
            if conn.execute(stmt, params[0]).rowcount != 1:
                return False
            if len(params) > 1:
                conn.execute(stmt, params[1:])
        if append_only(boundary):
            return True
        changed = conn.execute(self._row_statement(boundary), self._row_params(boundary))
        return bool(changed.rowcount == 1)

    def _append_joined_sqlite(self, boundary: Boundary) -> bool | None:
        """The usual boundary of a running run, one joined row appended alone (see
        :meth:`_write_one_sqlite`), written without the general path's steps (one
        ``_encode``, parameter dicts merged, ``_settle``); ``None``: not that boundary."""
        assert self._raw is not None
        events = boundary.events
        if len(events) != 2 or not append_only(boundary) or not joinable(*events):
            return None
        try:
            row = encode_joined(events[0], events[1], self._contexts)
            row.update(self._fence_params(boundary))
            # append_only: owned; a success has no error: those columns as NULL literals
            append = self._raw[ERRORLESS if errorless(events[0]) else True]
            applied = self._execute_alone(append.sql, append.args(row)) == 1
        except BaseException:
            self._contexts.forget(boundary.run_id)  # as _settle: no splice on a lost base
            raise
        if not applied:
            self._contexts.forget(boundary.run_id)
        return applied

    def _write_one_sqlite(self, boundary: Boundary, rows: Sequence[dict[str, Any]]) -> bool:
        raw_stmts = self._raw
        assert raw_stmts is not None
        append = raw_stmts[boundary.fence.owner is not None]
        params = self._append_params(boundary, rows)
        if len(params) == 1 and append_only(boundary):
            # The usual boundary is ONE statement: sent in autocommit it is its own
            # transaction, and an INSERT takes the write lock when it starts (before its
            # SELECT reads the fence), as BEGIN IMMEDIATE would; no BEGIN/COMMIT to send.
            return self._execute_alone(append.sql, append.args(params[0])) == 1

        def body(cursor: Any) -> tuple[bool, bool]:
            if params:
                cursor.execute(*append.bound(params[0]))
                if cursor.rowcount != 1:
                    return False, False
                for one in params[1:]:
                    cursor.execute(*append.bound(one))
            if not append_only(boundary):
                update_stmt = raw_stmts[_row_kind(boundary)]
                cursor.execute(*update_stmt.bound(self._row_params(boundary)))
                if cursor.rowcount != 1:
                    return False, False
            return True, True

        return self._immediate(body)

    def _pg_statement(self, boundary: Boundary, entries: int) -> Raw:
        """PostgreSQL: a whole boundary as ONE statement, sent in autocommit (its own
        transaction: one round trip). An append locks the run row FOR KEY SHARE while it
        checks the fence, so a claim (FOR UPDATE SKIP LOCKED) cannot take the run between
        the check and the commit; a row write is the fenced UPDATE in a CTE, the entries
        inserted only if it changed the row."""
        only = append_only(boundary)
        kind, clear = ("append", False) if only else _row_kind(boundary)
        key = (kind, clear, entries)
        found = self._pg_cache.get(key)
        if found is not None:
            return found
        owned = boundary.fence.owner is not None
        first: Any = bindparam("e0_seq")
        at_end = self._at_end(bindparam("f_id"), first)
        if only:
            gate = (
                select(runs.c.id)
                .where(self._fence(owned))
                .with_for_update(key_share=True, read=True)
                .cte("gate")
            )
            condition = exists(select(gate.c.id))
            conditions: list[Any] = [condition, at_end]
        else:
            changed = (
                self._row_statement(boundary).where(at_end).returning(runs.c.id).cte("changed")
            )
            gate = changed
            conditions = [exists(select(changed.c.id))]
        selects = [
            select(
                *[
                    sql_cast(bindparam(f"e{i}_{column.name}"), column.type).label(column.name)
                    for column in journal.columns
                ]
            ).where(*conditions)
            for i in range(entries)
        ]
        rows = selects[0] if len(selects) == 1 else union_all(*selects)
        stmt = insert(journal).from_select(list(JOURNAL_FIELDS), rows).add_cte(gate)
        found = self._pg_cache[key] = Raw.of(stmt, self._dialect_obj())
        return found

    def _dialect_obj(self) -> Any:
        raise NotImplementedError  # provided by SQLStore

    def _write_one_pg(self, boundary: Boundary, rows: Sequence[dict[str, Any]]) -> bool:
        stmt = self._pg_statement(boundary, len(rows))
        params = self._fence_params(boundary)
        if not append_only(boundary):
            params.update(self._row_params(boundary))
        for i, row in enumerate(rows):
            for name, value in row.items():
                params[f"e{i}_{name}"] = value
        with self._driver() as raw:
            raw.autocommit = True  # one statement: its own transaction
            try:
                try:
                    cursor = self._executed_pg(raw, stmt, params)
                except self._dbapi_error as error:
                    if _unique_violation(error):
                        return False  # a concurrent writer took the seq: refused
                    raise
                return bool(cursor.rowcount == len(rows))
            finally:
                raw.autocommit = False

    # -- reading a live run ----------------------------------------------------------------

    def _fold_tails(self, conn: Connection, stored: Sequence[StoredRun]) -> list[StoredRun]:
        """Runs as of their latest entry: a running run's row is a snapshot as of its
        ``last_seq``; the entries after it (one key range per run, one query for all) are
        folded onto it."""
        stored = resolve(conn, stored)
        behind = {s.id: s for s in stored if s.record.status == "running"}
        if not behind:
            return stored
        return with_tails(
            stored, read_tails(conn, {s.id: s.record.last_seq for s in behind.values()})
        )

    def _fold_claimed(self, conn: Connection, stored: Sequence[StoredRun]) -> list[StoredRun]:
        """:meth:`_fold_tails` for runs just claimed in ``conn``'s transaction (their rows
        come from the claim's ``UPDATE … RETURNING``): the claim holds those rows until it
        commits (PostgreSQL: their row locks; SQLite: the write lock), so each row's
        ``last_seq`` is still the snapshot's and one join on it reads every tail — one
        statement, cached, per ``CLAIM_TAIL_CHUNK`` runs instead of an OR-term per run."""
        stored = resolve(conn, stored)
        snapshots = {s.id: s.record.last_seq for s in stored if s.record.status == "running"}
        if not snapshots:
            return stored
        found: dict[str, list[Any]] = {}
        ids = list(snapshots)
        query = _claimed_tails(self._postgres)
        for start in range(0, len(ids), CLAIM_TAIL_CHUNK):
            chunk = ids[start : start + CLAIM_TAIL_CHUNK]
            params = {"ids": chunk, "seqs": [snapshots[i] for i in chunk]}
            for row in _values(conn.execute(query, params)):
                if row[SEQ] > snapshots[row[RUN_ID]]:  # the join's seq is the snapshot's
                    found.setdefault(row[RUN_ID], []).append(row)
        return with_tails(stored, found)


CLAIM_TAIL_CHUNK: Final = 500
"""Claimed runs per tail query (bind parameters: well under SQLite's 999)."""


@functools.cache
def _claimed_tails(postgres: bool) -> Any:
    """The journal after each given run's snapshot. PostgreSQL: the snapshots' ``(ids,
    seqs)`` as two array parameters, unnested and joined on the journal's key (exact for
    any snapshot; one index range per run). SQLite: ``ids`` as an expanding ``IN``, joined
    on each row's ``last_seq`` (exact only while the caller's transaction holds those rows,
    as a claim's does)."""
    if postgres:
        given = given_runs()
        after = and_(journal.c.run_id == given.c.id, journal.c.seq > given.c.seq)
        return (
            select(journal)
            .select_from(given.join(journal, after))
            .order_by(journal.c.run_id, journal.c.seq)
        )
    after = and_(runs.c.id == journal.c.run_id, journal.c.seq > runs.c.last_seq)
    return (
        select(journal)
        .select_from(journal.join(runs, after))
        .where(runs.c.id.in_(bindparam("ids", expanding=True)))
        .order_by(journal.c.run_id, journal.c.seq)
    )


TAIL_CHUNK: Final = 200
"""Runs per tail query (one OR-term each: well under SQLite's expression depth of 1000)."""


def read_tails(conn: Connection, snapshots: Mapping[str, int]) -> dict[str, list[Any]]:
    """The journal entries after each run's snapshot (as :func:`_values`): ``seq >
    last_seq`` of the snapshot the caller holds (not of the row now). Reads are READ
    COMMITTED: the row may have moved on since the snapshot was read; joining on its
    current ``last_seq`` would drop the entries between the two and fold an old snapshot
    to an old state."""
    found: dict[str, list[Any]] = {}
    ids = list(snapshots)
    for start in range(0, len(ids), TAIL_CHUNK):
        chunk = ids[start : start + TAIL_CHUNK]
        after = or_(
            *[and_(journal.c.run_id == rid, journal.c.seq > snapshots[rid]) for rid in chunk]
        )
        query = select(journal).where(after).order_by(journal.c.run_id, journal.c.seq)
        for row in _values(conn.execute(query)):
            found.setdefault(row[RUN_ID], []).append(row)
    return found


def _values(result: Any) -> Iterator[tuple[Any, ...]]:
    """A ``select(journal)`` result's rows as tuples in :data:`JOURNAL_FIELDS` order, for
    :meth:`Decoder.values` (a row's attributes cost more than its decoding)."""
    if tuple(result.keys()) != JOURNAL_FIELDS:
        raise RuntimeError(f"journal rows in an unexpected column order: {list(result.keys())}")
    return (tuple(row) for row in result)


def _row_kind(boundary: Boundary) -> tuple[str, bool]:
    """Which row statement writes ``boundary`` (and whether it clears the control)."""
    if boundary.fence.owner is None:
        kind = "unowned"
    else:
        kind = "owned_release" if boundary.release else "owned"
    return kind, boundary.clear_control


def _unique_violation(error: BaseException) -> bool:
    return getattr(error, "sqlstate", None) == "23505"
