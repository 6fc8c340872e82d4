"""Schema versions through Alembic: create a new database, refuse a mismatched one, upgrade.

The revision lives in ``flowloop_alembic_version`` (not ``alembic_version``, so a database
shared with an application's own Alembic history is not confused).

Alembic (and Mako with it) is imported only to change the schema or to explain a mismatch:
opening a database at :data:`HEAD` (every ``flowloop status``) reads the version table with
one plain ``SELECT`` (issue 13, cold start).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Final

from sqlalchemy import Connection, text

from flowloop.errors import SchemaMismatch, StoreError
from flowloop.store.base import SCHEMA_HEAD
from flowloop.store.base import VERSION_TABLE as VERSION_TABLE

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

MIGRATIONS: Final = Path(__file__).with_name("migrations")
HEAD: Final = SCHEMA_HEAD
"""The newest revision in migrations/versions (kept in flowloop/store/base.py)."""


def _config(connection: Connection | None = None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@cache
def _script() -> ScriptDirectory:
    from alembic.script import ScriptDirectory

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
    from alembic.runtime.migration import MigrationContext

    context = MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE})
    return context.get_current_revision()


def upgrade(connection: Connection, url: str = "the database") -> tuple[str | None, str]:
    """Bring the schema to :func:`head`; returns (from, to).

    Raises SchemaMismatch when the database is newer than this code, StoreError when
    Alembic cannot apply a revision (one line, the cause kept as ``__cause__``)."""
    from alembic import command
    from alembic.util import CommandError

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
    from alembic import command

    before = current(connection)
    script = _script()
    ahead = before is not None and revision in {
        r.revision for r in script.iterate_revisions(before, "base")
    }
    if ahead and revision != before:
        command.downgrade(_config(connection), revision)
    else:
        command.upgrade(_config(connection), revision)


def at_head(connection: Connection) -> bool:
    """Whether the version table (which must exist) holds exactly one row, :data:`HEAD`: what
    Alembic would read, in one plain ``SELECT``."""
    rows = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
    return len(rows) == 1 and rows[0][0] == HEAD


def check(connection: Connection, url: str) -> None:
    """Raise SchemaMismatch unless the database is at :func:`head`. A database at
    :data:`HEAD` is told without Alembic; any other is judged by Alembic as before."""
    if at_head(connection):
        return
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
    from alembic import command

    command.revision(_config(connection), message=message, autogenerate=True)
