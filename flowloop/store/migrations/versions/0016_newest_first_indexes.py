"""the runs' newest-first indexes sort newest first again on SQLite

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-03 13:30:00.000000

Listings (``flowloop status``, ``engine.runs``, the dashboard) ask for runs by
``created_at DESC, id``, and 0003/0004 built three indexes in that order. On SQLite,
0011's ``batch_alter_table`` rebuilt the runs table and its indexes from reflection, which
does not carry a column's sort order: the indexes came back as ``created_at, id``. SQLite
then reads the index backwards (``created_at DESC, id DESC``) and sorts each group of runs
created at the same instant again (``USE TEMP B-TREE FOR RIGHT PART OF ORDER BY``). Runs
share an instant when they are a fan-out's children (one time per batch), under a fake
clock (``flowloop.testing``), or copied in bulk: bench/scale.py's 47,620 copied runs took
129 ms per page of 100, 2.28 ms after. The three indexes are built again in their order.

PostgreSQL kept them (its migrations alter the table in place): nothing to do there but
the revision itself.
Downgrade: nothing to undo (the indexes are the ones 0003/0004 meant).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

NEWEST_FIRST = {
    "ix_flowloop_runs_created": [],
    "ix_flowloop_runs_workflow_created": ["workflow"],
    "ix_flowloop_runs_status_created": ["status"],
}
"""Each index's leading columns, before ``created_at DESC, id``."""


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for name, leading in NEWEST_FIRST.items():
        # (SQLite cannot rename an index: dropped, then built; WAL readers go on.)
        op.drop_index(name, table_name="flowloop_runs")
        op.create_index(
            name,
            "flowloop_runs",
            [*leading, sa.literal_column("created_at DESC"), "id"],
            unique=False,
        )


def downgrade() -> None:
    pass  # see the docstring
