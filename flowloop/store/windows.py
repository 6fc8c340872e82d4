"""A time window over the journal without a time index on the journal.

An index on the journal's time would cost every step boundary a page (its right edge is
rewritten by every commit; the former ``(kind, at)`` index cost 2.4 pages per commit). A
window is found through the runs instead: an entry journaled at or after ``since``
belongs to a run that is still live (its row may be a snapshot older than its entries) or
whose row was last written at or after ``since`` (a finished run's row is written by its
final boundary, the latest of its entries). Those runs are found through
``ix_flowloop_runs_status_created`` and ``ix_flowloop_runs_updated``, and their entries
through the journal's primary key — the cost grows with the runs of the window, not with
the history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from sqlalchemy import ColumnElement, UnaryExpression, and_, or_, select
from sqlalchemy.sql.operators import custom_op

from flowloop.lifecycle import LIVE
from flowloop.store.schema import journal, runs

T = TypeVar("T")


def runs_since(since: float) -> ColumnElement[bool]:
    """Runs that may have entries journaled at or after ``since``."""
    return or_(runs.c.status.in_(sorted(LIVE)), runs.c.updated_at >= since)


def journal_since(since: float) -> ColumnElement[bool]:
    """Journal entries at or after ``since``: the window's runs (a subquery on the runs'
    indexes), their entries by the journal's key."""
    window = select(runs.c.id).where(runs_since(since))
    return and_(journal.c.run_id.in_(window), journal.c.at >= since)


def unindexed(expression: ColumnElement[T], *, sqlite: bool) -> ColumnElement[T]:
    """``expression`` behind a unary ``+`` on SQLite, which no index serves (as is on
    PostgreSQL, whose planner goes by its statistics)."""
    if not sqlite:
        return expression
    return UnaryExpression(expression.self_group(), operator=custom_op("+"))


def ended_since(
    since: float, conditions: Sequence[ColumnElement[bool]], *, sqlite: bool
) -> ColumnElement[bool]:
    """Finished runs (``conditions`` say which) whose row was last written at or after
    ``since``, found by ``ix_flowloop_runs_updated``. On SQLite the other conditions are
    :func:`unindexed`: given the status or the workflow, its planner read every finished
    run by their indexes (1,100 ms for a 10-minute window over 330,000 runs; 20-60 ms by
    ``updated_at``). A query grouping such runs by workflow groups by the unindexed column
    too, or the planner reads the workflow's index in order, all of it, to save a sort."""
    return and_(runs.c.updated_at >= since, unindexed(and_(*conditions), sqlite=sqlite))
