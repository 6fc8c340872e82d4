"""the runs' due index leaves out runs with no due time

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01 19:00:00.000000

Claims ask for runs whose ``next_run_at <= now``: a running or finished run (no due time)
never matched, yet each had an entry in ``ix_flowloop_runs_due`` that a run's creation
wrote and its end moved (a B-tree page each, measured by bench/wal_pages.py). The index
becomes partial (``next_run_at IS NOT NULL``); no data changes, in either direction.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

NAME = "ix_flowloop_runs_due"
COLUMNS = ["status", "priority", "next_run_at"]


def upgrade() -> None:
    where = sa.text("next_run_at IS NOT NULL")
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.drop_index(NAME)
        batch_op.create_index(
            NAME, COLUMNS, unique=False, sqlite_where=where, postgresql_where=where
        )


def downgrade() -> None:
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.drop_index(NAME)
        batch_op.create_index(NAME, COLUMNS, unique=False)
