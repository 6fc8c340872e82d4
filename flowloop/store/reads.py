"""Reads shared by the store and the read commands (dashboard, stats, heat, prune).

- :func:`reading`: one read transaction. On SQLite it opens with a plain ``BEGIN``, never
  ``BEGIN IMMEDIATE`` (see :data:`flowloop.store.dialect.READ_OPTION`): a reader never takes
  the write lock, so a dashboard or ``flowloop stats`` cannot slow a worker's commits; on
  PostgreSQL every query of the block sees one snapshot.
- :func:`after_run` and :data:`NEWEST_FIRST`: keyset paging of runs on the
  ``(created_at DESC, id)`` order the runs' ``*_created`` indexes serve (no OFFSET scan).
- :func:`nearest_ranks` and :class:`Ranks`: nearest-rank percentiles computed in SQL with
  window functions, one code path for SQLite and PostgreSQL, so only the few rows at the
  wanted ranks leave the database.

``SQLStore._read`` (flowloop/store/sql.py) and ``SQLStore.find_runs`` still hold their own
copies of the first two; they can use these as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from sqlalchemy import ColumnElement, Connection, Engine, FromClause, Row, Select, func, or_, select
from sqlalchemy import and_ as sql_and

from flowloop.store.dialect import READ_OPTION
from flowloop.store.schema import runs

PERCENTILES: Final = (50, 95, 99)
"""The percentiles the read commands show."""

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@contextmanager
def reading(db: Engine) -> Iterator[Connection]:
    """One read transaction (``BEGIN``, never ``BEGIN IMMEDIATE``, on SQLite)."""
    with db.connect() as conn:
        conn = conn.execution_options(**{READ_OPTION: True})
        with conn.begin():
            yield conn


# -- keyset paging of runs -------------------------------------------------------------------

NEWEST_FIRST: Final = (runs.c.created_at.desc(), runs.c.id)
"""The runs' listing order: newest first, ties by id (what :func:`after_run` pages on)."""


def after_run(created_at: float, run_id: str) -> ColumnElement[bool]:
    """The runs that come after ``(created_at, run_id)`` in :data:`NEWEST_FIRST` order:
    the next page starts after the last row of this one, at the same cost on any page."""
    return or_(
        runs.c.created_at < created_at,
        sql_and(runs.c.created_at == created_at, runs.c.id > run_id),
    )


# -- nearest-rank percentiles ----------------------------------------------------------------


def rank(percentile: int, n: Any) -> Any:
    """The nearest-rank position ``ceil(p/100 * n)`` in integer arithmetic (same result on
    every database; works on a Python int or a SQL expression)."""
    return (n * percentile + 99) // 100


def nearest_ranks(
    value: ColumnElement[Any],
    *,
    where: Sequence[ColumnElement[bool]],
    groups: Mapping[str, ColumnElement[Any]] | None = None,
    columns: Sequence[ColumnElement[Any]] = (),
    select_from: FromClause | None = None,
    percentiles: Sequence[int] = PERCENTILES,
    top: int = 0,
) -> Select[Any]:
    """The rows at the nearest-rank positions of ``value`` (ascending; rows without one
    left out) in each group: a row has the ``groups`` (labelled by their keys), the
    ``columns``, ``value`` (labelled so), ``rn`` (its rank in the group) and ``n`` (the
    group's size). ``top > 0`` also keeps each group's ``top`` highest (the slowest)."""
    keys = list((groups or {}).values())
    partition = keys or None
    # One window (same partition and order) for both numbers: the database sorts once.
    ranked_query = select(
        *[column.label(label) for label, column in (groups or {}).items()],
        *columns,
        value.label("value"),
        func.row_number().over(partition_by=partition, order_by=value).label("rn"),
        func.count().over(partition_by=partition, order_by=value, rows=(None, None)).label("n"),
    )
    if select_from is not None:
        ranked_query = ranked_query.select_from(select_from)
    ranked = ranked_query.where(*where, value.is_not(None)).subquery()
    wanted = [ranked.c.rn == rank(p, ranked.c.n) for p in percentiles]
    if top > 0:
        wanted.append(ranked.c.rn > ranked.c.n - top)
    return select(ranked).where(or_(*wanted))


@dataclass
class Ranks(Generic[K, T]):
    """What :func:`nearest_ranks` found, by group: the value at each rank and the size."""

    values: dict[K, dict[int, T]] = field(default_factory=dict)
    sizes: dict[K, int] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        rows: Iterable[Row[Any]],
        group: Callable[[Row[Any]], K],
        value: Callable[[Row[Any]], T],
    ) -> Ranks[K, T]:
        found: Ranks[K, T] = cls()
        for row in rows:
            key = group(row)
            found.values.setdefault(key, {})[int(row.rn)] = value(row)
            found.sizes[key] = int(row.n)
        return found

    def size(self, key: K) -> int:
        return self.sizes.get(key, 0)

    def at(self, key: K, percentile: int) -> T | None:
        """The group's nearest-rank ``percentile`` (``None``: the group has no value)."""
        n = self.size(key)
        return self.values.get(key, {}).get(rank(percentile, n)) if n else None

    def highest(self, key: K, top: int) -> list[T]:
        """The group's ``top`` highest ranks' values (kept by ``nearest_ranks(top=...)``)."""
        n = self.size(key)
        ranks = self.values.get(key, {})
        return [ranks[position] for position in sorted(ranks) if position > n - top]


def ranked_seconds(rows: Iterable[Row[Any]], group: str | None = None) -> Ranks[str, float]:
    """:class:`Ranks` of a :func:`nearest_ranks` query of seconds, by its one ``group``
    column (``None``: one group, ``""``; a NULL group value is ``""`` too)."""
    return Ranks.of(
        rows,
        group=lambda row: "" if group is None else str(row._mapping[group] or ""),
        value=lambda row: float(row.value),
    )


def counts_and_seconds(
    db: Engine,
    counts: Select[Any],
    seconds: ColumnElement[Any],
    *,
    where: Sequence[ColumnElement[bool]],
    group: tuple[str, ColumnElement[Any]],
    select_from: FromClause | None = None,
    percentiles: Sequence[int] = PERCENTILES,
) -> tuple[list[Row[Any]], Ranks[str, float]]:
    """The rows of ``counts`` and the nearest-rank ``percentiles`` of ``seconds`` per
    ``group`` (its label, its column) among the rows ``where`` selects, read in one
    transaction: one snapshot, so the counts and the percentiles describe the same rows."""
    label, column = group
    ranked = nearest_ranks(
        seconds,
        where=where,
        groups={label: column},
        select_from=select_from,
        percentiles=percentiles,
    )
    with reading(db) as conn:
        return list(conn.execute(counts)), ranked_seconds(conn.execute(ranked), label)
