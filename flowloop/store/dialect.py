"""Every difference between SQLite and PostgreSQL, in one place.

SQLite: WAL journal, ``synchronous=NORMAL`` by default (durable across process crashes; the
last commits can be lost on power loss — choose ``FULL`` to rule that out), a generous busy
timeout, and every write transaction opened with ``BEGIN IMMEDIATE``: a deferred transaction
that later upgrades to a write fails with "database is locked" at once, bypassing the busy
timeout. The database file is created readable by its owner only.

PostgreSQL: psycopg 3; claims use ``FOR UPDATE SKIP LOCKED`` (rendered by SQLAlchemy and
ignored on SQLite).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import weakref
from collections.abc import Iterable, Sequence, Sized
from pathlib import Path
from typing import Any, Final

from sqlalchemy import (
    ARRAY,
    ColumnElement,
    Engine,
    Float,
    String,
    UnaryExpression,
    and_,
    any_,
    bindparam,
    create_engine,
    event,
    func,
    literal_column,
    make_url,
    select,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError
from sqlalchemy.pool import StaticPool
from sqlalchemy.sql.operators import custom_op

from flowloop.errors import MissingExtra, WrongDatabase
from flowloop.store.urls import normalize_url

DEFAULT_SYNCHRONOUS: Final = "NORMAL"
SYNCHRONOUS_MODES: Final = ("OFF", "NORMAL", "FULL", "EXTRA")
BUSY_TIMEOUT_MS: Final = 30_000
BUSY_FLOOR_MS: Final = 100
READ_OPTION: Final = "flowloop_read"
PG_CONNECT_TIMEOUT_S: Final = 5
PG_CONNECTION_DEFAULTS: Final[dict[str, int]] = {
    # A server that does not answer must not hang a worker's event loop for the OS's TCP
    # timeouts (minutes; ~15 for unacknowledged data): the database calls run on that loop.
    "connect_timeout": PG_CONNECT_TIMEOUT_S,
    # Sent data unacknowledged this long (a partition, a dead host) fails the call, and the
    # worker's outage handling takes over; a slow query on a live server is not affected.
    "tcp_user_timeout": 15_000,
    # A call waiting for a reply learns that the host is gone after 10 + 3 x 5 s.
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}
"""libpq connection parameters flowloop sets unless the URL sets them (``?keepalives_idle=…``)."""
VERSION_TABLE: Final = "flowloop_alembic_version"
"""The table that marks a flowloop database (flowloop.store.migrate.VERSION_TABLE)."""


def ids_in(column: ColumnElement[Any], name: str, *, postgres: bool) -> ColumnElement[bool]:
    """``column`` is one of the ids of the parameter ``name``, given as ONE value
    (:func:`ids_value`): a JSON array read by ``json_each`` on SQLite, an array on
    PostgreSQL. An expanding ``IN`` binds a variable per id, which SQLite refuses past
    32,766 and psycopg past 65,535 (``engine.run`` of a big map scopes its claims to its
    whole family), and SQLAlchemy renders every one of them again at each execution.
    (``json_each`` is built into SQLite since 3.38, and into the usual builds before.)"""
    if postgres:
        return column == any_(sql_cast(bindparam(name), ARRAY(String)))
    listed = func.json_each(bindparam(name, type_=String)).table_valued("value")
    return column.in_(select(listed.c.value).scalar_subquery())


IDS_LOOKED_UP: Final = 100
"""Up to this many run ids, SQLite looks a scope's runs up by their ids (:func:`within_ids`).
Past it, the index of the other conditions serves: a map's family of 10,000 children,
finished ones included until ``Engine.run`` reads the family again, took 42-46 s by
``engine.run`` looked up by id at every claim (``06748ca``), 27-28 s on the index
(``d0b8336``). The line is chosen, not measured: no size between 2 and 10,000 was timed."""


def look_up(ids: Sized | None, *, postgres: bool) -> bool:
    """A scope small enough for SQLite to look its runs up by their ids (never on
    PostgreSQL, whose statements do not change with it)."""
    return not postgres and ids is not None and len(ids) <= IDS_LOOKED_UP


def within_ids(
    column: ColumnElement[Any],
    conditions: Sequence[ColumnElement[bool]],
    name: str,
    *,
    postgres: bool,
    looked_up: bool,
) -> ColumnElement[bool]:
    """Runs whose id (``column``) is one of the parameter ``name`` (:func:`ids_in`) and meet
    ``conditions``; ``looked_up`` (:func:`look_up`): found by their ids. SQLite's planner
    took an index of the conditions' columns (the workflow's: its claimable runs) and
    tested each of those runs against the ids: with 20,000 runs of a call's child workflow
    scheduled for later, each scoped claim of ``Engine.run`` cost 5.7 ms and each idle
    check 8.8. Looked up, the conditions are one term behind a unary ``+`` on SQLite,
    which no index serves. PostgreSQL's plans are left to its statistics (the scoped
    claim's: tests/integration/test_claim_plans.py)."""
    ids = ids_in(column, name, postgres=postgres)
    if not looked_up:
        return and_(*conditions, ids)
    return and_(ids, UnaryExpression(and_(*conditions).self_group(), operator=custom_op("+")))


