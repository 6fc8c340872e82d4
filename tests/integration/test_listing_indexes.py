"""Listings read runs newest first straight from an index (migration 0016).

``flowloop status``, ``engine.runs`` and the dashboard page runs by ``created_at DESC, id``
through three indexes built in that order. On SQLite, migration 0011 rebuilt the runs
table from reflection, which dropped the ``DESC``: SQLite then sorted every group of runs
created at one instant again for each page (125 ms for a page of 100 among 27,000 runs
created in one burst, against 2.3 ms). These tests hold the order on a new database, on
one upgraded from 0015, and in the plan of the query ``engine.runs`` sends."""

from __future__ import annotations

import re
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.dialects import sqlite
from sqlalchemy.schema import CreateIndex
from storekit import to_revision

from flowloop import Engine, Workflow
from flowloop.store import SQLStore
from flowloop.store.schema import metadata

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


def test_an_upgrade_from_0015_sorts_the_sqlite_indexes_newest_first_again(
    sqlite_url: str,
) -> None:
    to_revision(sqlite_url, "0015")
    assert _sorted_newest_first(sqlite_url) == dict.fromkeys(NEWEST_FIRST, False)
    to_revision(sqlite_url, "head")
    assert _sorted_newest_first(sqlite_url) == dict.fromkeys(NEWEST_FIRST, True)


def test_a_page_of_runs_is_read_in_index_order_without_a_sort(sqlite_url: str) -> None:
    """The statements ``engine.runs`` sends (no filter, by workflow, by status), planned
    by SQLite on a database with runs: each walks its index, none sorts."""
    sent: list[tuple[str, Any]] = []
    with Engine(sqlite_url, workflows=[flow]) as engine:
        for _ in range(3):
            engine.start(flow, Nothing())
        status = engine.runs(limit=1)[0].status  # (started, not driven: all alike)
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
        finally:
            sa.event.remove(db, "before_cursor_execute", note)
        assert len(sent) == 3
        with db.connect() as conn:
            plans = [
                " ".join(
                    str(row[-1])
                    for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", params)
                )
                for sql, params in sent
            ]
    for plan in plans:
        assert "TEMP B-TREE" not in plan, plans
        assert "USING INDEX ix_flowloop_runs_" in plan, plans


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
