"""flowloop/store/raw.py: a statement's ``None`` parameters written as NULL literals on
SQLite (the driver's adaptation of each ``None`` costs more than binding a string) store
exactly what binding them stores; other paramstyles are left alone."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.dialects import postgresql, sqlite

from flowloop import Engine, Workflow, frozen
from flowloop.journal import JournalEvent
from flowloop.store import appends
from flowloop.store.entries import ERROR_FIELDS, JOURNAL_FIELDS, errorless
from flowloop.store.raw import VARIANTS_KEPT, Raw

TABLE = sa.Table(
    "t",
    sa.MetaData(),
    sa.Column("a", sa.Integer),
    sa.Column("b", sa.Text),
    sa.Column("c", sa.Float),
    sa.Column("d", sa.Text),
)


class Counter(BaseModel):
    n: int = 0


async def _count(ctx: Counter) -> None:
    ctx.n += 1


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


def test_raw__with_nulls_stores_what_binding_none_stores(tmp_path: Path) -> None:
    stmt = Raw.of(sa.insert(TABLE), sqlite.dialect(), ["a", "b", "c", "d"])
    errorless = stmt.with_nulls(frozenset({"b", "d"}))
    assert errorless.order == ("a", "c") and errorless.sql.count("NULL") == 2
    con = sqlite3.connect(tmp_path / "n.db")
    con.execute("CREATE TABLE t (a INTEGER, b TEXT, c REAL, d TEXT)")
    params = {"a": 1, "b": None, "c": 2.5, "d": None}
    con.execute(stmt.sql, stmt.args(params))
    con.execute(errorless.sql, errorless.args(params))
    assert _rows(con) == [(1, None, 2.5, None)] * 2
    with pytest.raises(ValueError, match="no parameter"):
        stmt.with_nulls(frozenset({"b", "e"}))
    named = Raw.of(sa.insert(TABLE), postgresql.psycopg.dialect(), ["a", "b"])
    assert named.with_nulls(frozenset({"b"})) is named  # another paramstyle: as it is


def test_raw__a_value_bound_when_built_is_used_unless_given(tmp_path: Path) -> None:
    built = sa.insert(TABLE).values(
        a=sa.bindparam("a"), b=sa.bindparam("b"), c=sa.bindparam("c"), d="built"
    )
    stmt = Raw.of(built, sqlite.dialect())
    assert stmt.defaults == {"d": "built"}  # a parameter left to the caller has no default
    con = sqlite3.connect(tmp_path / "d.db")
    con.execute("CREATE TABLE t (a INTEGER, b TEXT, c REAL, d TEXT)")
    con.execute(stmt.sql, stmt.args({"a": 1, "b": "x", "c": 1.5}))
    con.execute(stmt.sql, stmt.args({"a": 2, "b": "y", "c": 2.5, "d": "given"}))
    assert _rows(con) == [(1, "x", 1.5, "built"), (2, "y", 2.5, "given")]


def test_the_usual_boundary__binds_no_none(tmp_path: Path) -> None:
    """A step's success joined with the next step's start is written with its error columns
    as NULL literals: the driver adapts each ``None`` it binds (~0.7 us apiece)."""
    workflow = Workflow("usual", context=Counter)
    for i in range(3):
        workflow.step(name=f"s{i}", initial=i == 0, next=f"s{i + 1}" if i < 2 else "done")(_count)
    workflow.final("done")
    engine = Engine(f"sqlite:///{tmp_path / 'u.db'}", workflows=[workflow])
    store: Any = engine.store
    sent: list[tuple[str, Any]] = []
    execute_alone = store._execute_alone

    def spy(sql: str, args: Any) -> int:
        sent.append((sql, args))
        return int(execute_alone(sql, args))

    store._execute_alone = spy
    try:
        info = engine.run(workflow, Counter())
    finally:
        engine.close()
    assert info.status == "succeeded"
    appends = [(sql, args) for sql, args in sent if "INTO flowloop_journal" in sql]
    assert len(appends) == 2  # s0 -> s1 and s1 -> s2, each with the next start joined
    for sql, args in appends:
        assert "NULL AS error_type" in sql and "NULL AS retryable" in sql
        assert None not in args
    rows = sqlite3.connect(tmp_path / "u.db").execute(
        "SELECT error_type, error_message, traceback, retryable FROM flowloop_journal"
    )
    assert set(rows) == {(None, None, None, None)}


def test_a_batch_of_usual_boundaries__binds_no_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Concurrent runs' boundaries share a commit, each statement sent once with every
    run's parameters (executemany): the successes' appends too are sent with their error
    columns as NULL literals, and the failures', in a statement of their own, keep their
    error."""
    workflow = Workflow("batched", context=Counter)

    @workflow.step(initial=True, next="s1")
    async def s0(ctx: Counter) -> None:
        ctx.n += 1

    @workflow.step(next="done")
    async def s1(ctx: Counter) -> None:
        raise ValueError("s1 fails")

    workflow.final("done")
    sent: list[tuple[str, list[Any]]] = []
    executemany = appends._executemany

    def spy(cursor: Any, stmt: Raw, params: Any, **given: Any) -> bool:
        sent.append((stmt.sql, [stmt.args(one) for one in params]))
        return executemany(cursor, stmt, params, **given)

    monkeypatch.setattr(appends, "_executemany", spy)
    with Engine(
        f"sqlite:///{tmp_path / 'b.db'}", workflows=[workflow], max_concurrency=8
    ) as engine:
        for _ in range(8):
            engine.start(workflow, Counter())
        engine.run_until_idle()
        assert {run.status for run in engine.runs(workflow="batched")} == {"failed"}
    batched = [
        (sql, rows) for sql, rows in sent if "INTO flowloop_journal" in sql and len(rows) > 1
    ]
    literal = [rows for sql, rows in batched if "NULL AS error_type" in sql]
    successes = [args for rows in literal for args in rows if "step_succeeded" in args]
    assert successes and all(None not in args for args in successes), sent
    # The eight runs go in step, so their first failures are one batch too, sent with the
    # statement that binds the error columns.
    failures = [rows for sql, rows in batched if "NULL AS error_type" not in sql]
    assert any(sum("step_failed" in args for args in rows) > 1 for rows in failures), sent
    errors = sqlite3.connect(tmp_path / "b.db").execute(
        "SELECT kind, error_type, error_message FROM flowloop_journal WHERE kind = 'step_failed'"
    )
    assert set(errors) == {("step_failed", "ValueError", "s1 fails")}


