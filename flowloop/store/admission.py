"""SQL for debounced and throttled starts (flowloop/admission.py decides; this writes).

Contract: a debounced start touches only the run that collects its key's burst, and only
while that run is scheduled, unowned and has never started a step (fenced by ``last_seq``,
so a worker that claims it first wins and the start opens a new burst). A throttled start
counts its key's runs and creates the new one in the same transaction (on PostgreSQL under
a transaction-scoped advisory lock on the key, so two processes cannot both take the last
place).
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from typing import Any, Final

from sqlalchemy import Connection, select, text, update
from sqlalchemy.exc import IntegrityError

from flowloop import journal as j
from flowloop.store.base import NewRun, StoredRun
from flowloop.store.schema import journal, runs

ATTEMPTS: Final = 5
"""Tries when a concurrent start of the same key wins a race (nothing is written then)."""


class AdmissionStoreMixin:
    """Debounce and throttle writes for :class:`~flowloop.store.sql.SQLStore`."""

    _postgres: bool

    def _write(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _create_in(self, conn: Connection, new: NewRun) -> tuple[StoredRun, bool]:
        raise NotImplementedError  # provided by SQLStore

    def _stored(self, conn: Connection, run_id: str) -> StoredRun:
        from flowloop.store.sql import _stored_from_row  # the row mapping lives there

        return _stored_from_row(conn.execute(select(runs).where(runs.c.id == run_id)).one())

    def debounce_start(
        self, new: NewRun, marker: str, *, due: float, now: float, key: str
    ) -> tuple[StoredRun, bool]:
        """Create ``new`` (idempotency key ``marker``, due ``due``) or, when the run holding
        ``marker`` has not begun, give it ``new``'s context and due time (journaled
        ``run_debounced``). Returns the run and whether it was created."""
        for attempt in range(ATTEMPTS):
            try:
                with self._write() as conn:
                    return self._debounce_in(conn, new, marker, due=due, now=now, key=key)
            except IntegrityError:
                if attempt == ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _debounce_in(
        self, conn: Connection, new: NewRun, marker: str, *, due: float, now: float, key: str
    ) -> tuple[StoredRun, bool]:
        row = conn.execute(
            select(runs.c.id, runs.c.status, runs.c.owner, runs.c.last_seq).where(
                runs.c.idempotency_key == marker
            )
        ).first()
        if row is not None:
            began = conn.execute(
                select(journal.c.seq)
                .where(journal.c.run_id == row.id, journal.c.kind == j.STEP_STARTED)
                .limit(1)
            ).first()
            if row.status == "scheduled" and row.owner is None and began is None:
                context = new.record.context
                changed = conn.execute(
                    update(runs)
                    .where(
                        runs.c.id == row.id,
                        runs.c.last_seq == row.last_seq,
                        runs.c.status == "scheduled",
                        runs.c.owner.is_(None),
                    )
                    .values(
                        context=context,
                        next_run_at=due,
                        last_seq=row.last_seq + 1,
                        updated_at=now,
                    )
                )
                if changed.rowcount == 1:
                    conn.execute(
                        journal.insert().values(
                            run_id=row.id,
                            seq=row.last_seq + 1,
                            kind=j.RUN_DEBOUNCED,
                            at=now,
                            attempt=0,
                            context=context,
                            worker=new.events[0].worker,
                            data=json.dumps({"due": due, "debounce_key": key}, sort_keys=True),
                        )
                    )
                    return self._stored(conn, row.id), False
            # The burst's run has begun (or a worker just claimed it): it keeps a marker of
            # its own, and this start opens the next burst.
            conn.execute(
                update(runs).where(runs.c.id == row.id).values(idempotency_key=f"{marker}:{row.id}")
            )
        return self._create_in(conn, new)

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
