"""flowloop/store/raw.py's ``Raw.numbered``: on PostgreSQL the hot path's statements (a step
boundary, a run's creation) are sent with numbered placeholders on psycopg's RawCursor,
which psycopg passes on as they are, and store what the named form stores."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.dialects import postgresql, sqlite

from flowloop import Engine, Workflow
from flowloop.store.raw import Raw

psycopg = pytest.importorskip("psycopg")

TABLE = sa.Table(
    "t",
    sa.MetaData(),
    sa.Column("a", sa.Integer),
    sa.Column("b", sa.Text),
    sa.Column("c", sa.Text),
)
# A name used twice, a literal % (written %% in the named form) and a LIKE pattern.
_PG = postgresql.psycopg.dialect()
SELECT = sa.select(TABLE.c.a, sa.literal_column("'100%'").label("pct")).where(
    TABLE.c.b == sa.bindparam("b"),
    sa.or_(TABLE.c.c == sa.bindparam("b"), TABLE.c.c.like("x%")),
)


def test_numbered__numbers_each_name_once_and_keeps_literal_percents() -> None:
    named = Raw.of(SELECT, _PG)
    assert "%(b)s" in named.sql and "'100%%'" in named.sql
    numbered = named.numbered
    assert "%(" not in numbered.sql and "'100%'" in numbered.sql
    assert numbered.sql.count("$1") == 2 and "$2" in numbered.sql and "$3" not in numbered.sql
    assert numbered.order == ("b", "c_1")
    assert numbered.args({"b": "k"}) == ("k", "x%")  # the value bound when built, too
    with pytest.raises(ValueError, match="positional already"):
        _ = Raw.of(SELECT, sqlite.dialect()).numbered


def test_numbered__takes_any_name_and_refuses_what_it_cannot_number() -> None:
    odd = Raw.of(sa.select(TABLE.c.a).where(TABLE.c.b == sa.bindparam("b-1/x")), _PG)
    assert odd.numbered.sql.endswith("= $1::VARCHAR") and odd.numbered.order == ("b-1/x",)
    expanding = sa.select(TABLE.c.a).where(TABLE.c.b.in_(sa.bindparam("bs", expanding=True)))
    with pytest.raises(ValueError, match="expanded at execution"):
        _ = Raw.of(expanding, _PG).numbered


def _connect(url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(sa.make_url(url).set(drivername="postgresql").render_as_string(False))


def test_numbered__stores_and_reads_what_the_named_form_does(pg_url: str) -> None:
    insert = Raw.of(sa.insert(TABLE), _PG, ["a", "b", "c"])
    select = Raw.of(SELECT, _PG)
    given = [
        {"a": 1, "b": "k", "c": "k"},
        {"a": 2, "b": "k", "c": "xy"},
        {"a": None, "b": "%(b)s $1 ?", "c": "%(b)s $1 ?"},
        {"a": 3, "b": "k", "c": "z"},
    ]
    with _connect(pg_url) as conn:
        conn.execute("CREATE TABLE t (a integer, b text, c text)")
        for params in given:
            conn.cursor().execute(insert.sql, insert.args(params))
            psycopg.RawCursor(conn).execute(insert.numbered.sql, insert.numbered.args(params))
        rows = conn.execute("SELECT a, b, c FROM t ORDER BY ctid").fetchall()
        for b in ("k", "%(b)s $1 ?"):
            named_rows = conn.cursor().execute(select.sql, select.args({"b": b})).fetchall()
            raw = psycopg.RawCursor(conn)
            numbered_rows = raw.execute(
                select.numbered.sql, select.numbered.args({"b": b})
            ).fetchall()
            assert named_rows and sorted(named_rows, key=repr) == sorted(numbered_rows, key=repr)
    expected = [tuple(p.values()) for p in given]
    assert rows == [row for pair in zip(expected, expected, strict=True) for row in pair]


class Ctx(BaseModel):
    n: int = 0


def test_numbered__the_hot_path_sends_every_write_numbered(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run's creation and each of its boundaries: one statement each, on a RawCursor."""
    sent: list[str] = []
    made: list[object] = []

    class Counted(psycopg.RawCursor[Any]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(self)
            super().__init__(*args, **kwargs)

        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            sent.append(str(query))
            return super().execute(query, params, **kwargs)

    monkeypatch.setattr(psycopg, "RawCursor", Counted)
    with Engine(pg_url, workflows=[_two_steps()]) as engine:
        for _ in range(2):
            info = engine.run(engine.workflow("numbered"), Ctx())
            assert (info.status, engine.get(info.id).context) == ("succeeded", Ctx(n=2))
            assert engine.replay(info.id).differences == []
    assert len(sent) == 6  # per run: the creation, a -> b with b's start, b -> done
    assert all("%(" not in query and "$1" in query for query in sent)
    assert len(made) == 1  # kept with the write connection


def test_numbered__a_driver_without_a_raw_cursor_gets_the_statements_as_compiled(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(psycopg, "RawCursor")
    with Engine(pg_url, workflows=[_two_steps()]) as engine:
        info = engine.run(engine.workflow("numbered"), Ctx())
        assert (info.status, engine.get(info.id).context) == ("succeeded", Ctx(n=2))
        assert engine.replay(info.id).differences == []


def _two_steps() -> Workflow:
    wf = Workflow("numbered", context=Ctx)

    @wf.step(initial=True, next="b")
    async def a(ctx: Ctx) -> None:
        ctx.n += 1

    @wf.step(next="done")
    async def b(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    return wf
