"""Alembic environment: flowloop passes its own connection (see flowloop.store.migrate)."""

from __future__ import annotations

from alembic import context

from flowloop.store.schema import metadata

config = context.config
connection = config.attributes.get("connection")
if connection is None:  # pragma: no cover - flowloop always passes its connection
    raise RuntimeError("run migrations with `flowloop db upgrade`")

context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table="flowloop_alembic_version",
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
