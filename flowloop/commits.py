"""A boundary's commit as the executor makes it, and what follows once it is written.

The :class:`Commits` part of the executor (flowloop/executor.py drives runs,
flowloop/stepping.py runs a step): every boundary of a driven run goes through
:meth:`Commits._commit` — fenced off first, written alone or in the committer's shared
transaction (flowloop/committer.py), then the lease, the listeners and the run's last
record told. It runs once per step, so it reads the fenced-off runs as a set (no call).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from flowloop.journal import JournalEvent, RunRecord
from flowloop.store import Boundary, Store

if TYPE_CHECKING:
    from flowloop.committer import Committer, Stats
    from flowloop.executor import _Active
    from flowloop.leasekeeper import LeaseKeeper
    from flowloop.localdue import LocalDue
    from flowloop.outcome_log import OutcomeLog

log = logging.getLogger("flowloop")


class Commits:
    """Mixed into :class:`~flowloop.executor.Executor`, whose state it uses."""

    if TYPE_CHECKING:
        store: Store
        stats: Stats
        committer: Committer
        leases: LeaseKeeper
        outcomes: OutcomeLog
        due_here: LocalDue
        listeners: list[Callable[[RunRecord, Sequence[JournalEvent]], None]]
        tracked: set[str]
        committed: dict[str, tuple[RunRecord, float]]
        _active: dict[str, _Active]

    def _notify(self, boundary: Boundary) -> None:
        active = self._active.get(boundary.run_id)
        if active is not None and active.epoch == boundary.fence.epoch:
            active.record = boundary.record  # (what a cut-off writes after)
        if self.outcomes.held:  # an outcome's line, said once written (outcome_log.py)
            self.outcomes.written(boundary)
        for listener in self.listeners:
            try:
                listener(boundary.record, boundary.events)
            except Exception:  # a listener must never break the journal
                log.exception("listener failed")

    def note_committed(self, boundary: Boundary) -> None:
        """Keep the record of a tracked run's committed boundary: ``Engine.run`` answers
        with it rather than read back the row it knows."""
        if boundary.run_id in self.tracked:
            at = boundary.events[-1].at if boundary.events else 0.0
            self.committed[boundary.run_id] = (boundary.record, at)

    async def _commit(self, boundary: Boundary, *, refused_is_lost: bool = True) -> bool:
        """Write ``boundary`` (alone, or in a shared commit); whether it was applied. A
        refusal gives the run up as lost, unless ``refused_is_lost`` is False (a boundary
        honouring a request that may have changed: its caller looks at the row first)."""
        run_id = boundary.record.id
        # The runs fenced off (their lease deadline passed unrenewed: flowloop/leasethread.py),
        # the lease threads' own set, read as LeaseKeeper.fenced reads it.
        fenced = self.leases.fenced_runs
        if run_id in fenced:
            # Being abandoned: no boundary of it is written from then on.
            self.leases.given_up[run_id] = boundary.fence.epoch
            return False
        # A write of the run row renews the lease; an append leaves it to the heartbeat
        # (flowloop/store/appends.py), so only the former counts, from before it was sent.
        renews = self.store.renews_lease(boundary)
        before = time.monotonic() if renews else 0.0
        if len(self._active) <= 1:  # one run in flight: nothing can share its commit
            verdict = self.committer.write_now(boundary)
            applied = await verdict if isinstance(verdict, asyncio.Future) else verdict
        else:
            applied = await self.committer.submit(boundary)
        if not applied:
            if refused_is_lost:
                self._give_up(run_id, boundary.fence.epoch)
            return False
        if boundary.release:
            self.due_here.note(run_id, boundary.record.next_run_at)
        if run_id in self.tracked:
            self.note_committed(boundary)
        if renews:
            self.leases.renewed_by_write(run_id, before)
        self._notify(boundary)
        if not boundary.release and run_id in fenced:
            # Fenced while the write was in flight: it landed under a lease the database
            # still held, but nothing may follow it (the next step must not start).
            self.leases.given_up[run_id] = boundary.fence.epoch
            return False
        return True

    def _give_up(self, run_id: str, epoch: int) -> None:
        """A write of the run was refused: this drive lost it (its lease, or another writer
        moved it); say so, and write nothing more of it."""
        self.stats.lost_leases += 1
        why = "write refused (lease lost or run changed by another writer); abandoning it"
        log.warning("run %s: %s", run_id, why, extra={"run": run_id, "event": "lease_lost"})
        self.leases.given_up[run_id] = epoch
        self.leases.tell_lost(run_id, why)
