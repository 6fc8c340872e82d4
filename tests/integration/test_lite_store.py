"""The stdlib reader of a SQLite file (flowloop/store/lite.py) reads what SQLStore reads.

One database holds every kind of row the reads decode: finished and queued runs, running
runs whose rows are snapshots with a journal tail (short contexts, and long ones kept in
the journal only, as splices past several whole snapshots), joined step starts, a run whose
journaled context is gone and one whose tail cannot be folded, children, kept and dropped
events, a dropped run, breakers, and definitions (one damaged). Every read of LiteStore is
compared with SQLStore's on the same file: runs field by field, journals event by event.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from storekit import new_run, start_step, succeed_and_start

from flowloop import journal as j
from flowloop.errors import StoreError
from flowloop.store import RunFilter, SQLStore
from flowloop.store.entries import ROW_CONTEXT_MAX, SNAPSHOT_EVERY
from flowloop.store.lite import BUSY_TIMEOUT_S, LiteStore
from flowloop.store.schema import breakers, inbox, journal, runs

BLOB = "b" * (ROW_CONTEXT_MAX + 500)


def _running(store: SQLStore, steps: int, *, long: bool, workflow: str) -> str:
    """A run claimed by worker "a" that went on for ``steps`` boundaries and is still
    running: its row is a snapshot, its journal has a tail."""
    context = json.dumps({"n": 0, "blob": BLOB if long else ""})
    created, _ = store.create_run(new_run(workflow=workflow, context=context))
    [claimed] = store.claim(
        worker="a", now=time.time(), limit=1, lease_seconds=60, run_ids=[created.id]
    )
    boundary = start_step(claimed, "a")
    assert store.write([boundary]) == [True]
    record = boundary.record
    for n in range(1, steps + 1):
        context = json.dumps({"n": n, "blob": BLOB if long else "", "log": "y" * n})
        boundary = succeed_and_start(record, boundary.fence, context)
        assert store.write([boundary]) == [True]
        record = boundary.record
    return created.id


@pytest.fixture
def database(sqlite_url: str) -> Iterator[tuple[SQLStore, Path]]:
    store = SQLStore(sqlite_url)
    ids: dict[str, str] = {}
    ids["queued"] = store.create_run(new_run(workflow="orders", key="k1"))[0].id
    ids["queued2"] = store.create_run(new_run(workflow="orders", key="k2"))[0].id
    ids["short"] = _running(store, 3, long=False, workflow="orders")
    ids["long"] = _running(store, SNAPSHOT_EVERY + 3, long=True, workflow="etl")
    ids["long_short_tail"] = _running(store, 2, long=True, workflow="etl")
    ids["lost_context"] = store.create_run(new_run(workflow="etl", context=json.dumps(BLOB)))[0].id
    ids["bad_tail"] = _running(store, 2, long=False, workflow="orders")
    ids["child"] = store.create_run(new_run(workflow="etl"))[0].id
    ids["child2"] = store.create_run(new_run(workflow="etl"))[0].id
    ids["dropped"] = store.create_run(new_run(workflow="orders"))[0].id
    store.save_definition("f" * 32, "orders", 1, json.dumps({"states": {"a": {"kind": "wait"}}}))
    with store.engine.begin() as conn:
        conn.execute(sa.delete(journal).where(journal.c.run_id == ids["lost_context"]))
        conn.execute(
            sa.update(journal)
            .where(journal.c.run_id == ids["bad_tail"], journal.c.seq == 3)
            .values(data='{"~then": "not a start"}')
        )
        conn.execute(
            sa.update(journal)
            .where(journal.c.run_id == ids["short"], journal.c.seq.in_([3, 5]))
            .values(retryable=sa.case((journal.c.seq == 3, True), else_=False))
        )
        conn.execute(
            sa.update(runs)
            .where(runs.c.id.in_([ids["child"], ids["child2"]]))
            .values(parent_id=ids["short"])
        )
        conn.execute(
            sa.update(runs)
            .where(runs.c.id == ids["dropped"])
            .values(status="stopped", reason="dropped: max_queued=2")
        )
        conn.execute(
            sa.insert(inbox),
            [{"run_id": ids["queued"], "event": "go", "sent_at": 1.0} for _ in range(3)],
        )
        conn.execute(
            sa.insert(journal).values(
                run_id=ids["dropped"], seq=2, kind=j.EVENT_DROPPED, at=2.0, attempt=0
            )
        )
        conn.execute(
            sa.insert(breakers).values(
                name="payments",
                status="open",
                failures="[1.0, 2.0]",
                until=9.0,
                trial=None,
                opened=2,
                last_seq=3,
                updated_at=3.0,
            )
        )
        conn.exec_driver_sql(
            "INSERT INTO flowloop_definitions VALUES ('" + "d" * 32 + "', 'x', 1, '[1', 1.0)"
        )
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    try:
        yield store, path
    finally:
        store.close()


@pytest.fixture
def both(database: tuple[SQLStore, Path]) -> Iterator[tuple[SQLStore, LiteStore]]:
    """The database's SQLStore and a LiteStore on the same file."""
    store, path = database
    lite = _opened(path)
    try:
        yield store, lite
    finally:
        lite.close()


