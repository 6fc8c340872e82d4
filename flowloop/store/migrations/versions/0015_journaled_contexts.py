"""a long context is kept in the journal only, not in the run row too

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01 23:00:00.000000

Upgrade: nothing to change: rows written with their context stay valid; this flowloop
writes a context longer than ``ROW_CONTEXT_MAX`` characters to the journal only and the
run row's context column says so with an empty string (flowloop/store/journaled.py). The
revision exists so that an older flowloop refuses a database it would misread.

Downgrade: every such row gets its context back, read from the journal.
"""

from __future__ import annotations

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass  # see the docstring: the new rows need no new schema


def downgrade() -> None:
    from flowloop.store.journaled import restore_row_contexts

    restore_row_contexts(op.get_bind())
