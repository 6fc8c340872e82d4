"""Database URLs without SQLAlchemy: the default database, bare paths as SQLite URLs, and
the plain SQLite files that the reading commands open through the stdlib driver
(flowloop/store/lite.py; issue 13, cold start). Anything else is SQLAlchemy's to parse."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

DEFAULT_URL: Final = "sqlite:///flowloop.db"
ENV_DB: Final = "FLOWLOOP_DB"
PLAIN_SQLITE: Final = "sqlite:///"
NOT_PLAIN: Final = frozenset("?#%")
"""Characters after which a URL needs SQLAlchemy's parsing (a query, an escape)."""


def sqlite_url(path: str | os.PathLike[str]) -> str:
    return f"sqlite:///{Path(path)}"


def normalize_url(url: str) -> str:
    """Accept a bare file path as a SQLite database."""
    if "://" not in url:
        return sqlite_url(url)
    return url


def default_url() -> str:
    """``$FLOWLOOP_DB`` or ``./flowloop.db``."""
    return normalize_url(os.environ.get(ENV_DB) or DEFAULT_URL)


def plain_sqlite_file(url: str) -> Path | None:
    """The file of a plain SQLite URL (``sqlite:///path``, or a bare path): no driver
    named, no query, no escapes, not in memory, not a ``file:`` URI. ``None`` for any
    other URL: those are opened as before, through SQLAlchemy."""
    url = normalize_url(url)
    if not url.startswith(PLAIN_SQLITE):
        return None
    database = url[len(PLAIN_SQLITE) :]
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    if NOT_PLAIN & set(database):
        return None
    return Path(database)