def _opened(path: Path) -> LiteStore:
    lite = LiteStore.open(path)
    assert lite is not None
    return lite


def test_every_run_reads_the_same(both: tuple[SQLStore, LiteStore]) -> None:
    store, lite = both
    every = store.find_runs(RunFilter(limit=100))
    assert len(every) == 10
    problems = {s.id for s in every if s.problem is not None}
    assert len(problems) == 2, "the lost context and the bad tail are the runs' problems"
    assert {s.record.status for s in every} >= {"running", "scheduled", "stopped"}
    assert lite.find_runs(RunFilter(limit=100)) == every
    for stored in every:
        assert lite.get_run(stored.id) == store.get_run(stored.id), stored.id
    assert lite.get_run("no-such-run") is None


@pytest.mark.parametrize(
    "where",
    [
        RunFilter(workflow="etl"),
        RunFilter(statuses=["running", "stopped"]),
        RunFilter(statuses=[]),
        RunFilter(key="k2"),
        RunFilter(workflow="orders", statuses=["scheduled"], limit=1),
        RunFilter(limit=0),
    ],
)
def test_listings_filter_and_page_the_same(
    both: tuple[SQLStore, LiteStore], where: RunFilter
) -> None:
    store, lite = both
    expected = store.find_runs(where)
    assert lite.find_runs(where) == expected
    every = store.find_runs(RunFilter(limit=100))
    middle = every[4]
    after = RunFilter(limit=3, after=(middle.created_at, middle.id))
    assert lite.find_runs(after) == store.find_runs(after) != []


def test_journals_read_the_same_up_to_every_seq(both: tuple[SQLStore, LiteStore]) -> None:
    store, lite = both
    for stored in store.find_runs(RunFilter(limit=100)):
        events = store.journal(stored.id)
        assert lite.journal(stored.id) == events, stored.id
        for seq in range(1, len(events) + 2):
            assert lite.journal(stored.id, until_seq=seq) == store.journal(stored.id, until_seq=seq)


def test_a_retryable_flag_reads_as_a_boolean(both: tuple[SQLStore, LiteStore]) -> None:
    """SQLite stores a Boolean column as 0/1: the reader gives True/False, as SQLAlchemy."""
    store, lite = both
    flagged = [
        (e.seq, e.retryable)
        for s in store.find_runs(RunFilter(limit=100))
        for e in lite.journal(s.id)
        if e.retryable is not None
    ]
    assert sorted(flag for _, flag in flagged) == [False, True]
    assert all(type(flag) is bool for _, flag in flagged)


def test_the_rest_of_status_reads_the_same(both: tuple[SQLStore, LiteStore]) -> None:
    """Prefixes, definitions (a damaged one is None), breakers, backpressure, families."""
    store, lite = both
    every = store.find_runs(RunFilter(limit=100))
    for stored in every:
        for length in (1, 4, 32):
            prefix = stored.id[:length]
            assert lite.run_ids_with_prefix(prefix, limit=5) == store.run_ids_with_prefix(
                prefix, limit=5
            )
        assert lite.parent_of(stored.id) == store.parent_of(stored.id)
        assert lite.child_counts(stored.id) == store.child_counts(stored.id)
    assert lite.run_ids_with_prefix("", limit=5) == []
    for fingerprint in ("f" * 32, "d" * 32, "0" * 32):
        assert lite.definition(fingerprint) == store.definition(fingerprint)
    assert lite.definition("f" * 32) is not None and lite.definition("d" * 32) is None
    assert lite.breakers() == store.breakers() != []
    usage = store.backpressure_usage()
    assert lite.backpressure_usage() == usage
    assert usage["orders"]["kept"] == 3 and usage["orders"]["dropped_runs"] == 1
    assert usage["orders"]["dropped_events"] == 1
    assert sum(lite.child_counts(s.id).get("scheduled", 0) for s in every) == 2


