"""flowloop leaves another application's SQLite file exactly as it was (issue 20, item 10):
it refuses it before switching anything (WAL rewrites the header); and a database named by
a ``file:`` URI is created readable by its owner only, like any other."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from flowloop import Engine
from flowloop.cli import main
from flowloop.errors import StoreError


def test_a_foreign_sqlite_file_is_refused_without_a_byte_changed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
        conn.execute("INSERT INTO invoices (total) VALUES (12.5)")
    conn.close()
    before = other.read_bytes()
    with pytest.raises(StoreError, match=r"not a flowloop database .*invoices"):
        Engine(f"sqlite:///{other}")
    with pytest.raises(SystemExit) as exit_:
        main(["status", "--db", str(other)])
    assert exit_.value.code == 2  # WrongDatabase: --db names the wrong file, a usage error
    assert "not a flowloop database" in capsys.readouterr().err
    assert other.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.db"]  # no -wal, no -shm


def test_an_empty_file_and_a_flowloop_file_still_open(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.touch()
    with Engine(f"sqlite:///{empty}") as engine:
        assert engine.runs() == []
    with Engine(f"sqlite:///{empty}") as engine:  # now a flowloop database
        assert engine.runs() == []


def test_a_file_uri_database_is_created_private(tmp_path: Path) -> None:
    path = tmp_path / "uri.db"
    with Engine(f"sqlite:///file:{path}?uri=true") as engine:
        assert engine.runs() == []
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_second_engine_on_a_file_in_use_keeps_the_first_ones_locks(tmp_path: Path) -> None:
    """Opening a second engine on a file this process already uses read the file's header
    through a plain descriptor; closing it dropped every POSIX lock the process held on the
    file (SQLite's "How To Corrupt", 2.2). Another process could then change the journal
    mode or reset the WAL under the first engine: workers logged "database disk image is
    malformed". The first engine's shared lock holds after the second opens."""
    import subprocess
    import sys

    path = tmp_path / "busy.db"
    probe = (
        "import sqlite3, sys\n"
        "conn = sqlite3.connect(sys.argv[1], timeout=0)\n"
        "try:\n"
        "    print(conn.execute('PRAGMA journal_mode=DELETE').fetchone()[0])\n"
        "except sqlite3.OperationalError as error:\n"
        "    print(error)\n"
    )

    def another_process_switches_the_journal() -> str:
        done = subprocess.run(
            [sys.executable, "-c", probe, str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout.strip()

    with Engine(str(path)) as first:
        first.runs()  # its connection open, holding the file's shared lock (WAL)
        assert another_process_switches_the_journal() == "database is locked"
        with Engine(str(path)) as second:
            second.runs()
            assert another_process_switches_the_journal() == "database is locked"
        assert another_process_switches_the_journal() == "database is locked"