def ids_in_sql(column: str, name: str, *, postgres: bool) -> str:
    """:func:`ids_in` as SQL text, for statements written as text."""
    if postgres:
        return f"{column} = ANY(CAST(:{name} AS VARCHAR[]))"
    return f"{column} IN (SELECT value FROM json_each(:{name}))"


def ids_value(ids: Iterable[str], *, postgres: bool) -> Any:
    """The value of an :func:`ids_in` parameter."""
    return list(ids) if postgres else json.dumps(list(ids))


def safe_url(url: str | URL) -> str:
    """The URL with any password hidden, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return str(url)


def first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _sqlite_file(url: URL) -> Path | None:
    """The file of a SQLite URL, ``file:`` URIs (``?uri=true``) included; ``None`` for an
    in-memory database."""
    database = url.database
    if not database or database == ":memory:":
        return None
    if database.startswith("file:"):
        if url.query.get("mode") == "memory":
            return None
        database = database[len("file:") :].partition("?")[0]
        if not database or database == ":memory:":
            return None
        return Path(database)  # SQLite resolves it as the OS does
    if url.query.get("uri"):
        return Path(database)  # given to SQLite as it is, as a file: URI's path is
    # A plain path reaches SQLite through os.path.abspath (SQLAlchemy's pysqlite dialect):
    # `link/../x.db` is `./x.db`, not the link's parent's. So it is here, so that what is
    # checked and checkpointed is the file SQLite opens.
    return Path(os.path.abspath(database))


def _refuse_unless_ours(path: Path) -> None:
    """Refuse an existing file that is not SQLite, or another application's database (its
    tables named), before anything — switching it to WAL rewrites its header — touches
    it; read without changing a byte of it.

    Read through SQLite itself, never by a plain ``open()``: closing any descriptor of a
    file drops every POSIX lock this process holds on it (SQLite's "How To Corrupt An
    SQLite Database File", 2.2). A second engine opened beside a busy one dropped the first
    one's locks so, and other processes checkpointed and reset the WAL under it: "database
    disk image is malformed". SQLite's own connections share their locks per file."""
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return  # (the store's own open says what is wrong)
    try:
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    except sqlite3.DatabaseError as error:
        if getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_NOTADB:
            raise WrongDatabase(
                f"{path} is not a SQLite database (point --db at a new file)"
            ) from None
        return
    finally:
        conn.close()
    tables = sorted(str(row[0]) for row in rows)
    if tables and VERSION_TABLE not in tables:
        raise WrongDatabase(
            f"{path} is not a flowloop database (it has tables {', '.join(tables[:5])}); "
            "point --db at a new file"
        )


def _prepare_sqlite_file(url: URL) -> None:
    path = _sqlite_file(url)
    if path is None:
        return
    if path.is_dir():
        raise WrongDatabase(f"{path} is a directory, not a database file")
    if path.exists():
        _refuse_unless_ours(path)
        return
    if url.query.get("mode") == "ro":
        return
    if not path.parent.exists():
        raise WrongDatabase(
            f"directory {path.parent} does not exist (create it or choose another --db)"
        )
    # Created by us, readable by the owner only: contexts may hold personal data. Only if
    # it is still missing (O_EXCL): a descriptor of a file another engine of this process
    # opened meanwhile would drop its locks when closed (see _refuse_unless_ours).
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))


