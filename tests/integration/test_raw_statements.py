"""flowloop/store/raw.py: a statement's ``None`` parameters written as NULL literals on
SQLite (the driver's adaptation of each ``None`` costs more than binding a string) store
exactly what binding them stores; other paramstyles are left alone."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from flowloop.store.raw import VARIANTS_KEPT, Raw

TABLE = sa.Table(
    "t",
    sa.MetaData(),
    sa.Column("a", sa.Integer),
    sa.Column("b", sa.Text),
    sa.Column("c", sa.Float),
    sa.Column("d", sa.Text),
)


def _rows(con: sqlite3.Connection) -> list[tuple[Any, ...]]:
    return con.execute("SELECT a, b, c, d FROM t ORDER BY rowid").fetchall()


def test_raw__nulls_as_literals_store_what_bound_parameters_store(tmp_path: Path) -> None:
    stmt = Raw.of(sa.insert(TABLE), sqlite.dialect(), ["a", "b", "c", "d"])
    given = [
        {"a": 1, "b": "x?", "c": 1.5, "d": None},
        {"a": None, "b": None, "c": None, "d": None},
        {"a": 2, "b": "'; --", "c": None, "d": "y"},
        {"a": 3, "b": "z", "c": 2.5, "d": "w"},
    ]
    literal, bound = (sqlite3.connect(tmp_path / name) for name in ("l.db", "b.db"))
    for con in (literal, bound):
        con.execute("CREATE TABLE t (a INTEGER, b TEXT, c REAL, d TEXT)")
    for params in given:
        sql, args = stmt.bound(params)
        assert sql.count("?") == len(args) and None not in args
        literal.execute(sql, args)
        bound.execute(stmt.sql, stmt.args(params))
    assert _rows(literal) == _rows(bound) == [tuple(row.values()) for row in given]
    # one text per pattern of NULLs, kept; none when no value is None
    assert stmt.bound(given[3]) == (stmt.sql, (3, "z", 2.5, "w"))
    assert stmt.bound(given[0])[0] is stmt.bound({**given[0], "a": 9})[0]


def test_raw__patterns_past_the_kept_ones_are_still_right(tmp_path: Path) -> None:
    columns = [sa.Column(f"c{i}", sa.Integer) for i in range(8)]
    wide = sa.Table("w", sa.MetaData(), *columns)
    stmt = Raw.of(sa.insert(wide), sqlite.dialect(), [c.name for c in columns])
    con = sqlite3.connect(tmp_path / "w.db")
    con.execute(f"CREATE TABLE w ({', '.join(c.name for c in columns)})")
    patterns = [
        {f"c{i}": (None if mask >> i & 1 else mask) for i in range(8)} for mask in range(80)
    ]
    for params in patterns:
        con.execute(*stmt.bound(params))
    assert len(stmt._variants) == VARIANTS_KEPT
    assert con.execute("SELECT * FROM w ORDER BY rowid").fetchall() == [
        tuple(p.values()) for p in patterns
    ]


def test_raw__other_paramstyles_are_left_as_they_are() -> None:
    stmt = Raw.of(sa.insert(TABLE), postgresql.psycopg.dialect(), ["a", "b", "c", "d"])
    params = {"a": 1, "b": None, "c": None, "d": "x"}
    assert stmt.bound(params) == (stmt.sql, stmt.args(params))
