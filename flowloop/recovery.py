"""Recovery: settle the runs a dead or frozen worker left ``running``.

An idempotent step runs again (the attempt counts), a non-idempotent one fails as
``interrupted`` (or routes on ``on_error``); a run cut off in a state the deployed
definition no longer fits is parked. The :class:`Recovery` half of the executor, which
also judges every run a claim gives it (:meth:`Recovery._checked`: can the loaded
definition run it, as ``flowloop check`` says).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from flowloop import children, interruptions
from flowloop import journal as j
from flowloop.clock import Clock
from flowloop.definition import Workflow
from flowloop.errors import error_line
from flowloop.journal import JournalEvent, RunRecord
from flowloop.kept import INVALID_ROW
from flowloop.leasekeeper import LeaseKeeper, owner_is_dead_here
from flowloop.outcome_log import INTERRUPTED, INTERRUPTED_UNWRITTEN, OutcomeLog, step_fields
from flowloop.parking import halt_entry
from flowloop.store import Boundary, Fence, Store, StoredRun
from flowloop.verdicts import Verdict, judge
from flowloop.versions import versions_of, workflow_for

if TYPE_CHECKING:
    from pydantic import BaseModel

    from flowloop.committer import Stats
    from flowloop.executor import _Active
    from flowloop.kept import StrandedLooks

log = logging.getLogger("flowloop")

RECOVERY_BATCH: Final = 500


class Recovery:
    """Mixed into :class:`~flowloop.executor.Executor`, whose state it uses."""

    if TYPE_CHECKING:
        store: Store
        workflows: Mapping[str, Workflow]
        clock: Clock
        worker_id: str
        lease_seconds: float
        stats: Stats
        leases: LeaseKeeper
        outcomes: OutcomeLog
        _active: dict[str, _Active]
        _parked_for: frozenset[tuple[str, str]] | None
        """The loaded definitions :meth:`_park_stranded_waits` last looked with."""
        _kept_looks: StrandedLooks
        """This worker's looks for stranded kept events (:meth:`_hand_over_kept`)."""

        def _notify(self, boundary: Boundary) -> None: ...

        def wake(self, run_id: str | None = None) -> None: ...

    async def recover(self) -> int:
        """Settle every run left ``running`` by a dead worker, in batches: an idempotent
        step runs again (the attempt counts), a non-idempotent one fails as ``interrupted``."""
        refresh = getattr(self.clock, "refresh", None)  # a DatabaseClock: measure again
        if refresh is not None:
            try:
                refresh()
            except Exception as error:  # the sweep itself reports an outage
                log.debug("clock offset not measured: %s", error_line(error))
        dead = [owner for owner in self.store.running_owners() if owner_is_dead_here(owner)]
        if dead:
            self.store.expire_leases(dead)
        recovered = 0
        while True:
            rows = self.store.claim_interrupted(
                worker=self.worker_id,
                limit=RECOVERY_BATCH,
                lease_seconds=self.lease_seconds,
                workflows=list(self.workflows),
            )
            if not rows:
                return recovered
            try:
                boundaries = [
                    self._interrupted(row) if row.problem is None else self._broken(row)
                    for row in rows
                ]
                results = self.store.write(boundaries)
            except BaseException:
                for row in rows:  # (whether they were written is not known)
                    self.outcomes.drop(row.id)
                raise
            self.stats.commits += 1
            for boundary, applied in zip(boundaries, results, strict=True):
                if applied:
                    recovered += 1
                    self.stats.recovered += 1
                    self._notify(boundary)  # (says its line: flowloop/outcome_log.py)
                self.outcomes.settle(boundary.run_id)

    def _interrupted(self, row: StoredRun, cause: str | None = None) -> Boundary:
        record = row.record
        workflow = workflow_for(self.workflows, record)
        spec = workflow.steps.get(record.state)
        now = self.clock.now()
        if cause is None:  # found by recovery: this worker's own lease, or another's
            cause = (
                interruptions.LEASE_LOST if self._cut_off_here(row) else interruptions.WORKER_GONE
            )
        self.leases.given_up.pop(row.id, None)
        parked = self._park_interrupted(workflow, row, now)
        if parked is not None:
            return parked
        data: dict[str, Any]
        idempotent = spec is not None and spec.idempotent
        attempts_left = spec is not None and spec.retry.has_attempts_left(record.attempt)
        if idempotent and attempts_left:
            data = {"retry_at": now, "cause": cause}
        else:
            data = {"reason": "interrupted", "cause": cause}
        message = interruptions.message(
            cause, idempotent=idempotent, attempts_left=attempts_left, attempt=record.attempt
        )
        undoing = self._undoing(workflow, record)
        data, message, route = children.interrupted(workflow, record, data, message, now, undoing)
        data.setdefault("cause", cause)
        event = JournalEvent(
            run_id=record.id,
            seq=record.last_seq + 1,
            kind=j.STEP_INTERRUPTED,
            at=now,
            state=record.state,
            attempt=record.attempt,
            error_type="Interrupted",
            error_message=message,
            retryable="retry_at" in data,
            worker=self.worker_id,
            data=data,
            **route,
        )
        self.outcomes.hold(  # said once written (flowloop/outcome_log.py)
            record.id,
            event.seq,
            logging.ERROR if "reason" in data else logging.WARNING,
            INTERRUPTED,
            INTERRUPTED_UNWRITTEN,
            (record.id, record.last_seq, record.state, record.attempt, message),
            {
                **step_fields(record.workflow, record),
                "event": "step_finished",
                "outcome": "interrupted",
                "error_type": "Interrupted",
                "retryable": "retry_at" in data,
            },
        )
        return Boundary(
            events=[event],
            record=j.apply(record, event),
            fence=Fence(self.worker_id, row.lease_epoch),
            release=True,
        )

    def _cut_off_here(self, row: StoredRun) -> bool:
        """Whether the attempt recovery found cut off is this worker's own: it held the
        run's lease (gave it up, or drives it still) at the epoch just before this claim.
        Every claim adds one to the epoch, so a run this worker gave up, then another
        worker claimed (and, in its turn, went away), is not this worker's loss: that
        attempt was the other's."""
        held = row.lease_epoch - 1
        active = self._active.get(row.id)
        return self.leases.given_up.get(row.id) == held or (
            active is not None and active.epoch == held
        )

    def _undoing(self, workflow: Workflow, record: RunRecord) -> str | None:
        """The step whose compensation a run cut off in a compensating state was running:
        the one its last ``compensation_started`` names (``None``: not compensating)."""
        if not workflow.compensates(record.state):
            return None
        for event in reversed(self.store.journal(record.id)):
            if event.kind == j.COMPENSATION_STARTED:
                return event.state
        return None

    def _broken(self, row: StoredRun) -> Boundary:
        """A run whose row or journal tail cannot be read (``row.problem``) fails at once
        as ``invalid_row`` with the reason: judged again, it would be claimed forever."""
        record = row.record
        self.leases.given_up.pop(row.id, None)
        now, worker = self.clock.now(), self.worker_id
        event = halt_entry(
            record, j.RUN_FAILED, reason=INVALID_ROW, message=row.problem, now=now, worker=worker
        )
        log.error("run %s failed: invalid_row: %s", record.id, row.problem)
        return Boundary(
            events=[event],
            record=j.apply(record, event),
            fence=Fence(self.worker_id, row.lease_epoch),
            release=True,
        )

    def _park_stranded_waits(self) -> None:
        """Waiting runs without a timeout are never claimed: park, once at start, those
        the loaded definitions cannot take (flowloop/parking.py). Once per executor and
        set of loaded definitions: the engine keeps its executor between ``Engine.run``
        calls, and looking again at each call cost a transaction per call. A worker looks
        once when it starts, and ``run_until_idle`` at each call (a new executor each
        time): a wait stranded later (a run unpaused on a definition not loaded here, or
        released into a wait by a process of another version) is found by those, not by
        further ``Engine.run`` calls, whose own runs it does not hold back. Then the
        waiting runs it can take are handed the events kept for them that a worker killed
        after letting go of the run never handed over (flowloop/kept.py); the later
        recovery sweeps of a worker that keeps running do that again
        (:meth:`_hand_over_kept`)."""
        from flowloop.kept import hand_over_stranded
        from flowloop.parking import loaded_fingerprints, park_stranded_waits
        from flowloop.store.sql import SQLStore

        loaded = frozenset(
            (name, fingerprint)
            for name, fingerprints in loaded_fingerprints(self.workflows).items()
            for fingerprint in fingerprints
        )
        if loaded == self._parked_for or not isinstance(self.store, SQLStore):
            return
        park_stranded_waits(self.store, self.workflows, worker=self.worker_id, now=self.clock.now())
        failing = self._kept_looks.failing
        now = self.clock.now()
        hand_over_stranded(
            self.store, self.workflows, now=now, worker=self.worker_id, failing=failing
        )
        self._parked_for = loaded

    def _hand_over_kept(self) -> None:
        """At each recovery sweep after the first (which :meth:`_park_stranded_waits`
        does): hand the waiting runs no worker holds the events kept for them that they
        accept — a worker killed between the commit that entered the wait and its handing
        over left them there, and a fleet whose other workers keep running would otherwise
        leave them until some process starts. One read of the kept events when nothing is
        stranded (flowloop/kept.py); the runs it moves on are claimed at once."""
        from flowloop.kept import look_for_stranded

        handed = look_for_stranded(
            self.store,
            self.workflows,
            self._kept_looks,
            now=self.clock.now(),
            worker=self.worker_id,
        )
        if handed:
            self.wake()

    def _checked(
        self, workflow: Workflow, stored: StoredRun
    ) -> tuple[tuple[str, str, str] | None, BaseModel | None]:
        """Why this worker cannot run ``stored`` (the entry to finish it with: kind, reason,
        message), else ``None`` and its context as the check loaded it."""
        record = stored.record
        if stored.problem is not None:
            return (j.RUN_FAILED, "invalid_row", stored.problem), None
        verdict = self._verdict(workflow, record)
        if verdict.goes_on:
            return None, verdict.context
        # The reason says why, so `status` shows it without digging in the journal.
        kind = j.RUN_PAUSED if verdict.outcome == "paused" else j.RUN_FAILED
        return (kind, verdict.reason or "", verdict.message or ""), None

    def _verdict(self, workflow: Workflow, record: RunRecord) -> Verdict:
        """What this definition does with the run (flowloop/verdicts.py, as check says)."""
        same = record.fingerprint == workflow.fingerprint
        return judge(
            workflow,
            state=record.state,
            fingerprint=record.fingerprint,
            context=record.context,
            context_version=record.context_version,
            old=None if same else self.store.definition(record.fingerprint),
            journal=None if same else lambda: self.store.journal(record.id),
            versions=versions_of(self.workflows, workflow.name),
        )

    def _park_interrupted(self, workflow: Workflow, row: StoredRun, now: float) -> Boundary | None:
        """A run cut off in a state (or with a context) the deployed definition no longer
        fits is parked ``paused`` with the reason, not judged by a step spec it lacks."""
        record = row.record
        if record.fingerprint == workflow.fingerprint:
            return None
        verdict = self._verdict(workflow, record)
        if verdict.outcome != "paused":
            return None
        event = halt_entry(
            record,
            j.RUN_PAUSED,
            reason=verdict.reason or "",
            message=f"interrupted in attempt {record.attempt}; {verdict.message}",
            now=now,
            worker=self.worker_id,
            interrupted=record.attempt,
        )
        log.warning("run %s parked: %s", record.id, verdict.reason)
        return Boundary(
            events=[event],
            record=j.apply(record, event),
            fence=Fence(self.worker_id, row.lease_epoch),
            release=True,
        )

    # -- one run ---------------------------------------------------------------------------
