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

from sqlalchemy import ColumnElement, and_, or_, select

from flowloop.lifecycle import LIVE
from flowloop.store.schema import journal, runs


def runs_since(since: float) -> ColumnElement[bool]:
    """Runs that may have entries journaled at or after ``since``."""
    return or_(runs.c.status.in_(sorted(LIVE)), runs.c.updated_at >= since)


def journal_since(since: float) -> ColumnElement[bool]:
    """Journal entries at or after ``since``: the window's runs (a subquery on the runs'
    indexes), their entries by the journal's key."""
    window = select(runs.c.id).where(runs_since(since))
    return and_(journal.c.run_id.in_(window), journal.c.at >= since)
