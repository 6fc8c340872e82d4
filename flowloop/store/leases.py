"""Lease renewal and expiry, the same for run rows and loop rows.

Both tables carry ``owner`` and ``lease_expires_at``; lease times are computed by the
database's clock (``now_sql``), never by a worker's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Connection, Table, update


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


def expire(
    conn: Connection, table: Table, *, now_sql: ColumnElement[float], owners: Sequence[str]
) -> int:
    """End the leases of ``owners`` now (they are known dead); returns rows changed."""
    result = conn.execute(
        update(table).where(table.c.owner.in_(list(owners))).values(lease_expires_at=now_sql - 1.0)
    )
    return int(result.rowcount)
