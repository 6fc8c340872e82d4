"""Contexts kept in the journal only: reading a run row whose context is :data:`JOURNALED`.

A context longer than :data:`~flowloop.store.entries.ROW_CONTEXT_MAX` is written to the
journal (whole at creation and every ``SNAPSHOT_EVERY``-th entry, as a splice otherwise)
and not to the run row, whose context column says :data:`JOURNALED`. The row's snapshot is
still as of its ``last_seq``: its context is the journal's as of that seq, read here from
the run's latest whole context at or before it plus the splices after (one key range per
run). A running run's tail after ``last_seq`` is folded onto the result as before.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, Final

from sqlalchemy import ARRAY, Connection, and_, bindparam, func, not_, or_, select, update

from flowloop.store.base import StoredRun
from flowloop.store.entries import (
    JOURNALED,
    SPLICE_KEY,
    Unreadable,
    context_of,
    with_contexts,
)
from flowloop.store.schema import journal, runs


def _since_whole(run_id: Any, seq: Any) -> Any:
    """The condition on a journal row: of run ``run_id``, with a context, from the run's
    latest whole context at or before ``seq`` (seq 1, the run's creation, is always whole)
    to ``seq`` — one key range. An entry whose own data merely mentions the splice key is
    passed over as a start: the read starts earlier, never later."""
    earlier = journal.alias("earlier")
    whole = (
        select(func.max(earlier.c.seq))
        .where(
            earlier.c.run_id == run_id,
            earlier.c.seq <= seq,
            earlier.c.context.is_not(None),
            or_(earlier.c.data.is_(None), not_(earlier.c.data.like(f'%"{SPLICE_KEY}"%'))),
        )
        .scalar_subquery()
    )
    return and_(
        journal.c.run_id == run_id,
        journal.c.seq <= seq,
        journal.c.seq >= func.coalesce(whole, 1),
        journal.c.context.is_not(None),
    )


CONTEXT_COLUMNS: Final = (journal.c.run_id, journal.c.seq, journal.c.context, journal.c.data)
"""What reading a context back needs of each row (not the whole entry)."""


@functools.cache
def _one_run() -> Any:
    """The rows of one run (``:run_id``, ``:seq``): compiled once."""
    condition = _since_whole(bindparam("run_id"), bindparam("seq"))
    return select(*CONTEXT_COLUMNS).where(condition).order_by(journal.c.seq)


def given_runs() -> Any:
    """PostgreSQL: runs given as two array parameters, ``:ids`` and ``:seqs``, unnested
    into a table ``given(id, seq)`` to join the journal on (one parameter list of any
    length, one statement)."""
    return (
        func.unnest(
            bindparam("ids", type_=ARRAY(runs.c.id.type)),
            bindparam("seqs", type_=ARRAY(runs.c.last_seq.type)),
        )
        .table_valued("id", "seq")
        .render_derived(name="given")
    )


@functools.cache
def _many_runs() -> Any:
    """PostgreSQL: the rows of many runs, their ``(ids, seqs)`` as two array parameters
    unnested and joined on each run's range (one round trip per chunk)."""
    given = given_runs()
    on = _since_whole(given.c.id, given.c.seq)
    return (
        select(*CONTEXT_COLUMNS)
        .select_from(given.join(journal, on))
        .order_by(journal.c.run_id, journal.c.seq)
    )


PG_CHUNK: Final = 500
"""Runs per PostgreSQL statement (as many as a claim of interrupted runs takes)."""


def contexts_at(conn: Connection, wanted: Mapping[str, int]) -> dict[str, str | Unreadable]:
    """Per run id, its journal's context as of the given seq (its row's ``last_seq``).
    SQLite: one execution of a statement compiled once per run (no round trip; one
    statement for many runs, an OR-term and a subquery each, cost more to compile than
    all of them to run). PostgreSQL: one statement per ``PG_CHUNK`` runs."""
    if conn.dialect.name != "postgresql" or len(wanted) == 1:  # one run: a plainer plan
        query = _one_run()
        return {
            run_id: context_of(list(conn.execute(query, {"run_id": run_id, "seq": seq})), seq)
            for run_id, seq in wanted.items()
        }
    found: dict[str, list[Any]] = {}
    ids = list(wanted)
    for start in range(0, len(ids), PG_CHUNK):
        chunk = ids[start : start + PG_CHUNK]
        params = {"ids": chunk, "seqs": [wanted[i] for i in chunk]}
        for row in conn.execute(_many_runs(), params):
            found.setdefault(row.run_id, []).append(row)
    return {run_id: context_of(found.get(run_id, []), seq) for run_id, seq in wanted.items()}


def resolve(conn: Connection, stored: Sequence[StoredRun]) -> list[StoredRun]:
    """``stored`` with every journaled context read back (as of each row's snapshot): see
    :func:`~flowloop.store.entries.with_contexts`."""
    wanted = {s.id: s.record.last_seq for s in stored if s.record.context == JOURNALED}
    if not wanted:
        return list(stored)
    return with_contexts(stored, contexts_at(conn, wanted))


def restore_row_contexts(conn: Connection, *, batch: int = 500) -> None:
    """Migration 0015's downgrade: every run row's context written out whole again (what
    the previous layouts read), ``batch`` rows at a time. A context that cannot be read
    back stops the downgrade, naming the run: nothing is written in its place."""
    while True:
        rows = conn.execute(
            select(runs.c.id, runs.c.last_seq).where(runs.c.context == JOURNALED).limit(batch)
        ).all()
        if not rows:
            return
        for run_id, context in contexts_at(conn, {r.id: r.last_seq for r in rows}).items():
            if isinstance(context, Unreadable):
                raise RuntimeError(f"run {run_id}: {context.problem}; the downgrade stops here")
            conn.execute(update(runs).where(runs.c.id == run_id).values(context=context))
