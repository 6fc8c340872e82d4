"""the claimable runs with a concurrency key get an index in their claim order

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06 11:10:00.000000

A limited claim of a workflow with a ``concurrency_key`` takes its due runs by priority,
then by their key's place in its queue (``limit_rank``), then by due time: no index held
them in that order, so each claim read and sorted every due run of the workflow (20,000
queued over 100 keys: 15.4 ms a claim of ten on SQLite, 25.1 ms on PostgreSQL,
bench/due_backlog.py; a backlog drained in time square in its size).
``ix_flowloop_runs_keyed_due`` (workflow, priority DESC, limit_rank, next_run_at, id,
limit_key, owner), partial to the claimable runs with a key, a rank and a due time, lets
the claim read a window of them in that order (flowloop/store/claims.py). Runs without a
key have no entry in it. It leaves out ``lease_expires_at``: a column of an index, even a
partial one, makes PostgreSQL write every lease renewal of every run into each index of
the table (no HOT update). No data changes, in either direction; the build holds off
writes to the runs (PostgreSQL: reads go on; SQLite: under the write lock, readers of a
WAL database go on).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

NAME = "ix_flowloop_runs_keyed_due"
WHERE = (
    "limit_key IS NOT NULL AND limit_rank IS NOT NULL AND next_run_at IS NOT NULL"
    " AND status IN ('retrying', 'scheduled')"
)
COLUMNS = [
    "workflow",
    "priority DESC",
    "limit_rank",
    "next_run_at",
    "id",
    "limit_key",
    "owner",
]


def upgrade() -> None:
    where = sa.text(WHERE)
    spelled: list[sa.ColumnElement[str]] = [sa.literal_column(column) for column in COLUMNS]
    op.create_index(NAME, "flowloop_runs", spelled, sqlite_where=where, postgresql_where=where)


def downgrade() -> None:
    op.drop_index(NAME, table_name="flowloop_runs")
