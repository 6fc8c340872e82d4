"""a join counts the children that ended while held

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06 21:55:00.000000

A map's child held back by ``max_parallel`` that ends before its turn (an operator's stop)
took no slot and frees none. The join counted it with the others, so its end released
another held child: a map of ``max_parallel=2`` whose held children were stopped ran six.
``flowloop_joins.ended_held`` counts those ends apart: the next child's turn comes with the
ends that free a slot only (flowloop/store/joins.py). Existing joins start at 0 (what they
would have counted had none ended held; before, none was told apart). No other data
changes, in either direction.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("flowloop_joins", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("ended_held", sa.Integer(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("flowloop_joins", schema=None) as batch_op:
        batch_op.drop_column("ended_held")
