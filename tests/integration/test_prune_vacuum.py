"""``flowloop prune --vacuum`` (issue 20, item 12): after deleting, PostgreSQL's tables are
vacuumed (their space reusable: pg_stat shows the vacuum) and a SQLite file shrinks."""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa
from polling import poll
from pydantic import BaseModel

import flowloop.prune
from flowloop import Engine, Workflow
from flowloop.cli import main
from flowloop.prune import vacuum

RUNS = 300


class Ctx(BaseModel):
    blob: str = "x" * 2000


def filled(url: str) -> None:
    wf = Workflow("vacuumed", context=Ctx)
    wf.step(name="a", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    with Engine(url, workflows=[wf]) as engine:
        for _ in range(RUNS):
            engine.start(wf, Ctx())
        engine.run_until_idle()


def prune(capsys: pytest.CaptureFixture[str], url: str, *extra: str) -> dict[str, object]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    with engine.begin() as conn:  # the runs finished an hour ago
        conn.execute(sa.text("UPDATE flowloop_runs SET updated_at = updated_at - 3600"))
    engine.dispose()
    try:
        main(["prune", "--older-than", "30m", "--json", "--db", url, *extra])
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr().err
    return dict(json.loads(capsys.readouterr().out))


def test_prune_vacuum_shrinks_a_sqlite_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "flowloop.db"
    url = f"sqlite:///{db}"
    filled(url)
    with sa.create_engine(url).connect() as conn:
        conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    before = db.stat().st_size
    result = prune(capsys, url, "--vacuum")
    assert result["runs"] == RUNS and result["vacuumed"] is True
    assert db.stat().st_size < before / 4, (before, db.stat().st_size)


def test_prune_vacuum_vacuums_postgres_tables(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    filled(pg_url)
    result = prune(capsys, pg_url, "--vacuum")
    assert result["runs"] == RUNS and result["vacuumed"] is True
    engine = sa.create_engine(pg_url, poolclass=sa.NullPool)

    def vacuumed() -> bool:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT relname FROM pg_stat_user_tables WHERE schemaname = current_schema()"
                    " AND relname LIKE 'flowloop_%' AND last_vacuum IS NOT NULL"
                )
            )
            return {"flowloop_runs", "flowloop_journal"} <= {row[0] for row in rows}

    try:
        poll(vacuumed, timeout=10, every=0.1, what="pg_stat to show the vacuum")
    finally:
        engine.dispose()


def test_vacuum_tries_the_truncating_checkpoint_again_while_another_holds_its_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another connection's checkpoint holds the checkpoint lock when ``vacuum`` asks for
    its truncating one (SQLite answers busy at once, no busy handler): it asks again, and
    the WAL is truncated once the lock is free. A single try leaves it whole."""
    # Events decide when the lock is let go, not vacuum's 2 s of retries (60 s: well past
    # the waits below, short enough that a failed hand-over does not stall the suite).
    monkeypatch.setattr(flowloop.prune, "TRUNCATE_RETRY_S", 60.0)
    db = tmp_path / "flowloop.db"
    url = f"sqlite:///{db}"
    filled(url)  # (the store that filled it is closed: no checkpointing thread of its own)

    def connect() -> sqlite3.Connection:
        return sqlite3.connect(db, isolation_level=None, check_same_thread=False, timeout=30)

    reader, holder, watcher = connect(), connect(), connect()
    # The reader's snapshot predates the VACUUM: a RESTART checkpoint cannot finish (it
    # waits for that reader, holding the checkpoint lock) until the reader lets go.
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM flowloop_runs").fetchone()
    holding = threading.Thread(target=_checkpoint_held, args=(holder,), daemon=True)
    tries: list[str] = []
    failures: list[BaseException] = []  # (sqlite3 swallows a trace callback's exceptions)

    def on_statement(sql: str) -> None:
        if "wal_checkpoint(TRUNCATE)" not in sql:
            return
        tries.append(sql)
        try:
            if len(tries) == 1:  # the lock taken by the holder before this try
                holding.start()
                poll(
                    lambda: watcher.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[0] == 1,
                    timeout=10,
                    every=0.005,
                    what="another connection to hold the checkpoint lock",
                )
            elif len(tries) == 2:  # and let go before the next
                reader.execute("COMMIT")
                holding.join(timeout=30)
                assert not holding.is_alive(), "the holder's checkpoint did not end"
        except BaseException as error:
            failures.append(error)
            raise

    engine = sa.create_engine(url, poolclass=sa.NullPool)
    sa.event.listen(
        engine, "connect", lambda dbapi, _record: dbapi.set_trace_callback(on_statement)
    )
    try:
        vacuum(engine)
        assert failures == []
        assert len(tries) == 2
        # Truncated by the try after the busy one (read while the watcher keeps the file
        # open: the last connection to close removes it).
        assert Path(f"{db}-wal").stat().st_size == 0
    finally:
        engine.dispose()
        if reader.in_transaction:  # (a failed try: the holder still waits for the reader)
            reader.execute("COMMIT")
        if holding.ident is not None:
            holding.join(timeout=30)
        for conn in (reader, watcher) if holding.is_alive() else (reader, holder, watcher):
            conn.close()  # (never one another thread still uses)


def _checkpoint_held(conn: sqlite3.Connection) -> None:
    """A RESTART checkpoint, tried until it takes the lock (a watcher's PASSIVE one may
    hold it for a moment); it then returns only once the reader has let go."""
    while conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()[0] == 1:
        pass
