"""Read statements the store runs on every call of ``Engine.run`` or every poll, built
once with bind parameters.

SQLAlchemy builds and hashes a statement's cache key at each ``execute`` of a statement
built anew; for the small reads of a call's path that cost more than running them (an idle
check: 430 µs built per call, 110 µs built once, on a 1,996 MHz EPYC). The claims build
theirs once too (``SQLStore._claim_statement``), and a child's end its own
(flowloop/store/joins.py).
"""

from __future__ import annotations

from functools import cache
from typing import Any, Final

from sqlalchemy import ColumnElement, bindparam, func, select

from flowloop.lifecycle import CLAIMABLE
from flowloop.store import claims, dialect
from flowloop.store.schema import journal, runs

RUN_BY_ID: Final = select(runs).where(runs.c.id == bindparam("r_id"))
"""A run's row (``r_id``)."""

JOURNAL_OF: Final = (
    select(journal).where(journal.c.run_id == bindparam("r_id")).order_by(journal.c.seq)
)
"""A run's entries in order (``r_id``)."""

JOURNAL_UNTIL: Final = (
    select(journal)
    .where(journal.c.run_id == bindparam("r_id"), journal.c.seq <= bindparam("r_seq"))
    .order_by(journal.c.seq)
)
"""A run's entries up to ``r_seq`` in order (``r_id``)."""

FIRST_ENTRY_OF: Final = (
    select(journal.c.seq)
    .where(
        journal.c.run_id == bindparam("r_id"),
        journal.c.kind.in_(bindparam("r_kinds", expanding=True)),
    )
    .order_by(journal.c.seq)
    .limit(1)
)
"""The seq of a run's first entry of one of ``r_kinds`` (``r_id``): read on the journal's
key in seq order, so it stops at that entry."""

RUNNING_OWNERS: Final = select(runs.c.owner).where(runs.c.owner.is_not(None)).distinct()
"""Every owner of a run now."""

CHILDREN_OF: Final = select(runs.c.id, runs.c.status).where(
    runs.c.parent_id.in_(bindparam("r_parents", expanding=True))
)
"""The children of the runs ``r_parents`` (a list), with their status."""


@cache
def next_due(
    *, by_workflow: bool, by_id: bool, postgres: bool, looked_up: bool, segmented: int | None
) -> Any:
    """The earliest due time of a claimable run, of the workflows ``p_workflows`` (a list)
    and the runs ``p_ids`` (:func:`~flowloop.store.dialect.ids_value`) when asked, looked
    up by their ids with ``looked_up`` (:func:`~flowloop.store.dialect.look_up`); or, with
    ``segmented`` (:func:`~flowloop.store.claims.segments`), of the workflows read a
    segment at a time."""
    if segmented == 0:
        return claims.PG_NEXT_DUE
    if segmented is not None:
        return claims.segmented_next_due(segmented)
    # NOT NULL spelled out: it lets the (partial) due index serve the minimum.
    conditions: list[ColumnElement[bool]] = [
        runs.c.status.in_(sorted(CLAIMABLE)),
        runs.c.next_run_at.is_not(None),
    ]
    if by_workflow:
        conditions.append(runs.c.workflow.in_(bindparam("p_workflows", expanding=True)))
    if by_id:  # a family's runs (see dialect.within_ids)
        scoped = dialect.within_ids(
            runs.c.id, conditions, "p_ids", postgres=postgres, looked_up=looked_up
        )
        conditions = [scoped]
    return select(func.min(runs.c.next_run_at)).where(*conditions)
