"""Idempotent writes to any SQLAlchemy target: upsert on a key, the kit's bookkeeping tables
(rejects, loaded files), a table derived from a row model, and one engine per target URL.

Running a write twice leaves the target as running it once: rows are upserted on the table's
primary key — a natural key (``order_id``) or, for data without one, the source position
(:func:`source_columns`: the file name and the line a record starts on; the file's sha256
tells which version of the file a row came from).
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import types
import typing
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any, Final

import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.dialects import mysql, postgresql, sqlite

from flowloop.errors import FlowloopError
from flowloop.store.dialect import create_engine_for

SOURCE_FILE: Final = "source_file"
SOURCE_ROW: Final = "source_row"
SOURCE_SHA256: Final = "source_sha256"
LINEAGE: Final = (SOURCE_FILE, SOURCE_ROW, SOURCE_SHA256)
"""Columns the loader fills in where a table has them: where each row came from."""

_engines: dict[str, tuple[int, sa.Engine]] = {}
_engines_lock = threading.Lock()


def target_engine(url: str, metadata: sa.MetaData) -> sa.Engine:
    """One engine per target URL and process (steps run in threads; a forked child must not
    share its parent's connections), ``metadata``'s tables created on first use."""
    with _engines_lock:
        cached = _engines.get(url)
        if cached is not None and cached[0] == os.getpid():
            return cached[1]
        if cached is not None:
            cached[1].dispose(close=False)
        backend = sa.make_url(url).get_backend_name()
        if backend == "postgresql":
            # flowloop's own PostgreSQL sessions: libpq timeouts and keepalives, and the
            # server ends a session left idle in a transaction. A client lost mid-batch (a
            # partition) held the batch's row locks, and the retried batch waited for good.
            engine = create_engine_for(url)
        else:
            # A loop worker holds its pool for days: check server connections before use.
            engine = sa.create_engine(
                url,
                connect_args={"timeout": 30} if backend == "sqlite" else {},
                pool_pre_ping=backend != "sqlite",
            )
        if backend == "sqlite":
            sa.event.listen(engine, "connect", _sqlite_pragmas)
        metadata.create_all(engine)
        _engines[url] = (os.getpid(), engine)
        return engine


def close_engine(url: str) -> None:
    """Dispose of the cached engine of ``url`` (benchmarks and tests between targets)."""
    with _engines_lock:
        cached = _engines.pop(url, None)
    if cached is not None:
        cached[1].dispose()


def _sqlite_pragmas(dbapi: Any, _record: Any) -> None:
    # WAL + NORMAL: a committed batch survives the process being killed.
    cursor = dbapi.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def upsert(conn: sa.Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``rows`` or overwrite the rows with the same primary key: running it twice
    leaves the table as running it once."""
    keys = [column.name for column in table.primary_key.columns]
    # One row per key (the last wins, as it would row by row): PostgreSQL refuses to update
    # one row twice in a statement.
    unique = list({tuple(row[k] for k in keys): row for row in rows}.values())
    if not unique:
        return
    others = [c.name for c in table.columns if c.name not in keys]
    dialect = conn.dialect.name
    if dialect in ("sqlite", "postgresql"):
        insert = sqlite.insert(table) if dialect == "sqlite" else postgresql.insert(table)
        conn.execute(
            insert.on_conflict_do_update(
                index_elements=keys, set_={name: insert.excluded[name] for name in others}
            )
            if others
            else insert.on_conflict_do_nothing(index_elements=keys),
            unique,
        )
    elif dialect in ("mysql", "mariadb"):
        my_insert = mysql.insert(table)
        conn.execute(
            my_insert.on_duplicate_key_update(
                {name: my_insert.inserted[name] for name in others or keys}
            ),
            unique,
        )
    else:  # any other database: delete the keys, then insert, in the caller's transaction
        where = sa.and_(*(table.c[k] == sa.bindparam(f"key_{k}") for k in keys))
        old = [{f"key_{k}": row[k] for k in keys} for row in unique]
        conn.execute(table.delete().where(where), old)
        conn.execute(table.insert(), unique)


def rejects_table(metadata: sa.MetaData, name: str = "rejects") -> sa.Table:
    """Rejected records (and files: ``row_no`` 0), keyed by file and row."""
    if name in metadata.tables:
        return metadata.tables[name]
    return sa.Table(
        name,
        metadata,
        sa.Column("file", sa.String(255), primary_key=True),
        sa.Column("row_no", sa.Integer, primary_key=True),  # the record's first line; 0: file
        sa.Column("reason", sa.Text, nullable=False),
        sa.Column("raw", sa.Text),
        sa.Column("file_sha256", sa.String(64), nullable=False),
    )


def loaded_files_table(metadata: sa.MetaData, name: str = "loaded_files") -> sa.Table:
    """Files loaded (or rejected as a whole), by name and sha256: no run takes them again."""
    if name in metadata.tables:
        return metadata.tables[name]
    return sa.Table(
        name,
        metadata,
        sa.Column("file", sa.String(255), primary_key=True),
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("mtime_ns", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),  # loaded | rejected
        sa.Column("rows_loaded", sa.Integer, nullable=False),
        sa.Column("rows_rejected", sa.Integer, nullable=False),
        sa.Column("loaded_at", sa.String(32), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
    )


def source_columns() -> list[sa.Column[Any]]:
    """The source-position key for a table whose data has no natural key: file name and
    record line (the primary key), and the file's sha256."""
    return [
        sa.Column(SOURCE_FILE, sa.String(255), primary_key=True),
        sa.Column(SOURCE_ROW, sa.Integer, primary_key=True),
        sa.Column(SOURCE_SHA256, sa.String(64), nullable=False),
    ]


_TYPES: Final[tuple[tuple[type, Any], ...]] = (
    (bool, sa.Boolean),  # before int: bool is an int
    (int, sa.BigInteger),
    (float, sa.Float),
    (Decimal, sa.Numeric(38, 10)),
    (dt.datetime, sa.DateTime(timezone=True)),  # before date: a datetime is a date
    (dt.date, sa.Date),
    (dt.time, sa.Time),
    (str, sa.Text),
)


def table_from_model(
    name: str,
    metadata: sa.MetaData,
    model: type[BaseModel],
    *,
    key: str | Sequence[str] | None,
) -> sa.Table:
    """A target table with one column per field of ``model`` (``x: float | None`` is a
    nullable float column) and the lineage columns (:func:`source_columns`); its primary key
    is ``key``, or the source position (file, line) when ``key`` is None."""
    keys = [key] if isinstance(key, str) else list(key or [])
    unknown = [k for k in keys if k not in model.model_fields]
    if unknown:
        raise FlowloopError(
            f"key {', '.join(unknown)} is not a field of {model.__name__} "
            f"(fields: {', '.join(model.model_fields)}); name a field, or key=None"
        )
    columns: list[sa.Column[Any]] = []
    for field_name, info in model.model_fields.items():
        python, optional = _unwrap(info.annotation)
        sql_type = next(
            (t for p, t in _TYPES if isinstance(python, type) and issubclass(python, p)), None
        )
        if sql_type is None:
            raise FlowloopError(
                f"{model.__name__}.{field_name}: no column type for {python!r}; "
                f"define the table yourself (sa.Table) and pass it as table="
            )
        columns.append(
            sa.Column(field_name, sql_type, primary_key=field_name in keys, nullable=optional)
        )
    lineage = source_columns()
    for column in lineage if keys else ():  # lineage, but not the key
        column.primary_key = False
    return sa.Table(name, metadata, *columns, *lineage)


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """``float | None`` → ``(float, True)``; ``Annotated[str, …]`` → ``(str, False)``."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        inner, _ = _unwrap(args[0]) if len(args) == 1 else (None, True)
        return inner, True
    return annotation, False
