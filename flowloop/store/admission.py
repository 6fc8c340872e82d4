"""SQL for debounced and throttled starts (flowloop/admission.py decides; this writes).

Contract: a debounced start touches only the run that collects its key's burst, and only
while that run is scheduled or paused, unowned and has not begun (no entry of
:data:`flowloop.admission.BEGAN`), fenced by ``last_seq``: a worker that claims it first
wins and the start opens a new burst (so does one that finds it moved at each of its
:data:`ATTEMPTS` writes: never merged unwritten). A throttled start
counts its key's runs and creates the new one in the same transaction (on PostgreSQL under
a transaction-scoped advisory lock on the key, so two processes cannot both take the last
place).
"""

from __future__ import annotations

import enum
import json
from contextlib import AbstractContextManager
from typing import Any, Final

from sqlalchemy import ColumnElement, Connection, func, insert, or_, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError

from flowloop import admission
from flowloop import journal as j
from flowloop.backpressure import DROPPED_REASON, usage_by_workflow
from flowloop.journal import JournalEvent
from flowloop.store import dialect
from flowloop.store.base import InboxEvent, NewRun, StoredRun
from flowloop.store.entries import row_context
from flowloop.store.inbox import kept_row
from flowloop.store.schema import inbox, journal, runs

_FINISHED: Final = ("failed", "stopped", "succeeded")

ATTEMPTS: Final = 5
"""Tries when a concurrent start of the same key wins a race (nothing is written then)."""
BOUNDED_ATTEMPTS: Final = 5
"""Tries of a start under ``max_queued`` (a lost key race or deadlock, or every run to
drop being claimed at that moment: nothing is written then)."""


class _Claiming(enum.Enum):
    """Every queued run :meth:`AdmissionStoreMixin.start_bounded` could drop is being
    claimed (or was since the count): they are leaving the queue, look again."""

    CLAIMING = "claiming"


_CLAIMING: Final = _Claiming.CLAIMING


