"""one journal row per step boundary: a step's success holds the next step's start

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01 16:00:00.000000

Upgrade: nothing to change: rows written one entry per row stay valid; this flowloop
writes a step's success and the next step's start (same worker, same boundary) as one row,
the start in the row's ``data`` under ``~then`` (flowloop/store/entries.py). The revision
exists so that an older flowloop refuses a database it would misread.

Downgrade: every joined row is split back into its two entries.
"""

from __future__ import annotations

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass  # see the docstring: the new rows need no new schema


def downgrade() -> None:
    from flowloop.store.relayout import split_joined_rows

    split_joined_rows(op.get_bind())
