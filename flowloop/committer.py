"""Group commit of step boundaries, kept through database outages.

Boundaries submitted in the same event-loop turn share one transaction; a batch the
database refused for an outage is kept and retried with backoff (flowloop/store/outage.py
says what counts as one), so runs wait and none is failed or lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from flowloop import outagelog
from flowloop.errors import error_line
from flowloop.store import Boundary, Store
from flowloop.store.outage import is_outage

log = logging.getLogger("flowloop")

OUTAGE_BACKOFF_START: Final = 0.2
OUTAGE_BACKOFF_CAP: Final = 5.0
"""Seconds between attempts to reach a database that went away (at most; a third of the
lease when that is shorter, so a worker notices the database is back well within a lease)."""


def backoff_cap(lease_seconds: float) -> float:
    return min(OUTAGE_BACKOFF_CAP, max(OUTAGE_BACKOFF_START, lease_seconds / 3))


@dataclass
class Stats:
    """What an executor did (``Engine.run_until_idle`` returns it)."""

    steps: int = 0
    """Step attempts that succeeded."""
    commits: int = 0
    boundaries: int = 0
    lost_leases: int = 0
    recovered: int = 0
    outage_retries: int = 0
    attempts: int = 0
    """Step attempts that ran to an outcome: succeeded (``steps``), failed, timed out, or
    cut off by the run's deadline (``attempts - steps`` of them did not succeed)."""
    compensations: int = 0
    """Compensation attempts that ran to an outcome (succeeded or failed)."""


class Committer:
    """Group commit: boundaries submitted in the same event-loop turn share one transaction.

    The flush runs on the loop thread; while it commits, finished steps queue up and form
    the next batch, so the batch grows with the load without any timer.

    When the database is unreachable the batch is kept and retried with backoff: runs wait,
    none is failed or lost. A retried boundary that the store now refuses may have been
    committed just before the connection dropped; the stored row says which.
    """

    def __init__(self, store: Store, stats: Stats, *, cap: float = OUTAGE_BACKOFF_CAP) -> None:
        self.store = store
        self.stats = stats
        self.cap = cap
        self._outage = outagelog.Part("writes")
        self._pending: list[tuple[Boundary, asyncio.Future[bool]]] = []
        self._scheduled = False
        self._retrying: list[tuple[Boundary, asyncio.Future[bool]]] = []
        self._backoff = 0.0
        """The last retry gap (doubled at each failed retry, back to 0 after a write)."""
        self._timer: asyncio.TimerHandle | None = None
        """The retry of a kept batch, while one is due. Every boundary submitted meanwhile
        joins it; with no retry due, :meth:`submit` schedules a flush itself — also after
        every kept boundary's run was fenced off (the retry found nothing left to write),
        which used to leave the committer waiting for a retry that never came."""
        self.fenced: Callable[[str], bool] = lambda run_id: False
        """Whether a run is fenced off (its lease deadline passed unrenewed): a boundary of
        it still queued is not written (the executor's own check comes before it queues)."""
        self.released: set[str] = set()
        """Runs whose releasing boundary was applied (their owner let go of them), noted at
        commit time, before the waiting task resumes (the heartbeat must not take the
        missing lease for a lost one)."""

    def submit(self, boundary: Boundary, *, alone: bool = False) -> asyncio.Future[bool]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._pending.append((boundary, future))
        # While a retry is due (``_timer``), that flush takes the new boundaries along; in
        # every other state something must be scheduled, or the boundary waits for ever.
        if self._scheduled or self._timer is not None:
            return future
        if alone and not self._retrying:
            # One run in flight: nothing can join the batch, so write now and save two
            # event-loop turns (the flush callback, then waking the awaiting run).
            self._flush()
            return future
        self._scheduled = True
        loop.call_soon(self._flush)
        return future

    def write_now(self, boundary: Boundary) -> bool | asyncio.Future[bool]:
        """:meth:`submit` with ``alone=True`` for the usual boundary of a run driven alone:
        written at once and its verdict returned, without a future to create, resolve and
        await, when nothing else is queued or kept. A future otherwise (something queued,
        or the database is out: the boundary is kept and retried, see :meth:`submit`)."""
        if self._pending or self._scheduled or self._timer is not None or self._retrying:
            return self.submit(boundary, alone=True)
        try:  # (not queued: the caller has just looked whether the run is fenced off)
            applied = self.store.write([boundary])[0]
        except Exception as error:
            if not is_outage(error):
                self._backoff = 0.0
                raise
            future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._retry_later([(boundary, future)], error)
            return future
        self._written(1)
        self._settled(boundary, applied)
        return applied

    def _written(self, boundaries: int) -> None:
        if self._backoff:  # (written after an outage)
            self._outage.answered()
        self._backoff = 0.0
        self.stats.commits += 1
        self.stats.boundaries += boundaries

    def _settled(self, boundary: Boundary, applied: bool) -> None:
        if applied and boundary.release:
            self.released.add(boundary.run_id)

    def _flush(self) -> None:
        self._scheduled = False
        self._timer = None
        retried, self._retrying = self._retrying, []
        queued, self._pending = self._pending, []
        # A cancelled waiter (its run was abandoned: lease lost, cut off) must not have
        # its boundary written after the fact. (Once per boundary: no call that need not be.)
        fenced = self.fenced
        batch = []
        boundaries = []
        for entry in retried + queued if retried else queued:
            boundary, future = entry
            if future.cancelled():
                continue
            if boundary.fence.owner is not None and fenced(boundary.record.id):
                future.set_result(False)
                continue
            batch.append(entry)
            boundaries.append(boundary)
        if not batch:
            return
        try:
            results = self.store.write(boundaries)
        except Exception as error:
            if not is_outage(error):
                self._backoff = 0.0
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                return
            self._retry_later(batch, error)
            return
        self._written(len(batch))
        if retried:
            retried_ids = {id(boundary) for boundary, _ in retried}
            results = [
                applied or (id(boundary) in retried_ids and self._already_applied(boundary))
                for boundary, applied in zip(boundaries, results, strict=True)
            ]
        released = self.released
        for (boundary, future), applied in zip(batch, results, strict=True):
            if applied and boundary.release:  # (:meth:`_settled`, without its call)
                released.add(boundary.record.id)
            if not future.done():
                future.set_result(applied)

    def _retry_later(
        self, batch: list[tuple[Boundary, asyncio.Future[bool]]], error: Exception
    ) -> None:
        self._retrying = batch
        self._backoff = min(self.cap, max(OUTAGE_BACKOFF_START, self._backoff * 2))
        self.stats.outage_retries += 1
        log.log(
            self._outage.failed(),
            "writes: database %s (%s); %d boundary write(s) kept, retrying in %.1fs",
            outagelog.cause(error),
            error_line(error),
            len(batch),
            self._backoff,
        )
        self._timer = asyncio.get_running_loop().call_later(self._backoff, self._flush)

    def _already_applied(self, boundary: Boundary) -> bool:
        try:
            stored = self.store.get_run(boundary.run_id)
        except Exception:
            return False
        return (
            stored is not None
            and stored.record.last_seq == boundary.record.last_seq
            and stored.lease_epoch == boundary.fence.epoch
            and stored.record.status == boundary.record.status
        )
