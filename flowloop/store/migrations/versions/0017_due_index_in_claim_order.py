"""the runs' due index holds a status and workflow's runs in claim order; waiting runs get theirs

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 06:30:00.000000

``ix_flowloop_runs_due`` was (status, priority, next_run_at). Claims take the highest
priority first, so SQLite could not read a priority's due runs in claim order from it,
nor skip the runs due later: it walked the workflow's index instead, reading every
claimable run of the workflow at every poll (runs asleep or waiting with a timeout
included). The index becomes (status, workflow, priority DESC, next_run_at, id), still
partial: the claims read it a (status, workflow, priority) segment at a time
(flowloop/store/claims.py). No data changes, in either direction.

A new partial index, ``ix_flowloop_runs_waiting`` (workflow) of the runs waiting without a
due time, serves the look for waits the loaded definitions cannot take
(flowloop/parking.py, at a worker's start and each ``run_until_idle``): it read every
queued run of the workflow. It holds only such runs (a wait with no timeout), so only a
run's entering and leaving one write it.

On PostgreSQL the new index is built under another name before the old one goes (the
build holds off writes to the runs, reads go on; dropping and renaming take no time).
SQLite cannot rename an index: the old one is dropped, then the new one built (readers of
a WAL database go on). Both as 0014 did.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

NAME = "ix_flowloop_runs_due"
BUILDING = "ix_flowloop_runs_due_0017"
WHERE = "next_run_at IS NOT NULL"
IN_CLAIM_ORDER = ["status", "workflow", "priority DESC", "next_run_at", "id"]
BEFORE = ["status", "priority", "next_run_at"]
WAITING = "ix_flowloop_runs_waiting"
WAITING_WHERE = "status = 'scheduled' AND next_run_at IS NULL"


def _replace(columns: Sequence[str]) -> None:
    """``NAME`` built again on ``columns`` (written as SQL: a sort order survives)."""
    where = sa.text(WHERE)
    spelled: list[sa.ColumnElement[str]] = [sa.literal_column(column) for column in columns]
    if op.get_bind().dialect.name == "postgresql":
        op.create_index(BUILDING, "flowloop_runs", spelled, postgresql_where=where)
        op.drop_index(NAME, table_name="flowloop_runs")
        op.execute(f"ALTER INDEX {BUILDING} RENAME TO {NAME}")
        return
    op.drop_index(NAME, table_name="flowloop_runs")
    op.create_index(NAME, "flowloop_runs", spelled, sqlite_where=where)


def upgrade() -> None:
    _replace(IN_CLAIM_ORDER)
    where = sa.text(WAITING_WHERE)
    op.create_index(
        WAITING, "flowloop_runs", ["workflow"], sqlite_where=where, postgresql_where=where
    )


def downgrade() -> None:
    op.drop_index(WAITING, table_name="flowloop_runs")
    _replace(BEFORE)