def test_errorless__reads_exactly_the_error_fields() -> None:
    """A column outside ERROR_FIELDS set does not stop the NULL-literal append; one inside
    does (its value would otherwise be written as NULL)."""
    plain = {name: None for name in JOURNAL_FIELDS}
    for name in JOURNAL_FIELDS:
        event = frozen.build(JournalEvent, {**plain, name: "x"})
        assert errorless(event) is (name not in ERROR_FIELDS), name


def test_raw__unprefixed_takes_a_row_named_as_the_columns(tmp_path: Path) -> None:
    """A run's creation binds its row as it is: the statement's ``p_``-named parameters
    (an INSERT must name them apart from the columns) taken from the columns' names."""
    named: dict[str, Any] = {name: sa.bindparam(f"p_{name}") for name in ("a", "b", "d")}
    named["c"] = sa.bindparam("p_c") * 2
    prefixed = Raw.of(sa.insert(TABLE).values(named), sqlite.dialect())
    plain = prefixed.unprefixed("p_")
    assert set(plain.order or ()) == {"a", "b", "c", "d", "param_1"}
    assert plain.defaults == {"param_1": 2} and plain.sql == prefixed.sql
    con = sqlite3.connect(tmp_path / "t.db")
    con.execute("CREATE TABLE t (a INTEGER, b TEXT, c REAL, d TEXT)")
    row = {"a": 1, "b": "x", "c": 1.25, "d": None}
    con.execute(*plain.bound(row))
    con.execute(*prefixed.bound({f"p_{name}": value for name, value in row.items()}))
    assert _rows(con) == [(1, "x", 2.5, None)] * 2
    with pytest.raises(KeyError):  # a column left out is missing, not bound as NULL
        plain.bound({"a": 1, "b": "x", "c": 1.0})
    clash = Raw.of(
        sa.insert(TABLE).values(a=sa.bindparam("p_a"), b=sa.bindparam("a")), sqlite.dialect()
    )
    with pytest.raises(ValueError, match="two parameters are one"):
        clash.unprefixed("p_")
    with pytest.raises(ValueError, match="named in its SQL"):
        Raw.of(sa.insert(TABLE), postgresql.psycopg.dialect()).unprefixed("p_")