class AdmissionStoreMixin:
    """Debounce and throttle writes for :class:`~flowloop.store.sql.SQLStore`."""

    _postgres: bool

    def _write(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _read(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _create_in(self, conn: Connection, new: NewRun) -> tuple[StoredRun, bool]:
        raise NotImplementedError  # provided by SQLStore

    def _fold_tails(self, conn: Connection, stored: list[StoredRun]) -> list[StoredRun]:
        raise NotImplementedError  # provided by AppendStoreMixin

    def _stored(self, conn: Connection, run_id: str) -> StoredRun:
        from flowloop.store.entries import stored_from_row as _stored_from_row

        row = conn.execute(select(runs).where(runs.c.id == run_id)).one()
        return self._fold_tails(conn, [_stored_from_row(row)])[0]

    def debounce_start(
        self, new: NewRun, marker: str, *, due: float | None, now: float, key: str
    ) -> tuple[StoredRun, bool]:
        """Create ``new`` (idempotency key ``marker``) or, when the run holding ``marker``
        still collects its burst (:func:`flowloop.admission.collecting`), give it ``new``'s
        context and due time ``due`` (journaled ``run_debounced``; a paused one stays
        paused, due only when unpaused). Returns the run and whether it was created."""
        for attempt in range(ATTEMPTS):
            try:
                with self._write() as conn:
                    return self._debounce_in(conn, new, marker, due=due, now=now, key=key)
            except IntegrityError:
                if attempt == ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _debounce_in(
        self,
        conn: Connection,
        new: NewRun,
        marker: str,
        *,
        due: float | None,
        now: float,
        key: str,
    ) -> tuple[StoredRun, bool]:
        self._serialize(conn, marker)  # concurrent starts of one burst take turns
        for _ in range(ATTEMPTS):
            found = conn.execute(select(runs.c.id).where(runs.c.idempotency_key == marker)).first()
            if found is None:
                break
            stored = self._stored(conn, found.id)
            began = conn.execute(
                select(journal.c.seq)
                .where(journal.c.run_id == stored.id, journal.c.kind.in_(admission.BEGAN))
                .limit(1)
            ).first()
            if not admission.collecting(stored.record.status, stored.owner, began is not None):
                # The burst's run has begun, ended or been claimed: it keeps a marker of
                # its own, and this start opens the next burst.
                self._own_marker(conn, stored.id, marker)
                break
            if self._debounce_into(conn, stored, new, due=due, now=now, key=key):
                return self._stored(conn, stored.id), False
            # (PostgreSQL: an operator's pause, unpause or stop, or a claim, moved the run
            # between the read and the write: look at it again.)
        else:
            # Moved under every try: it keeps a marker of its own and this start opens the
            # next burst (created on the marker it held, it was returned as merged, its
            # context lost with nothing written).
            self._own_marker(conn, stored.id, marker)
        return self._create_in(conn, new)

    def _own_marker(self, conn: Connection, run_id: str, marker: str) -> None:
        """The burst's run ``run_id`` collects no more starts: it gets a marker of its own,
        the burst's (``marker``) is free for a new run."""
        conn.execute(
            update(runs)
            .where(runs.c.id == run_id, runs.c.idempotency_key == marker)
            .values(idempotency_key=f"{marker}:{run_id}")
        )

    def _debounce_into(
        self,
        conn: Connection,
        stored: StoredRun,
        new: NewRun,
        *,
        due: float | None,
        now: float,
        key: str,
    ) -> bool:
        """Journal ``run_debounced`` on the burst's run (fenced on its row as read: the
        journal protocol's one writer per seq); False, nothing written, if it moved."""
        record = stored.record
        data: dict[str, Any] = {"due": due, "debounce_key": key}
        version = new.record.context_version
        if version != 1 or record.context_version != 1:
            # The version of the context it brings (a start under a newer definition: the
            # run's next load upcast it again), as a transition's; version 1 says nothing.
            data[j.CONTEXT_VERSION] = version
        event = JournalEvent(
            run_id=record.id,
            seq=record.last_seq + 1,
            kind=j.RUN_DEBOUNCED,
            at=now,
            state=record.state,  # (its entry into its first state: a wait's timeout counts)
            context=new.record.context,
            worker=new.events[0].worker,
            data=data,
        )
        after = j.apply(record, event)  # replay equals the row: paused, it stays undue
        changed = conn.execute(
            update(runs)
            .where(
                runs.c.id == record.id,
                runs.c.last_seq == record.last_seq,
                runs.c.status == record.status,
                runs.c.owner.is_(None),
            )
            .values(
                context=row_context(after.context),  # a long one: the journal's below
                context_version=after.context_version,
                next_run_at=after.next_run_at,
                last_seq=after.last_seq,
                updated_at=now,
            )
        )
        if changed.rowcount != 1:
            return False
        conn.execute(
            journal.insert().values(
                run_id=event.run_id,
                seq=event.seq,
                kind=event.kind,
                at=event.at,
                state=event.state,
                attempt=0,
                context=event.context,
                worker=event.worker,
                data=json.dumps(event.data, sort_keys=True),
            )
        )
        return True

    def throttled_start(
        self, new: NewRun, prefix: str, *, since: float, decide: Any
    ) -> tuple[StoredRun | None, Any]:
        """Count the runs whose idempotency key starts with ``prefix`` created after
        ``since``; ``decide(times)`` says whether ``new`` may be created (and if not, its
        verdict is returned with no run)."""
        with self._write() as conn:
            if self._postgres:
                conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": prefix})
            created = [
                float(at)
                for (at,) in conn.execute(
                    select(runs.c.created_at).where(
                        runs.c.idempotency_key >= prefix,
                        runs.c.idempotency_key < prefix[:-1] + chr(ord(prefix[-1]) + 1),
                        runs.c.created_at > since,
                    )
                )
            ]
            admitted, verdict = decide(created)
            if not admitted:
                return None, verdict
            stored, _ = self._create_in(conn, new)
            return stored, verdict

    # -- backpressure (flowloop/backpressure.py) ------------------------------------------

    def _serialize(self, conn: Connection, name: str) -> None:
        """Serialize count-then-insert on ``name`` (SQLite's writes are serialized already)."""
        if self._postgres:
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:k))"), {"k": name})

    def keep_bounded(
        self, message: InboxEvent, limit: int, *, drop_oldest: bool, now: float, worker: str
    ) -> str:
        """Keep ``message`` for its run if fewer than ``limit`` events are kept for it, or
        (``drop_oldest``) after dropping the oldest kept one — journaled ``event_dropped`` on
        the run, which only an unowned run allows. ``"buffered"``, ``"full"``, ``"busy"``
        (a worker holds the run: nothing dropped) or ``"duplicate"``; nothing is written
        unless ``"buffered"``."""
        try:
            with self._write() as conn:
                self._serialize(conn, f"inbox:{message.run_id}")
                kept = conn.execute(
                    select(func.count()).where(
                        inbox.c.run_id == message.run_id, inbox.c.consumed_seq.is_(None)
                    )
                ).scalar_one()
                if kept >= limit:
                    if not drop_oldest:
                        return "full"
                    if not self._drop_oldest_kept(conn, message.run_id, limit, now, worker):
                        return "busy"
                conn.execute(insert(inbox).values(kept_row(message)))
        except IntegrityError:
            if message.dedupe_key is not None:
                return "duplicate"
            raise
        return "buffered"

    def _drop_oldest_kept(
        self, conn: Connection, run_id: str, limit: int, now: float, worker: str
    ) -> bool:
        run = conn.execute(select(runs.c.owner, runs.c.last_seq).where(runs.c.id == run_id)).one()
        oldest = conn.execute(
            select(inbox.c.id, inbox.c.event, inbox.c.sent_at)
            .where(inbox.c.run_id == run_id, inbox.c.consumed_seq.is_(None))
            .order_by(inbox.c.id)
            .limit(1)
        ).one()
        seq = run.last_seq + 1
        # The journal protocol: only the run's lease holder appends while it is owned.
        moved = conn.execute(
            update(runs)
            .where(runs.c.id == run_id, runs.c.last_seq == run.last_seq, runs.c.owner.is_(None))
            .values(last_seq=seq, updated_at=now)
        )
        if moved.rowcount != 1:
            return False
        conn.execute(update(inbox).where(inbox.c.id == oldest.id).values(consumed_seq=seq))
        data = {"inbox_id": oldest.id, "sent_at": oldest.sent_at, "reason": f"max_inbox={limit}"}
        conn.execute(
            journal.insert().values(
                run_id=run_id,
                seq=seq,
                kind=j.EVENT_DROPPED,
                at=now,
                attempt=0,
                event=oldest.event,
                worker=worker,
                data=json.dumps(data, sort_keys=True),
            )
        )
        return True

    def start_bounded(
        self, new: NewRun, limit: int, *, drop_oldest: bool, now: float, worker: str
    ) -> tuple[StoredRun, bool] | None:
        """Create ``new`` if fewer than ``limit`` runs of its workflow wait to start
        (scheduled, unowned, only ``run_created`` journaled), or (``drop_oldest``) after
        stopping the oldest of them (``run_stopped``, reason ``dropped``). A run that
        already holds ``new``'s key is returned as by ``create_run``. None: full, nothing
        written.

        A worker's claim takes the oldest queued run too, and claims do not take the starts'
        turn: the run to drop is locked (``FOR UPDATE``) and stopped only while it still
        waits; one being claimed is passed by (``SKIP LOCKED``). When every one is being
        claimed, the start looks again in a new transaction, waiting for those claims to
        commit (it holds no run's lock then: no deadlock with a worker that holds one).
        A lost key race or a deadlock writes nothing and is tried again too.
        """
        patient = False
        for attempt in range(BOUNDED_ATTEMPTS):
            last = attempt == BOUNDED_ATTEMPTS - 1
            try:
                with self._write() as conn:
                    outcome = self._start_bounded_in(
                        conn,
                        new,
                        limit,
                        drop_oldest=drop_oldest,
                        patient=patient,
                        now=now,
                        worker=worker,
                    )
            except IntegrityError:
                # A concurrent start (of another workflow: its idempotency key) took a
                # key first: once more, and the winner is found and returned.
                if last:
                    raise
                continue
            except OperationalError as error:
                if last or not dialect.is_deadlock(error):
                    raise
                continue  # a deadlock's victim: nothing was written
            if outcome is not _CLAIMING:
                return outcome
            patient = True  # those claims commit: they leave the queue
        return None

    def _start_bounded_in(
        self,
        conn: Connection,
        new: NewRun,
        limit: int,
        *,
        drop_oldest: bool,
        patient: bool,
        now: float,
        worker: str,
    ) -> tuple[StoredRun, bool] | _Claiming | None:
        workflow = new.record.workflow
        self._serialize(conn, f"queue:{workflow}")  # starts take turns (claims do not)
        queued = (runs.c.workflow == workflow, runs.c.status == "scheduled")
        waiting = (runs.c.last_seq == 1, runs.c.owner.is_(None))
        counted = select(func.count()).where(*queued, *waiting)
        if conn.execute(counted).scalar_one() < limit or self._holds_key(conn, new):
            return self._create_in(conn, new)
        if not drop_oldest:
            return None
        # Never a call's or map's child: stopped here, its join would not hear of it and
        # its parent would wait for ever. None but children: full.
        droppable = select(runs.c.id).where(*queued, *waiting, runs.c.parent_id.is_(None))
        oldest = conn.execute(
            droppable.order_by(runs.c.created_at, runs.c.id)
            .limit(1)
            # PostgreSQL: the one taken is locked, so no claim takes it before this commits;
            # one a claim took since the count is passed by, one a claim holds is passed by
            # too or (patient) waited for.
            .with_for_update(skip_locked=not patient)
        ).scalar()
        if oldest is None:
            waiting_now, children = conn.execute(
                select(func.count(), func.count(runs.c.parent_id)).where(*queued, *waiting)
            ).one()
            if waiting_now < limit:  # claimed since the count: room now
                return self._create_in(conn, new)
            return _CLAIMING if waiting_now > children else None
        reason = f"{DROPPED_REASON}{limit}"
        stopped = conn.execute(
            update(runs)
            .where(runs.c.id == oldest, *queued, *waiting)
            .values(status="stopped", reason=reason, next_run_at=None, last_seq=2, updated_at=now)
        )
        if stopped.rowcount != 1:  # cannot happen while it is locked: journal no stop
            return _CLAIMING
        conn.execute(
            journal.insert().values(
                run_id=oldest,
                seq=2,
                kind=j.RUN_STOPPED,
                at=now,
                attempt=0,
                worker=worker,
                data=json.dumps({"reason": reason}),
            )
        )
        return self._create_in(conn, new)

    def _holds_key(self, conn: Connection, new: NewRun) -> bool:
        held: list[ColumnElement[bool]] = []
        if new.record.key is not None:
            held.append((runs.c.workflow == new.record.workflow) & (runs.c.key == new.record.key))
        if new.idempotency_key is not None:
            held.append(runs.c.idempotency_key == new.idempotency_key)
        if not held:
            return False
        return conn.execute(select(runs.c.id).where(or_(*held)).limit(1)).first() is not None

    def backpressure_usage(self) -> dict[str, dict[str, int]]:
        """Per workflow (only those with something to show): ``queued`` runs not yet started,
        ``kept`` events kept for its runs and ``kept_max`` on one run, ``dropped_events``
        (``event_dropped`` entries) and ``dropped_runs`` (stopped for ``max_queued``)."""
        with self._read() as conn:
            queued = conn.execute(
                select(runs.c.workflow, func.count())
                .where(runs.c.status == "scheduled", runs.c.last_seq == 1)
                .group_by(runs.c.workflow)
            ).all()
            kept = conn.execute(
                select(runs.c.workflow, func.count())
                .select_from(inbox.join(runs, runs.c.id == inbox.c.run_id))
                # A finished run's are never taken: counted, the gauge never came down.
                .where(inbox.c.consumed_seq.is_(None), runs.c.status.not_in(_FINISHED))
                .group_by(runs.c.workflow, inbox.c.run_id)
            ).all()
            dropped_events = conn.execute(
                select(runs.c.workflow, func.count())
                .select_from(journal.join(runs, runs.c.id == journal.c.run_id))
                .where(journal.c.kind == j.EVENT_DROPPED)
                .group_by(runs.c.workflow)
            ).all()
            dropped_runs = conn.execute(
                select(runs.c.workflow, func.count())
                .where(runs.c.status == "stopped", runs.c.reason.like(f"{DROPPED_REASON}%"))
                .group_by(runs.c.workflow)
            ).all()
        return usage_by_workflow(queued, kept, dropped_events, dropped_runs)
