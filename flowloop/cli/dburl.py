"""A PostgreSQL URL's query settings (``?sslmode=require&connect_timeout=5``) checked
before anything connects: a misspelt one (``?sslmod=require``) failed when connecting with
the driver's words (``invalid connection option "sslmod"``), exit 1 as if the server were
down. Refused here as the mistake it is (exit 2), naming the setting meant, as a bad
``sslmode`` value is (flowloop/store/dialect.py)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Final

from flowloop.errors import WrongDatabase

POSTGRES_SCHEMES: Final = ("postgresql", "postgres")


def known_settings() -> Collection[str] | None:
    """The settings a PostgreSQL URL's query may give: libpq's connection keywords (as
    the installed libpq knows them) and psycopg's own ``connect`` arguments; ``None``
    without psycopg (the store says what to install)."""
    import inspect

    try:
        import psycopg
        from psycopg import pq
    except ImportError:
        return None
    keywords = {option.keyword.decode() for option in pq.Conninfo.get_defaults()}
    own = inspect.signature(psycopg.Connection.connect).parameters
    return keywords | {name for name, p in own.items() if p.kind is p.KEYWORD_ONLY}


def check_url_settings(url: str) -> None:
    """Refuse (WrongDatabase, exit 2) a PostgreSQL ``url`` whose query names a setting
    that neither libpq nor psycopg takes, with the close one (``'sslmod' in the database
    URL is no PostgreSQL connection setting; did you mean 'sslmode'?``). Any other URL,
    and one without a query, is left as it is."""
    scheme = url.partition("://")[0].partition("+")[0].lower()
    if scheme not in POSTGRES_SCHEMES or "?" not in url:
        return  # (no import for a SQLite file: `flowloop status` starts fast, issue 13)
    from urllib.parse import parse_qsl, urlsplit

    given = [name for name, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)]
    if not given:
        return
    known = known_settings()
    if known is None:
        return
    for name in given:
        if name not in known:
            from flowloop.suggest import did_you_mean

            meant = did_you_mean(name, sorted(known), n=1, shown=repr)
            raise WrongDatabase(
                f"{name!r} in the database URL is no PostgreSQL connection setting"
                + (f"; {meant}" if meant else " (see libpq's connection parameters)")
            )
