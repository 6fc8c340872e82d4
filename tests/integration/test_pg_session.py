"""flowloop's PostgreSQL connections carry timeouts derived from the worker's lease (issue
20, items 13 and 14): libpq's ``tcp_user_timeout`` and ``connect_timeout`` (a silent
network fails a call well within the lease), the server's
``idle_in_transaction_session_timeout``, ``statement_timeout`` and keepalives; a URL's own
values win, and a lease shorter than those timeouts can serve is warned about."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa
from polling import poll

from flowloop import Engine
from flowloop.store.sql import SQLStore


def settings(engine: Engine) -> dict[str, str]:
    assert isinstance(engine.store, SQLStore)
    with engine.store.engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        params = raw.info.get_parameters()
        shown = {
            name: str(conn.execute(sa.text(f"SHOW {name}")).scalar_one())
            for name in (
                "idle_in_transaction_session_timeout",
                "statement_timeout",
                "tcp_keepalives_idle",
                "tcp_keepalives_interval",
            )
        }
    return {**params, **shown}


def test_connection_timeouts_follow_the_lease(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flowloop.store")
    with Engine(pg_url, lease_seconds=30) as engine:
        found = settings(engine)
    assert found["tcp_user_timeout"] == "5000" and found["connect_timeout"] == "5", found
    assert found["idle_in_transaction_session_timeout"] == "10s"
    assert found["statement_timeout"] == "10s"
    assert found["tcp_keepalives_idle"] == "5" and found["tcp_keepalives_interval"] == "2"
    assert (found["keepalives_idle"], found["keepalives_interval"]) == ("5", "2"), found
    assert "lease_too_short" not in caplog.text and "shorter than" not in caplog.text

    with Engine(pg_url, lease_seconds=3) as engine:
        found = settings(engine)
    assert found["tcp_user_timeout"] == "1000" and found["connect_timeout"] == "2", found
    assert found["idle_in_transaction_session_timeout"] == "2s"
    assert found["statement_timeout"] == "2s"
    assert found["tcp_keepalives_idle"] == "1" and found["keepalives_count"] == "3", found
    assert "lease 3s is shorter than PostgreSQL's timeouts can serve" in caplog.text
    assert "still fences its runs off by its own clock" in caplog.text

    with Engine(f"{pg_url}&tcp_user_timeout=7000", lease_seconds=30) as engine:
        assert settings(engine)["tcp_user_timeout"] == "7000"  # the URL's own value wins


def test_a_session_idle_after_a_batch_statement_is_ended_by_the_server(pg_url: str) -> None:
    """psycopg sends an executemany (a group commit's UPDATE and INSERT) as a pipeline;
    after it PostgreSQL no longer times an idle transaction out, so a client lost right
    after a batch statement held the rows' locks for good. flowloop's engine follows each
    executemany in a transaction with a statement that starts the timer again."""
    with Engine(pg_url, lease_seconds=3) as engine:
        assert isinstance(engine.store, SQLStore)
        with engine.store.engine.connect() as conn:
            conn.execute(sa.text("CREATE TEMP TABLE batch (n integer)"))
            conn.execute(sa.text("INSERT INTO batch VALUES (:n)"), [{"n": 1}, {"n": 2}])
            pid = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
            # Now idle inside the transaction, as a client gone between two statements.
            watching = sa.create_engine(pg_url, poolclass=sa.NullPool, isolation_level="AUTOCOMMIT")
            with watching.connect() as watcher:  # autocommit: a fresh view at each look

                def ended() -> bool:
                    found = watcher.execute(
                        sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"),
                        {"p": pid},
                    ).scalar_one()
                    return found == 0

                poll(ended, timeout=30, every=0.1, what="the server to end the idle session")
            conn.invalidate()
