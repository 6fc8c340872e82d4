"""Creating runs: one transaction per call, however many runs it carries.

A run's row and its first journal entries go in together; a run whose business key or
idempotency key is taken already is returned instead (a lost race is retried, and the
winner found). Creating a run is on the hot path of ``engine.run``: a plain run (no key,
no limit key, not a child) is inserted on SQLite through statements compiled once, on
the driver's cursor (through SQLAlchemy's execution machinery each statement costs more
Python than SQLite needs to run it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final, TypeVar

from sqlalchemy import (
    ColumnElement,
    Connection,
    and_,
    bindparam,
    func,
    insert,
    or_,
    select,
    union_all,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.exc import IntegrityError, OperationalError

from flowloop import frozen
from flowloop.store import dialect
from flowloop.store.appends import stored_columns
from flowloop.store.base import NewRun, StoredRun
from flowloop.store.entries import JOURNAL_FIELDS, ContextCache, event_row, replaced_run
from flowloop.store.entries import stored_from_row as _stored_from_row
from flowloop.store.raw import Raw
from flowloop.store.schema import journal, runs

T = TypeVar("T")

CREATE_ATTEMPTS: Final = 3
"""Tries of a run-creating transaction that lost a key race before the last, unguarded one."""


def _plain(new: NewRun) -> bool:
    """A run no other can hold a key of, not counted by a limit, not a child."""
    return (
        new.record.key is None
        and not new.idempotency_key
        and new.limit_key is None
        and new.parent_id is None
        and new.record.join is None
    )


_BY_IDEMPOTENCY: Final = select(runs).where(
    runs.c.idempotency_key.in_(bindparam("p_keys", expanding=True))
)


def _unique_keys(new: NewRun) -> list[tuple[str, str]]:
    """The unique keys a new run takes: (workflow, business key) and ("", idempotency key)."""
    keys = []
    if new.record.key is not None:
        keys.append((new.record.workflow, new.record.key))
    if new.idempotency_key:
        keys.append(("", new.idempotency_key))
    return keys


def _new_run_row(new: NewRun) -> dict[str, Any]:
    record = new.record
    return {
        "id": record.id,
        "workflow": record.workflow,
        "key": record.key,
        "idempotency_key": new.idempotency_key,
        **stored_columns(record),
        "priority": new.priority,
        "owner": new.owner,
        "lease_epoch": 1 if new.owner else 0,
        "control": None,
        "created_at": new.events[0].at,
        "updated_at": new.events[-1].at,
        "limit_key": new.limit_key,
        "limit_rank": new.limit_rank,
        "parent_id": new.parent_id,
        "join_id": record.join,
        "child_index": new.child_index,
        "join_state": None if record.join is None else "held" if new.held else "open",
    }


def _created(new: NewRun, row: dict[str, Any], lease: float | None) -> StoredRun:
    """The stored run a plain creation made (what reading its row back would give)."""
    return frozen.build(  # StoredRun(...) without its generated __init__ (one per run)
        StoredRun,
        {
            "record": new.record,
            "idempotency_key": None,
            "priority": new.priority,
            "owner": new.owner,
            "lease_expires_at": lease,
            "lease_epoch": row["lease_epoch"],
            "control": None,
            "created_at": row["created_at"],
            "updated_at": row["updated_at"],
            "limit_key": new.limit_key,
        },
    )


def _read_back(row: Any, new: NewRun) -> StoredRun:
    """The run a creation's ``RETURNING`` row stands for, its context whole (a long one is
    in the journal only: the row says so)."""
    stored = _stored_from_row(row)
    if stored.record.context == new.record.context:
        return stored
    whole = dataclasses.replace(stored.record, context=new.record.context)
    return replaced_run(stored, record=whole)


class CreationStoreMixin:
    """Run creation for :class:`~flowloop.store.sql.SQLStore`."""

    now_sql: ColumnElement[float]
    _contexts: ContextCache
    _pg_creates: dict[tuple[bool, int], Raw]
    _insert_events: Any
    _postgres: bool
    _dbapi_error: type[Exception]

    def _write(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _driver(self) -> AbstractContextManager[Any]:  # provided by SQLStore
        raise NotImplementedError

    def _executed_pg(self, raw: Any, stmt: Raw, params: Mapping[str, Any]) -> Any:
        raise NotImplementedError  # provided by SQLStore

    def _ranked(self, conn: Connection, news: Sequence[NewRun]) -> list[NewRun]:
        raise NotImplementedError  # provided by LimitStoreMixin

    def _fold_tails(self, conn: Connection, stored: Sequence[StoredRun]) -> list[StoredRun]:
        raise NotImplementedError  # provided by AppendStoreMixin

    def _dialect_obj(self) -> Any:
        raise NotImplementedError  # provided by SQLStore

    def _immediate(self, body: Callable[[Any], tuple[bool, T]]) -> T:
        raise NotImplementedError  # provided by ImmediateStoreMixin

    def _build_creation(self) -> None:
        run_columns = [c.name for c in runs.columns if c.name != "lease_expires_at"]
        self._insert_run = (
            insert(runs)
            .values({name: bindparam(f"p_{name}") for name in run_columns})
            .returning(*runs.c)
        )
        self._insert_runs = insert(runs).returning(*runs.c)
        self._insert_run_owned = (
            insert(runs)
            .values(
                {
                    **{name: bindparam(f"p_{name}") for name in run_columns},
                    "lease_expires_at": self.now_sql + bindparam("p_lease"),
                }
            )
            .returning(*runs.c)
        )
        self._raw_create: dict[bool, Raw] | None = None

    def _prepare_raw_creation(self, sqlite_dialect: Any) -> None:
        run_columns = [c.name for c in runs.columns if c.name != "lease_expires_at"]
        values: dict[str, Any] = {name: bindparam(f"p_{name}") for name in run_columns}
        lease = runs.c.lease_expires_at
        owned_values = {**values, "lease_expires_at": self.now_sql + bindparam("p_lease")}
        # Its parameters named as the columns (and ``lease``, the lease's length): a new
        # run's row is its parameters, without a renamed copy per run.
        self._raw_create = {
            owned: Raw.of(
                insert(runs).values(owned_values if owned else values).returning(lease),
                sqlite_dialect,
            ).unprefixed("p_")
            for owned in (False, True)
        }
        self._raw_event = Raw.of(insert(journal), sqlite_dialect, list(JOURNAL_FIELDS))
        self._dbapi_integrity: type[Exception] = sqlite_dialect.loaded_dbapi.IntegrityError

    def _create_one_sqlite(self, new: NewRun) -> tuple[StoredRun, bool] | None:
        """A plain run in one driver transaction; ``None`` when the insert failed on a
        constraint (an id taken): the general path decides then, as it always did."""
        assert self._raw_create is not None
        row = _new_run_row(new)
        row["lease"] = new.lease_seconds  # (the statement's one parameter not a column)
        stmt = self._raw_create[bool(new.owner)]
        event = self._raw_event
        integrity = self._dbapi_integrity

        def body(cursor: Any) -> tuple[bool, tuple[float | None] | None]:
            try:
                cursor.execute(*stmt.bound(row))
                made: tuple[float | None] = cursor.fetchone()
                for entry in new.events:  # (each its own NULLs: no executemany)
                    cursor.execute(*event.bound(event_row(entry)))
            except integrity:
                return False, None  # rolled back
            return True, made

        made = self._immediate(body)
        if made is None:
            return None
        lease = made[0]
        return _created(new, row, lease), True

    def _pg_create(self, owned: bool, events: int) -> Raw:
        """PostgreSQL: a plain run's row and its first entries as ONE statement (the row's
        INSERT in a CTE, the entries inserted from it), sent in autocommit: one round trip
        instead of four (BEGIN, two INSERTs, COMMIT)."""
        key = (owned, events)
        found = self._pg_creates.get(key)
        if found is not None:
            return found
        run_columns = [c.name for c in runs.columns if c.name != "lease_expires_at"]
        values: dict[str, Any] = {name: bindparam(f"p_{name}") for name in run_columns}
        if owned:
            values["lease_expires_at"] = self.now_sql + bindparam("p_lease")
        made = insert(runs).values(values).returning(runs.c.lease_expires_at).cte("made")
        selects = [
            select(
                *[
                    sql_cast(bindparam(f"e{i}_{column.name}"), column.type).label(column.name)
                    for column in journal.columns
                ]
            ).select_from(made)
            for i in range(events)
        ]
        rows = selects[0] if events == 1 else union_all(*selects)
        logged = (
            insert(journal)
            .from_select(list(JOURNAL_FIELDS), rows)
            .returning(journal.c.seq)
            .cte("logged")
        )
        stmt = select(
            made.c.lease_expires_at, select(func.count()).select_from(logged).scalar_subquery()
        )
        found = self._pg_creates[key] = Raw.of(stmt, self._dialect_obj())
        return found

    def _create_one_pg(self, new: NewRun) -> tuple[StoredRun, bool] | None:
        row = _new_run_row(new)
        params: dict[str, Any] = {f"p_{name}": value for name, value in row.items()}
        params["p_lease"] = new.lease_seconds
        for i, event in enumerate(new.events):
            for name, value in event_row(event).items():
                params[f"e{i}_{name}"] = value
        stmt = self._pg_create(bool(new.owner), len(new.events))
        with self._driver() as raw:
            raw.autocommit = True  # one statement: its own transaction
            try:
                try:
                    cursor = self._executed_pg(raw, stmt, params)
                except self._dbapi_error as error:
                    if getattr(error, "sqlstate", None) == "23505":
                        return None  # an id taken: the general path decides
                    raise
                lease, logged = cursor.fetchone()
            finally:
                raw.autocommit = False
        if logged != len(new.events):  # cannot happen: the entries follow the row
            raise AssertionError(f"run {row['id']}: {logged} of {len(new.events)} entries")
        return _created(new, row, lease), True

    def create_run(self, new: NewRun) -> tuple[StoredRun, bool]:
        if _plain(new) and (self._raw_create is not None or self._postgres):
            created = (
                self._create_one_sqlite(new)
                if self._raw_create is not None
                else self._create_one_pg(new)
            )
            if created is not None:
                return self._noted([created])[0]
        return self._noted(self._retrying_key_races(lambda conn: [self._create_in(conn, new)]))[0]

    def create_runs(self, news: Sequence[NewRun]) -> list[tuple[StoredRun, bool]]:
        if any(new.owner for new in news):  # created claimed: the one-by-one statement
            created = self._retrying_key_races(
                lambda conn: [self._create_in(conn, n) for n in news]
            )
        else:
            created = self._retrying_key_races(lambda conn: self._create_many_in(conn, news))
        return self._noted(created)

    def _noted(self, created: list[tuple[StoredRun, bool]]) -> list[tuple[StoredRun, bool]]:
        """Runs created claimed: their context is the base of their next entry's splice."""
        for stored, new in created:
            if new and stored.owner is not None:
                self._contexts.note(stored.id, stored.record.last_seq, stored.record.context)
        return created

    def _retrying_key_races(
        self, create: Callable[[Connection], list[tuple[StoredRun, bool]]]
    ) -> list[tuple[StoredRun, bool]]:
        for _ in range(CREATE_ATTEMPTS):
            try:
                with self._write() as conn:
                    return create(conn)
            except IntegrityError:
                # Lost a race with a concurrent start of the same key (nothing was
                # written): once more, and the winner is found and returned.
                continue
            except OperationalError as error:
                if not dialect.is_deadlock(error):
                    raise
                continue  # chosen as a deadlock's victim (nothing was written): again
        with self._write() as conn:
            return create(conn)

    def _create_in(self, conn: Connection, new: NewRun) -> tuple[StoredRun, bool]:
        taken = self._existing_many(conn, [new])
        existing = next((taken[key] for key in _unique_keys(new) if key in taken), None)
        if existing is not None:
            return existing, False
        if new.limit_key is not None:
            new = self._ranked(conn, [new])[0]
        stmt = self._insert_run_owned if new.owner else self._insert_run
        params = {f"p_{name}": value for name, value in _new_run_row(new).items()}
        params["p_lease"] = new.lease_seconds
        inserted = conn.execute(stmt, params).one()
        conn.execute(self._insert_events, [event_row(e) for e in new.events])
        return _read_back(inserted, new), True

    def _create_many_in(
        self, conn: Connection, news: Sequence[NewRun]
    ) -> list[tuple[StoredRun, bool]]:
        """Unowned runs in a few statements: one lookup of the keys already taken, one
        multi-row INSERT of the runs, one of their journal events."""
        taken = self._existing_many(conn, news)
        # Per run: the existing run holding its key, else the id of the run that is
        # inserted for it, and whether it is this run's own (not an earlier one's of the
        # batch with the same key).
        plan: list[tuple[StoredRun | None, str, bool]] = []
        fresh: list[NewRun] = []
        claimed: dict[tuple[str, str], str] = {}  # keys of this batch's new runs -> id
        for new in news:
            keys = _unique_keys(new)
            existing = next((taken[key] for key in keys if key in taken), None)
            earlier = next((claimed[key] for key in keys if key in claimed), None)
            if existing is not None or earlier is not None:
                plan.append((existing, earlier or "", False))
                continue
            claimed.update((key, new.record.id) for key in keys)
            plan.append((None, new.record.id, True))
            fresh.append(new)
        inserted: dict[str, StoredRun] = {}
        if fresh:
            # One order for every writer (by key): two batches with overlapping keys take
            # the unique index's entries in the same order instead of deadlocking.
            fresh = self._ranked(conn, fresh)  # in the order given: FIFO per key
            fresh.sort(key=lambda new: (_unique_keys(new), new.record.id))
            rows = conn.execute(self._insert_runs, [_new_run_row(new) for new in fresh])
            by_id = {new.record.id: new for new in fresh}
            inserted = {row.id: _read_back(row, by_id[row.id]) for row in rows}
            events = [event_row(event) for new in fresh for event in new.events]
            conn.execute(self._insert_events, events)
        return [
            (existing if existing is not None else inserted[run_id], created)
            for existing, run_id, created in plan
        ]

    def _existing_many(
        self, conn: Connection, news: Sequence[NewRun]
    ) -> dict[tuple[str, str], StoredRun]:
        """Runs already holding a (workflow, key) or an idempotency key (as ("", key)) of
        ``news``."""
        keys: dict[str, set[str]] = {}
        idempotency = {new.idempotency_key for new in news if new.idempotency_key}
        for new in news:
            if new.record.key is not None:
                keys.setdefault(new.record.workflow, set()).add(new.record.key)
        if not keys and idempotency:  # children and idempotent starts: built once
            rows = conn.execute(_BY_IDEMPOTENCY, {"p_keys": sorted(idempotency)}).all()
        else:
            conditions = [
                and_(runs.c.workflow == workflow, runs.c.key.in_(sorted(names)))
                for workflow, names in keys.items()
            ]
            if idempotency:
                conditions.append(runs.c.idempotency_key.in_(sorted(idempotency)))
            if not conditions:
                return {}
            rows = conn.execute(select(runs).where(or_(*conditions))).all()
        found: dict[tuple[str, str], StoredRun] = {}
        folded = self._fold_tails(conn, [_stored_from_row(r) for r in rows])
        for row, stored in zip(rows, folded, strict=True):
            if row.key is not None:
                found[(row.workflow, row.key)] = stored
            if row.idempotency_key is not None:
                found[("", row.idempotency_key)] = stored
        return found
