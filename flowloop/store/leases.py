"""Lease renewal and expiry, the same for run rows and loop rows.

Both tables carry ``owner`` and ``lease_expires_at``; lease times are computed by the
database's clock (``now_sql``), never by a worker's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Connection, Table, select, update


def renew(
    conn: Connection,
    table: Table,
    key: Any,
    *,
    now_sql: ColumnElement[float],
    worker: str,
    keys: Sequence[str],
    lease_seconds: float,
) -> set[str]:
    """Extend ``worker``'s unexpired leases on the rows whose ``key`` is in ``keys``;
    returns the keys it still holds (an expired lease is not revived: self-fencing)."""
    rows = conn.execute(
        update(table)
        .where(
            table.c.owner == worker,
            key.in_(list(keys)),
            table.c.lease_expires_at >= now_sql,
        )
        .values(lease_expires_at=now_sql + lease_seconds)
        .returning(key)
    )
    return {row[0] for row in rows}


def renew_skip_locked(
    conn: Connection,
    table: Table,
    key: Any,
    *,
    now_sql: ColumnElement[float],
    worker: str,
    keys: Sequence[str],
    lease_seconds: float,
) -> tuple[set[str], set[str]]:
    """:func:`renew` without ever waiting for a row lock (PostgreSQL): the rows are locked
    in ``key`` order, skipping those another transaction holds — the store's group commit
    updates run rows in its own order, and two writers waiting on each other deadlock.

    Returns the keys renewed, and the keys *unknown*: skipped while their last committed
    version was still ``worker``'s unexpired lease (being written right now, by this
    worker's loop as a rule): neither renewed nor lost. Any other key is lost."""
    wanted = list(keys)
    held = (table.c.owner == worker, key.in_(wanted), table.c.lease_expires_at >= now_sql)
    lockable = select(key).where(*held).order_by(key).with_for_update(skip_locked=True)
    rows = conn.execute(
        update(table)
        .where(key.in_(lockable.scalar_subquery()))
        .values(lease_expires_at=now_sql + lease_seconds)
        .returning(key)
    )
    kept = {row[0] for row in rows}
    missing = [k for k in wanted if k not in kept]
    if not missing:
        return kept, set()
    # A plain read never waits for a lock: it sees the last committed version of a row.
    still = conn.execute(
        select(key).where(
            table.c.owner == worker, key.in_(missing), table.c.lease_expires_at >= now_sql
        )
    )
    return kept, {row[0] for row in still}


def expire(
    conn: Connection, table: Table, *, now_sql: ColumnElement[float], owners: Sequence[str]
) -> int:
    """End the leases of ``owners`` now (they are known dead); returns rows changed."""
    result = conn.execute(
        update(table).where(table.c.owner.in_(list(owners))).values(lease_expires_at=now_sql - 1.0)
    )
    return int(result.rowcount)