def test_only_a_flowloop_database_at_the_current_schema_opens(
    tmp_path: Path, sqlite_url: str
) -> None:
    """Anything else is None (SQLStore then opens it and says what is wrong), unchanged."""
    assert LiteStore.open(tmp_path / "missing.db") is None
    assert not (tmp_path / "missing.db").exists(), "nothing is created"
    assert LiteStore.open(tmp_path) is None  # a directory
    (tmp_path / "text.db").write_text("not a database")
    assert LiteStore.open(tmp_path / "text.db") is None
    with sqlite3.connect(tmp_path / "foreign.db") as conn:
        conn.execute("CREATE TABLE t (x)")
    assert LiteStore.open(tmp_path / "foreign.db") is None
    SQLStore(sqlite_url).close()
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE flowloop_alembic_version SET version_num = '0001'")
    assert LiteStore.open(path) is None


# `flowloop ARGS` as the program runs it, printing at exit whether it read through LiteStore.
PROGRAM = """
import atexit, sys
from flowloop.store.lite import LiteStore
opened = []
real_open = LiteStore.open
LiteStore.open = lambda path: opened.append(real_open(path)) or opened[-1]
atexit.register(lambda: print("lite" if any(opened) else "sqlalchemy"))
from flowloop.cli import main
main(sys.argv[1:])
"""


def _cli(db: str, *args: str) -> tuple[int, str, str]:
    """``flowloop ARGS --db DB`` as a program: its exit code, what it printed on stderr,
    and which store it read through."""
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, *args, "--db", db],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, result.stderr, result.stdout.splitlines()[-1]


def test_a_failed_read_is_the_line_sqlalchemys_would_be(
    database: tuple[SQLStore, Path],
) -> None:
    """A read that fails after the file opened (a table dropped behind flowloop's back)
    is one StoreError, worded as the CLI words the same error through SQLAlchemy."""
    store, path = database
    lite = _opened(path)
    try:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE flowloop_breakers")
        with pytest.raises(StoreError, match=r"database .*flowloop\.db: no such table"):
            lite.breakers()
        assert lite.get_run("x") is None, "the next read works (no transaction left open)"
    finally:
        lite.close()
    *through_lite, used = _cli(str(path), "status")
    *through_sqlalchemy, fell_back = _cli(f"sqlite:///{path}?timeout=30", "status")
    assert (used, fell_back) == ("lite", "sqlalchemy")  # a URL with options is not plain
    assert through_lite == through_sqlalchemy
    assert through_lite[0] == 1 and "no such table: flowloop_breakers" in through_lite[1]
    assert "Traceback" not in through_lite[1]