def test_raw__bound_many_keeps_the_order_and_stores_what_binding_stores(tmp_path: Path) -> None:
    """A batch's parameter sets with their ``None`` values as NULL literals: one
    ``executemany`` per run of consecutive sets with the same ``None`` values, the sets in
    their order (a run's entries must go in by seq), the same rows as binding them."""
    stmt = Raw.of(sa.insert(TABLE), sqlite.dialect(), ["a", "b", "c", "d"])
    given = [
        (1, "x", None, None),
        (2, "y", None, None),
        (3, None, 1.5, "z"),
        (4, "w", None, None),
        (5, "v", 2.5, "u"),
    ]
    pairs = stmt.bound_many(list(given))
    assert [len(args) for _, args in pairs] == [2, 1, 1, 1]
    assert all(sql.count("?") == len(one) for sql, args in pairs for one in args)
    assert all(None not in one for _, args in pairs for one in args)
    assert pairs[0][0] is pairs[2][0]  # a pattern's text made once
    assert pairs[3] == (stmt.sql, [given[4]])  # no None: the statement as it is
    literal, bound = (sqlite3.connect(tmp_path / name) for name in ("l.db", "b.db"))
    for con in (literal, bound):
        con.execute("CREATE TABLE t (a INTEGER, b TEXT, c REAL, d TEXT)")
    for sql, args in pairs:
        literal.executemany(sql, args)
    bound.executemany(stmt.sql, given)
    assert _rows(literal) == _rows(bound) == given
    plain = [(6, "a", 1.0, "b")]
    assert stmt.bound_many(plain) == [(stmt.sql, plain)]
    named = Raw.of(sa.insert(TABLE), postgresql.psycopg.dialect(), ["a", "b", "c", "d"])
    assert named.bound_many([{"a": None}]) == [(named.sql, [{"a": None}])]


class _Sent:
    """A driver cursor that notes what each ``executemany`` binds."""

    def __init__(self, cursor: Any, sent: list[tuple[str, list[Any]]]) -> None:
        self._cursor = cursor
        self._sent = sent

    def executemany(self, sql: str, args: Any) -> Any:
        args = list(args)
        self._sent.append((sql, args))
        return self._cursor.executemany(sql, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


def test_a_batch_of_starts_and_ends__binds_no_none(tmp_path: Path) -> None:
    """Concurrent runs' first starts (an append and the row's update) and their ends (the
    row let go: no owner, no lease) are batches too: their appends and updates sent with
    their ``None`` values as NULL literals, one statement per pattern, the same rows."""
    workflow = Workflow("ends", context=Counter)
    workflow.step(name="s0", initial=True, next="done")(_count)
    workflow.final("done")
    with Engine(f"sqlite:///{tmp_path / 'e.db'}", workflows=[workflow], max_concurrency=8) as e:
        ids = [e.start(workflow, Counter()).id for _ in range(8)]
        store: Any = e.store
        sent: list[tuple[str, list[Any]]] = []
        with store._lock:
            raw = store._driver_of(store._held_conn())
            store._driver_cursor = _Sent(raw.cursor(), sent)
        stats = e.run_until_idle()
        assert stats.steps == 8 and stats.boundaries == 16 and stats.commits <= 4
        assert [e.get(run_id).status for run_id in ids] == ["succeeded"] * 8
        assert [e.get(run_id).context for run_id in ids] == [Counter(n=1)] * 8
    batched = [(sql, args) for sql, args in sent if len(args) > 1]
    kinds = {sql.split()[0] + (" NULL" if "NULL" in sql else "") for sql, _ in batched}
    assert kinds == {"INSERT NULL", "UPDATE NULL"}, batched
    # (the errorless append, a success's, is not looked through: its usual rows have none)
    looked = [args for sql, args in sent if "NULL AS error_type" not in sql]
    assert looked and all(None not in one for args in looked for one in args), sent
    rows = sqlite3.connect(tmp_path / "e.db").execute(
        "SELECT status, owner, lease_expires_at, next_run_at, last_seq FROM flowloop_runs"
    )
    assert set(rows) == {("succeeded", None, None, None, 3)}
