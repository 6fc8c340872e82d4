"""PostgreSQL: a batch's writes as one statement per kind, its rows sent as one JSON array.

A batch (concurrent runs sharing a commit) used to send each statement once per boundary,
as a pipelined ``executemany``: for 100 boundaries, 100 executions of the fenced append on
the server, psycopg's adaptation of every parameter of every row in the client, and a
round trip more to restart the server's idle-in-transaction timer after the pipeline
(:func:`~flowloop.store.dialect.restart_idle_timer`). Here the rows go as one parameter,
read by ``json_to_recordset`` and joined to the run rows, with the same fence and the same
check that the append goes at the run's end, row by row: one execution, whose row count is
the verdict as before (all applied, or the batch is rolled back and written one by one).
Measured on 100 owned appends (a scratch script, 200 rounds): 106 µs of wall time and
33 µs of the client's CPU per boundary, against 41 and 12 here.

SQLite keeps its ``executemany``: its statements run in the process, where binding a row
costs less than reading it out of JSON would.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Float,
    Integer,
    String,
    Text,
    bindparam,
    column,
    func,
    insert,
    select,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import JSON
from sqlalchemy.sql.selectable import TableValuedAlias

from flowloop.store.entries import JOURNAL_FIELDS
from flowloop.store.schema import journal, runs

PART_CHARS: Final = 4_000_000
"""The most characters of rows one statement reads. A batch of long contexts read as one
array outlasted the worker's ``statement_timeout`` (a third of its lease, 2 s at least):
100 runs whose steps each stored 2 MB were cancelled at every retry, for ever (50 runs of
1 MB, 4 commits, went through). A part of 4 MB takes the server tens of milliseconds."""
FENCE_COLUMNS: Final = (("f_id", String(40)), ("f_owner", String(200)), ("f_epoch", Integer()))
"""The fence's values of a row (AppendStoreMixin._fence_params)."""
_NUL: Final = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
"""A NUL character as JSON writes it: ``\\u0000`` after an even run of backslashes (an odd
one is an escaped backslash followed by the text ``u0000``)."""

Value = Callable[[str], Any]
"""The value of a row's field in a statement: a bound parameter, or a column of the rows'
JSON (:func:`rows_of`)."""


def rows_of(columns: Sequence[tuple[str, Any]]) -> TableValuedAlias:
    """``json_to_recordset`` of the parameter ``rows`` (a JSON array of objects), as the
    table ``u`` of these typed columns (a key an object lacks is NULL)."""
    source = func.json_to_recordset(sql_cast(bindparam("rows", type_=Text), JSON))
    return source.table_valued(*[column(name, type_) for name, type_ in columns]).render_derived(
        name="u", with_types=True
    )


def appends(
    fence: Callable[[bool, Value], ColumnElement[bool]],
    at_end: Callable[[Any, Any], ColumnElement[bool]],
) -> dict[bool, Any]:
    """The fenced appends of many journal rows (an owner's, ``True``, and an operator's):
    each row only if its run's fence holds and no entry of the run is at or after its
    seq, the run rows held as the single append holds them."""
    rows = rows_of([(c.name, c.type) for c in journal.columns] + list(FENCE_COLUMNS))
    return {
        owned: insert(journal)
        .from_select(
            list(JOURNAL_FIELDS),
            select(*[rows.c[name] for name in JOURNAL_FIELDS])
            .select_from(rows)
            .join(runs, fence(owned, rows.c.__getitem__))
            .where(at_end(rows.c.run_id, rows.c.seq))
            .with_for_update(read=True, key_share=True, of=runs),
        )
        .execution_options(preserve_rowcount=True)
        for owned in (True, False)
    }


def row_writes(
    statements: Callable[[Value], Mapping[tuple[str, bool], Any]], record_columns: Sequence[str]
) -> dict[tuple[str, bool], Any]:
    """The run rows' writes of many boundaries, keyed as the single ones (kind, whether
    the control request is cleared): ``statements(value)`` builds them."""
    typed = [(f"p_{name}", runs.c[name].type) for name in record_columns]
    control = ("f_control", runs.c.control.type)  # the request the writer saw
    rows = rows_of([*typed, ("p_at", Float()), ("p_lease", Float()), *FENCE_COLUMNS, control])
    return dict(statements(lambda name: rows.c[name]))


def rows_json(params: Sequence[Mapping[str, Any]]) -> str | None:
    """``params`` (each a row's fields by name) as one JSON array; ``None`` when a text
    holds a NUL character, which PostgreSQL's ``json`` refuses to turn into text (such a
    batch goes by ``executemany`` and fails as it always has: no text column holds NUL),
    or a value JSON has not (NaN, infinities, a type of its own)."""
    try:
        text = _dumps(params)
    except (TypeError, ValueError):
        return None
    if "\\u0000" in text and _NUL.search(text):
        return None
    return text


def rows_json_parts(params: Sequence[Mapping[str, Any]]) -> list[tuple[str, int]] | None:
    """:func:`rows_json` in parts of at most :data:`PART_CHARS` characters (a row that
    does not fit in one goes alone), each with its number of rows; ``None`` as
    :func:`rows_json`."""
    whole = rows_json(params)
    if whole is None or len(whole) <= PART_CHARS:
        return None if whole is None else [(whole, len(params))]
    parts: list[tuple[str, int]] = []
    part: list[str] = []
    size = 1  # the part's text: its brackets, and a comma before each row but the first
    for row in params:
        one = _dumps(row)  # as in the whole, which was made
        if part and size + len(one) + 1 > PART_CHARS:
            parts.append(("[" + ",".join(part) + "]", len(part)))
            part, size = [], 1
        part.append(one)
        size += len(one) + 1
    parts.append(("[" + ",".join(part) + "]", len(part)))
    return parts


def _dumps(value: Any) -> str:
    # Not ASCII-escaped: shorter for the server to read, and text as the driver sends it.
    return json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
