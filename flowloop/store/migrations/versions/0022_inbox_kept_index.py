"""the events kept in the inbox, not yet taken, get a partial index

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07 15:00:00.000000

Every worker's recovery sweep (every 10 s at most) now hands the waiting runs that no worker
holds the events kept for them that they accept — a worker killed between the commit that
entered the wait and its handing them over left them there (flowloop/kept.py). The inbox
keeps every taken event too (``consumed_seq`` set): read through ``ix_flowloop_inbox_pending``
(run_id, consumed_seq) that look went through the whole inbox at every sweep.
``ix_flowloop_inbox_kept`` (run_id, event), partial to ``consumed_seq IS NULL``, holds only
the kept events, with what the look compares. No data changes, in either direction; the
build holds off writes to the inbox (PostgreSQL: reads go on; SQLite: under the write lock,
readers of a WAL database go on).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

NAME = "ix_flowloop_inbox_kept"
WHERE = "consumed_seq IS NULL"


def upgrade() -> None:
    where = sa.text(WHERE)
    op.create_index(
        NAME,
        "flowloop_inbox",
        ["run_id", "event"],
        unique=False,
        sqlite_where=where,
        postgresql_where=where,
    )


def downgrade() -> None:
    op.drop_index(NAME, table_name="flowloop_inbox")
