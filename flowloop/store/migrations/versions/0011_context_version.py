"""runs remember the version of their stored context (context migrations, issue 16)

Revision ID: 0011
Revises: 0009
Create Date: 2026-12-01 10:20:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("context_version", sa.Integer(), server_default=sa.text("1"), nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.drop_column("context_version")
