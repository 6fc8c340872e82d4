"""Schema versions through Alembic: create a new database, refuse a mismatched one, upgrade.

The revision lives in ``flowloop_alembic_version`` (not ``alembic_version``, so a database
shared with an application's own Alembic history is not confused).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import Connection

from flowloop.errors import SchemaMismatch, StoreError

VERSION_TABLE: Final = "flowloop_alembic_version"
MIGRATIONS: Final = Path(__file__).with_name("migrations")


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@cache
def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def head() -> str:
    """The schema revision this code expects."""
    revision = _script().get_current_head()
    assert revision is not None
    return revision


def known(revision: str) -> bool:
    try:
        return _script().get_revision(revision) is not None
    except Exception:
        return False


def current(connection: Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def upgrade(connection: Connection, url: str = "the database") -> tuple[str | None, str]:
    """Bring the schema to :func:`head`; returns (from, to).

    Raises SchemaMismatch when the database is newer than this code, StoreError when
    Alembic cannot apply a revision (one line, the cause kept as ``__cause__``)."""
    before = current(connection)
    if before is not None and not known(before):
        raise SchemaMismatch(
            f"{url}: schema revision {before} is newer than this flowloop ({head()}); "
            "upgrade flowloop instead"
        )
    try:
        command.upgrade(_config(connection), "head")
    except CommandError as error:
        raise StoreError(f"{url}: cannot upgrade the schema: {error}") from error
    return before, head()


def to_revision(connection: Connection, revision: str) -> None:
    """Upgrade or downgrade the schema to ``revision`` (tests, and going back a release)."""
    before = current(connection)
    script = _script()
    ahead = before is not None and revision in {
        r.revision for r in script.iterate_revisions(before, "base")
    }
    if ahead and revision != before:
        command.downgrade(_config(connection), revision)
    else:
        command.upgrade(_config(connection), revision)


def check(connection: Connection, url: str) -> None:
    """Raise SchemaMismatch unless the database is at :func:`head`."""
    revision = current(connection)
    if revision == head():
        return
    if revision is None or known(revision):
        raise SchemaMismatch(
            f"{url}: schema revision {revision or 'none'} is older than this flowloop "
            f"({head()}); run `flowloop db upgrade`"
        )
    raise SchemaMismatch(
        f"{url}: schema revision {revision} is newer than this flowloop ({head()}); "
        "upgrade flowloop"
    )


def new_revision(message: str, connection: Connection) -> None:
    """Autogenerate a migration for schema.py changes (``flowloop db revision``), comparing
    with ``connection``'s database, which must be at :func:`head`."""
    command.revision(_config(connection), message=message, autogenerate=True)
