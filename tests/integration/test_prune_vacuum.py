"""``flowloop prune --vacuum`` (issue 20, item 12): after deleting, PostgreSQL's tables are
vacuumed (their space reusable: pg_stat shows the vacuum) and a SQLite file shrinks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.cli import main

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
