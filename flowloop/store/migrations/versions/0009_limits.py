"""flow control across workers: runs.limit_key, rate limits, breakers and their journal

Revision ID: 0009
Revises: 0005
Create Date: 2026-12-01 10:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("limit_key", sa.String(length=400), nullable=True))
        batch_op.add_column(sa.Column("limit_rank", sa.Integer(), nullable=True))
        batch_op.create_index(
            "ix_flowloop_runs_limit_key",
            ["workflow", "limit_key"],
            unique=False,
            sqlite_where=sa.text("limit_key IS NOT NULL"),
            postgresql_where=sa.text("limit_key IS NOT NULL"),
        )
    op.create_table(
        "flowloop_rate_limits",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("last_grant", sa.Float(), nullable=True),
        sa.Column("queue_end", sa.Float(), nullable=False),
        sa.Column("grants", sa.Integer(), nullable=False),
        sa.Column("deferrals", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "flowloop_breakers",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("failures", sa.Text(), nullable=False),
        sa.Column("until", sa.Float(), nullable=True),
        sa.Column("trial", sa.String(length=200), nullable=True),
        sa.Column("opened", sa.Integer(), nullable=False),
        sa.Column("last_seq", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "flowloop_breaker_journal",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("worker", sa.String(length=200), nullable=True),
        sa.Column("data", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("name", "seq"),
    )


def downgrade() -> None:
    op.drop_table("flowloop_breaker_journal")
    op.drop_table("flowloop_breakers")
    op.drop_table("flowloop_rate_limits")
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_flowloop_runs_limit_key")
        batch_op.drop_column("limit_rank")
        batch_op.drop_column("limit_key")
