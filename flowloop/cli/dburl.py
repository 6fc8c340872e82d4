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
CHOICES: Final = {
    "channel_binding": ("disable", "prefer", "require"),
    "gssencmode": ("disable", "prefer", "require"),
    "load_balance_hosts": ("disable", "random"),
    "sslcertmode": ("disable", "allow", "require"),
    "sslnegotiation": ("postgres", "direct"),
    "target_session_attrs": (
        "any",
        "read-write",
        "read-only",
        "primary",
        "standby",
        "prefer-standby",
    ),
}
"""libpq's settings that take one of some words (``sslmode``: the store's own check). A
value it does not know failed when connecting, "the database server is unreachable": a
worker waited for the database for ever."""
WHOLE_NUMBERS: Final = (
    "keepalives",
    "keepalives_count",
    "keepalives_idle",
    "keepalives_interval",
    "tcp_user_timeout",
)
"""libpq's settings that take a whole number (``keepalives_idle=abc`` waited for ever too;
``connect_timeout`` is psycopg's to read, which takes ``5.5`` and refuses ``abc`` at once)."""
MANY: Final = frozenset({"host"})
"""Settings a URL may give more than once: SQLAlchemy makes ``?host=A:5432&host=B:5432``
one multi-host connection."""


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
    URL is no PostgreSQL connection setting; did you mean 'sslmode'?``), a setting given
    twice, or a value libpq would refuse only when connecting (:data:`CHOICES`,
    :data:`WHOLE_NUMBERS`). Any other URL, and one without a query, is left as it is."""
    scheme = url.partition("://")[0].partition("+")[0].lower()
    if scheme not in POSTGRES_SCHEMES or "?" not in url:
        return  # (no import for a SQLite file: `flowloop status` starts fast, issue 13)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)  # (its query is what the driver gets: blanks dropped, a
    except ArgumentError:  # password with a "?" read as SQLAlchemy reads it)
        return  # (not a URL SQLAlchemy reads: the store says so)
    given = [
        (name, value)
        for name, values in parsed.query.items()
        for value in ((values,) if isinstance(values, str) else values)
    ]
    known = known_settings() if given else None
    if known is None:
        return
    import re

    from flowloop.store.dialect import _check_sslmode
    from flowloop.suggest import did_you_mean

    for name, _ in given:
        if name not in known:
            meant = did_you_mean(name, sorted(known), n=1, shown=repr)
            raise WrongDatabase(
                f"{name!r} in the database URL is no PostgreSQL connection setting"
                + (f"; {meant}" if meant else " (see libpq's connection parameters)")
            )
    _check_sslmode(parsed)  # (the store's own words for an sslmode, each one given)
    for name, value in given:
        choices = CHOICES.get(name)
        if choices is not None and value not in choices:
            meant = did_you_mean(value, choices, n=1, shown=repr)
            raise WrongDatabase(
                f"{name}={value!r} in the database URL is not one of its values"
                + (f"; {meant}" if meant else f" (use one of {', '.join(choices)})")
            )
        if name in WHOLE_NUMBERS and not re.fullmatch(r"\s*[+-]?\d+\s*", value):
            raise WrongDatabase(f"{name}={value!r} in the database URL is not a whole number")
    names = [name for name, _ in given]
    twice = next((n for n in names if n not in MANY and names.count(n) > 1), None)
    if twice is not None:  # (libpq was given the list's text: "invalid … value", a wait)
        raise WrongDatabase(f"{twice} is given twice in the database URL; give it once")
