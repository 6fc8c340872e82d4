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

import sqlite3
from typing import Final

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

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
    if isinstance(error, (OperationalError, InterfaceError)):
        return True
    return isinstance(error, DBAPIError) and bool(error.connection_invalidated)
