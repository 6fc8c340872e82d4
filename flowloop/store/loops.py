"""Loop rows and their iteration journal (SQL shared by SQLite and PostgreSQL).

Contract: a loop row is written only by (a) the worker that fired its current slot — fenced
by owner, lease epoch and ``last_seq`` like a run — or (b) an operator while no live worker
owns it. Firing a slot inserts its ``iteration_started`` entry under a unique (loop, slot)
index, so two workers sharing a database can never run the same slot twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Connection,
    Integer,
    Text,
    and_,
    cast,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from flowloop.store.schema import loop_journal, loops, meta

CHANGES_KEY: Final = "loops_changed"
"""A counter in flowloop_meta bumped by every operator change of a loop, so an idle worker
notices pause/unpause/stop with one tiny query instead of re-reading every loop."""


@dataclass(frozen=True, kw_only=True)
class LoopRow:
    name: str
    schedule: str
    status: str
    next_fire_at: float | None
    last_slot: float | None
    last_started_at: float | None
    last_ended_at: float | None
    last_result: str | None
    last_error: str | None
    iterations: int
    consecutive_failures: int
    skipped: int
    missed: int
    reason: str | None
    owner: str | None
    lease_expires_at: float | None
    lease_epoch: int
    control: str | None
    last_seq: int
    updated_at: float


@dataclass(frozen=True, kw_only=True)
class LoopEvent:
    loop: str
    kind: str
    at: float
    slot: float | None = None
    attempt: int = 0
    count: int = 0
    duration: float | None = None
    error_type: str | None = None
    error_message: str | None = None
    worker: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)
    seq: int = 0


def _row(row: Any) -> LoopRow:
    return LoopRow(**{column.name: getattr(row, column.name) for column in loops.columns})


def _event_from(row: Any) -> LoopEvent:
    return LoopEvent(
        loop=row.loop, seq=row.seq, kind=row.kind, at=row.at, slot=row.slot,
        attempt=row.attempt, count=row.count, duration=row.duration,
        error_type=row.error_type, error_message=row.error_message, worker=row.worker,
        data=json.loads(row.data) if row.data else {},
    )


def _event_rows(events: Sequence[LoopEvent], first_seq: int) -> list[dict[str, Any]]:
    return [
        {
            "loop": e.loop, "seq": first_seq + i, "kind": e.kind, "at": e.at, "slot": e.slot,
            "attempt": e.attempt, "count": e.count, "duration": e.duration,
            "error_type": e.error_type, "error_message": e.error_message, "worker": e.worker,
            "data": json.dumps(dict(e.data), sort_keys=True) if e.data else None,
        }
        for i, e in enumerate(events)
    ]


class LoopStoreMixin:
    """Loop persistence for :class:`~flowloop.store.sql.SQLStore`."""

    now_sql: ColumnElement[float]

    def _write(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _read(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _bump_changes(self, conn: Connection) -> None:
        updated = conn.execute(
            update(meta)
            .where(meta.c.key == CHANGES_KEY)
            .values(value=cast(cast(meta.c.value, Integer) + 1, Text))
        )
        if updated.rowcount == 0:
            conn.execute(insert(meta).values(key=CHANGES_KEY, value="1"))

    def loop_changes(self) -> int:
        with self._read() as conn:
            value = conn.execute(
                select(meta.c.value).where(meta.c.key == CHANGES_KEY)
            ).scalar_one_or_none()
        return int(value or 0)

    def sync_loop(
        self, *, name: str, schedule: str, first_slot: float, at: float, worker: str
    ) -> LoopRow:
        """Create the loop row if new; a changed schedule restarts it at ``first_slot``."""
        with self._write() as conn:
            row = conn.execute(select(loops).where(loops.c.name == name)).first()
            if row is None:
                conn.execute(
                    insert(loops).values(
                        name=name, schedule=schedule, status="scheduled",
                        next_fire_at=first_slot, iterations=0, consecutive_failures=0,
                        skipped=0, missed=0, lease_epoch=0, last_seq=1, updated_at=at,
                    )
                )
                conn.execute(insert(loop_journal), _event_rows(
                    [LoopEvent(loop=name, kind="loop_created", at=at, slot=first_slot,
                               worker=worker, data={"schedule": schedule})], 1))
            elif row.schedule != schedule:
                conn.execute(
                    update(loops).where(loops.c.name == name).values(
                        schedule=schedule, last_seq=row.last_seq + 1, updated_at=at,
                        next_fire_at=first_slot if row.status == "scheduled" else row.next_fire_at,
                    )
                )
                conn.execute(insert(loop_journal), _event_rows(
                    [LoopEvent(loop=name, kind="loop_rescheduled", at=at, slot=first_slot,
                               worker=worker, data={"schedule": schedule, "was": row.schedule})],
                    row.last_seq + 1))
            fresh = conn.execute(select(loops).where(loops.c.name == name)).one()
        return _row(fresh)

    def get_loop(self, name: str) -> LoopRow | None:
        with self._read() as conn:
            row = conn.execute(select(loops).where(loops.c.name == name)).first()
        return None if row is None else _row(row)

    def list_loops(self, names: Sequence[str] | None = None) -> list[LoopRow]:
        query = select(loops).order_by(loops.c.name)
        if names is not None:
            query = query.where(loops.c.name.in_(list(names)))
        with self._read() as conn:
            return [_row(row) for row in conn.execute(query)]

    def loop_journal(self, name: str, *, limit: int = 1000) -> list[LoopEvent]:
        with self._read() as conn:
            rows = conn.execute(
                select(loop_journal).where(loop_journal.c.loop == name)
                .order_by(loop_journal.c.seq.desc()).limit(limit)
            )
            return [_event_from(row) for row in reversed(list(rows))]

    def _claimable(self) -> ColumnElement[bool]:
        return or_(loops.c.owner.is_(None), loops.c.lease_expires_at < self.now_sql)

    def fire_loop(
        self, *, name: str, follows_seq: int, worker: str, lease_seconds: float,
        events: Sequence[LoopEvent], changes: Mapping[str, Any],
    ) -> LoopRow | None:
        """Fire the due slot of a scheduled loop read at ``follows_seq``: status running,
        owned by ``worker``, ``events`` (ending with ``iteration_started``) journaled.
        ``None`` if it is not this worker's to fire (another worker fired that slot, or the
        loop changed since it was read)."""
        try:
            with self._write() as conn:
                row = conn.execute(
                    update(loops)
                    .where(
                        loops.c.name == name, loops.c.status == "scheduled",
                        loops.c.last_seq == follows_seq, self._claimable(),
                    )
                    .values(
                        status="running", owner=worker, lease_epoch=loops.c.lease_epoch + 1,
                        lease_expires_at=self.now_sql + lease_seconds,
                        last_seq=loops.c.last_seq + len(events), **changes,
                    )
                    .returning(*loops.c)
                ).first()
                if row is None:
                    return None
                conn.execute(insert(loop_journal), _event_rows(events, row.last_seq - len(events) + 1))
        except IntegrityError:
            return None  # that slot already started elsewhere: the transaction rolled back
        return _row(row)

    def write_loop(
        self, *, name: str, owner: str | None, epoch: int, follows_seq: int,
        changes: Mapping[str, Any], events: Sequence[LoopEvent], release: bool = True,
    ) -> bool:
        """A fenced update of a loop row plus its journal entries. ``owner=None``: an
        operator write that applies only while no live worker owns the loop."""
        fence = and_(
            loops.c.name == name, loops.c.lease_epoch == epoch, loops.c.last_seq == follows_seq
        )
        owned = loops.c.owner == owner if owner is not None else self._claimable()
        values: dict[str, Any] = {**changes, "last_seq": follows_seq + len(events)}
        if release:
            values.update(owner=None, lease_expires_at=None)
        with self._write() as conn:
            result = conn.execute(update(loops).where(fence, owned).values(**values))
            if result.rowcount != 1:
                return False
            if events:
                conn.execute(insert(loop_journal), _event_rows(events, follows_seq + 1))
            if owner is None:
                self._bump_changes(conn)
        return True

    def renew_loops(self, *, worker: str, names: Sequence[str], lease_seconds: float) -> set[str]:
        if not names:
            return set()
        with self._write() as conn:
            rows = conn.execute(
                update(loops)
                .where(loops.c.owner == worker, loops.c.name.in_(list(names)),
                       loops.c.lease_expires_at >= self.now_sql)
                .values(lease_expires_at=self.now_sql + lease_seconds)
                .returning(loops.c.name)
            )
            return {row.name for row in rows}

    def request_loop_control(self, name: str, action: str | None) -> bool:
        with self._write() as conn:
            result = conn.execute(update(loops).where(loops.c.name == name).values(control=action))
            self._bump_changes(conn)
            return bool(result.rowcount == 1)

    def interrupted_loops(self) -> list[LoopRow]:
        """Loops left ``running`` by a worker whose lease has expired."""
        with self._read() as conn:
            rows = conn.execute(
                select(loops).where(loops.c.status == "running", self._claimable())
            )
            return [_row(row) for row in rows]

    def expire_loop_leases(self, owners: Sequence[str]) -> None:
        if not owners:
            return
        with self._write() as conn:
            conn.execute(
                update(loops).where(loops.c.owner.in_(list(owners)))
                .values(lease_expires_at=self.now_sql - 1.0)
            )

    def iter_loop_names(self) -> Iterator[str]:
        with self._read() as conn:
            yield from (row.name for row in conn.execute(select(loops.c.name)))
