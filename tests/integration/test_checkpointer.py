"""SQLite WAL checkpoints run on the store's own thread, not inside its commits
(flowloop/store/checkpointer.py), on real SQLite files.

Measured through SQLite itself: the frames a WAL holds (``PRAGMA wal_checkpoint`` from a
connection of the test's) and what the database file holds without its WAL.
"""

from __future__ import annotations

import gc
import logging
import shutil
import sqlite3
import tempfile
import threading
from pathlib import Path

import pytest
from polling import poll
from pydantic import BaseModel
from storekit import new_run

from flowloop import Engine, Workflow
from flowloop.errors import DefinitionError
from flowloop.store import RunFilter, SQLStore
from flowloop.store.checkpointer import FALLBACK_PAGES, THREAD_NAME, Checkpointer, soon
from flowloop.testing import TestEngine

RUNS = 200
"""Of 10 steps each: ~6,000 WAL frames, six times SQLite's default checkpoint threshold."""
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
    assert 2 * SQLITE_DEFAULT_PAGES < frames < FALLBACK_PAGES


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
        after_runs = checkpointer.passes

        def whole() -> bool:
            # A pass begun after the runs (`passes` counts a pass as it begins) has ended,
            # and it found every frame of the WAL copied. (`passes` read first: `last` is
            # then at least that pass's answer.)
            ended = checkpointer.passes >= after_runs + 2
            last = checkpointer.last
            return ended and last is not None and last[1] > 0 and last[1] == last[2]

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


def _threads_of(path: Path) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == f"{THREAD_NAME} {path}"]


def test_a_store_starts_one_at_its_first_write(sqlite_url: str, tmp_path: Path) -> None:
    """A store that reads starts no thread (`status`, the dashboard); its first write does,
    once; a store that only reads, one in memory, and one on a ``file:`` URI or with
    ``?uri=true`` never do; a closed store's thread is gone."""
    SQLStore(sqlite_url).close()  # the database exists: opening it again writes nothing
    store = SQLStore(sqlite_url)
    assert store.find_runs(RunFilter(limit=5)) == []
    assert store.checkpointer is None
    store.create_run(new_run())
    checkpointer = store.checkpointer
    assert checkpointer is not None and checkpointer.running
    store.create_run(new_run())
    assert store.checkpointer is checkpointer
    assert _threads_of(_file(sqlite_url)) == [f"{THREAD_NAME} {_file(sqlite_url)}"]
    store.close()
    assert not checkpointer.running

    reader = SQLStore(sqlite_url, reads_only=True)
    assert reader.checkpointer is None
    reader.close()
    uri = f"sqlite:///file:{tmp_path / 'uri.db'}?uri=true"
    plain_uri = f"sqlite:///{tmp_path / 'plain.db'}?uri=true"  # given to SQLite as it is
    for url in ("sqlite://", uri, plain_uri):
        other = SQLStore(url)
        other.create_run(new_run())
        assert other.checkpointer is None, url
        other.close()


def test_a_store_left_open_stops_its_thread_when_collected(sqlite_url: str) -> None:
    store = SQLStore(sqlite_url)  # creating the schema wrote
    checkpointer = store.checkpointer
    assert checkpointer is not None and checkpointer.running
    del store
    gc.collect()
    poll(lambda: not checkpointer.running, timeout=10, what="the thread to end", every=0.05)


def test_an_engine_that_fails_to_start_closes_its_store(sqlite_url: str) -> None:
    """An engine whose workflow is refused closes the store it made, and its thread with it
    (the store's schema was written, so the thread had started)."""
    with pytest.raises(DefinitionError):
        Engine(sqlite_url, workflows=[Workflow("stateless", context=Count)])
    assert _threads_of(_file(sqlite_url)) == []


