"""Listings read runs newest first straight from an index (migration 0016).

``flowloop status``, ``engine.runs`` and the dashboard page runs by ``created_at DESC, id``
through three indexes built in that order. On SQLite, migration 0011 rebuilt the runs
table from reflection, which dropped the ``DESC``: SQLite then sorted every group of runs
created at one instant (a fan-out's children, runs under a fake clock) again for each page
(bench/scale.py, 47,620 runs copied with one ``created_at``: 129 ms per page of 100, 2.28
ms after). These tests hold the order on a new database, on a database written by an older
flowloop and upgraded, and in the plans of the statements ``engine.runs`` sends."""

from __future__ import annotations

import contextlib
import re
import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.dialects import sqlite
from sqlalchemy.schema import CreateIndex
from storekit import to_revision

from flowloop import Engine, Workflow
from flowloop.store import SQLStore
from flowloop.store.schema import metadata

OLD_LAYOUT = Path(__file__).resolve().parent.parent / "fixtures" / "layout_0011_interrupted.sql"
NEWEST_FIRST = (
    "ix_flowloop_runs_created",
    "ix_flowloop_runs_workflow_created",
    "ix_flowloop_runs_status_created",
)


class Nothing(BaseModel):
    pass


flow = Workflow("listed", context=Nothing)


@flow.step(initial=True, next="done")
def only(ctx: Nothing) -> None:
    pass


flow.final("done")


def _index_sql(url: str) -> dict[str, str]:
    """Each newest-first index's definition, as the database keeps it."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                rows = conn.exec_driver_sql("SELECT name, sql FROM sqlite_master")
            else:
                rows = conn.exec_driver_sql(
                    "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema()"
                )
            return {name: sql for name, sql in rows if name in NEWEST_FIRST}
    finally:
        engine.dispose()


def _sorted_newest_first(url: str) -> dict[str, bool]:
    return {name: "created_at DESC" in sql for name, sql in _index_sql(url).items()}


def test_a_new_database_keeps_its_listing_indexes_newest_first(store_url: str) -> None:
    with Engine(store_url, workflows=[flow]):
        pass
    assert _sorted_newest_first(store_url) == dict.fromkeys(NEWEST_FIRST, True)


def test_a_database_written_by_an_older_flowloop_gets_its_indexes_newest_first(
    tmp_path: Path,
) -> None:
    """A SQLite file written at schema 0011 (tests/fixtures, made by flowloop 33efa28),
    whose indexes came out of 0011's table rebuild in ascending order: upgraded, they are
    newest first."""
    path = tmp_path / "old.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.executescript(OLD_LAYOUT.read_text())
    url = f"sqlite:///{path}"
    assert _sorted_newest_first(url) == dict.fromkeys(NEWEST_FIRST, False)
    to_revision(url, "head")
    assert _sorted_newest_first(url) == dict.fromkeys(NEWEST_FIRST, True)


def test_a_page_of_runs_is_read_in_index_order_without_a_sort(sqlite_url: str) -> None:
    """The statements ``engine.runs`` sends (no filter, by workflow, by status, the page
    after a run), planned by SQLite on a database with runs: each walks its index, none
    sorts."""
    sent: list[tuple[str, Any]] = []
    with Engine(sqlite_url, workflows=[flow]) as engine:
        for _ in range(3):
            engine.start(flow, Nothing())
        newest = engine.runs(limit=1)[0]  # (started, not driven: all alike)
        status, first = newest.status, newest.id
        db = engine.store.engine if isinstance(engine.store, SQLStore) else None
        assert db is not None

        def note(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
            if "ORDER BY flowloop_runs.created_at DESC" in statement:
                sent.append((statement, params))

        sa.event.listen(db, "before_cursor_execute", note)
        try:
            assert len(engine.runs(limit=2)) == 2
            assert len(engine.runs(workflow="listed", limit=2)) == 2
            assert len(engine.runs(status=status, limit=2)) == 2
            assert len(engine.runs(limit=2, after=first)) == 2
        finally:
            sa.event.remove(db, "before_cursor_execute", note)
        assert len(sent) == 4
        with db.connect() as conn:
            plans = [
                " ".join(
                    str(row[-1])
                    for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", params)
                )
                for sql, params in sent
            ]
    expected = ["created", "workflow_created", "status_created", "created"]
    for plan, index in zip(plans, expected, strict=True):
        assert "TEMP B-TREE" not in plan, plans
        assert f"USING INDEX ix_flowloop_runs_{index} " in f"{plan} ", plans


def _normal(sql: str) -> str:
    return re.sub(r"\s+", " ", sql.replace('"', "")).replace("( ", "(").replace(" )", ")").lower()


def test_every_index_of_a_new_sqlite_database_is_the_one_schema_py_declares(
    sqlite_url: str,
) -> None:
    """Migrations that rebuild a table on SQLite (``batch_alter_table``) rebuild its
    indexes from reflection: whatever reflection drops (a sort order, a ``WHERE``) is lost
    without a word. Each index the migrations leave is the one the metadata declares."""
    with Engine(sqlite_url, workflows=[flow]):
        pass
    engine = sa.create_engine(sqlite_url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            )
            built = {name: _normal(sql) for name, sql in rows}
    finally:
        engine.dispose()
    declared = {
        index.name: _normal(str(CreateIndex(index).compile(dialect=sqlite.dialect())))
        for table in metadata.tables.values()
        for index in table.indexes
    }
    assert built == declared
