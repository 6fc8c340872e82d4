"""composition: run deadlines, child runs (parent, join, index) and join counters

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 09:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "flowloop_joins",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("parent_id", sa.String(length=40), nullable=False),
        sa.Column("state", sa.String(length=200), nullable=False),
        sa.Column("visit", sa.Integer(), nullable=False),
        sa.Column("child_workflow", sa.String(length=200), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("created", sa.Integer(), nullable=False),
        sa.Column("max_parallel", sa.Integer(), nullable=False),
        sa.Column("succeeded", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("stopped", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("flowloop_joins", schema=None) as batch_op:
        batch_op.create_index("ix_flowloop_joins_parent", ["parent_id"], unique=False)
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("deadline_at", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("parent_id", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("join_id", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("child_index", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("join_state", sa.String(length=16), nullable=True))
        batch_op.create_index("ix_flowloop_runs_parent", ["parent_id"], unique=False)
        batch_op.create_index("ix_flowloop_runs_join", ["join_id", "child_index"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_flowloop_runs_join")
        batch_op.drop_index("ix_flowloop_runs_parent")
        batch_op.drop_column("join_state")
        batch_op.drop_column("child_index")
        batch_op.drop_column("join_id")
        batch_op.drop_column("parent_id")
        batch_op.drop_column("deadline_at")
    with op.batch_alter_table("flowloop_joins", schema=None) as batch_op:
        batch_op.drop_index("ix_flowloop_joins_parent")
    op.drop_table("flowloop_joins")
