"""Shared fixtures: database URLs for SQLite (real files) and PostgreSQL (a schema per test).

PostgreSQL comes from ``$FLOWLOOP_TEST_PG`` (default: the local ``test`` database). Each
test gets a fresh schema ``t_<uuid>`` selected with libpq's ``options=-csearch_path=…`` and
dropped afterwards. Without a server the PostgreSQL tests are skipped with the reason shown;
under ``CI=true`` they fail instead, so a missing server cannot hide a broken store.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
import sqlalchemy as sa

from flowloop.store import SQLStore

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:  # helper modules (crashkit, storekit) import as top level
    sys.path.insert(0, str(TESTS_DIR))

PG_ENV = "FLOWLOOP_TEST_PG"
PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
PG_CONNECT_TIMEOUT_S = 3

_pg_problem: list[str | None] = []  # cached once per session: None = reachable


def pg_base_url() -> str:
    return os.environ.get(PG_ENV) or PG_DEFAULT


def _pg_unreachable() -> str | None:
    """Why PostgreSQL cannot be used (``None`` when it can); asked once per session."""
    if not _pg_problem:
        try:
            engine = sa.create_engine(
                pg_base_url(), connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S}
            )
            try:
                with engine.connect() as conn:
                    conn.execute(sa.text("select 1"))
            finally:
                engine.dispose()
            _pg_problem.append(None)
        except Exception as error:  # no driver, no server, bad credentials: all the same here
            first = str(error).strip().splitlines()[0] if str(error).strip() else repr(error)
            _pg_problem.append(f"PostgreSQL at {pg_base_url()} is unreachable: {first}")
    return _pg_problem[0]


def require_pg() -> None:
    """Skip (or, under CI=true, fail) when PostgreSQL is not there."""
    problem = _pg_unreachable()
    if problem is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{problem} (CI=true: PostgreSQL tests must run)")
    pytest.skip(f"{problem} (set {PG_ENV} or start the server)")


def with_search_path(url: str, schema: str) -> str:
    option = quote(f"-csearch_path={schema}", safe="-")
    return f"{url}{'&' if '?' in url else '?'}options={option}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh, private schema."""
    require_pg()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = sa.create_engine(pg_base_url())
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        yield with_search_path(pg_base_url(), schema)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite database file in the test's own directory (not created yet)."""
    return f"sqlite:///{tmp_path / 'flowloop.db'}"


@pytest.fixture
def python_sigint() -> None:
    """Skip unless a SIGINT this process sends itself reaches Python's default handler
    (the main thread, and SIGINT not ignored, as a background job's is)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT reaches the main thread only")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default here (ignored by a background job?)")


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest) -> str:
    """The same test on a SQLite file and on a PostgreSQL schema."""
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    return str(request.getfixturevalue(name))


@pytest.fixture
def store(store_url: str) -> Iterator[SQLStore]:
    """A store on :func:`store_url`'s database (both), closed after the test."""
    s = SQLStore(store_url)
    yield s
    s.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Mark every test that touches PostgreSQL, so `-m "not postgres"` works.
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = callspec.params if callspec is not None else {}
        fixtures = getattr(item, "fixturenames", ())
        if "pg_url" in fixtures or params.get("store_url") == "postgres":
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(autouse=True)
def _plain_calls_on_this_thread() -> Iterator[None]:
    """flowloop.freshstack's per-thread rule starts empty in every test: what one test's
    runs taught the test thread must not decide how the next test's runs are called."""
    from flowloop import freshstack

    freshstack.reset_thread()
    yield
