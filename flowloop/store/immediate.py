"""SQLite's hot-path transactions on the driver's cursor: ``BEGIN IMMEDIATE``, a few
precompiled statements, ``COMMIT``.

A run's creation and its end (an append and the row's update) are each one such
transaction. Written through :meth:`SQLStore._driver` they cost two generator context
managers, a new cursor and the driver's ``commit()`` — which prepares its ``COMMIT`` anew
at every call (the driver's statement cache serves ``execute`` only) — ~2.6 % of a
1-step ``engine.run``'s instructions: :meth:`ImmediateStoreMixin._immediate` does the same
with none of them, the store's kept cursor and a cached ``COMMIT``. Its errors are those
of ``_driver`` inside ``_held``: a driver error rolled back and wrapped as SQLAlchemy
would, and a wrapped ``OperationalError`` or ``InterfaceError`` drops the connection.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Final, TypeVar

from sqlalchemy import Connection
from sqlalchemy.exc import InterfaceError, OperationalError, StatementError

T = TypeVar("T")

LOST_HANDLE: Final = (OperationalError, InterfaceError)
"""The wrapped driver errors after which the store's held write connection is dropped (a
new one connected at the next write): a database gone or locked, and an interface error —
sqlite3's ``SQLITE_MISUSE`` (the handle used wrongly) — which may leave the handle broken.
Kept, a broken handle failed every later write of the process (an outage by
:func:`~flowloop.store.outage.is_outage`, retried for ever); dropped, a sound one costs
one connect."""


class ImmediateStoreMixin:
    """:meth:`_immediate` for :class:`~flowloop.store.sql.SQLStore` (SQLite only)."""

    _lock: Any
    _dbapi_error: type[Exception]
    _driver_cursor: Any

    def _held_conn(self) -> Connection:  # provided by SQLStore
        raise NotImplementedError

    def _driver_of(self, conn: Connection) -> Any:  # provided by SQLStore
        raise NotImplementedError

    def _driver_error(self, conn: Connection, raw: Any, error: Exception) -> StatementError:
        raise NotImplementedError  # provided by SQLStore

    def _drop_writer(self, conn: Connection) -> None:  # provided by SQLStore
        raise NotImplementedError

    def _immediate(self, body: Callable[[Any], tuple[bool, T]]) -> T:
        """``body(cursor)`` in one ``BEGIN IMMEDIATE`` transaction on the held SQLite
        connection's driver cursor: committed when it returns ``(True, value)``, rolled
        back when it returns ``(False, value)`` or raises; ``value``."""
        with self._lock:
            conn = self._held_conn()
            raw = self._driver_of(conn)
            try:
                cursor = self._driver_cursor
                if cursor is None:  # kept with its connection (as _execute_alone's)
                    cursor = self._driver_cursor = raw.cursor()
                cursor.execute("BEGIN IMMEDIATE")
                try:
                    keep, value = body(cursor)
                except BaseException:
                    with contextlib.suppress(Exception):
                        raw.rollback()
                    raise
                if keep:
                    # The connection is in autocommit (isolation_level None): this is
                    # what ``raw.commit()`` sends, from the statement cache.
                    cursor.execute("COMMIT")
                else:
                    raw.rollback()
                return value
            except self._dbapi_error as error:
                wrapped = self._driver_error(conn, raw, error)
                if isinstance(wrapped, LOST_HANDLE):
                    self._drop_writer(conn)
                raise wrapped from error