def _foreign_wal_file(path: Path) -> None:
    """A SQLite file that is not flowloop's, in WAL mode, its last rows still in the WAL:
    the writer ended without a checkpoint (os._exit), as a crashed program leaves it."""
    code = (
        "import os, sqlite3\n"
        f"conn = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
        "conn.execute('PRAGMA journal_mode=WAL')\n"
        "conn.execute('PRAGMA wal_autocheckpoint=0')\n"
        "conn.execute('CREATE TABLE notes (body TEXT)')\n"
        "for n in range(50):\n"
        "    conn.execute('INSERT INTO notes VALUES (?)', ('x' * 500,))\n"
        "os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.parent.iterdir()) if p.is_file()}


def test_a_foreign_file_and_its_wal_are_left_byte_for_byte_as_they_were(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    _foreign_wal_file(path)
    before = _files(path)
    assert "notes.db-wal" in before and len(before["notes.db-wal"]) > 0
    assert LiteStore.open(path) is None
    code, stderr, _ = _cli(str(path), "status")
    assert code == 2 and "is not a flowloop database (it has tables notes)" in stderr
    after = _files(path)
    assert after.keys() == before.keys(), "no file created or removed"
    # The data, byte for byte: nothing checkpointed into the file. (The -shm file is the
    # WAL's shared index, which every reader of a WAL database marks, read-only or not.)
    for name in ("notes.db", "notes.db-wal"):
        assert after[name] == before[name], name


def test_reading_an_idle_database_leaves_no_file_behind(tmp_path: Path) -> None:
    """A WAL database whose writers all closed has no -wal or -shm: reading it, through
    LiteStore or `flowloop status`, leaves none behind (the reads' connection is
    read-write, as SQLStore's: the last one to close removes them)."""
    path = tmp_path / "flowloop.db"
    store = SQLStore(f"sqlite:///{path}")
    store.create_run(new_run())
    store.close()
    before = _files(path)
    assert not any(name.endswith(("-wal", "-shm")) for name in before)
    lite = _opened(path)
    assert len(lite.find_runs(RunFilter())) == 1
    lite.close()
    assert _files(path).keys() == before.keys()
    code, _, used = _cli(str(path), "status")
    assert (code, used) == (0, "lite")
    assert _files(path).keys() == before.keys()


def test_a_path_through_a_symlinked_directory_opens_the_file_sqlalchemy_opens(
    tmp_path: Path,
) -> None:
    """``link/../x.db`` is resolved by text, as the driver does, not by following
    ``link`` first: the file a worker given the same --db writes is the one read."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    (elsewhere / "sub").mkdir(parents=True)
    here.mkdir()
    (here / "link").symlink_to(elsewhere / "sub")
    for directory, key in ((here, "here"), (elsewhere, "elsewhere")):
        store = SQLStore(f"sqlite:///{directory / 'x.db'}")
        store.create_run(new_run(key=key))
        store.close()
    typed = here / "link" / ".." / "x.db"
    lite = _opened(typed)
    store = SQLStore(f"sqlite:///{typed}", create=False)
    try:
        read = lite.find_runs(RunFilter())
        assert read == store.find_runs(RunFilter())
        assert [s.record.key for s in read] == ["here"]
    finally:
        lite.close()
        store.close()


def test_a_database_left_by_a_killed_writer_reads_the_same(tmp_path: Path) -> None:
    """A writer SIGKILLed between commits leaves its WAL and shared memory behind: the
    read-only reader sees every committed boundary, as SQLStore does."""
    path = tmp_path / "killed.db"
    SQLStore(f"sqlite:///{path}").close()
    code = (
        "import os, signal, time\n"
        "from storekit import new_run, start_step\n"
        "from flowloop.store import SQLStore\n"
        f"store = SQLStore('sqlite:///{path}')\n"
        "for n in range(20):\n"
        "    created, _ = store.create_run(new_run(key=str(n)))\n"
        "[claimed] = store.claim(worker='w', now=time.time(), limit=1, lease_seconds=60)\n"
        "assert store.write([start_step(claimed, 'w')]) == [True]\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    tests = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), *sys.path])}
    killed = subprocess.run([sys.executable, "-c", code], env=env, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / "killed.db-wal").exists()
    lite = _opened(path)
    store = SQLStore(f"sqlite:///{path}", create=False)
    try:
        every = store.find_runs(RunFilter(limit=100))
        assert len(every) == 20 and any(s.record.status == "running" for s in every)
        assert lite.find_runs(RunFilter(limit=100)) == every
    finally:
        lite.close()
        store.close()


def test_it_waits_out_locks_as_long_as_the_store(both: tuple[SQLStore, LiteStore]) -> None:
    from flowloop.store.dialect import BUSY_TIMEOUT_MS

    _, lite = both
    [(waits,)] = lite._conn.execute("PRAGMA busy_timeout").fetchall()
    assert waits == BUSY_TIMEOUT_S * 1000 == BUSY_TIMEOUT_MS


def _shown(path: Path, *args: str) -> tuple[int, str]:
    """Exit code, output and the error a command ended with (the CLI prints its message)."""
    from click.testing import CliRunner

    from flowloop.cli import cli

    result = CliRunner().invoke(cli, [*args, "--db", str(path)])
    return result.exit_code, f"{result.output}{result.exception!r}"


def test_the_reading_commands_show_the_same(
    database: tuple[SQLStore, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`status`, `history` and `replay` (JSON and tables) print the same through either
    store, for every run, damaged ones included."""
    store, path = database
    run_ids = [s.id for s in store.find_runs(RunFilter(limit=100))]
    commands = [("status", "--json"), ("status",), ("status", "--limit", "3", "--json")]
    for run_id in run_ids:
        commands += [("status", run_id, "--json"), ("status", run_id[:8])]
        commands += [("history", run_id, "--json"), ("history", run_id)]
        commands += [("replay", run_id, "--json"), ("replay", run_id, "--at", "1")]
    opened: list[LiteStore] = []
    real_open = LiteStore.open

    def counted(at: Path) -> LiteStore | None:
        lite = real_open(at)
        opened.extend([lite] if lite is not None else [])
        return lite

    monkeypatch.setattr(LiteStore, "open", counted)
    lite_shows = [_shown(path, *args) for args in commands]
    assert len(opened) == len(commands), "every command read through the stdlib reader"
    monkeypatch.setattr(LiteStore, "open", lambda at: None)
    assert [_shown(path, *args) for args in commands] == lite_shows
    codes = {code for code, _ in lite_shows}
    assert 0 in codes and codes <= {0, 1}, codes
