"""Statements compiled once for one dialect, executed on the driver's cursor: the hot path's
writes (a step boundary, a run's creation), where SQLAlchemy's execution machinery costs
more Python per statement than the database needs to run it.

On SQLite a ``None`` parameter is expensive: the driver adapts every parameter that is not
a str, int, float or bytearray — for ``None`` it builds a key, misses the adapters'
registry and looks up two protocol attributes (≈ 0.7 µs each, against 0.3 for a string;
a run's creation binds thirty of them). :meth:`Raw.bound` writes them into the statement
as ``NULL`` literals instead: one variant of the text per pattern of ``None`` values (a
handful per statement), each prepared once by the driver's statement cache.

On PostgreSQL the same statements are sent with numbered placeholders (:attr:`Raw.numbered`)
on psycopg's ``RawCursor``, which passes them on as they are.
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

VARIANTS_KEPT: Final = 32
"""``NULL`` patterns a statement keeps the text of (past this, each is built per call)."""

_NONES: Final = itertools.repeat(None)
"""``None`` as often as asked (:meth:`Raw.bound` compares each value with it)."""

_NAMED: Final = re.compile(r"%\(([^)]+)\)s|%%")
"""A ``%(name)s`` placeholder (the pyformat style of SQLAlchemy's psycopg dialect; a name is
anything up to its ``)``, as psycopg reads it), or the ``%%`` that stands for a literal
``%`` in that style."""


@dataclass(frozen=True)
class Raw:
    """A statement compiled once for one dialect: its SQL, the order of its positional
    parameters, and the values of parameters bound at build time (e.g. ``control=None``)."""

    sql: str
    order: tuple[str, ...] | None
    defaults: dict[str, Any]
    native: bool = False
    """Its placeholders are PostgreSQL's own, ``$1``, ``$2`` … (:attr:`numbered`)."""
    _variants: dict[tuple[bool, ...], str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, stmt: Any, dialect: Any, column_keys: list[str] | None = None) -> Raw:
        compiled = stmt.compile(dialect=dialect, column_keys=column_keys)
        # Only the values bound when the statement was built (``.values(owner=None)``): a
        # parameter left to the caller is the caller's to give, and without such values
        # (the usual boundary's append) :meth:`args` merges nothing.
        escaped = compiled.escaped_bind_names
        required = {
            escaped.get(name, name) for bind, name in compiled.bind_names.items() if bind.required
        }
        defaults = {
            name: value
            for name, value in compiled.construct_params(_check=False).items()
            if name not in required
        }
        order = tuple(compiled.positiontup) if compiled.positiontup is not None else None
        return cls(compiled.string, order, defaults)

    @functools.cached_property
    def _positional(self) -> Callable[[Mapping[str, Any]], tuple[Any, ...]]:
        """The positional parameters picked out of a mapping at C speed."""
        assert self.order is not None
        pick = operator.itemgetter(*self.order)
        if len(self.order) == 1:
            return lambda full: (pick(full),)
        return cast("Callable[[Mapping[str, Any]], tuple[Any, ...]]", pick)

    @functools.cached_property
    def numbered(self) -> Raw:
        """This statement with its ``%(name)s`` placeholders numbered as PostgreSQL's own
        (``$1``, ``$2`` …; a name used twice keeps its number) and its parameters passed in
        that order, for psycopg's ``RawCursor``. psycopg reads the placeholders of a
        ``%(name)s`` query at every execute unless the query is short: it caches them for
        queries of up to 4,096 bytes and 50 parameters, and a step boundary's statement
        and a run's creation are longer (a fifth of a PostgreSQL step's instructions in the
        client went to reading them again)."""
        if self.order is not None:
            raise ValueError("numbered: the statement's parameters are positional already")
        if "__[POSTCOMPILE_" in self.sql:  # an expanding IN (...): its SQL is made per call
            raise ValueError("numbered: the statement has parameters expanded at execution")
        numbers: dict[str, int] = {}

        def number(found: re.Match[str]) -> str:
            name = found.group(1)
            if name is None:  # %%: a literal % once nothing reads the placeholders
                return "%"
            return f"${numbers.setdefault(name, len(numbers) + 1)}"

        sql = _NAMED.sub(number, self.sql)
        if "%" in _NAMED.sub("", self.sql):  # a % that is neither: not this style
            raise ValueError(f"numbered: a % that is no placeholder in {self.sql[:200]!r}")
        return Raw(sql, tuple(numbers), self.defaults, native=True)

    def unprefixed(self, prefix: str) -> Raw:
        """This statement with ``prefix`` cut from the names of its parameters, so that a
        row whose keys are the columns is its parameters as it is (an INSERT or UPDATE of a
        column must name its parameter apart from the column: ``p_state`` for ``state``).
        Positional placeholders only (SQLite's ``?``, :attr:`numbered`): the names are
        the caller's, not the statement's."""
        if self.order is None:
            raise ValueError("unprefixed: the statement's parameters are named in its SQL")
        order = tuple([name.removeprefix(prefix) for name in self.order])
        defaults = {name.removeprefix(prefix): value for name, value in self.defaults.items()}
        if len(set(order) | defaults.keys()) != len(set(self.order) | self.defaults.keys()):
            raise ValueError(f"unprefixed: two parameters are one without {prefix!r}")
        return Raw(self.sql, order, defaults, native=self.native)

    @functools.cached_property
    def _pieces(self) -> tuple[str, ...] | None:
        """The SQL cut at its ``?`` placeholders (SQLite's style), one more piece than
        parameters; ``None`` for another style (or a ``?`` that is not a placeholder)."""
        if self.order is None or self.native:
            return None
        pieces = tuple(self.sql.split("?"))
        return pieces if len(pieces) == len(self.order) + 1 else None

    @staticmethod
    def _marked(pieces: tuple[str, ...], marks: list[str]) -> str:
        """The SQL with each placeholder replaced by its mark (``?`` or ``NULL``)."""
        return "".join([p + m for p, m in zip(pieces[:-1], marks, strict=True)]) + pieces[-1]

    def with_nulls(self, names: frozenset[str]) -> Raw:
        """This statement with the parameters ``names`` written as ``NULL`` literals (see
        the module's docstring), for a caller whose values there are always ``None``: the
        usual boundary's row, a step's success, has no error. In another paramstyle than
        SQLite's ``?``, the statement as it is (those parameters bound as given)."""
        pieces = self._pieces
        if pieces is None or self.order is None:
            return self
        if not names <= set(self.order):
            unknown = ", ".join(sorted(names - set(self.order)))
            raise ValueError(f"with_nulls: the statement has no parameter(s) {unknown}")
        marks = ["NULL" if name in names else "?" for name in self.order]
        order = tuple([name for name in self.order if name not in names])
        defaults = {k: v for k, v in self.defaults.items() if k not in names}
        return Raw(self._marked(pieces, marks), order, defaults)

    def args(self, params: Mapping[str, Any]) -> Any:
        """The driver's parameters for ``params``: positional (a tuple) or named (a dict)."""
        full = {**self.defaults, **params} if self.defaults else params
        if self.order is None:
            return dict(full)
        return self._positional(full)

    def bound_many(self, values: list[Any]) -> list[tuple[str, list[Any]]]:
        """``(sql, args)`` pairs to pass to ``executemany`` in turn for the positional
        ``values`` (each a tuple of :meth:`args`): on SQLite each ``None`` written as a
        ``NULL`` literal, as :meth:`bound` writes it, the sets in their order — one pair per
        run of consecutive sets with the same ``None`` values (a batch's rows of one kind
        mostly have the same); elsewhere, or with no ``None``, ``[(sql, values)]``."""
        pieces = self._pieces
        if pieces is None or not any([None in one for one in values]):
            return [(self.sql, values)]
        out: list[tuple[str, list[Any]]] = []
        last: tuple[bool, ...] | None = None
        for one in values:
            nulls = tuple([value is None for value in one])
            if nulls != last:
                last = nulls
                sql = self._variants.get(nulls)
                if sql is None:
                    sql = self._marked(pieces, ["NULL" if null else "?" for null in nulls])
                    if len(self._variants) < VARIANTS_KEPT:
                        self._variants[nulls] = sql
                out.append((sql, []))
            out[-1][1].append(
                tuple([value for value in one if value is not None]) if any(nulls) else one
            )
        return out

    def bound(self, params: Mapping[str, Any]) -> tuple[str, Any]:
        """``(sql, args)`` to execute with ``params``: on SQLite each ``None`` written as a
        ``NULL`` literal instead of a parameter (see the module's docstring); elsewhere
        :attr:`sql` and :meth:`args`."""
        values = self.args(params)
        pieces = self._pieces
        if pieces is None or None not in values:
            return self.sql, values
        # Which values are given, and those values, at C speed (two list comprehensions
        # over thirty values cost more than the rest of the call).
        given = tuple(map(operator.is_not, values, _NONES))
        sql = self._variants.get(given)
        if sql is None:
            sql = self._marked(pieces, ["?" if kept else "NULL" for kept in given])
            if len(self._variants) < VARIANTS_KEPT:
                self._variants[given] = sql
        return sql, tuple(itertools.compress(values, given))
