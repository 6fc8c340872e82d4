"""Operating loops from the engine: list them, pause, stop, unpause, trigger, backfill."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowloop import loop_requests
from flowloop.clock import Clock
from flowloop.errors import FlowloopError, InvalidTransition, UnknownLoop
from flowloop.loop_slots import INTERRUPTED_MESSAGE
from flowloop.operations import _user
from flowloop.store import Store
from flowloop.store.loops import LoopEvent, LoopRow, LoopStoreMixin

CHANGING_TRIES = 8
"""Reads of a loop an operator's fenced write makes before it gives up (a worker changing
the loop as often: a refusal that says so)."""


class LoopControls:
    """Mixed into :class:`~flowloop.engine.Engine`, whose store and clock it uses."""

    if TYPE_CHECKING:
        store: Store
        clock: Clock

    def _loop_store(self) -> LoopStoreMixin:
        if not isinstance(self.store, LoopStoreMixin):
            raise FlowloopError("this store does not keep loops")
        return self.store

    def loops(self) -> list[LoopRow]:
        """Every loop a worker has registered in this database."""
        return self._loop_store().list_loops()

    def loop(self, name: str) -> LoopRow:
        row = self._loop_store().get_loop(name)
        if row is None:
            raise UnknownLoop(name)
        return row

    def loop_history(self, name: str, *, limit: int = 1000) -> list[LoopEvent]:
        """The loop's last ``limit`` journal entries, oldest first."""
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise FlowloopError(f"limit={limit!r} must be a whole number of entries, 0 or more")
        self.loop(name)
        return self._loop_store().loop_journal(name, limit=limit)

    def pause_loop(self, name: str) -> LoopRow:
        """Pause a loop: at once if it is waiting, after the running iteration otherwise."""
        return self._loop_control(name, "pause")

    def stop_loop(self, name: str) -> LoopRow:
        """Stop a loop; a running iteration is cancelled."""
        return self._loop_control(name, "stop")

    def unpause_loop(self, name: str) -> LoopRow:
        """Resume a paused (or stopped) loop; its worker picks the next slot from now. A
        pause still pending (its iteration runs) is withdrawn instead."""
        for _ in range(CHANGING_TRIES):
            # Each write is fenced on the row as read; refused (the iteration ended and
            # its worker honoured the pause meanwhile, …), the loop is read again. Before,
            # such an unpause returned with the loop paused.
            row = self.loop(name)
            if row.status not in ("paused", "stopped"):
                if row.control != "pause":
                    raise InvalidTransition(name, row.status, "unpause", what="loop")
                if self._loop_store().withdraw_loop_pause(row):
                    return self.loop(name)
                continue
            unpaused = {
                "status": "scheduled",
                "next_fire_at": None,
                "reason": None,
                "consecutive_failures": 0,
            }
            if self._loop_write(row, "loop_unpaused", unpaused):
                return self.loop(name)
        raise FlowloopError(
            f"loop {name!r} kept changing; look at `flowloop loops {name}` and try again"
        )

    def trigger_loop(self, name: str) -> LoopRow:
        """Ask the loop's worker for one iteration now, journaled ``manual`` (never while
        another iteration of the loop runs); the schedule is unchanged."""
        loop_requests.ask(
            self._loop_store(), self.loop(name), loop_requests.TRIGGER, now=self.clock.now()
        )
        return self.loop(name)

    def backfill_loop(self, name: str, request: loop_requests.BackfillRequest) -> LoopRow:
        """Ask the loop's worker to run the slots of ``request``'s range that never started,
        one at a time (journaled ``backfill``, ended by ``backfill_finished``)."""
        loop_requests.ask(
            self._loop_store(),
            self.loop(name),
            loop_requests.BACKFILL,
            request,
            now=self.clock.now(),
        )
        return self.loop(name)

    def withdraw_loop_request(self, name: str) -> LoopRow:
        """Withdraw the loop's pending trigger, or the rest of its backfill: an iteration
        running now finishes; no manual one starts after it (journaled
        ``request_withdrawn`` when the loop waits for its slot)."""
        store = self._loop_store()
        for _ in range(CHANGING_TRIES):  # (a worker fired or finished meanwhile: read again)
            row = self.loop(name)
            if row.control not in loop_requests.MANUAL:
                raise loop_requests.LoopRequestRefused(
                    f"loop {name!r} has no trigger or backfill pending"
                    + (f" ({row.control} requested)" if row.control else "")
                )
            event = LoopEvent(
                loop=name,
                kind="request_withdrawn",
                at=self.clock.now(),
                worker=f"operator:{_user()}",
                data={"request": row.control},
            )
            if store.withdraw_loop_run(row, event):
                return self.loop(name)
        raise loop_requests.LoopRequestRefused(
            f"loop {name!r} kept changing; look at `flowloop loops {name}` and try again"
        )

    def _loop_control(self, name: str, action: str) -> LoopRow:
        row = self.loop(name)
        target = "paused" if action == "pause" else "stopped"
        if row.status == target:
            return row
        if row.status == "stopped":
            raise InvalidTransition(name, row.status, action, what="loop")
        if row.status == "running":
            if not self._settle_lapsed(row, target):
                self._loop_store().request_loop_control(name, action)
        elif not self._loop_write(
            row,
            f"loop_{target}",
            {"status": target, "next_fire_at": None, "reason": f"{target} by {_user()}"},
        ):
            self._loop_store().request_loop_control(name, action)
        return self.loop(name)

    def _settle_lapsed(self, row: LoopRow, target: str) -> bool:
        """Pause or stop a loop left running by a worker whose lease has run out (killed,
        gone): its iteration journaled interrupted, as a worker's recovery would — which
        may never come when no worker defines the loop any more. Fenced like an operator's
        write: False (nothing written) while a live worker holds the loop."""
        now, who = self.clock.now(), f"operator:{_user()}"
        reason = f"{target} by {_user()}"
        events = [
            LoopEvent(
                loop=row.name,
                kind="iteration_interrupted",
                at=now,
                slot=row.last_slot,
                worker=who,
                error_type="Interrupted",
                error_message=INTERRUPTED_MESSAGE,
            ),
            LoopEvent(loop=row.name, kind=f"loop_{target}", at=now, worker=who),
        ]
        return self._loop_store().write_loop(
            name=row.name,
            owner=None,
            epoch=row.lease_epoch,
            follows_seq=row.last_seq,
            changes={
                "status": target,
                "next_fire_at": None,
                "reason": reason,
                "control": None,
                "last_result": "interrupted",
                "last_error": INTERRUPTED_MESSAGE,
                "last_ended_at": now,
                "iterations": row.iterations + 1,
                "consecutive_failures": row.consecutive_failures + 1,
                "updated_at": now,
            },
            events=events,
        )

    def _loop_write(self, row: LoopRow, kind: str, changes: dict[str, Any]) -> bool:
        now = self.clock.now()
        event = LoopEvent(loop=row.name, kind=kind, at=now, worker=f"operator:{_user()}")
        return self._loop_store().write_loop(
            name=row.name,
            owner=None,
            epoch=row.lease_epoch,
            follows_seq=row.last_seq,
            changes={**changes, "control": None, "updated_at": now},
            events=[event],
        )