def _enter_wal(cursor: sqlite3.Cursor) -> None:
    """Switch the database to WAL, waiting out other connections doing the same.

    Changing the journal mode needs an exclusive lock and SQLite answers "database is
    locked" at once, without the busy handler, while another process is switching a new
    file too (two workers, or a worker and ``flowloop status``, opening it together).
    Once switched, the mode is stored in the file and the pragma is a cheap no-op.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    delay = 0.001
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


_busy_ms: weakref.WeakKeyDictionary[Engine, int] = weakref.WeakKeyDictionary()


def checkpointed_file(engine: Engine) -> Path | None:
    """The SQLite file whose WAL a store writing through ``engine`` checkpoints itself
    (flowloop/store/checkpointer.py); ``None`` in memory, read-only, on PostgreSQL, for a
    ``file:`` URI (its parameters — a VFS, ``nolock`` — would have to be the thread's too)
    and for ``?uri=true`` (the path goes to SQLite as it is)."""
    database = engine.url.database or ""
    if engine.dialect.name != "sqlite" or database.startswith("file:"):
        return None
    if engine.url.query.get("uri") or engine.url.query.get("mode") == "ro":
        return None
    return _sqlite_file(engine.url)


def busy_timeout_ms(lease_seconds: float) -> int:
    """SQLite's busy timeout for a worker holding leases of ``lease_seconds``: a sixth of
    the lease (at most 30 s, at least 0.1 s). Database calls run on the worker's event
    loop, so a write waiting out another process's lock must give up — and the worker's
    outage handling take over — well before the heartbeat has to fence its runs off."""
    return int(min(BUSY_TIMEOUT_MS, max(BUSY_FLOOR_MS, lease_seconds * 1000 / 6)))


def set_busy_timeout(engine: Engine, milliseconds: int) -> None:
    """The busy timeout of ``engine``'s SQLite connections from now on (new connections;
    the caller drops the ones it holds). No-op on PostgreSQL."""
    if engine.dialect.name == "sqlite":
        _busy_ms[engine] = milliseconds
        if not isinstance(engine.pool, StaticPool):  # in memory: its one connection is it
            engine.dispose()


def create_engine_for(url_text: str, *, synchronous: str = DEFAULT_SYNCHRONOUS) -> Engine:
    try:
        url = make_url(normalize_url(url_text))
    except ArgumentError as error:
        raise WrongDatabase(f"{url_text!r} is not a database URL ({error})") from None
    try:
        if url.get_backend_name() == "sqlite":
            return _sqlite_engine(url, synchronous)
        if url.get_backend_name() == "postgresql":
            return _postgres_engine(url)
    except NoSuchModuleError:
        raise WrongDatabase(
            f"unknown database driver {url.drivername!r} in {safe_url(url)}: "
            "use sqlite:///path or postgresql+psycopg://…"
        ) from None
    raise WrongDatabase(
        f"unsupported database {safe_url(url)}: use sqlite:///path or postgresql+psycopg://…"
    )


def _sqlite_engine(url: URL, synchronous: str) -> Engine:
    mode = synchronous.upper()
    if mode not in SYNCHRONOUS_MODES:
        raise WrongDatabase(
            f"synchronous={synchronous!r} is not a SQLite mode (use {', '.join(SYNCHRONOUS_MODES)})"
        )
    _prepare_sqlite_file(url)
    memory = url.database in (None, "", ":memory:")
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": BUSY_TIMEOUT_MS / 1000},
        **({"poolclass": StaticPool} if memory else {}),
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event issue BEGIN itself (the driver's own implicit
        # BEGIN is DEFERRED and cannot be made IMMEDIATE).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if not memory:
            _enter_wal(cursor)
        cursor.execute(f"PRAGMA synchronous={mode}")
        cursor.execute(f"PRAGMA busy_timeout={_busy_ms.get(engine, BUSY_TIMEOUT_MS)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # Straight to the driver: exec_driver_sql is a full SQLAlchemy execution (~15 us)
        # for a statement with no parameters and no result.
        sql = "BEGIN" if conn.get_execution_options().get(READ_OPTION) else "BEGIN IMMEDIATE"
        try:
            conn.connection.driver_connection.execute(sql)
        except sqlite3.Error as error:
            raise DBAPIError.instance(sql, None, error, sqlite3.Error) from error

    return engine


PG_SESSION_DEFAULTS: Final[dict[str, int]] = {
    # The server's side of a vanished client. A host lost between the statements of a
    # boundary write leaves an "idle in transaction" session holding the run's row lock,
    # and every other worker's claim skips the row (SKIP LOCKED) until the session ends:
    # the server ends it after this long idle in a transaction (set from the lease, see
    # pg_session_params) ...
    "idle_in_transaction_session_timeout": 10_000,
    # ... and probes an idle connection whose client went silent (10 + 3 x 5 s).
    "tcp_keepalives_idle": 10,
    "tcp_keepalives_interval": 5,
    "tcp_keepalives_count": 3,
}
"""Session settings flowloop sets on each PostgreSQL connection it opens. They are sent
with ``SET`` at connect time (one round trip for all of them) rather than as libpq's
``options=-c …``: a URL's own ``options=`` (a search_path) is kept, and a connection
pooler that refuses the ``options`` startup parameter (PgBouncer) still works. A
statement timeout is set only once the lease is known (:func:`pg_session_params`):
schema creation and upgrades at start-up are not cut off."""
_pg_session: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()


def _clamp(value: float, low: float, high: float) -> int:
    return int(min(high, max(low, value)))


def pg_idle_in_transaction_ms(lease_seconds: float) -> int:
    """How long a flowloop session may sit idle inside a transaction: a third of the lease
    (2 s to 60 s). flowloop's own transactions never pause between statements, so only a
    vanished or frozen client hits it — and its runs are then free to be taken over soon
    after their leases end."""
    return _clamp(lease_seconds * 1000 / 3, 2_000, 60_000)


def pg_statement_timeout_ms(lease_seconds: float) -> int:
    """How long the server lets one statement of a worker's session run: a third of the
    lease (2 s to 60 s). A statement waiting that long (a row lock another session holds,
    a server starved of I/O) is cancelled — SQLSTATE 57014, an outage to the caller, who
    retries — instead of holding the worker past its lease. flowloop's statements are
    short: claims and writes touch a few rows, prune deletes in batches (its VACUUM turns
    the timeout off)."""
    return _clamp(lease_seconds * 1000 / 3, 2_000, 60_000)


def pg_session_params(lease_seconds: float) -> dict[str, int]:
    """The server-side bounds of a worker's sessions for leases of ``lease_seconds``: the
    idle-in-transaction and statement timeouts above, and keepalive probes of a silent
    client after a sixth of the lease (1 to 10 s), then every twelfth (1 to 5 s), 3 of
    them — a client gone between two statements is found out by the server too."""
    return {
        "idle_in_transaction_session_timeout": pg_idle_in_transaction_ms(lease_seconds),
        "statement_timeout": pg_statement_timeout_ms(lease_seconds),
        "tcp_keepalives_idle": _clamp(lease_seconds / 6, 1, 10),
        "tcp_keepalives_interval": _clamp(lease_seconds / 12, 1, 5),
        "tcp_keepalives_count": 3,
    }


_pg_connect: weakref.WeakKeyDictionary[Engine, dict[str, int]] = weakref.WeakKeyDictionary()


def pg_connect_params(lease_seconds: float) -> dict[str, int]:
    """libpq timeouts for a worker holding leases of ``lease_seconds``: a silent network
    must fail a call (and the reconnect after it) well before the lease ends — a sixth of
    the lease each (``tcp_user_timeout`` 1 to 15 s, ``connect_timeout`` 2 to 5 s, libpq:
    at least 2), and keepalive probes while a call waits for a reply (a sixth of the lease
    idle, 1 to 10 s; then every twelfth, 1 to 5 s; 3 of them).

    These bound a call only coarsely (the kernel checks ``tcp_user_timeout`` when a
    retransmission is due, so a 1 s timeout fails a call after 1 to 3 s); the lease itself
    is kept by the worker's own clock (flowloop.leasethread), whatever a call is doing."""
    return {
        "tcp_user_timeout": _clamp(lease_seconds * 1000 / 6, 1_000, 15_000),
        "connect_timeout": _clamp(lease_seconds / 6, 2, PG_CONNECT_TIMEOUT_S),
        "keepalives": 1,
        "keepalives_idle": _clamp(lease_seconds / 6, 1, 10),
        "keepalives_interval": _clamp(lease_seconds / 12, 1, 5),
        "keepalives_count": 3,
    }


