"""journal-first writes: the journal clustered on (run_id, seq), no time index on it

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01 12:20:00.000000

Upgrade: a database written by the previous layout has a fresh run row for every run (each
boundary rewrote it) and whole contexts in every journal entry; both are valid in the new
layout as they are, so live runs stay resumable with no data change. Only the journal's
storage (SQLite: WITHOUT ROWID, clustered on its key) and the indexes change: the
journal's (kind, at) goes, the runs get one on updated_at (time windows, prune), and
the runs' parent, join and owner indexes leave NULLs out.

Downgrade: the previous layout needs every run row to equal the fold of its journal and
every journal context whole: a running run's row is brought up to its latest entry and
spliced contexts are written out whole, before the old index comes back.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


PARTIAL = {
    "ix_flowloop_runs_parent": ["parent_id"],
    "ix_flowloop_runs_join": ["join_id", "child_index"],
    "ix_flowloop_runs_owner": ["owner"],
}
"""Indexes of the runs that become partial (most runs have no parent, join or owner)."""


def _recreate_journal(with_rowid: bool) -> None:
    """SQLite: copy the journal into a table with or without a rowid (PostgreSQL: nothing)."""
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table(
        "flowloop_journal",
        recreate="always",
        table_kwargs={"sqlite_with_rowid": with_rowid},
    ):
        pass


def upgrade() -> None:
    with op.batch_alter_table("flowloop_journal", schema=None) as batch_op:
        batch_op.drop_index("ix_flowloop_journal_kind_at")
    _recreate_journal(with_rowid=False)
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.create_index("ix_flowloop_runs_updated", ["updated_at"], unique=False)
        for name, columns in PARTIAL.items():
            batch_op.drop_index(name)
            where = sa.text(f"{columns[0]} IS NOT NULL")
            batch_op.create_index(
                name, columns, unique=False, sqlite_where=where, postgresql_where=where
            )


def downgrade() -> None:
    from flowloop.store.relayout import materialize_previous_layout

    materialize_previous_layout(op.get_bind())
    with op.batch_alter_table("flowloop_runs", schema=None) as batch_op:
        batch_op.drop_index("ix_flowloop_runs_updated")
        for name, columns in PARTIAL.items():
            batch_op.drop_index(name)
            batch_op.create_index(name, columns, unique=False)
    _recreate_journal(with_rowid=True)
    with op.batch_alter_table("flowloop_journal", schema=None) as batch_op:
        batch_op.create_index("ix_flowloop_journal_kind_at", ["kind", "at"], unique=False)
