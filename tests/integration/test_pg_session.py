"""flowloop's PostgreSQL connections carry timeouts derived from the worker's lease (issue
20, items 13 and 14): libpq's ``tcp_user_timeout`` and ``connect_timeout`` (a silent
network fails a call well within the lease), the server's
``idle_in_transaction_session_timeout``, ``statement_timeout`` and keepalives; a URL's own
values win, and a lease shorter than those timeouts can serve is warned about."""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa

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
