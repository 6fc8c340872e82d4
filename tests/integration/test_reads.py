"""flowloop.store.reads on SQLite and PostgreSQL: the nearest-rank percentiles that stats,
heat and the dashboard share (checked against the definition computed in Python), the
newest-first keyset condition (pages with ties on ``created_at`` lose and repeat no run),
and the read transaction (it never takes SQLite's write lock)."""

from __future__ import annotations

import math
import random
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow
from flowloop.store import SQLStore
from flowloop.store.dialect import create_engine_for
from flowloop.store.reads import (
    NEWEST_FIRST,
    Ranks,
    after_run,
    nearest_ranks,
    rank,
    ranked_seconds,
    reading,
)
from flowloop.store.schema import runs

metadata = sa.MetaData()
samples = sa.Table(
    "reads_samples",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("grp", sa.String(10), nullable=False),
    sa.Column("tag", sa.String(10), nullable=False),
    sa.Column("value", sa.Float, nullable=True),
)
T0 = 1_800_000_000.0


class Empty(BaseModel):
    pass


@pytest.fixture
def db(store_url: str) -> Iterator[sa.Engine]:
    engine = create_engine_for(store_url)
    metadata.create_all(engine)
    yield engine
    engine.dispose()


def nearest_rank(values: list[float], percentile: int) -> float:
    """The textbook definition: the smallest value with at least p % of them at or below."""
    ordered = sorted(values)
    return ordered[math.ceil(percentile / 100 * len(ordered)) - 1]


def test_rank__is_ceil_of_p_percent_of_n() -> None:
    for n in range(1, 300):
        for p in (1, 50, 95, 99, 100):
            assert rank(p, n) == math.ceil(p * n / 100)


def test_nearest_ranks__match_python_per_group_without_nulls_and_keep_the_top(
    db: sa.Engine,
) -> None:
    rng = random.Random(7)
    rows, expected = [], {}
    for group, size in (("a", 1), ("b", 2), ("c", 37), ("d", 201)):
        values = [round(rng.uniform(0, 100), 3) for _ in range(size)]
        expected[group] = values
        rows += [{"grp": group, "tag": f"t{i}", "value": v} for i, v in enumerate(values)]
        rows.append({"grp": group, "tag": "null", "value": None})  # never ranked
    rows.append({"grp": "e", "tag": "null", "value": None})  # a group with no value at all
    with db.begin() as conn:
        conn.execute(samples.insert(), rows)

    picked = nearest_ranks(
        samples.c.value,
        where=[samples.c.id > 0],
        groups={"group": samples.c.grp},
        columns=[samples.c.tag],
        top=3,
    )
    with reading(db) as conn:
        found = Ranks.of(
            conn.execute(picked),
            group=lambda row: str(row.group),
            value=lambda row: (str(row.tag), float(row.value)),
        )
    for group, values in expected.items():
        assert found.size(group) == len(values)
        for p in (50, 95, 99):
            at = found.at(group, p)
            assert at is not None and at[1] == nearest_rank(values, p), (group, p)
        assert sorted(v for _, v in found.highest(group, 3)) == sorted(values)[-3:]
    assert found.size("e") == 0 and found.at("e", 50) is None
    # Only the wanted ranks leave the database: at most 3 percentiles + 3 top per group.
    assert all(len(ranks) <= 6 for ranks in found.values.values())


def test_nearest_ranks__without_groups_rank_the_whole_selection(db: sa.Engine) -> None:
    values = [float(v) for v in range(1, 26)]
    with db.begin() as conn:
        conn.execute(samples.insert(), [{"grp": "x", "tag": "t", "value": v} for v in values])
    picked = nearest_ranks(samples.c.value * 2, where=[], percentiles=(50, 99))
    with reading(db) as conn:
        found = ranked_seconds(conn.execute(picked))
    assert found.size("") == 25
    assert found.at("", 50) == 26.0 and found.at("", 99) == 50.0  # ranks 13 and 25
    assert found.at("", 95) is None  # rank 24: not asked for


def test_after_run__pages_newest_first_through_ties(store_url: str) -> None:
    clock = FakeClock(T0)
    wf = Workflow("paged", context=Empty)

    @wf.step(initial=True, next="done")
    def only(ctx: Empty) -> None: ...

    wf.final("done")
    with Engine(store_url, clock=clock) as engine:
        for gap in (0, 0, 0, 1, 0, 2, 0):  # ties on created_at, several of them
            clock.advance(gap)
            engine.start(wf, Empty())
        assert isinstance(engine.store, SQLStore)
        db = engine.store.engine
        with reading(db) as conn:
            everything = [
                (float(r[0]), str(r[1]))
                for r in conn.execute(select_runs().order_by(*NEWEST_FIRST))
            ]
        seen: list[tuple[float, str]] = []
        after: tuple[float, str] | None = None
        while True:
            query = select_runs()
            if after is not None:
                query = query.where(after_run(*after))
            with reading(db) as conn:
                page = [
                    (float(r[0]), str(r[1]))
                    for r in conn.execute(query.order_by(*NEWEST_FIRST).limit(2))
                ]
            if not page:
                break
            seen += page
            after = page[-1]
    assert len(everything) == 7
    assert seen == everything == sorted(everything, key=lambda r: (-r[0], r[1]))


def select_runs() -> sa.Select[Any]:
    return sa.select(runs.c.created_at, runs.c.id)


def test_reading__never_takes_the_sqlite_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "reads.db"
    db = create_engine_for(f"sqlite:///{path}")
    metadata.create_all(db)
    writer = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        writer.execute("BEGIN IMMEDIATE")  # a worker's commit in progress
        with reading(db) as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(samples)).scalar() == 0
    finally:
        writer.execute("ROLLBACK")
        writer.close()
        db.dispose()
