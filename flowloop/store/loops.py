"""Loop rows and their iteration journal (SQL shared by SQLite and PostgreSQL).

Contract: a loop row is written only by (a) the worker that fired its current slot — fenced
by owner, lease epoch, ``last_seq`` and an unexpired lease (the database's clock) like a
run — or (b) an operator while no live worker
owns it. Firing a slot inserts its ``iteration_started`` entry under a unique (loop, slot)
index, so two workers sharing a database can never run the same slot twice.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
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

from flowloop.journal import load_data
from flowloop.loop_requests import REQUEST_KEY_PREFIX
from flowloop.store import leases
from flowloop.store.schema import loop_journal, loops, meta

CHANGES_KEY: Final = "loops_changed"
"""A counter in flowloop_meta bumped by every operator change of a loop, so an idle worker
notices pause/unpause/stop with one tiny query instead of re-reading every loop."""
SYNC_BATCH: Final = 500
"""Loops registered per transaction (also bounds the size of an ``IN (...)`` list)."""
SYNC_TRIES: Final = 3
"""Tries of one batch that lost a race to register a new loop with another worker."""


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


_CHANGES_QUERY: Final = select(meta.c.value).where(meta.c.key == CHANGES_KEY)


class Unfenced(enum.Enum):
    """The type of :data:`ANY_CONTROL`."""

    ANY = "any"


ANY_CONTROL: Final = Unfenced.ANY
"""``write_loop(control=...)``: the write is not fenced on the loop's request."""


@dataclass(frozen=True, kw_only=True)
class LoopSpec:
    """What a worker registers for one loop."""

    name: str
    schedule: str
    first_slot: float
    keep_due: bool = True
    """A schedule change keeps a pending slot already due (handled as after downtime): not
    as it is for a loop that does not coalesce, which would catch up one by one the slots
    the new schedule has between it and now — slots no schedule ever had while the workers
    were down (an every=1 loop, down 59 minutes: some 3,500 iterations). Its slot is moved
    to ``latest_slot`` instead, if that is later: one iteration."""
    latest_slot: float | None = None
    """The new schedule's last slot at or before the change (``keep_due=False``; None:
    ``first_slot``, the slot due dropped)."""


def _request_key(name: str) -> str:
    """The ``flowloop_meta`` key of the loop's pending backfill range (a key holds 64)."""
    return f"{REQUEST_KEY_PREFIX}{name}"[:64]


def _row(row: Any) -> LoopRow:
    return LoopRow(**{column.name: getattr(row, column.name) for column in loops.columns})


def _event_from(row: Any) -> LoopEvent:
    return LoopEvent(
        loop=row.loop,
        seq=row.seq,
        kind=row.kind,
        at=row.at,
        slot=row.slot,
        attempt=row.attempt,
        count=row.count,
        duration=row.duration,
        error_type=row.error_type,
        error_message=row.error_message,
        worker=row.worker,
        data=load_data(row.data),
    )