def test_an_engine_for_tests_that_fails_to_start_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The testing kit's engine: its store closed (thread gone), its temporary folder
    removed, when a workflow is refused."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    good = _chain()
    with pytest.raises(DefinitionError):
        TestEngine(workflows=[good, Workflow("stateless", context=Count)])
    # (The template database the kit copies per engine is the process's, kept for others.)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("flowloop-test-")] == []
    assert [t for t in threading.enumerate() if str(tmp_path) in t.name] == []


def test_the_thread_checkpoints_the_file_the_driver_opens(tmp_path: Path) -> None:
    """`link/../x.db` is `./x.db` to SQLite (SQLAlchemy's driver makes the path absolute
    with os.path.abspath before SQLite opens it): so it is to the thread, which checkpoints
    that file, not another."""
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere" / "deep")
    store = SQLStore(f"sqlite:///{tmp_path / 'link' / '..' / 'x.db'}")
    try:
        checkpointer = store.checkpointer
        assert checkpointer is not None
        assert checkpointer.path == tmp_path / "x.db"
        assert (tmp_path / "x.db").exists()
        assert not (tmp_path / "elsewhere" / "x.db").exists()
    finally:
        store.close()


def test_none_on_postgres(pg_url: str) -> None:
    store = SQLStore(pg_url)
    try:
        assert store.checkpointer is None
    finally:
        store.close()


def test_a_checkpoint_says_whether_to_take_the_next_soon(tmp_path: Path) -> None:
    """What spaces the checkpoints out while nothing is written: a checkpoint that finds the
    log as the previous one left it answers False; one that found it changed, or found
    another checkpoint under way, True."""
    path = tmp_path / "t.db"
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode=WAL")
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE t (x)")
    checkpointer = Checkpointer.open(path, "NORMAL")
    assert checkpointer is not None
    try:
        assert checkpointer._checkpoint() is True  # the first: the table's pages
        assert checkpointer._checkpoint() is False
        writer.execute("INSERT INTO t VALUES (1)")
        assert checkpointer._checkpoint() is True
        assert checkpointer.last is not None and checkpointer.last[1] == checkpointer.last[2]
        assert checkpointer._checkpoint() is False
        assert checkpointer.passes == 4
    finally:
        checkpointer.close()  # never started: closes its connection
        writer.close()


def test_a_busy_answer_keeps_the_pace() -> None:
    """A pass kept out by another checkpoint (busy) is followed soon, even when it answers
    what the previous one did; an unchanged answer otherwise is not."""
    assert soon((1, -1, -1), (1, -1, -1)) is True
    assert soon((0, 40, 40), (0, 40, 40)) is False
    assert soon((0, 40, 40), (0, 52, 52)) is True
    assert soon(None, (0, 0, 0)) is True


def test_a_file_it_cannot_open_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file gone before the thread would open it is not created again: no checkpointer,
    and the log says the checkpoints stay in the commits."""
    missing = tmp_path / "gone.db"
    with caplog.at_level(logging.DEBUG, logger="flowloop.store"):
        assert Checkpointer.open(missing, "NORMAL") is None
    assert not missing.exists()
    assert any("stay in its commits" in r.getMessage() for r in caplog.records)


def test_a_store_whose_file_cannot_be_opened_again_keeps_sqlites_checkpoints(
    sqlite_url: str,
) -> None:
    """The thread's connection failing to open leaves the store's own checkpoint as SQLite
    has it (1,000 pages): no thread, no raised threshold."""
    SQLStore(sqlite_url).close()
    path = _file(sqlite_url)
    store = SQLStore(sqlite_url)
    try:
        # Moved away: the store's pooled connection keeps its open file; a new one fails.
        path.rename(path.with_name("moved.db"))
        try:
            store.create_run(new_run())
        finally:
            path.with_name("moved.db").rename(path)
        assert store.checkpointer is None
        with store._held() as conn:  # the connection the store writes through
            driver = conn.connection.driver_connection
            assert driver is not None
            pages = driver.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        assert pages == SQLITE_DEFAULT_PAGES
    finally:
        store.close()
