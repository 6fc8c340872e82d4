"""The pause and stop requests an operator leaves on the runs an executor drives.

The :class:`Requests` half of :class:`~flowloop.executor.Executor`: the lease thread polls
them (flowloop/leasethread.py) and hands them over; a boundary honours one (a pause, a
parent's pause, a stop) after reading it again, and its write is fenced on it (the store
clears a request only while the row still holds the one its writer saw).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from flowloop import journal as j
from flowloop.journal import JournalEvent, RunRecord
from flowloop.lifecycle import CONTROLS, PAUSES, STOP
from flowloop.store import Fence, Store
from flowloop.store.outage import is_outage

if TYPE_CHECKING:
    from flowloop.executor import _Active
    from flowloop.leasekeeper import LeaseKeeper

HONOUR_ATTEMPTS: Final = 8
"""How often a boundary honouring a request is written again after the request changed
under it (each time the row is read first): more changes than that in a row, and the run
is given up as lost (its lease runs out, and the next claim honours what the row holds)."""


class Requests:
    """Mixed into :class:`~flowloop.executor.Executor`, whose state it uses."""

    if TYPE_CHECKING:
        store: Store
        worker_id: str
        _active: dict[str, _Active]
        _controls: dict[str, str]
        _polled_pauses: set[str]
        leases: LeaseKeeper

        async def _finish(
            self,
            record: RunRecord,
            fence: Fence,
            events: list[JournalEvent],
            *,
            honoured: str | None = None,
            refused_is_lost: bool = True,
        ) -> bool: ...
        def _give_up(self, run_id: str, epoch: int) -> None: ...
        def _event(
            self, record: RunRecord, kind: str, offset: int = 1, **fields: Any
        ) -> JournalEvent: ...

    def apply_controls(self, requests: Mapping[str, str]) -> None:
        """Pending pause/stop requests (read by the lease thread, flowloop/leasethread.py).

        The requests are this worker id's: those of runs another executor drives (another
        thread's ``Engine.run``, a worker) are not kept — kept, they stayed for ever, and
        paused such a run again were this executor to drive it after an unpause. A drive
        given up here (lost) takes none.

        They come after every poll that found some, and a few after the last of those
        (flowloop.leasethread.QUIET_POLLS_HANDED), an overtaken one left out: a
        pause an earlier poll read that this one lacks was withdrawn (``unpause`` of a
        running run clears its request), and is dropped, unless the run's boundary has
        honoured it already."""
        for run_id in self._polled_pauses - requests.keys():
            if self._controls.get(run_id) in PAUSES:
                del self._controls[run_id]
        self._polled_pauses = set()
        for run_id, action in requests.items():
            active = self._active.get(run_id)
            if active is None or active.lost:
                continue
            self._controls[run_id] = action
            if action in PAUSES:
                self._polled_pauses.add(run_id)
            if action == STOP and active.step_task is not None:
                active.stopping_step = "stop"
                active.step_task.cancel()

    def _confirmed_control(self, run_id: str) -> str | None:
        """The request the run's row holds now, read again before a boundary honours one:
        the last poll's may be a poll old (a stop asked for since, a pause withdrawn by an
        unpause). The boundary is fenced on it too, for a change after this read. The
        database out: the last poll's (the write, fenced on it, waits for the database)."""
        try:
            action = self.store.pending_controls(worker=self.worker_id).get(run_id)
        except Exception as error:
            if not is_outage(error):
                raise
            return self._controls.get(run_id)
        return self._kept(run_id, action)

    def _kept(self, run_id: str, action: str | None) -> str | None:
        """``action`` as the run's request from now on (one of CONTROLS, else none)."""
        if action in CONTROLS:
            self._controls[run_id] = action
            return action
        self._controls.pop(run_id, None)
        return None

    async def _honour_control(self, record: RunRecord, fence: Fence) -> bool:
        """Honour the request a claimed run has before its step starts; False: none (or
        it was withdrawn meanwhile), the run goes on."""
        if record.id not in self._controls:
            return False
        action = self._confirmed_control(record.id)
        if action is None:
            return False

        def entries(honour: str) -> list[JournalEvent]:
            kind, data = j.control_entry(honour)
            return [self._event(record, kind, state=record.state, data=data)]

        return await self._commit_honouring(record, fence, action, entries) is not None

    async def _commit_honouring(
        self,
        record: RunRecord,
        fence: Fence,
        action: str,
        entries: Callable[[str], list[JournalEvent]],
    ) -> bool | None:
        """Commit the boundary ``entries(action)`` that honours ``action`` and lets the run
        go. Refused because the request changed since it was read (a stop asked for, a
        pause withdrawn) while the run is still this drive's: again with the request the
        row holds now, so neither the request nor a step's outcome in ``entries`` is lost.
        True: committed; ``None``: the request is gone, nothing written (the caller goes
        on); False: the run is lost to this drive (told as a lost lease)."""
        for _ in range(HONOUR_ATTEMPTS):
            if await self._finish(
                record, fence, entries(action), honoured=action, refused_is_lost=False
            ):
                return True
            lost, now = self._request_now(record, fence)
            if lost:
                break
            if now is None:
                return None
            action = now
        if not self.leases.fenced(record.id):  # (a fenced run is being given up already)
            self._give_up(record.id, fence.epoch)
        return False

    def _request_now(self, record: RunRecord, fence: Fence) -> tuple[bool, str | None]:
        """After a write honouring a request was refused: whether the run is lost to this
        drive, else the request its row holds now. Lost: no longer this drive's as
        ``record`` left it (another owner or epoch, its journal moved on, its lease fenced
        off here), or the database out (the refusal is then taken as the lease's loss)."""
        if self.leases.fenced(record.id):
            return True, None
        try:
            row = self.store.get_run(record.id)
        except Exception as error:
            if not is_outage(error):
                raise
            return True, None
        if (
            row is None
            or row.owner != self.worker_id
            or row.lease_epoch != fence.epoch
            or row.record.last_seq != record.last_seq
        ):
            return True, None
        # (The request as it was: changed and changed back, or the lease ended by the
        # database's clock; written again, a lease that ended refuses it again.)
        return False, self._kept(record.id, row.control)
