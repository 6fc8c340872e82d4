"""Real faults for the outage-recovery tests (tests/acceptance/test_outage_recovery.py):

* :func:`scratch_pg_database` — a PostgreSQL database of the test's own (created, then
  dropped with ``FORCE``), so that :class:`PgOutage` may refuse every connection to it
  (``ALLOW_CONNECTIONS false`` and ``pg_terminate_backend`` of its backends) without
  touching any other test's database;
* :class:`SqliteLock` — another process holding ``BEGIN EXCLUSIVE`` on a SQLite file until
  it is told to let go.

Every wait is bounded; the fault's own length is the one thing measured by the clock.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from polling import poll

LOCKER = """
import sqlite3, sys, time, os
conn = sqlite3.connect(sys.argv[1], timeout=60, isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
open(sys.argv[2] + ".held", "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
conn.execute("COMMIT")
conn.close()
"""


@contextlib.contextmanager
def scratch_pg_database(base_url: str) -> Iterator[str]:
    """A new, empty PostgreSQL database on the server of ``base_url``; its URL."""
    name = f"flowloop_faults_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(base_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
        yield sa.make_url(base_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


class PgOutage:
    """The scratch database refuses connections; those it had are terminated."""

    def __init__(self, base_url: str, database: str) -> None:
        self.database = database
        self.admin = sa.create_engine(base_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)

    def begin(self) -> int:
        with self.admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS false'))
            return int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))"
                        " FROM pg_stat_activity WHERE datname = :db"
                    ),
                    {"db": self.database},
                ).scalar_one()
            )

    def end(self) -> None:
        with self.admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS true'))

    def close(self) -> None:
        self.admin.dispose()


class SqliteLock:
    """Another process holding an exclusive lock on a SQLite file (``BEGIN EXCLUSIVE``)."""

    def __init__(self, path: Path, flag: Path) -> None:
        self.flag = flag
        self.proc = subprocess.Popen([sys.executable, "-c", LOCKER, str(path), str(flag)])
        poll(
            Path(f"{flag}.held").exists,
            timeout=30,
            every=0.01,
            what="the other process to lock the database",
        )

    def release(self) -> None:
        self.flag.write_text("go")
        self.proc.wait(30)
        assert self.proc.returncode == 0


class PgReadOnly:
    """The scratch database turns read-only (``default_transaction_read_only``), its
    sessions are terminated so that the new ones get it, then it turns writable again."""

    def __init__(self, base_url: str, database: str) -> None:
        self.outage = PgOutage(base_url, database)

    def _set(self, sql: str) -> None:
        with self.outage.admin.connect() as conn:
            conn.execute(sa.text(sql))
            conn.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :db"
                ),
                {"db": self.outage.database},
            )

    def begin(self) -> None:
        self._set(f'ALTER DATABASE "{self.outage.database}" SET default_transaction_read_only = on')

    def end(self) -> None:
        self._set(f'ALTER DATABASE "{self.outage.database}" RESET default_transaction_read_only')

    def close(self) -> None:
        self.outage.close()