def pg_shortest_lease() -> float:
    """The shortest lease the timeouts can serve when the network drops every packet: a
    blocked call (a failed statement, then a reconnect) must end within half the lease.
    A shorter lease is still kept — the worker fences its runs off by its own clock — but a
    network stall of a second or two then costs the worker every run it holds."""
    floor = pg_connect_params(0.0)
    return 2 * (floor["tcp_user_timeout"] / 1000 + floor["connect_timeout"])


def set_pg_session(engine: Engine, **settings: int) -> None:
    """Override session settings of ``engine``'s PostgreSQL connections from now on (the
    pool is emptied; connections in use keep theirs). No-op on SQLite."""
    if engine.dialect.name == "postgresql":
        _pg_session.setdefault(engine, dict(PG_SESSION_DEFAULTS)).update(settings)
        engine.dispose()


def set_lease_bounds(engine: Engine, lease_seconds: float) -> None:
    """Every connection-level bound derived from the lease, on ``engine``'s new
    connections: SQLite's busy timeout; PostgreSQL's libpq timeouts and keepalives and the
    server-side session timeouts and keepalives."""
    if engine.dialect.name == "sqlite":
        set_busy_timeout(engine, busy_timeout_ms(lease_seconds))
        return
    _pg_connect[engine] = pg_connect_params(lease_seconds)
    set_pg_session(engine, **pg_session_params(lease_seconds))


