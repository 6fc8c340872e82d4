"""the children a map holds back get a partial index: listings count them apart

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07 15:10:00.000000

`flowloop status` and the dashboard list and count a map's child held back by its
parent's ``max_parallel`` (``join_state = 'held'``, status ``scheduled``) as ``held``,
apart from ``scheduled``. No index held ``join_state``: counting them read every scheduled
run's row (100,000 runs, half scheduled, on SQLite: the dashboard's counts per workflow
went from 5 ms to 52 ms). ``ix_flowloop_runs_held`` (workflow, status, join_state),
partial to those children, counts them from the index alone (join_state a column too:
SQLite reads a column of the condition from the row otherwise). Only a held child has an
entry (written when it is created held, removed at its turn or end), so no other run's
write touches it. No data changes, in either direction; the build holds off writes to the
runs (PostgreSQL: reads go on; SQLite: under the write lock, readers of a WAL database go
on).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

NAME = "ix_flowloop_runs_held"
WHERE = "join_state = 'held'"


def upgrade() -> None:
    where = sa.text(WHERE)
    columns = ["workflow", "status", "join_state"]
    op.create_index(NAME, "flowloop_runs", columns, sqlite_where=where, postgresql_where=where)


def downgrade() -> None:
    op.drop_index(NAME, table_name="flowloop_runs")
