"""The listings count a map's children held back (``held``) from their own partial index,
``ix_flowloop_runs_held`` (migration 0021): without it, telling them apart from
``scheduled`` read every scheduled run's row (100,000 runs, half scheduled: the dashboard's
counts per workflow went from 5 ms to 52 ms on SQLite)."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from heldkit import Fan, held_fan
from storekit import to_revision

from flowloop import Engine, FakeClock
from flowloop.store import SQLStore
from flowloop.ui import queries as q

INDEX = "ix_flowloop_runs_held"


def indexes(url: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        return {ix["name"] for ix in sa.inspect(engine).get_indexes("flowloop_runs")}
    finally:
        engine.dispose()


def test_migration_0021_builds_and_drops_the_held_index(store_url: str) -> None:
    with Engine(store_url):
        pass
    assert INDEX in indexes(store_url)
    to_revision(store_url, "0020")
    assert INDEX not in indexes(store_url)
    to_revision(store_url, "head")
    assert INDEX in indexes(store_url)


def test_the_dashboards_held_counts_read_their_index_alone(sqlite_url: str) -> None:
    """The statements that count the held children (the runs list's, with and without a
    workflow, and the counts per workflow), planned by SQLite: each reads the partial
    index alone (covering), not the scheduled runs' rows."""
    parent, item = held_fan("indexed")
    with Engine(sqlite_url, clock=FakeClock(auto_advance=False), workflows=[parent, item]) as e:
        e.start(parent, Fan(items=[1, 2, 3]))
        e.run_until_idle(idle_horizon=0)
    store = SQLStore(sqlite_url, create=False)
    sent: list[tuple[str, Any]] = []

    def note(_conn: Any, _cursor: Any, statement: str, params: Any, *_: Any) -> None:
        if "join_state = 'held'" in statement and "GROUP BY" in statement:
            sent.append((statement, params))

    try:
        sa.event.listen(store.engine, "before_cursor_execute", note)
        try:
            page = q.list_runs(store.engine, q.RunsQuery())
            by_workflow = q.list_runs(store.engine, q.RunsQuery(workflow="indexed_item"))
            counts = q.status_counts(store.engine)
        finally:
            sa.event.remove(store.engine, "before_cursor_execute", note)
        assert (page.counts["held"], page.counts["waiting"]) == (2, 1)
        assert by_workflow.counts["held"] == 2
        assert counts["indexed_item"] == {"held": 2, "waiting": 1}
        assert len(sent) == 3, sent
        with store.engine.connect() as conn:
            plans = [
                " ".join(
                    str(row[-1])
                    for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", params)
                )
                for sql, params in sent
            ]
    finally:
        store.close()
    for plan in plans:
        assert f"USING COVERING INDEX {INDEX}" in plan, plans