_PG_IN_TRANSACTION: Final = 2
"""psycopg's ``TransactionStatus.INTRANS`` (idle inside a transaction block)."""


def restart_idle_timer(connection: Any) -> None:
    """After an executemany on a psycopg ``connection`` inside a transaction: start the
    server's idle-in-transaction timer again. psycopg sends an executemany as a pipeline
    ended by Sync and Flush; PostgreSQL (15, measured) stops the timer when it reads that
    Flush and does not start it again, so a client lost right after a batch's UPDATE or
    INSERT would hold the rows' locks for good. Any statement starts the timer again."""
    if connection.info.transaction_status == _PG_IN_TRANSACTION:
        connection.execute("SELECT 1")


SSLMODES: Final = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
"""libpq's ``sslmode`` values."""


def _check_sslmode(url: URL) -> None:
    """``?sslmode=`` that libpq does not know, refused as the setting it is (exit 2): it
    failed when connecting as "the database server is unreachable (connection is bad:
    invalid sslmode value …)", exit 1, as if the server were down."""
    given = url.query.get("sslmode")
    for mode in (given,) if isinstance(given, str) else given or ():
        if mode not in SSLMODES:
            from flowloop.suggest import did_you_mean

            meant = did_you_mean(mode, SSLMODES, n=1, shown=repr)
            raise WrongDatabase(
                f"sslmode={mode!r} in the database URL is not a PostgreSQL SSL mode"
                + (f"; {meant}" if meant else f" (use one of {', '.join(SSLMODES)})")
            )


def _postgres_engine(url: URL) -> Engine:
    _check_sslmode(url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    connect_args = {k: v for k, v in PG_CONNECTION_DEFAULTS.items() if k not in url.query}
    try:
        engine = create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    except ModuleNotFoundError as error:
        raise MissingExtra("PostgreSQL needs psycopg 3", error.name, "postgres") from error

    @event.listens_for(engine, "do_connect")
    def _on_do_connect(_dialect: Any, _record: Any, _cargs: Any, cparams: Any) -> None:
        for name, value in _pg_connect.get(engine, {}).items():
            if name not in url.query:
                cparams[name] = value

    @event.listens_for(engine, "do_executemany")
    def _on_executemany(cursor: Any, statement: str, parameters: Any, _context: Any) -> bool:
        cursor.executemany(statement, parameters)
        restart_idle_timer(cursor.connection)
        return True

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        settings = _pg_session.get(engine, PG_SESSION_DEFAULTS)
        # One statement, one round trip: a reconnect during an outage must not cost one per
        # setting (set_config(…, false) is SET for the session).
        calls = ", ".join(
            f"set_config('{name}', '{int(value)}', false)" for name, value in settings.items()
        )
        with dbapi_connection.cursor() as cursor:
            cursor.execute(f"SELECT {calls}")
        dbapi_connection.commit()

    return engine


def lock_schema(conn: Any) -> None:
    """Serialize schema creation and upgrades of one database schema within the current
    write transaction: on PostgreSQL a transaction-scoped advisory lock keyed on the schema
    (workers started together on a new schema would otherwise all create the tables);
    SQLite's ``BEGIN IMMEDIATE`` already holds the database's write lock."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            "SELECT pg_advisory_xact_lock(hashtext('flowloop schema ' || current_schema()))"
        )


DEADLOCK_SQLSTATES: Final = ("40P01", "40001")  # deadlock detected, serialization failure


def is_deadlock(error: BaseException) -> bool:
    """Whether PostgreSQL aborted the transaction to break a deadlock (retrying it is safe:
    nothing of it was written)."""
    return getattr(getattr(error, "orig", None), "sqlstate", None) in DEADLOCK_SQLSTATES


def db_now(engine: Engine) -> ColumnElement[float]:
    """SQL for the database server's clock in epoch seconds (leases are judged by it)."""
    if engine.dialect.name == "sqlite":
        return literal_column("((julianday('now') - 2440587.5) * 86400.0)", Float)
    return sql_cast(literal_column("extract(epoch from clock_timestamp())"), Float)
