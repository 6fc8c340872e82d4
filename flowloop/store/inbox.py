"""Events sent to runs: the inbox a waiting run takes its events from.

An event is kept (``buffered``) until its run is in a state that accepts it; delivering one
marks it consumed by the boundary it leads to, in that boundary's transaction, so an event
is applied once or not at all (``conflict``: another writer moved the run first). A
``dedupe_key`` makes a second send of the same event a ``duplicate``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any, Final

from sqlalchemy import Connection, String, bindparam, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.types import TupleType

from flowloop.journal import ASLEEP
from flowloop.lifecycle import HELD
from flowloop.store.base import Boundary, InboxEvent
from flowloop.store.joins import reports_end
from flowloop.store.schema import inbox

KEPT_FOR_FREE_RUNS: Final = (
    "SELECT DISTINCT i.run_id FROM flowloop_inbox AS i{indexed}"
    " CROSS JOIN flowloop_runs AS r"
    " WHERE r.id = i.run_id AND i.consumed_seq IS NULL AND i.run_id > :after"
    " AND r.status = 'scheduled' AND r.owner IS NULL"
    f" AND (r.reason IS NULL OR r.reason <> '{ASLEEP}')"
    f" AND (r.join_state IS NULL OR r.join_state <> '{HELD}')"
    " AND (r.workflow, r.state, i.event) IN :takers"
    " ORDER BY i.run_id LIMIT :limit"
)
"""The look for stranded kept events: through the partial index of the kept events
(``ix_flowloop_inbox_kept``, migration 0022) — the inbox keeps every taken event too — then
each one's run by its key: what it reads grows with the events kept, not with the inbox or
the runs. On SQLite that index and that order are said (INDEXED BY; a CROSS JOIN keeps its
left table outer): with statistics that found the index empty the planner went through
every run by its key instead, and each one's events (2,000 runs, 100,000 taken events,
none kept: 3.5 ms a look; said, 0.05 ms). PostgreSQL plans it so by itself."""
_TAKERS = TupleType(String(), String(), String())
_KEPT_FOR_FREE_RUNS: Final = {
    postgres: text(
        KEPT_FOR_FREE_RUNS.format(indexed="" if postgres else " INDEXED BY ix_flowloop_inbox_kept")
    ).bindparams(bindparam("takers", expanding=True, type_=_TAKERS))
    for postgres in (False, True)
}


class _Conflict(Exception):
    """Raised inside a transaction to roll it back: a fenced write was refused."""


def kept_row(message: InboxEvent) -> dict[str, Any]:
    """The inbox row that keeps ``message`` until its run takes it (its id is the
    database's, its ``consumed_seq`` empty)."""
    return {
        "run_id": message.run_id,
        "event": message.event,
        "payload": message.payload,
        "dedupe_key": message.dedupe_key,
        "sent_at": message.sent_at,
        "sender": message.sender,
    }


class InboxStoreMixin:
    """The inbox's reads and writes for :class:`~flowloop.store.sql.SQLStore`."""

    _postgres: bool  # provided by SQLStore

    def _write(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _read(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _apply(self, conn: Connection, boundaries: Sequence[Boundary]) -> list[bool]:
        raise NotImplementedError  # provided by AppendStoreMixin

    def _report_ends(self, conn: Connection, boundaries: Sequence[Boundary]) -> None:
        raise NotImplementedError  # provided by JoinStoreMixin

    def _lock_joins(self, conn: Connection, ends: Sequence[Boundary]) -> None:
        raise NotImplementedError  # provided by JoinStoreMixin

    def deliver(self, message: InboxEvent, boundary: Boundary | None) -> str:
        try:
            with self._write() as conn:
                if message.id is None:
                    message_id = conn.execute(
                        insert(inbox).values(kept_row(message)).returning(inbox.c.id)
                    ).scalar_one()
                else:
                    message_id = message.id
                if boundary is None:
                    return "buffered"
                consumed = conn.execute(
                    update(inbox)
                    .where(inbox.c.id == message_id, inbox.c.consumed_seq.is_(None))
                    .values(consumed_seq=boundary.record.last_seq)
                ).rowcount
                ends = [boundary] if reports_end(boundary) else []
                self._lock_joins(conn, ends)  # before the run's row (see there)
                if consumed != 1 or not self._apply(conn, [boundary])[0]:
                    raise _Conflict
                if ends:
                    self._report_ends(conn, ends)
        except _Conflict:
            return "conflict"
        except IntegrityError:
            if message.dedupe_key is not None and message.id is None:
                return "duplicate"
            raise
        return "applied"

    def has_message(self, run_id: str, dedupe_key: str) -> bool:
        with self._read() as conn:
            found = conn.execute(
                select(inbox.c.id)
                .where(inbox.c.run_id == run_id, inbox.c.dedupe_key == dedupe_key)
                .limit(1)
            ).first()
        return found is not None

    def kept_for_free_runs(
        self, accepting: Collection[tuple[str, str, str]], *, after: str, limit: int
    ) -> list[str]:
        """Runs that events are kept for which their state accepts now — ``accepting``:
        (workflow, state, event), every loaded version's waits — and that no worker holds
        (scheduled, no owner; not asleep before the state, not a map's child held back), by
        id after ``after``: those a worker may have died before handing their kept events
        (flowloop/kept.py, :func:`hand_over_stranded`). Every recovery sweep asks, and when
        nothing is stranded it finds nothing: :data:`KEPT_FOR_FREE_RUNS`."""
        if not accepting:
            return []
        values = {"after": after, "takers": list(accepting), "limit": limit}
        with self._read() as conn:
            found = conn.execute(_KEPT_FOR_FREE_RUNS[self._postgres], values)
            return [str(row.run_id) for row in found]

    def kept_count(self, run_id: str) -> int:
        """How many events are kept for the run, not taken yet."""
        with self._read() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(inbox)
                    .where(inbox.c.run_id == run_id, inbox.c.consumed_seq.is_(None))
                ).scalar_one()
            )

    def pending_events(self, run_id: str) -> list[InboxEvent]:
        with self._read() as conn:
            rows = conn.execute(
                select(inbox)
                .where(inbox.c.run_id == run_id, inbox.c.consumed_seq.is_(None))
                .order_by(inbox.c.id)
            )
            return [
                InboxEvent(
                    id=row.id,
                    run_id=row.run_id,
                    event=row.event,
                    payload=row.payload,
                    dedupe_key=row.dedupe_key,
                    sent_at=row.sent_at,
                    sender=row.sender,
                    consumed_seq=row.consumed_seq,
                )
                for row in rows
            ]
