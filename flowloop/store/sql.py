"""One SQLAlchemy Core store for SQLite and PostgreSQL.

Dialect decisions live in :mod:`flowloop.store.dialect`; everything here is the same SQL on
both. The hot path (``write``, flowloop/store/appends.py) runs on one held connection and
costs one commit per call, however many boundaries it carries. A running run's row is a
snapshot: every read of a run folds the journal entries after it (``_fold_tails``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, cast

from sqlalchemy import (
    Connection,
    Engine,
    and_,
    func,
    insert,
    inspect,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.exc import (
    DBAPIError,
    IntegrityError,
    SQLAlchemyError,
    StatementError,
)
from sqlalchemy.pool import StaticPool

from flowloop.errors import MissingDatabase, StoreError, WrongDatabase
from flowloop.ids import prefix_bounds
from flowloop.journal import JournalEvent
from flowloop.lifecycle import CLAIMABLE
from flowloop.store import built, claims, dialect, leases, migrate, outage
from flowloop.store.admission import AdmissionStoreMixin
from flowloop.store.appends import AppendStoreMixin, append_only
from flowloop.store.base import Boundary, RunFilter, Store, StoredRun
from flowloop.store.checkpointer import FALLBACK_PAGES, Checkpointer
from flowloop.store.creation import CreationStoreMixin
from flowloop.store.entries import (
    JOURNALED,
    SNAPSHOT_EVERY,
    ContextCache,
    decode,
    definition_structure,
    row_context,
    until,
)
from flowloop.store.entries import stored_from_row as _stored_from_row
from flowloop.store.immediate import LOST_HANDLE, ImmediateStoreMixin
from flowloop.store.inbox import InboxStoreMixin
from flowloop.store.joins import JoinStoreMixin, reports_end
from flowloop.store.limits import ClaimLimits, LimitStoreMixin
from flowloop.store.loops import LoopStoreMixin
from flowloop.store.raw import Raw
from flowloop.store.schema import definitions, journal, runs

CREATE_ATTEMPTS = 3
"""Tries of a run-creating transaction that lost a key race before the last, unguarded one."""

_PREPARED: dict[tuple[Any, ...], dict[str, Any]] = {}
"""The write statements built per dialect: (name, driver, paramstyle) to the attributes
building them sets on a store (see SQLStore._prepare_statements). The server's version is
not part of it: these statements compile the same for every version (and it is unknown
before a store's first connection)."""
_PREPARING = threading.Lock()

log = logging.getLogger("flowloop.store")


class SQLStore(
    # Order matters: a mixin's stub for what another provides must come after it.
    ImmediateStoreMixin,
    AppendStoreMixin,
    LimitStoreMixin,
    CreationStoreMixin,
    JoinStoreMixin,
    LoopStoreMixin,
    AdmissionStoreMixin,
    InboxStoreMixin,
    Store,
):
    """The store on a SQLAlchemy URL (``sqlite:///path`` or ``postgresql+psycopg://…``)."""

    def __init__(
        self,
        url: str,
        *,
        synchronous: str = dialect.DEFAULT_SYNCHRONOUS,
        create: bool = True,
        check_schema: bool = True,
        reads_only: bool = False,
    ) -> None:
        """``reads_only``: a store that is only read from (the reading commands' Reader):
        its write statements are not built (a write through it is an AttributeError)."""
        self.url = url
        outage.note_opened(url)
        self.engine: Engine = dialect.create_engine_for(url, synchronous=synchronous)
        # Its WAL checkpointed by a thread of ours from the first write on, not inside a
        # commit (checkpointer.py); a store that only reads starts none.
        self._wal_file = None if reads_only else dialect.checkpointed_file(self.engine)
        self._synchronous = synchronous.upper()
        self._checkpointer: Checkpointer | None = None
        self.now_sql = dialect.db_now(self.engine)
        self._lock = threading.RLock()
        # In memory the pool's one connection is the writer's too: reads take _lock (_read).
        self._one_connection = isinstance(self.engine.pool, StaticPool)
        self._writer: Connection | None = None
        self._driver_for: Connection | None = None
        self._driver_conn: Any = None
        self._driver_cursor: Any = None
        self._claim_cache: dict[tuple[str, bool, bool, bool, int | None], Any] = {}
        self._claim_limits: dict[str, ClaimLimits] = {}
        try:
            if check_schema:
                self._ensure_schema(create=create)
        except SQLAlchemyError as error:
            self.close()  # the checkpointing thread too, if creating the schema started it
            raise StoreError(f"cannot use {outage.describe(error, url)}") from error
        except StoreError:
            self.close()
            raise
        dialect_ = self.engine.dialect
        self._postgres = dialect_.name == "postgresql"
        self._dbapi_error: type[Exception] = dialect_.loaded_dbapi.Error
        # psycopg 3's cursor for numbered placeholders (Raw.numbered); another driver gets
        # the hot path's statements as compiled
        self._numbered_cursor: Any = (
            getattr(dialect_.loaded_dbapi, "RawCursor", None)
            if dialect_.driver == "psycopg"
            else None
        )
        self._contexts = ContextCache()
        self._pg_cache: dict[tuple[str, bool, int], Raw] = {}
        self._pg_creates: dict[tuple[bool, int], Raw] = {}
        if not reads_only:
            self._prepare_statements()

    # -- the write statements, shared by the stores of one dialect ---------------------------

    def _prepare_statements(self) -> None:
        """The write statements (the boundary's fenced append and row updates, run creation,
        their forms compiled for the driver), built and compiled once per process for every
        store on the same dialect: 15-27 ms for the first store, a dozen attributes set for
        each later one. A store opened ``reads_only`` (a Reader's) skips them.

        (Built here, not on first use: a class-level ``__getattr__`` that built them lazily
        turned every attribute read of a store into a slower, unspecialized lookup, +2.4 %
        instructions per step by callgrind.)"""
        dialect_ = self.engine.dialect
        key = (dialect_.name, dialect_.driver, dialect_.paramstyle)
        with _PREPARING:
            built = _PREPARED.get(key)
            if built is None:
                # Built on an empty SQLStore (not a subclass's) that holds only what building
                # reads, the clock's SQL: what it ends up holding is the statements alone.
                builder = object.__new__(SQLStore)
                builder.now_sql = self.now_sql
                builder._build_statements()
                builder._prepare_raw(dialect_)
                if dialect_.name == "sqlite":
                    builder._prepare_raw_creation(dialect_)
                built = {k: v for k, v in vars(builder).items() if k != "now_sql"}
                _PREPARED[key] = built
        for name, value in built.items():  # setattr: this store's __dict__ stays unmade
            setattr(self, name, value)

    # -- connections -----------------------------------------------------------------------

    @property
    def checkpointer(self) -> Checkpointer | None:
        """The thread checkpointing this store's SQLite WAL, from its first write on;
        ``None`` before it, on PostgreSQL, in memory, for a ``file:`` URI or ``?uri=true``,
        for a store that only reads, and where the thread could not open the file."""
        return self._checkpointer

    def close(self) -> None:
        with self._lock:  # no write now can start a thread this close would miss
            self._wal_file = None
            checkpointer = self._checkpointer
        if checkpointer is not None:
            checkpointer.close()
        with self._lock:  # a write racing close: before it, or connecting after the dispose
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self.engine.dispose()

    def _held_conn(self) -> Connection:
        """The held write connection, connected again when it was lost (``_lock`` held)."""
        conn = self._writer
        if conn is None or conn.closed or conn.invalidated:
            conn = self._writer = self.engine.connect()
            if self._wal_file is not None:
                self._checkpoint_apart(conn)
        return conn

    def _checkpoint_apart(self, conn: Connection) -> None:
        """The write connection ``conn`` checkpoints only past :data:`FALLBACK_PAGES` while
        the store's checkpointing thread (started by the first write) runs. Only speed is
        at stake here: what fails leaves the connection checkpointing as SQLite has it."""
        try:
            if self._checkpointer is None:
                self._checkpointer = self._started_checkpointer()
                if self._checkpointer is None:
                    self._wal_file = None  # tried once: the checkpoints stay in the commits
                    return
            if not self._checkpointer.running:
                return  # stopped: a simulated crash
            driver = conn.connection.driver_connection
            assert driver is not None
            driver.execute(f"PRAGMA wal_autocheckpoint={FALLBACK_PAGES}")
        except Exception as error:
            self._wal_file = None
            log.debug("WAL checkpoints of %s stay in the commits: %s", self.url, error)

    def _started_checkpointer(self) -> Checkpointer | None:
        assert self._wal_file is not None
        checkpointer = Checkpointer.open(self._wal_file, self._synchronous)
        if checkpointer is None:
            return None
        # Stopped when a store dropped without close() is collected: registered first, so
        # that no thread can run without it.
        weakref.finalize(self, checkpointer.stop)
        try:
            checkpointer.start()
        except RuntimeError:  # no thread to be had
            checkpointer.close()
            raise
        return checkpointer

    def _drop_writer(self, conn: Connection) -> None:
        # A dropped connection must not poison the next transaction.
        conn.invalidate()
        self._writer = None

    @contextmanager
    def _held(self) -> Iterator[Connection]:
        """The held write connection, for one caller at a time."""
        with self._lock:
            conn = self._held_conn()
            try:
                yield conn
            except LOST_HANDLE:
                self._drop_writer(conn)
                raise

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        """A write transaction on the held connection (``BEGIN IMMEDIATE`` on SQLite)."""
        with self._held() as conn, conn.begin():
            yield conn

    def _driver_of(self, conn: Connection) -> Any:
        """``conn``'s driver connection (kept: three property lookups per boundary)."""
        if self._driver_for is not conn:
            self._driver_conn = conn.connection.driver_connection
            self._driver_cursor = None
            self._driver_for = conn
        return self._driver_conn

    @contextmanager
    def _driver(self) -> Iterator[Any]:
        """The held connection's driver connection, for the precompiled hot path. A driver
        error is rolled back and wrapped as SQLAlchemy would wrap it, so callers (and the
        executor's outage handling) see the same exception types as on every other path."""
        with self._held() as conn:
            raw = self._driver_of(conn)
            try:
                yield raw
            except self._dbapi_error as error:
                raise self._driver_error(conn, raw, error) from error

    def _driver_error(self, conn: Connection, raw: Any, error: Exception) -> StatementError:
        """A driver error as SQLAlchemy's own execution turns it: rolled back, and a
        connection the server ended (its idle-in-transaction timeout, a restart) marked
        invalidated — which makes the error an outage to retry — and replaced at the next
        use."""
        lost = bool(self.engine.dialect.is_disconnect(cast(Any, error), raw, None))
        with contextlib.suppress(self._dbapi_error):
            raw.rollback()
        if lost:
            self._drop_writer(conn)
        return DBAPIError.instance(
            None, None, error, self._dbapi_error, connection_invalidated=lost
        )

    def _executed_pg(self, raw: Any, stmt: Raw, params: Mapping[str, Any]) -> Any:
        """``stmt`` executed with ``params`` on PostgreSQL's driver connection ``raw``; its
        cursor. On psycopg 3 its placeholders numbered (:attr:`Raw.numbered`), which
        psycopg sends as they are: the hot path's statements are too long for psycopg's
        cache of the placeholders it reads."""
        if self._numbered_cursor is None:
            cursor = raw.cursor()
            cursor.execute(stmt.sql, stmt.args(params))
            return cursor
        numbered = stmt.numbered
        # Kept with its connection (_driver_of), as SQLite's in _execute_alone (which serves
        # SQLite alone: one kind of cursor per store)
        cursor = self._driver_cursor
        if cursor is None:
            cursor = self._driver_cursor = self._numbered_cursor(raw)
        cursor.execute(numbered.sql, numbered.args(params))
        return cursor

    def _execute_alone(self, sql: str, args: Any) -> int:
        """One statement on the held connection's driver, sent alone (in autocommit: its own
        transaction); its rowcount. Errors as :meth:`_driver` and :meth:`_held` treat them:
        the usual boundary's write, without their two generator context managers."""
        with self._lock:
            conn = self._held_conn()
            raw = self._driver_of(conn)
            try:
                cursor = self._driver_cursor
                if cursor is None:  # kept with its connection: a new one per call costs more
                    cursor = self._driver_cursor = raw.cursor()
                return int(cursor.execute(sql, args).rowcount)
            except self._dbapi_error as error:
                wrapped = self._driver_error(conn, raw, error)
                if isinstance(wrapped, LOST_HANDLE):
                    self._drop_writer(conn)
                raise wrapped from error

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        """A read transaction on a pooled connection. In memory (a ``StaticPool``) the one
        connection is the held writer's, which the lease renewer's thread writes on under
        ``_lock``: a read takes the lock too (else its ``BEGIN`` lands inside a renewal's
        transaction, or a renewal inside the read's, and the threads use one connection at
        once)."""
        lock = self._lock if self._one_connection else None
        if lock is not None:
            lock.acquire()
        try:
            with self.engine.connect() as conn:
                conn = conn.execution_options(**{dialect.READ_OPTION: True})
                with conn.begin():
                    yield conn
        finally:
            if lock is not None:
                lock.release()

    # -- schema ----------------------------------------------------------------------------

    def _ensure_schema(self, *, create: bool) -> None:
        url = dialect.safe_url(self.url)
        # Opening a database in use (`flowloop status` beside a worker) only reads. Creating
        # the schema happens under a lock (see dialect.lock_schema), with the check
        # repeated under it: another process may have created it meanwhile.
        with self._read() as conn:
            if migrate.VERSION_TABLE in inspect(conn).get_table_names():
                migrate.check(conn, url)
                return
        with self._schema_write() as conn:
            tables = set(inspect(conn).get_table_names())
            ours = {t for t in tables if t.startswith("flowloop_")}
            if migrate.VERSION_TABLE not in tables:
                foreign = sorted(tables - ours)
                if foreign or ours:
                    raise WrongDatabase(
                        f"{url} is not a flowloop database (it has tables "
                        f"{', '.join((foreign or sorted(ours))[:5])}); "
                        "point --db at a new file or schema"
                    )
                if not create:
                    raise MissingDatabase(f"{url} has no flowloop schema yet {_creating(conn)}")
                migrate.upgrade(conn)  # a new database: create the schema at head
                return
            migrate.check(conn, url)

    @contextmanager
    def _schema_write(self) -> Iterator[Connection]:
        """A write transaction that alone may change the schema."""
        with self._write() as conn:
            dialect.lock_schema(conn)
            yield conn

    def new_revision(self, message: str) -> None:
        with self._schema_write() as conn:
            migrate.new_revision(message, conn)

    def upgrade_schema(self) -> tuple[str | None, str]:
        """Apply pending migrations (``flowloop db upgrade``); returns (from, to). A database
        error is a StoreError of one line (the cause kept)."""
        url = dialect.safe_url(self.url)
        try:
            with self._schema_write() as conn:
                return migrate.upgrade(conn, url)
        except SQLAlchemyError as error:  # (the cause in words where it is known)
            raise StoreError(f"cannot upgrade {outage.describe(error, self.url)}") from error

    def _build_statements(self) -> None:
        self._build_appends()
        self._insert_events = insert(journal)
        self._build_creation()

    # -- definitions -----------------------------------------------------------------------

    def db_now(self) -> float:
        with self._read() as conn:
            return float(conn.execute(select(self.now_sql)).scalar_one())

    def save_definition(self, fingerprint: str, name: str, version: int, structure: str) -> None:
        with self._read() as conn:
            saved = conn.execute(
                select(definitions.c.fingerprint).where(definitions.c.fingerprint == fingerprint)
            ).first()
        if saved is not None:
            return
        try:
            with self._write() as conn:
                conn.execute(
                    insert(definitions),
                    [
                        {
                            "fingerprint": fingerprint,
                            "name": name,
                            "version": version,
                            "structure": structure,
                            "created_at": float(conn.execute(select(self.now_sql)).scalar_one()),
                        }
                    ],
                )
        except IntegrityError:
            pass  # saved concurrently by another process: same content by construction

    def definition(self, fingerprint: str) -> dict[str, Any] | None:
        with self._read() as conn:
            text = conn.execute(
                select(definitions.c.structure).where(definitions.c.fingerprint == fingerprint)
            ).scalar_one_or_none()
        return definition_structure(text, fingerprint)

    # -- runs ------------------------------------------------------------------------------

    def get_run(self, run_id: str) -> StoredRun | None:
        with self._read() as conn:
            row = conn.execute(built.RUN_BY_ID, {"r_id": run_id}).first()
            return None if row is None else self._fold_tails(conn, [_stored_from_row(row)])[0]

    def run_ids_with_prefix(self, prefix: str, *, limit: int) -> list[str]:
        if not prefix:
            return []
        low, high = prefix_bounds(prefix)
        query = (
            select(runs.c.id)
            .where(runs.c.id >= low, runs.c.id < high)
            .order_by(runs.c.id)
            .limit(limit)
        )
        with self._read() as conn:
            # The range is exact in codepoint order (SQLite; PostgreSQL in a C collation,
            # and for hex ids in any locale); the filter keeps the answer exact anyway.
            return [row.id for row in conn.execute(query) if row.id.startswith(prefix)]

    def find_runs(self, where: RunFilter) -> list[StoredRun]:
        query = select(runs)
        if where.workflow is not None:
            query = query.where(runs.c.workflow == where.workflow)
        if where.statuses:
            query = query.where(runs.c.status.in_(list(where.statuses)))
        if where.key is not None:
            query = query.where(runs.c.key == where.key)
        if where.after is not None:
            created, run_id = where.after
            query = query.where(
                or_(
                    runs.c.created_at < created,
                    and_(runs.c.created_at == created, runs.c.id > run_id),
                )
            )
        query = query.order_by(runs.c.created_at.desc(), runs.c.id).limit(where.limit)
        with self._read() as conn:
            return self._fold_tails(conn, [_stored_from_row(row) for row in conn.execute(query)])

    def journal(self, run_id: str, *, until_seq: int | None = None) -> list[JournalEvent]:
        with self._read() as conn:
            rows = (
                conn.execute(built.JOURNAL_OF, {"r_id": run_id})
                if until_seq is None
                else conn.execute(built.JOURNAL_UNTIL, {"r_id": run_id, "r_seq": until_seq})
            )
            events = decode(rows, strict=False)
        return until(events, until_seq)

    def first_entry(self, run_id: str, kinds: Collection[str]) -> int | None:
        with self._read() as conn:
            seq = conn.execute(built.FIRST_ENTRY_OF, {"r_id": run_id, "r_kinds": list(kinds)})
            return seq.scalar()

    # -- the hot path (flowloop/store/appends.py) ------------------------------------------

    def write(self, boundaries: Sequence[Boundary]) -> list[bool]:
        if not boundaries:
            return []
        if (
            reports_end(boundaries[0])
            if len(boundaries) == 1
            else any(map(reports_end, boundaries))
        ):
            # A child's end: its join counter and its parent in the same transaction.
            return self._write_with_ends(boundaries)
        return self._write_appends(boundaries)

    def renews_lease(self, boundary: Boundary) -> bool:
        """A write of the run row renews the owner's lease; an append leaves it to the
        heartbeat (the fence is still judged by every write)."""
        return (
            boundary.fence.owner is not None and not boundary.release and not append_only(boundary)
        )

    def _dialect_obj(self) -> Any:
        return self.engine.dialect

    _lease_for_write = 30.0

    def set_write_lease(self, seconds: float) -> None:
        """The lease that every owned write renews (the worker's lease length). It also
        bounds how long a call waits for another process's lock (SQLite) and how long a
        session may sit idle in a transaction (PostgreSQL: a vanished client's locks)."""
        self._lease_for_write = seconds
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            dialect.set_lease_bounds(self.engine, seconds)
            if self.engine.dialect.name != "sqlite":
                shortest = dialect.pg_shortest_lease()
                if seconds < shortest:
                    log.warning(
                        "lease %gs is shorter than PostgreSQL's timeouts can serve when the "
                        "network drops packets (%gs): the worker still fences its runs off "
                        "by its own clock, but a network stall of a second costs it every "
                        "run it holds; use --lease %gs or more",
                        seconds,
                        shortest,
                        shortest,
                        extra={"event": "lease_too_short"},
                    )

    # -- claiming --------------------------------------------------------------------------

    def _claim_statement(
        self, kind: str, by_workflow: bool, by_id: bool, looked_up: bool, segmented: int | None
    ) -> Any:
        """The claim for one shape of filter (flowloop/store/claims.py), built once: building
        SQLAlchemy statements per call costs more than the commit."""
        key = (kind, by_workflow, by_id, looked_up, segmented)
        cached = self._claim_cache.get(key)
        if cached is None:
            cached = self._claim_cache[key] = claims.claim_statement(
                kind,
                by_workflow=by_workflow,
                workflows=segmented,
                by_id=by_id,
                looked_up=looked_up,
                postgres=self._postgres,
                now_sql=self.now_sql,
                now_text=str(self.now_sql.compile(dialect=self.engine.dialect)),
            )
        return cached

    def _claim(
        self,
        kind: str,
        *,
        worker: str,
        lease_seconds: float,
        limit: int,
        workflows: Sequence[str] | None,
        run_ids: Sequence[str] | None,
        now: float = 0.0,
    ) -> list[StoredRun]:
        if (workflows is not None and not workflows) or (run_ids is not None and not run_ids):
            return []
        if workflows is not None:  # each once: a statement names each in a segment of its own
            workflows = list(dict.fromkeys(workflows))
        limited = [w for w in workflows or () if w in self._claim_limits] if kind == "due" else []
        if limited:  # counted against their limits, in this same transaction
            assert workflows is not None
            workflows = [w for w in workflows if w not in self._claim_limits]
        looked_up = dialect.look_up(run_ids, postgres=self._postgres)
        by_id = run_ids is not None
        segmented = claims.segments(kind, workflows, by_id=by_id, postgres=self._postgres)
        stmt = self._claim_statement(kind, workflows is not None, by_id, looked_up, segmented)
        params: dict[str, Any] = {
            "p_worker": worker,
            "p_lease": lease_seconds,
            "p_limit": limit,
            "p_now": now,
        }
        if workflows is not None:
            params.update(claims.workflow_params(workflows, segmented))
        if run_ids is not None:
            params["p_ids"] = dialect.ids_value(run_ids, postgres=self._postgres)
        with self._write() as conn:
            found = (
                self._claim_limited(
                    conn,
                    limited,
                    worker=worker,
                    lease_seconds=lease_seconds,
                    limit=limit,
                    now=now,
                    ids=params.get("p_ids"),
                    looked_up=looked_up,
                )
                if limited
                else []
            )
            params["p_limit"] = limit - len(found)
            if segmented == 0:
                params["p_scan"] = claims.window(params["p_limit"])
            if (workflows is None or workflows) and params["p_limit"] > 0:
                found.extend(conn.execute(stmt, params))
            rows = self._fold_claimed(conn, [_stored_from_row(row) for row in found])
        rows.sort(key=lambda r: (-r.priority, r.record.next_run_at or 0.0, r.id))
        for stored in rows:  # the claimer's next entry splices against this context
            self._note_claimed(stored)
        return rows

    def _note_claimed(self, stored: StoredRun) -> None:
        """The claimed run's context as the base of its next entry's splice. A context the
        journal alone keeps is read from its latest whole one: the next is whole, so that
        a run released and claimed again and again does not make every read replay splices
        back to its creation. An unreadable one is the base of nothing."""
        record = stored.record
        if stored.problem is not None:
            self._contexts.forget(stored.id)
            return
        journaled = row_context(record.context) == JOURNALED
        spliced = SNAPSHOT_EVERY - 1 if journaled else 0
        self._contexts.note(stored.id, record.last_seq, record.context, spliced)

    def claim(
        self,
        *,
        worker: str,
        now: float,
        limit: int,
        lease_seconds: float,
        workflows: Sequence[str] | None = None,
        run_ids: Sequence[str] | None = None,
    ) -> list[StoredRun]:
        return self._claim(
            "due",
            worker=worker,
            lease_seconds=lease_seconds,
            limit=limit,
            workflows=workflows,
            run_ids=run_ids,
            now=now,
        )

    def claim_interrupted(
        self,
        *,
        worker: str,
        limit: int,
        lease_seconds: float,
        workflows: Sequence[str] | None = None,
    ) -> list[StoredRun]:
        return self._claim(
            "interrupted",
            worker=worker,
            lease_seconds=lease_seconds,
            limit=limit,
            workflows=workflows,
            run_ids=None,
        )

    def running_owners(self) -> list[str]:
        with self._read() as conn:
            rows = conn.execute(built.RUNNING_OWNERS)
            return sorted(row.owner for row in rows)

    def expire_leases(self, owners: Sequence[str]) -> int:
        if not owners:
            return 0
        with self._write() as conn:
            return leases.expire(conn, runs, now_sql=self.now_sql, owners=owners)

    def renew(self, *, worker: str, run_ids: Sequence[str], lease_seconds: float) -> set[str]:
        if not run_ids:
            return set()
        with self._write() as conn:
            return leases.renew(
                conn,
                runs,
                runs.c.id,
                now_sql=self.now_sql,
                worker=worker,
                keys=run_ids,
                lease_seconds=lease_seconds,
            )

    def release(self, *, worker: str, run_ids: Sequence[str]) -> None:
        if not run_ids:
            return
        with self._write() as conn:
            conn.execute(
                update(runs)
                .where(runs.c.owner == worker, runs.c.id.in_(list(run_ids)))
                .values(owner=None, lease_expires_at=None)
            )

    # -- control ---------------------------------------------------------------------------

    def request_control(
        self, run_id: str, action: str | None, *, unless: Collection[str] = ()
    ) -> bool:
        query = update(runs).where(runs.c.id == run_id)
        if isinstance(unless, str):  # one request named alone, not its letters
            unless = (unless,)
        if unless:
            query = query.where(
                or_(runs.c.control.is_(None), runs.c.control.not_in(sorted(unless)))
            )
        with self._write() as conn:
            return bool(conn.execute(query.values(control=action)).rowcount == 1)

    def withdraw_control(self, run_id: str, action: str) -> bool:
        with self._write() as conn:
            result = conn.execute(
                update(runs)
                .where(runs.c.id == run_id, runs.c.control == action)
                .values(control=None)
            )
            return bool(result.rowcount == 1)

    def pending_controls(self, *, worker: str) -> dict[str, str]:
        with self._read() as conn:
            rows = conn.execute(
                select(runs.c.id, runs.c.control).where(
                    runs.c.owner == worker, runs.c.control.is_not(None)
                )
            )
            return {row.id: row.control for row in rows}

    def count_due(self, *, now: float, workflows: Sequence[str] | None = None) -> int:
        query = (
            select(func.count())
            .select_from(runs)
            .where(runs.c.status.in_(sorted(CLAIMABLE)), runs.c.next_run_at <= now)
        )
        if workflows is not None:
            query = query.where(runs.c.workflow.in_(list(workflows)))
        with self._read() as conn:
            return int(conn.execute(query).scalar_one())

    def next_due(
        self, *, workflows: Sequence[str] | None = None, run_ids: Sequence[str] | None = None
    ) -> float | None:
        if workflows is not None and not workflows:
            return None
        if workflows is not None:
            workflows = list(dict.fromkeys(workflows))
        by_id = run_ids is not None
        segmented = claims.segments("due", workflows, by_id=by_id, postgres=self._postgres)
        params: dict[str, Any] = {}
        if workflows is not None:
            params.update(claims.workflow_params(workflows, segmented))
        if run_ids is not None:
            params["p_ids"] = dialect.ids_value(run_ids, postgres=self._postgres)
        query = built.next_due(
            by_workflow=workflows is not None,
            by_id=by_id,
            postgres=self._postgres,
            looked_up=dialect.look_up(run_ids, postgres=self._postgres),
            segmented=segmented,
        )
        with self._read() as conn:
            value = conn.execute(query, params).scalar_one_or_none()
        return None if value is None else float(value)


def _creating(conn: Connection) -> str:
    """How the missing schema gets created: on PostgreSQL none can be while no schema of
    the search_path exists (CREATE SCHEMA first)."""
    if (
        conn.dialect.name != "sqlite"
        and conn.execute(text("SELECT current_schema()")).scalar() is None
    ):
        return (
            "and no schema of its search_path exists: create one (CREATE SCHEMA …), then a "
            "command that writes, or `flowloop db upgrade`, creates flowloop's tables in it"
        )
    return "(a command that writes, or `flowloop db upgrade`, creates it)"
