"""a sleep before a wait or final state; a deadline passed in a retry backoff

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-07 08:00:00.000000

Upgrade: nothing to change. This flowloop journals a ``step.sleep`` before a wait or final
state as a success with ``asleep`` in its data (the run rests ``scheduled``, reason
``asleep``) and the entry into the state when it ends as ``sleep_ended``, a new kind; and a
run whose deadline passes in a retry backoff goes from ``retrying`` to its ``on_deadline``
state (``scheduled`` or ``succeeded``), which the lifecycle did not allow before. An older
flowloop takes events during such a sleep, leaves such a run in its final state with no due
time, and cannot fold those journals: the revision exists so that it refuses the database.

Downgrade: refused, naming a run, while a run that can still move (any but a succeeded
one: a failed or stopped run can be retried) has such entries in its journal; nothing
else changes.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import Connection, and_, exists, or_, select
from sqlalchemy.orm import aliased

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass  # see the docstring: the new entries need no new schema


def downgrade() -> None:
    found = _misread_run(op.get_bind())
    if found is not None:
        run_id, status, what = found
        raise RuntimeError(
            f"cannot downgrade below 0020: run {run_id} ({status}) {what}, which flowloop "
            "before it misreads; downgrade once it has succeeded, or prune it"
        )


def _misread_run(conn: Connection) -> tuple[str, str, str] | None:
    """A run an older flowloop would misread: its id, status and why; else ``None``."""
    from flowloop import journal as j
    from flowloop.store.schema import journal, runs

    movable = runs.c.status != "succeeded"
    slept = (
        select(runs.c.id, runs.c.status)
        .join(journal, journal.c.run_id == runs.c.id)
        .where(
            movable,
            or_(
                journal.c.kind == j.SLEEP_ENDED,
                and_(
                    # (the kinds that carry the marker first: the LIKE reads only those)
                    journal.c.kind.in_((j.STEP_SUCCEEDED, j.RUN_MIGRATED, j.RUN_UNPAUSED)),
                    # (data is compact JSON: an escaped string holding these words never
                    # matches)
                    journal.c.data.like(f'%"{j.ASLEEP}":true%'),
                ),
            ),
        )
        .limit(1)
    )
    row = conn.execute(slept).first()
    if row is not None:
        return row[0], row[1], "slept before a wait or final state (step.sleep)"
    # The deadline passed while the run was retrying: the last entry before it that set
    # the status was a failure backing off — entries that keep the status may lie between
    # (a deferral by a rate limit, a migration, an event rejected or dropped: review).
    before, between = aliased(journal), aliased(journal)
    keep_status = (j.RUN_DEFERRED, j.RUN_MIGRATED, j.EVENT_REJECTED, j.EVENT_DROPPED)
    backoff = (
        select(runs.c.id, runs.c.status)
        .join(journal, journal.c.run_id == runs.c.id)
        .join(before, and_(before.c.run_id == runs.c.id, before.c.seq < journal.c.seq))
        .where(
            movable,
            journal.c.kind == j.DEADLINE_PASSED,
            before.c.kind.in_((j.STEP_FAILED, j.STEP_INTERRUPTED)),
            before.c.next_state.is_(None),  # (a failure routed on: not backing off)
            ~exists().where(
                between.c.run_id == runs.c.id,
                between.c.seq > before.c.seq,
                between.c.seq < journal.c.seq,
                between.c.kind.not_in(keep_status),
            ),
        )
        .limit(1)
    )
    row = conn.execute(backoff).first()
    if row is not None:
        return row[0], row[1], "passed its deadline in a retry backoff"
    return None
