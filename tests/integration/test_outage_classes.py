"""Outages are told apart by SQLSTATE class and SQLite result code, from real errors of
real databases (issue 20, item 5): read-only PostgreSQL (25006, an InternalError) and a
SQLite lock held by another process are outages; a read-only SQLite file, bad SQL and a
value too long are not."""

from __future__ import annotations

from pathlib import Path

import faultkit
import pytest
import sqlalchemy as sa

from flowloop.store.outage import is_outage, sqlite_code, sqlstate


def error_of(engine: sa.Engine, sql: str, *, read_only: bool = False) -> BaseException:
    with engine.connect() as conn:
        if read_only:
            conn.execute(sa.text("SET TRANSACTION READ ONLY"))
        with pytest.raises(sa.exc.DBAPIError) as caught:
            conn.execute(sa.text(sql))
    return caught.value


def test_postgres_errors_by_sqlstate(pg_url: str) -> None:
    engine = sa.create_engine(pg_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (v varchar(3))"))
        read_only = error_of(engine, "INSERT INTO t VALUES ('a')", read_only=True)
        assert isinstance(read_only, sa.exc.InternalError)
        assert sqlstate(read_only) == "25006" and is_outage(read_only)
        too_long = error_of(engine, "INSERT INTO t VALUES ('abcd')")
        assert sqlstate(too_long) == "22001" and not is_outage(too_long)
        syntax = error_of(engine, "SELEC 1")
        assert sqlstate(syntax) == "42601" and not is_outage(syntax)
    finally:
        engine.dispose()


def test_sqlite_errors_by_result_code(tmp_path: Path) -> None:
    path = tmp_path / "x.db"
    engine = sa.create_engine(f"sqlite:///{path}", connect_args={"timeout": 0.05})
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (v text)"))
        lock = faultkit.SqliteLock(path, tmp_path / "unlock")
        try:
            locked = error_of(engine, "INSERT INTO t VALUES ('a')")
        finally:
            lock.release()
        assert sqlite_code(locked) == 5 and is_outage(locked)  # SQLITE_BUSY
        syntax = error_of(engine, "SELEC 1")
        assert not is_outage(syntax)
    finally:
        engine.dispose()
    # Opened read-only (as a read-only file or mount would be; root writes any file).
    engine = sa.create_engine(f"sqlite:///file:{path}?mode=ro&uri=true")
    try:
        read_only = error_of(engine, "INSERT INTO t VALUES ('a')")
        assert sqlite_code(read_only) == 8 and not is_outage(read_only)  # SQLITE_READONLY
    finally:
        engine.dispose()
