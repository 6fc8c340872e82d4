"""A worker says an outage once, in words, and when it is over (flowloop/outagelog.py).

Each part of a worker (claims, writes, heartbeat, loops) logged a warning at every retry —
67 to 203 lines in 40 s of one outage — a read-only PostgreSQL and a locked SQLite file
were both "database unreachable", and nothing said the database was back (fault audit)."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from flowloop import outagelog
from flowloop.store.outage import is_outage


def test_the_cause_in_words_from_real_errors(tmp_path: Path, pg_url: str) -> None:
    db = tmp_path / "locked.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN EXCLUSIVE")
    waiter = sa.create_engine(f"sqlite:///{db}", connect_args={"timeout": 0.01})
    with pytest.raises(DBAPIError) as locked, waiter.connect() as conn:
        conn.execute(sa.text("INSERT INTO t VALUES (1)"))
    holder.execute("ROLLBACK")
    waiter.dispose()
    engine = sa.create_engine(pg_url)
    with pytest.raises(DBAPIError) as read_only, engine.connect() as conn:
        conn.execute(sa.text("SET default_transaction_read_only = on"))
        conn.execute(sa.text("COMMIT"))
        conn.execute(sa.text("CREATE TABLE t (x int)"))
    engine.dispose()
    refused = sa.create_engine("postgresql+psycopg://postgres@127.0.0.1:1/none")
    with pytest.raises(DBAPIError) as unreachable:
        refused.connect()
    for error, said in ((locked, "locked"), (read_only, "read-only"), (unreachable, "unreachable")):
        assert is_outage(error.value)
        assert outagelog.cause(error.value) == said


def test_said_once_a_minute_and_when_it_is_over(caplog: pytest.LogCaptureFixture) -> None:
    claims, writes = outagelog.Part("claims"), outagelog.Part("writes")
    levels = [claims.failed() for _ in range(3)]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert writes.failed() == logging.WARNING  # each part says it once
    # Another engine's part of the same name is its own (one process, two databases: the
    # healthy one's answer ended the other's outage, every retry warned again — review).
    other = outagelog.Part("claims")
    other.answered()
    assert claims.failed() == logging.DEBUG
    with caplog.at_level(logging.WARNING, logger="flowloop"):
        claims.answered()
        claims.answered()  # said once
    [line] = caplog.messages
    assert line.startswith("claims: the database answers again (out for ")
    assert claims.failed() == logging.WARNING  # a new outage is said again
