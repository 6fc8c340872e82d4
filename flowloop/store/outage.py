"""Which database errors are outages (wait and retry) and which are not (report them).

The exception class alone does not tell: PostgreSQL in read-only mode (a standby, a
failover in progress, ``default_transaction_read_only``) answers SQLSTATE 25006, which
psycopg raises as ``InternalError``; a full disk is ``53100`` (``OperationalError``), a
syntax error is ``42601`` (``ProgrammingError``). So errors are classified by the
SQLSTATE's class on PostgreSQL and by the primary result code on SQLite, and by type only
where the driver gives no code (a connection lost mid-call).

An outage is something that goes away without anyone changing flowloop's data or code:
the server unreachable, restarting or refusing connections, read-only for a while, out
of disk, memory or connections, a lock held by another process, a statement cut off by
its timeout, a transaction aborted to break a deadlock (nothing of it was written).
A SQLite file that is read-only or cannot be opened is a mistake to report, not to wait
out: waiting would hang ``flowloop resume`` for ever.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Final

from sqlalchemy import make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from flowloop.store.dialect import safe_url

OUTAGE_SQLSTATE_CLASSES: Final = frozenset(
    {
        "08",  # connection exception
        "40",  # transaction rollback: serialization failure, deadlock (safe to retry)
        "53",  # insufficient resources: disk full, out of memory, too many connections
        "57",  # operator intervention: admin/crash shutdown, cannot connect now, canceled
        "58",  # system error: I/O error
    }
)
OUTAGE_SQLSTATES: Final = frozenset(
    {
        "25006",  # read_only_sql_transaction: a standby, or read-only for a while
        "55P03",  # lock_not_available (lock_timeout)
    }
)
NOT_OUTAGE_SQLSTATE_CLASSES: Final = frozenset(
    {
        "0A",  # feature not supported
        "22",  # data exception: a value too long, a NUL in text, a bad number
        "23",  # integrity constraint violation
        "28",  # invalid authorization (a wrong password does not fix itself)
        "3D",  # invalid catalog name: no such database
        "3F",  # invalid schema name
        "42",  # syntax error or access rule violation
        "54",  # program limit exceeded: an index row too big, …
        "XX",  # internal error (corruption): report it
    }
)
"""Anything else with a SQLSTATE is judged by its exception type (a connection refused
while the database does not accept connections is 55000, an OperationalError)."""
OUTAGE_SQLITE_CODES: Final = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_PROTOCOL,
        sqlite3.SQLITE_INTERRUPT,
    }
)
"""Every other SQLite code (READONLY, CANTOPEN, CORRUPT, a plain ERROR …) is reported."""


def _driver_error(error: BaseException) -> BaseException:
    return getattr(error, "orig", None) or error


def sqlstate(error: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE of ``error`` (or of the driver error it wraps), if any."""
    code = getattr(_driver_error(error), "sqlstate", None)
    return code if isinstance(code, str) and len(code) == 5 else None


def sqlite_code(error: BaseException) -> int | None:
    """SQLite's primary result code of ``error`` (``SQLITE_BUSY`` …), if any."""
    code = getattr(_driver_error(error), "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def is_outage(error: BaseException) -> bool:
    """A database that is unreachable, restarting, read-only for now, full or locked:
    retry later. Not a bug, a conflict or a mistake to report."""
    state = sqlstate(error)
    if state is not None:
        if state[:2] in OUTAGE_SQLSTATE_CLASSES or state in OUTAGE_SQLSTATES:
            return True
        if state[:2] in NOT_OUTAGE_SQLSTATE_CLASSES:
            return False
    code = sqlite_code(error)
    if code is not None:
        return code in OUTAGE_SQLITE_CODES
    if state is None and _refused_connection(_first_line(error)) is not None:
        # A server that answered "no such database", "no such role" or "wrong password"
        # (libpq gives no SQLSTATE for them): a mistake, not an outage — a worker started
        # on it waited for ever (review).
        return False
    if isinstance(error, (OperationalError, InterfaceError)):
        return True
    return isinstance(error, DBAPIError) and bool(error.connection_invalidated)


# -- telling the user -------------------------------------------------------------------

PG_CAUSES: Final = {
    "25006": "the database is read-only (a standby, or default_transaction_read_only)",
    "53100": "the database server's disk is full",
    "53200": "the database server is out of memory",
    "53300": "the database server has no connection slot left",
    "3D000": "the database does not exist",
    "3F000": "no schema of its search_path exists: create it first (CREATE SCHEMA …)",
    "57P01": "the database server is shutting down",
    "57P03": "the database server is starting up or not accepting connections",
}
PG_CLASS_CAUSES: Final = {
    "08": "the database server is unreachable",
    "28": "the database server refused the credentials",
    "53": "the database server is out of resources",
    "22": "a value does not fit the database column",
}


def _first_line(error: BaseException) -> str:
    text = str(_driver_error(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__


_opened: list[str] = []


def note_opened(url: str) -> None:
    """Remember the database this process opened last (for :func:`last_opened`)."""
    _opened[:] = [url]


def last_opened() -> str | None:
    """The URL of the database this process opened last: the CLI names it in the one line
    it prints for a storage error that reached it."""
    return _opened[0] if _opened else None


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (``None``: in memory, or not SQLite)."""
    try:
        made = make_url(url)
    except Exception:
        return None
    if made.get_backend_name() != "sqlite" or not made.database:
        return None
    database = made.database
    if database == ":memory:":
        return None
    if database.startswith("file:"):
        database = database[len("file:") :].partition("?")[0]
    return Path(database)


def _sqlite_cause(path: Path, code: int | None) -> str | None:
    directory = path.parent if path.parent != Path("") else Path(".")
    try:
        fs = os.statvfs(directory)
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY:
        return "the file system is read-only"
    if code == sqlite3.SQLITE_FULL or fs.f_bavail == 0:
        return "the disk is full"
    if code in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN) and not os.access(
        directory, os.W_OK
    ):
        return f"no permission to write in {directory}"
    if code == sqlite3.SQLITE_READONLY:
        return "the database is read-only (file permissions, or opened with mode=ro)"
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return "the database is locked by another process"
    if code == sqlite3.SQLITE_CORRUPT:
        return "the database file is corrupt"
    return None


def _refused_connection(detail: str) -> str | None:
    """Why the server answered a connection with a refusal (libpq gives no SQLSTATE for
    it, only the server's message): it was reached, so not "unreachable"."""
    if "does not exist" in detail and 'database "' in detail:
        return PG_CAUSES["3D000"]
    if "authentication failed" in detail or ("role " in detail and "does not exist" in detail):
        return PG_CLASS_CAUSES["28"]
    return None


def describe(error: BaseException, url: str) -> str:
    """One line for a storage error: the database, the cause in words when it is known,
    and the driver's own first line."""
    detail = _first_line(error)
    path = sqlite_path(url)
    cause: str | None
    if path is not None:
        where = str(path)
        cause = _sqlite_cause(path, sqlite_code(error))
    else:
        where = safe_url(url)
        state = sqlstate(error)
        cause = None if state is None else PG_CAUSES.get(state, PG_CLASS_CAUSES.get(state[:2]))
        if cause is None and isinstance(error, OperationalError) and state is None:
            cause = _refused_connection(detail) or "the database server is unreachable"
    text = f"database {where}: {cause} ({detail})" if cause else f"database {where}: {detail}"
    return text.replace("\n", " ")