def _event_rows(events: Sequence[LoopEvent], first_seq: int) -> list[dict[str, Any]]:
    return [
        {
            "loop": e.loop,
            "seq": first_seq + i,
            "kind": e.kind,
            "at": e.at,
            "slot": e.slot,
            "attempt": e.attempt,
            "count": e.count,
            "duration": e.duration,
            "error_type": e.error_type,
            "error_message": e.error_message,
            "worker": e.worker,
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
        """The operator-change counter: what an idle worker polls (keep it this cheap)."""
        with self._read() as conn:
            value = conn.execute(_CHANGES_QUERY).scalar_one_or_none()
        return int(value or 0)

    def sync_loop(
        self, *, name: str, schedule: str, first_slot: float, at: float, worker: str
    ) -> LoopRow:
        """Create the loop row if new; a changed schedule restarts it at ``first_slot``
        (see :meth:`_reschedule`: not under a running iteration, nor past a due slot)."""
        spec = LoopSpec(name=name, schedule=schedule, first_slot=first_slot)
        [row] = self.sync_loops([spec], at=at, worker=worker)
        return row

    def sync_loops(self, specs: Sequence[LoopSpec], *, at: float, worker: str) -> list[LoopRow]:
        """:meth:`sync_loop` for many loops in one transaction per ``SYNC_BATCH`` (a worker
        with thousands of loops registers them in a fraction of a second)."""
        rows: list[LoopRow] = []
        for start in range(0, len(specs), SYNC_BATCH):
            batch = specs[start : start + SYNC_BATCH]
            for tries_left in reversed(range(SYNC_TRIES)):
                try:
                    rows.extend(self._sync_batch(batch, at=at, worker=worker))
                    break
                except IntegrityError:
                    # Another worker starting at the same moment registered one of these
                    # loops first (PostgreSQL: both read it missing): read them again.
                    if not tries_left:
                        raise
        return rows

    def _sync_batch(self, batch: Sequence[LoopSpec], *, at: float, worker: str) -> list[LoopRow]:
        names = [spec.name for spec in batch]
        with self._write() as conn:
            existing = {
                row.name: row for row in conn.execute(select(loops).where(loops.c.name.in_(names)))
            }
            new_rows, new_events = [], []
            for spec in batch:
                row = existing.get(spec.name)
                if row is None:
                    new_rows.append(
                        dict(
                            name=spec.name,
                            schedule=spec.schedule,
                            status="scheduled",
                            next_fire_at=spec.first_slot,
                            iterations=0,
                            consecutive_failures=0,
                            skipped=0,
                            missed=0,
                            lease_epoch=0,
                            last_seq=1,
                            updated_at=at,
                        )
                    )
                    new_events.extend(
                        _event_rows(
                            [
                                LoopEvent(
                                    loop=spec.name,
                                    kind="loop_created",
                                    at=at,
                                    slot=spec.first_slot,
                                    worker=worker,
                                    data={"schedule": spec.schedule},
                                )
                            ],
                            1,
                        )
                    )
                elif row.schedule != spec.schedule:
                    self._reschedule(conn, row, spec, at=at, worker=worker)
            if new_rows:
                conn.execute(insert(loops), new_rows)
                conn.execute(insert(loop_journal), new_events)
            fresh = conn.execute(select(loops).where(loops.c.name.in_(names)))
            by_name = {row.name: _row(row) for row in fresh}
        return [by_name[name] for name in names]

    def _reschedule(
        self, conn: Connection, row: Any, spec: LoopSpec, *, at: float, worker: str
    ) -> None:
        """Give the loop its new schedule, unless a live worker holds it (an iteration runs
        there): that worker's outcome write is fenced on ``last_seq``, which this write
        would move, so its iteration would end unrecorded and be journaled interrupted.
        Such a loop keeps its old schedule; the registering worker applies the new one
        once the iteration has ended (:meth:`Scheduler._schedule`).

        A scheduled loop's pending slot moves to ``first_slot`` — unless it was already
        due (downtime): kept, the loop's next wake handles it under the new schedule
        (coalesced, missed past the grace) as after any downtime, not dropped unjournaled;
        one that does not coalesce, moved to ``latest_slot`` if later (one iteration).
        A paused or stopped loop keeps its (no) next slot."""
        nxt = row.next_fire_at
        if row.status == "scheduled" and (nxt is None or nxt > at):
            nxt = spec.first_slot
        elif row.status == "scheduled" and not spec.keep_due:
            # Due, for a loop that does not coalesce: kept as one iteration, at the new
            # schedule's latest slot if later (before, dropped for the next slot to come).
            nxt = spec.first_slot if spec.latest_slot is None else max(nxt, spec.latest_slot)
        moved = conn.execute(
            update(loops)
            .where(
                loops.c.name == spec.name,
                loops.c.last_seq == row.last_seq,
                loops.c.status != "running",
                self._claimable(),
            )
            .values(
                schedule=spec.schedule,
                last_seq=row.last_seq + 1,
                updated_at=at,
                next_fire_at=nxt,
            )
        )
        if moved.rowcount != 1:
            return
        conn.execute(
            insert(loop_journal),
            _event_rows(
                [
                    LoopEvent(
                        loop=spec.name,
                        kind="loop_rescheduled",
                        at=at,
                        slot=nxt,
                        worker=worker,
                        data={"schedule": spec.schedule, "was": row.schedule},
                    )
                ],
                row.last_seq + 1,
            ),
        )

    def get_loop(self, name: str) -> LoopRow | None:
        with self._read() as conn:
            row = conn.execute(select(loops).where(loops.c.name == name)).first()
        return None if row is None else _row(row)

    def list_loops(self, names: Sequence[str] | None = None) -> list[LoopRow]:
        query = select(loops).order_by(loops.c.name)
        wanted = None if names is None else set(names)
        if wanted is not None and len(wanted) <= SYNC_BATCH:
            query = query.where(loops.c.name.in_(sorted(wanted)))
        with self._read() as conn:
            rows = [_row(row) for row in conn.execute(query)]
        # Many names: one scan filtered here rather than an IN list past SQLite's limits.
        return rows if wanted is None else [row for row in rows if row.name in wanted]

    def loop_journal(self, name: str, *, limit: int = 1000) -> list[LoopEvent]:
        with self._read() as conn:
            rows = conn.execute(
                select(loop_journal)
                .where(loop_journal.c.loop == name)
                .order_by(loop_journal.c.seq.desc())
                .limit(limit)
            )
            return [_event_from(row) for row in reversed(list(rows))]

    def _claimable(self) -> ColumnElement[bool]:
        return or_(loops.c.owner.is_(None), loops.c.lease_expires_at < self.now_sql)

    def _held_by(self, owner: str) -> ColumnElement[bool]:
        """``owner`` still holds the loop: the complement of :meth:`_claimable` for it."""
        return and_(loops.c.owner == owner, loops.c.lease_expires_at >= self.now_sql)

    def fire_loop(
        self,
        *,
        name: str,
        follows_seq: int,
        worker: str,
        lease_seconds: float,
        events: Sequence[LoopEvent],
        changes: Mapping[str, Any],
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
                        loops.c.name == name,
                        loops.c.status == "scheduled",
                        loops.c.last_seq == follows_seq,
                        self._claimable(),
                    )
                    .values(
                        status="running",
                        owner=worker,
                        lease_epoch=loops.c.lease_epoch + 1,
                        lease_expires_at=self.now_sql + lease_seconds,
                        last_seq=loops.c.last_seq + len(events),
                        **changes,
                    )
                    .returning(*loops.c)
                ).first()
                if row is None:
                    return None
                first_seq = row.last_seq - len(events) + 1
                conn.execute(insert(loop_journal), _event_rows(events, first_seq))
        except IntegrityError:
            return None  # that slot already started elsewhere: the transaction rolled back
        return _row(row)

    def write_loop(
        self,
        *,
        name: str,
        owner: str | None,
        epoch: int,
        follows_seq: int,
        changes: Mapping[str, Any],
        events: Sequence[LoopEvent],
        release: bool = True,
        control: str | Unfenced | None = ANY_CONTROL,
    ) -> bool:
        """A fenced update of a loop row plus its journal entries. ``owner``: the worker
        that fired the slot, which writes only while its lease is unexpired by the
        database's clock (a worker frozen past its lease writes nothing, whether or not
        another worker has settled the iteration yet). ``owner=None``: an operator write
        that applies only while no live worker owns the loop. ``control``: the request
        (``pause``, ``stop``, …, or None) the write was decided on — a write that honours
        a request, or its absence, is refused once an operator has changed it (an unpause
        withdrawing a pause moves neither the lease nor ``last_seq``)."""
        fence = and_(
            loops.c.name == name, loops.c.lease_epoch == epoch, loops.c.last_seq == follows_seq
        )
        if control is None:
            fence = and_(fence, loops.c.control.is_(None))
        elif not isinstance(control, Unfenced):
            fence = and_(fence, loops.c.control == control)
        owned = self._held_by(owner) if owner is not None else self._claimable()
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
            return leases.renew(
                conn,
                loops,
                loops.c.name,
                now_sql=self.now_sql,
                worker=worker,
                keys=names,
                lease_seconds=lease_seconds,
            )

    def request_loop_control(self, name: str, action: str | None) -> bool:
        with self._write() as conn:
            result = conn.execute(update(loops).where(loops.c.name == name).values(control=action))
            self._bump_changes(conn)
            return bool(result.rowcount == 1)

    def withdraw_loop_pause(self, row: LoopRow) -> bool:
        """Withdraw the pause ``row`` has pending (an unpause), if the loop still has it with
        the status read: False (nothing written) once its worker has honoured it meanwhile
        (paused) or the loop changed otherwise — read it again."""
        with self._write() as conn:
            result = conn.execute(
                update(loops)
                .where(
                    loops.c.name == row.name,
                    loops.c.status == row.status,
                    loops.c.control == "pause",
                )
                .values(control=None)
            )
            if result.rowcount != 1:
                return False
            self._bump_changes(conn)
        return True

    def interrupted_loops(self) -> list[LoopRow]:
        """Loops left ``running`` by a worker whose lease has expired."""
        with self._read() as conn:
            rows = conn.execute(select(loops).where(loops.c.status == "running", self._claimable()))
            return [_row(row) for row in rows]

    def running_loop_owners(self) -> set[str]:
        """The workers that hold a running loop (to spot dead ones on this host)."""
        with self._read() as conn:
            rows = conn.execute(
                select(loops.c.owner)
                .where(loops.c.status == "running", loops.c.owner.is_not(None))
                .distinct()
            )
            return {row.owner for row in rows}

    def expire_loop_leases(self, owners: Sequence[str]) -> None:
        if not owners:
            return
        with self._write() as conn:
            leases.expire(conn, loops, now_sql=self.now_sql, owners=owners)

    # -- manual iterations (flowloop/loop_requests.py) ---------------------------------------

    def request_loop_run(self, name: str, action: str, request: str | None = None) -> bool:
        """Ask the loop's worker for a manual iteration (``control`` = ``action``), with a
        backfill's range kept in ``flowloop_meta``. Applies only to a scheduled or running
        loop with no other request pending; False otherwise (nothing written)."""
        with self._write() as conn:
            result = conn.execute(
                update(loops)
                .where(
                    loops.c.name == name,
                    loops.c.status.in_(("scheduled", "running")),
                    loops.c.control.is_(None),
                )
                .values(control=action)
            )
            if result.rowcount != 1:
                return False
            key = _request_key(name)
            conn.execute(meta.delete().where(meta.c.key == key))
            if request is not None:
                conn.execute(insert(meta).values(key=key, value=request))
            self._bump_changes(conn)
        return True

    def withdraw_loop_run(self, row: LoopRow, event: LoopEvent) -> bool:
        """Withdraw the trigger or backfill ``row.control`` asks for, if it still does. A
        loop waiting for its slot (scheduled) gets ``event`` journaled with it, fenced on
        the row as read: a worker firing the request from that row fails its fenced write
        and reads the loop again. A running one's worker reads the request again when its
        iteration ends; its row is fenced on its status only (its seq would fence the
        worker off)."""
        fence = and_(
            loops.c.name == row.name, loops.c.control == row.control, loops.c.status == row.status
        )
        values: dict[str, Any] = {"control": None}
        if row.status == "scheduled":
            fence = and_(fence, loops.c.last_seq == row.last_seq, self._claimable())
            values.update(last_seq=row.last_seq + 1, updated_at=event.at)
        # (Running: the status in the fence — its iteration ended meanwhile, the loop
        # scheduled with the request kept, a worker would fire it: refused, read again.)
        with self._write() as conn:
            if conn.execute(update(loops).where(fence).values(**values)).rowcount != 1:
                return False
            if row.status == "scheduled":
                conn.execute(insert(loop_journal), _event_rows([event], row.last_seq + 1))
            conn.execute(meta.delete().where(meta.c.key == _request_key(row.name)))
            self._bump_changes(conn)
        return True

    def loop_run_request(self, name: str) -> str | None:
        """A loop's pending backfill range (JSON), if any."""
        key = _request_key(name)
        with self._read() as conn:
            value = conn.execute(select(meta.c.value).where(meta.c.key == key)).scalar()
        return None if value is None else str(value)

    def loop_started_slots(
        self, name: str, start: float, end: float
    ) -> list[tuple[float, float, str | None]]:
        """The ``iteration_started`` entries of slots in ``[start, end]``: (slot, at,
        reason)."""
        with self._read() as conn:
            rows = conn.execute(
                select(loop_journal.c.slot, loop_journal.c.at, loop_journal.c.data).where(
                    loop_journal.c.loop == name,
                    loop_journal.c.kind == "iteration_started",
                    loop_journal.c.slot >= start - 0.001,
                    loop_journal.c.slot <= end + 0.001,
                )
            )
            return [
                (
                    float(row.slot),
                    float(row.at),
                    json.loads(row.data).get("reason") if row.data else None,
                )
                for row in rows
            ]
