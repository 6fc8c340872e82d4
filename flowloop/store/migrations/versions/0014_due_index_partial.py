"""the runs' due index leaves out runs with no due time

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01 19:00:00.000000

Claims ask for runs whose ``next_run_at <= now``: a running or finished run (no due time)
never matched, yet each had an entry in ``ix_flowloop_runs_due`` that a run's creation
wrote and its end moved (a B-tree page each, measured by bench/wal_pages.py). The index
becomes partial (``next_run_at IS NOT NULL``); no data changes, in either direction.

On PostgreSQL the new index is built under another name before the old one goes: the
build holds off writes to the runs (reads go on), and dropping and renaming — the only
steps that lock the table against reads — take no time. SQLite cannot rename an index:
the old one is dropped, then the new one built (readers of a WAL database go on).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

NAME = "ix_flowloop_runs_due"
BUILDING = "ix_flowloop_runs_due_0014"
COLUMNS = ["status", "priority", "next_run_at"]


def _replace(where: sa.TextClause | None) -> None:
    """``NAME`` rebuilt with ``where`` (``None``: a whole index)."""
    partial: dict[str, Any] = (
        {} if where is None else {"sqlite_where": where, "postgresql_where": where}
    )
    if op.get_bind().dialect.name == "postgresql":
        op.create_index(BUILDING, "flowloop_runs", COLUMNS, unique=False, **partial)
        op.drop_index(NAME, table_name="flowloop_runs")
        op.execute(f"ALTER INDEX {BUILDING} RENAME TO {NAME}")
        return
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.drop_index(NAME)
        batch_op.create_index(NAME, COLUMNS, unique=False, **partial)


def upgrade() -> None:
    _replace(sa.text("next_run_at IS NOT NULL"))


def downgrade() -> None:
    _replace(None)
