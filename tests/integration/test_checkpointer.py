"""SQLite WAL checkpoints run on the store's own thread, not inside its commits
(flowloop/store/checkpointer.py), on real SQLite files.

Measured through SQLite itself: the frames a WAL holds (``PRAGMA wal_checkpoint`` from a
connection of the test's) and what the database file holds without its WAL.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path

import pytest
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.store import SQLStore
from flowloop.store.checkpointer import FALLBACK_PAGES, Checkpointer

RUNS = 100
"""Of 10 steps each: ~3,000 WAL frames, three times SQLite's default checkpoint threshold."""
SQLITE_DEFAULT_PAGES = 1000


class Count(BaseModel):
    n: int = 0


def _chain() -> Workflow:
    workflow = Workflow("ten_steps", context=Count)
    for i in range(10):

        async def add(ctx: Count) -> None:
            ctx.n += 1

        workflow.step(name=f"s{i}", initial=i == 0, next=f"s{i + 1}" if i < 9 else "done")(add)
    workflow.final("done")
    return workflow


def _file(url: str) -> Path:
    return Path(url.removeprefix("sqlite:///"))


def _wal_frames(path: Path) -> tuple[int, int]:
    """(frames in the WAL, frames copied into the database) by a connection of our own."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        _busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    finally:
        conn.close()
    return int(frames), int(copied)


def _run_many(engine: Engine, workflow: Workflow) -> None:
    for _ in range(RUNS):
        assert engine.run(workflow, Count()).status == "succeeded"


def test_commits_leave_the_wal_to_the_checkpointer(sqlite_url: str) -> None:
    """With the thread stopped, a thousand pages no longer make a commit checkpoint: the
    WAL holds every frame the runs wrote (SQLite's default would have copied and restarted
    it every ~1,000 pages, inside the commit that crossed them)."""
    workflow = _chain()
    with Engine(sqlite_url, workflows=[workflow]) as engine:
        assert isinstance(engine.store, SQLStore)
        checkpointer = engine.store.checkpointer
        assert checkpointer is not None and checkpointer.running
        checkpointer.close()
        assert not checkpointer.running
        _run_many(engine, workflow)
        frames, _copied = _wal_frames(_file(sqlite_url))
    assert 3 * SQLITE_DEFAULT_PAGES < frames < FALLBACK_PAGES


def test_the_thread_copies_every_run_into_the_database_file(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The store's thread checkpoints what the runs wrote: the database file alone, copied
    without its WAL, holds every run, finished."""
    workflow = _chain()
    with Engine(sqlite_url, workflows=[workflow]) as engine:
        assert isinstance(engine.store, SQLStore)
        checkpointer = engine.store.checkpointer
        assert checkpointer is not None
        _run_many(engine, workflow)

        def whole() -> bool:
            last = checkpointer.last
            return last is not None and last[1] > 0 and last[1] == last[2]

        poll(whole, timeout=30, what="a checkpoint of the whole WAL", every=0.05)
        alone = tmp_path / "alone.db"
        shutil.copyfile(_file(sqlite_url), alone)
        conn = sqlite3.connect(alone)
        try:
            finished = conn.execute(
                "SELECT COUNT(*) FROM flowloop_runs WHERE status = 'succeeded'"
            ).fetchone()[0]
        finally:
            conn.close()
    assert finished == RUNS


def test_only_a_writing_store_on_a_file_has_one(sqlite_url: str) -> None:
    """A store that only reads, and one in memory, checkpoint nothing; a closed store's
    thread is gone."""
    store = SQLStore(sqlite_url)
    checkpointer = store.checkpointer
    assert checkpointer is not None and checkpointer.running
    reader = SQLStore(sqlite_url, reads_only=True)
    assert reader.checkpointer is None
    reader.close()
    memory = SQLStore("sqlite://")
    assert memory.checkpointer is None
    memory.close()
    store.close()
    assert not checkpointer.running


def test_none_on_postgres(pg_url: str) -> None:
    store = SQLStore(pg_url)
    try:
        assert store.checkpointer is None
    finally:
        store.close()


def test_a_checkpoint_says_whether_the_log_changed(tmp_path: Path) -> None:
    """What spaces the checkpoints out while nothing is written: a checkpoint that finds the
    log as the previous one left it answers False."""
    path = tmp_path / "t.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE t (x)")
    checkpointer = Checkpointer(path, "NORMAL")
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        assert checkpointer._checkpoint(conn) is True  # the first: the table's pages
        assert checkpointer._checkpoint(conn) is False
        writer.execute("INSERT INTO t VALUES (1)")
        assert checkpointer._checkpoint(conn) is True
        assert checkpointer.last is not None and checkpointer.last[1] == checkpointer.last[2]
        assert checkpointer._checkpoint(conn) is False
        assert checkpointer.passes == 4
    finally:
        conn.close()
        writer.close()


def test_a_file_it_cannot_open_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file gone before the thread opens it is not created again; the commits' own
    fallback checkpoint is all that is left, and the log says so."""
    missing = tmp_path / "gone.db"
    checkpointer = Checkpointer(missing, "NORMAL")
    with caplog.at_level(logging.WARNING, logger="flowloop.store"):
        checkpointer.start()
        checkpointer.close()
    assert not missing.exists()
    assert not checkpointer.running
    assert any("fall back to commits" in r.getMessage() for r in caplog.records)
