"""What an operator does to runs: pause, stop, unpause, send an event, retry, migrate.

The :class:`Operations` half of :class:`~flowloop.engine.Engine`: every write here is one
fenced journal entry on a run nobody owns (a run a worker holds gets a request instead,
which the worker honours at its next step boundary).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final, cast

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from flowloop import children, starts
from flowloop import journal as j
from flowloop.clock import Clock
from flowloop.definition import Workflow
from flowloop.errors import (
    DefinitionError,
    DefinitionMismatch,
    FlowloopError,
    InvalidEvent,
    InvalidTransition,
    NoFreeSlot,
)
from flowloop.events import (
    EventRefused,
    NotWaiting,
    accepted,
    accepts,
    asleep_before,
    asleep_until,
    check_bufferable,
    check_payload_keys,
    declared_payloads,
    due_before_pause,
    entering,
    payload_json,
    receive,
    sleep_end,
    stored_wait_due,
    wait_due,
)
from flowloop.journal import JournalEvent, RunRecord
from flowloop.kept import refusal, try_deliver_pending
from flowloop.lifecycle import FINISHED, PARENT_PAUSE, PARENT_PAUSED, PAUSE, PAUSES, STOP
from flowloop.limits import MAX_NAME_LENGTH, check_finite, check_key, check_text
from flowloop.runinfo import RunInfo, SendResult
from flowloop.store import Boundary, Fence, InboxEvent, NewRun, Store, StoredRun
from flowloop.store.entries import stored_waits
from flowloop.store.joins import JoinStoreMixin
from flowloop.versions import Registry

if TYPE_CHECKING:
    from flowloop.engine import Engine
    from flowloop.executor import Listener
    from flowloop.migration import Moved

SEND_ATTEMPTS: Final = 200
SEND_RETRY_SECONDS: Final = 0.01
SEND_HOLD_SECONDS: Final = 2.0
"""How long ``send`` (without ``buffer``) waits for a worker to let go of a waiting run."""


STOPPING: Final = "stopping"
"""What a run with a stop pending is called when a pause is refused."""


class Operations:
    """Mixed into :class:`~flowloop.engine.Engine`, whose state it uses."""

    if TYPE_CHECKING:
        store: Store
        clock: Clock
        worker_id: str
        direct_listeners: list[Listener]
        _workflows: Registry

        def _stored(self, run_id: str) -> StoredRun: ...
        def _info(
            self, stored: StoredRun, parsed: tuple[str, BaseModel] | None = None
        ) -> RunInfo: ...
        def _workflow_for(self, record: RunRecord) -> Workflow | None: ...
        def get(self, run_id: str) -> RunInfo: ...
        def resolve(self, run_id: str) -> str: ...
        def workflow(self, name: str) -> Workflow: ...

    def _whole(self) -> Engine:
        """This object as the engine it is part of (the helpers it calls take the engine)."""
        return cast("Engine", self)

    def migrate(self, run_id: str, *, to: int, by: str | None = None) -> RunInfo:
        """Move a live run to version ``to`` of its workflow (registered, declaring
        ``migrates_from`` for the run's version); journaled with who, from and to. A run
        parked for a mismatch goes on. Raises FlowloopError saying why it cannot move."""
        from flowloop.migration import migrate_run

        stored = self._stored(run_id)
        migrate_run(self._whole(), stored, to=to, by=by or _user())
        return self.get(stored.id)

    def migrate_workflow(self, name: str, *, to: int, by: str | None = None) -> list[Moved]:
        """:meth:`migrate` every live run of ``name`` below version ``to``."""
        from flowloop.migration import migrate_all

        return migrate_all(self._whole(), name, to=to, by=by or _user())

    def operate(
        self, stored: StoredRun, kind: str, *, join_to: str | None = None, **fields: Any
    ) -> bool:
        """Write one operator entry on a run nobody owns (fenced); False if it moved.
        ``join_to``: the id of the join of the call or map state the entry renames (to
        ``fields["state"]``), moved to that state in the same transaction."""
        if join_to is None:
            return self._operate(stored, kind, **fields)
        boundary = self._operator_boundary(stored, kind, **fields)
        store = self.store
        if not isinstance(store, JoinStoreMixin):  # (joins exist on the SQL store only)
            raise FlowloopError("a call or map state's join needs the SQL store")
        state = fields["state"]
        written = store.rename_join(boundary, join_to, state, boundary.record.visit(state))
        if written:
            self._tell(boundary)
        return written

    def _operate(self, stored: StoredRun, kind: str, **fields: Any) -> bool:
        """Write one operator event on a run nobody owns. False if someone owns it."""
        boundary = self._operator_boundary(stored, kind, **fields)
        written = self.store.write([boundary])[0]
        if written:
            self._tell(boundary)
        return written

    def _operator_boundary(self, stored: StoredRun, kind: str, **fields: Any) -> Boundary:
        """One operator event on a run nobody owns, fenced on its row as read."""
        record = stored.record
        event = JournalEvent(
            run_id=record.id,
            seq=record.last_seq + 1,
            kind=kind,
            at=self.clock.now(),
            worker=f"operator:{_user()}",
            **fields,
        )
        return Boundary(
            events=[event],
            record=j.apply(record, event),
            fence=Fence(None, stored.lease_epoch),
            clear_control=_clears_request(kind, stored.control),
            seen_control=stored.control,  # a request made since: refused, the caller looks again
        )

    def _retry_child(self, stored: StoredRun, **fields: Any) -> bool:
        """An operator's retry of a map's (or call's) child: while its parent is still in
        that state and visit, its join takes its end back and the child runs as one of
        ``max_parallel`` — refused (NoFreeSlot) when that many run already
        (flowloop/store/joins.py)."""
        store = self.store
        if not isinstance(store, JoinStoreMixin):  # (children exist on the SQL store only)
            return self._operate(stored, j.RUN_RETRIED, **fields)
        boundary = self._operator_boundary(stored, j.RUN_RETRIED, **fields)
        outcome, join = store.retry_child(boundary)
        if outcome == "full" and join is not None:
            raise NoFreeSlot(stored.id, join.parent_id, join.max_parallel)
        if outcome == "joining" and join is not None:
            raise FlowloopError(
                f"run {stored.id}'s parent {join.parent_id} is taking its children's results "
                "now: retry it once its worker has let it go (a dead worker's lease runs out)"
            )
        if outcome == "written":
            self._tell(boundary)
        return outcome == "written"

    def _tell(self, boundary: Boundary) -> None:
        self._tell_events(boundary.record, boundary.events)

    def _tell_created(self, new: NewRun) -> None:
        self._tell_events(new.record, new.events)

    def _tell_events(self, record: RunRecord, events: Sequence[JournalEvent]) -> None:
        for listener in self.direct_listeners:
            try:
                listener(record, events)
            except Exception:  # a listener must never break an operator's write
                logging.getLogger("flowloop.engine").exception("listener failed")

    def pause(self, run_id: str) -> RunInfo:
        """Pause a run: at once if it is queued, else at its next step boundary. A stop
        asked for already wins: the pause is refused (InvalidTransition, "stopping"). Its
        live children pause too (unpausing it unpauses those, not a child paused itself)."""
        return self._control(run_id, PAUSE)

    def stop(self, run_id: str) -> RunInfo:
        """Stop a run for good (until an operator retries it); a running step is cancelled."""
        return self._control(run_id, STOP)

    def _control(self, run_id: str, action: str) -> RunInfo:
        stored = self._stored(run_id)
        run_id = stored.id
        status = stored.record.status
        if status in FINISHED:
            if action == STOP and status == "stopped":
                return self._info(stored)  # done already, as a pause of a paused run
            raise InvalidTransition(run_id, status, action)
        if action in PAUSES and stored.control == STOP:
            # Its owner stops it at its next boundary, or its claim does (paused already).
            raise InvalidTransition(run_id, STOPPING, action)
        if action in PAUSES and status == "paused":
            if action == PAUSE and stored.record.reason == PARENT_PAUSED:
                # Paused by its parent, now by an operator too: the pause becomes its own,
                # and unpausing the parent leaves it. (Moved meanwhile: as it now is.)
                if not self._operate(stored, j.RUN_PAUSED, state=stored.record.state):
                    return self._control(run_id, action)
                return self.get(run_id)
            return self._info(stored)
        # Stop and pause cascade to the run's live children (and theirs): a stop before
        # the run's own, a pause after it (a pause refused leaves its children as they were).
        if action == STOP and children.has_live_children(self.store, run_id):
            # Asked of the run first: the children's stops complete its join and make it
            # due, and a worker claiming it before its own stop lands honours this request
            # instead of joining them (it took its failure route, the stop lost on a finished
            # run). A command cut off after this leaves the request for that claim.
            self.store.request_control(run_id, STOP)
            children.cascade(self.store, run_id, STOP, self._control)
            stored = self._stored(run_id)  # (with the request it now has to clear)
            if stored.record.status in FINISHED:
                return self._control(run_id, action)  # (stopped: done; else refused)
        requested = self._request(stored, action)
        if requested and action == STOP:
            # Again: a worker fanning the run out meanwhile made children the first read
            # did not see, and its fan-out let the run go before this request landed (the
            # stop written for it then, by _honour_if_let_go, cascades no further).
            children.cascade(self.store, run_id, STOP, self._control)
        if requested and action in PAUSES:
            children.cascade(self.store, run_id, PARENT_PAUSE, self._control)
            after = self._stored(run_id)
            if after.record.status != "paused" and after.control not in PAUSES:
                self._unpause_children(run_id)  # unpaused while its pause reached them
        return self.get(run_id)

    def _request(self, stored: StoredRun, action: str) -> bool:
        """Pause or stop a run now when nobody owns it, else ask its owner to at its next
        boundary. A pause leaves a stop asked for meanwhile in place, and is refused
        (InvalidTransition); a parent's pause leaves the child's own pause or stop in
        place, or the child paused meanwhile, and is not made (False)."""
        kind, data = j.control_entry(action)
        if action == PARENT_PAUSE and stored.control in (PAUSE, STOP):
            return False  # its own request stays, honoured when it is claimed
        if stored.record.status != "running":
            if self._operate(stored, kind, state=stored.record.state, data=data):
                return True
            moved = self._stored(stored.id)  # claimed, paused or ended meanwhile
            if action in PAUSES and moved.record.status == "paused":
                return action == PAUSE
        unless = {PAUSE: (STOP,), PARENT_PAUSE: (STOP, PAUSE)}.get(action, ())
        if self.store.request_control(stored.id, action, unless=unless):
            self._honour_if_let_go(stored.id, action)
            return True
        if action == PARENT_PAUSE:
            return False
        raise InvalidTransition(stored.id, STOPPING, action)

    def _honour_if_let_go(self, run_id: str, action: str) -> None:
        """A stop or pause asked of a run's owner that let go of the run meanwhile (into a
        wait without a timeout, a pause: no claim would come to honour it, and a parent's
        unpause would clear it): written now, as for a run nobody owns, fenced on the
        request (claimed since: its claimer honours it). A pause of a run paused by its
        parent makes the pause its own; a run paused already otherwise stays as it is."""
        moved = self._stored(run_id)
        record = moved.record
        let_go = moved.owner is None and record.status not in ("running", *FINISHED)
        paused = record.status == "paused"
        made_own = action == PAUSE and record.reason == PARENT_PAUSED
        if let_go and moved.control == action and (action == STOP or not paused or made_own):
            kind, data = j.control_entry(action)
            self._operate(moved, kind, state=record.state, data=data)

    def unpause(self, run_id: str) -> RunInfo:
        return self._unpause(run_id, cascaded=False)

    def _unpause(self, run_id: str, *, cascaded: bool, tries: int = 3) -> RunInfo:
        """Unpause a run, or withdraw the pause it has not honoured yet; ``cascaded``: only
        a pause its parent's cascaded (the parent is being unpaused), looked at again here,
        not an operator's own made since the parent listed its children."""
        stored = self._stored(run_id)
        run_id = stored.id
        pauses = (PARENT_PAUSE,) if cascaded else PAUSES
        pending = stored.control
        if stored.record.status != "paused" and pending is not None and pending in pauses:
            # Not paused yet: withdraw the pause it has not honoured, that request only (a
            # stop asked for meanwhile stays).
            if self.store.withdraw_control(run_id, pending):
                self._unpause_children(run_id)
                return self.get(run_id)
            stored = self._stored(run_id)  # honoured or replaced meanwhile: look again
        record = stored.record
        if record.status != "paused" or (cascaded and record.reason != PARENT_PAUSED):
            raise InvalidTransition(run_id, record.status, "unpause")
        if cascaded and stored.control == PAUSE:
            # An operator's pause landed on it while its parent's held it: the pause is
            # its own now, and stays (unpausing would clear the request, the pause lost).
            self._operate(stored, j.RUN_PAUSED, state=record.state)
            return self.get(run_id)
        workflow = self._workflow_for(record)
        data: dict[str, Any] = {}
        by_stored = False
        held = record.join is not None and children.is_held(self.store, run_id)
        slept = None if held else self._sleep_end(workflow, record)
        if held:
            data["due"] = None  # a map's child paused before its turn: held again
        elif slept is not None:
            # Paused asleep before its state (step.sleep): it sleeps on, due when the sleep
            # ends (at once if that has passed); before a wait or final state it takes no
            # event before (a step, call, map or compensating state just starts then).
            data.update({"due": slept[0], **({j.ASLEEP: True} if slept[1] else {})})
        elif workflow is not None and record.state in workflow.waits:
            # Back to waiting: due when its timeout was due (at once if that has passed),
            # never before, and not at all without a timeout.
            data["due"] = wait_due(workflow, record.state, self.store.journal(run_id))
        elif workflow is None and self._waits_by_stored_definition(record):
            # Unpaused by a process without the definition (`flowloop unpause` without -w):
            # the timeout its entry stored, not at once — unless events were kept for it:
            # due at once, its claim hands them over (and judges the timeout by the journal).
            found, due = stored_wait_due(record.state, self.store.journal(run_id))
            by_stored = found and not self.store.pending_events(run_id)
            if by_stored:
                data["due"] = due
        else:
            # Due when it was due before its pause (at once if that has passed): a run
            # started for later (run_at), backing off before a retry, deferred by a rate
            # limit (its place in the limit's queue kept: the reason says it) or a breaker,
            # or debounced; read from the journal (also without the definition).
            # Paused in a wait and migrated out of it since: due at once, not at the
            # timeout of the wait it left.
            before, reason = due_before_pause(
                self.store.journal(run_id), waited=self._waits_in_definition
            )
            if before is not None and before > self.clock.now():
                data["due"] = before
            if reason is not None:
                data["reason"] = reason
        if not self._operate(stored, j.RUN_UNPAUSED, state=record.state, data=data):
            if tries > 1:  # moved meanwhile (a map child's turn journaled): look again
                return self._unpause(run_id, cascaded=cascaded, tries=tries - 1)
            raise FlowloopError(f"run {run_id} changed while unpausing; try again")
        if held:
            self._due_if_its_turn_came_meanwhile(run_id)
        elif "due" in data and workflow is not None:
            # Events kept while it was paused: the run takes them now (else its claim does).
            self._hand_over_kept(run_id)
        elif by_stored:
            self._due_if_kept_meanwhile(run_id)
        self._unpause_children(run_id)
        return self.get(run_id)

    def _due_if_its_turn_came_meanwhile(self, run_id: str) -> None:
        """A map's child unpaused as held (no due time) whose turn came between that look
        and the write: the release's due time was written over (a child in a step state
        has no turn entry to refuse the write), and it waited for ever, its slot taken
        (review). Released due at once instead. (Claimed or moved meanwhile: its holder
        goes on.)"""
        if children.is_held(self.store, run_id):
            return
        stored = self._stored(run_id)
        record = stored.record
        if stored.owner is None and record.status == "scheduled" and record.next_run_at is None:
            data = {"reason": j.TURN_REASON}
            self._operate(stored, j.RUN_RELEASED, state=record.state, data=data)

    def _due_if_kept_meanwhile(self, run_id: str) -> None:
        """A definition-less unpause set the timeout's due time (or none, for a wait
        without one): an event kept after it looked (its sender saw the run paused, so
        handed nothing over) would wait for that timeout, or for ever. Released due at once
        instead; its claim hands the event over. (Moved on meanwhile, or claimed: whoever
        holds it takes the event.)"""
        if not self.store.pending_events(run_id):
            return
        stored = self._stored(run_id)
        if stored.owner is None and stored.record.status == "scheduled":
            data = {"reason": "events were kept for it"}
            self._operate(stored, j.RUN_RELEASED, state=stored.record.state, data=data)

    def _sleep_end(self, workflow: Workflow | None, record: RunRecord) -> tuple[float, bool] | None:
        """When the sleep the run was paused in before its state ends (it had not entered
        or begun the state yet), and whether it sleeps ``asleep`` (before a wait or final
        state); else ``None``."""
        events = self.store.journal(record.id)
        if workflow is None:  # (definition-less: the stored one's waits, the entry's flag)
            wait = self._waits_by_stored_definition(record)
            end = sleep_end(record.state, events, wait=wait)
            return None if end is None else (end, asleep_until(record.state, events) is not None)
        end = sleep_end(record.state, events, wait=record.state in workflow.waits)
        return None if end is None else (end, asleep_before(workflow, record.state))

    def _waits_by_stored_definition(self, record: RunRecord) -> bool:
        """Whether the run's state is a wait state by the definition stored with its runs."""
        return self._waits_in_definition(record.fingerprint, record.state)

    def _waits_in_definition(self, fingerprint: str, state: str) -> bool:
        """Whether ``state`` is a wait state by the stored definition ``fingerprint``."""
        return state in stored_waits(self.store.definition(fingerprint))

    def _unpause_children(self, run_id: str) -> None:
        for child in children.paused_children(self.store, run_id):
            with contextlib.suppress(FlowloopError):  # unpaused, paused again or ended
                self._unpause(child, cascaded=True)

    def send(
        self,
        run_id: str,
        event: str,
        payload: Mapping[str, Any] | BaseModel | None = None,
        *,
        dedupe_key: str | None = None,
        buffer: bool = False,
    ) -> SendResult:
        """Send ``event`` to a run waiting in a wait state that accepts it: the payload is
        validated and merged into the context, the event journaled, and the run moves on.

        Not accepted now: with ``buffer=True`` the event is kept until the run reaches a
        state that accepts it, else InvalidEvent lists what the state accepts. The same
        ``dedupe_key`` twice for one run has effect once (``status == "duplicate"``). A
        payload mapping with a key that no field of the event's payload model takes is
        refused (:class:`~flowloop.events.UnknownPayloadField`, nothing written; see
        :func:`~flowloop.events.check_payload_keys`).
        """
        run_id = self.resolve(run_id)
        given = payload  # (a mapping's keys are checked: UnknownPayloadField)
        if isinstance(payload, BaseModel):
            payload = payload_json(payload, self._declared_payloads(run_id, event))
        check_key("dedupe key", dedupe_key)
        check_finite("payload", payload)
        check_text("event", event, MAX_NAME_LENGTH)
        message = InboxEvent(
            run_id=run_id,
            event=event,
            payload=None if payload is None else json.dumps(payload, sort_keys=True),
            dedupe_key=dedupe_key,
            sent_at=self.clock.now(),
            sender=f"{_user()}@{self.worker_id}",
        )
        hold_until = time.monotonic() + SEND_HOLD_SECONDS
        for _ in range(SEND_ATTEMPTS):
            stored = self._stored(run_id)
            if dedupe_key is not None and self.store.has_message(run_id, dedupe_key):
                return SendResult(status="duplicate", run=self._info(stored))
            record = stored.record
            if record.status in FINISHED:
                raise InvalidTransition(run_id, record.status, f"send {event!r} to")
            self.workflow(record.workflow)  # UnknownWorkflow unless registered
            workflow = self._workflows.for_run(record)
            self._refuse_mismatch(workflow, record)
            waiting_here = accepts(workflow, record, event)
            here = record.state if waiting_here else None
            check_payload_keys(workflow, event, given, state=here, buffer=buffer)
            # A map's child held back takes no event before its turn (taken, it would go on
            # beside the max_parallel running): kept, and handed over when its turn comes.
            held = waiting_here and record.join is not None and self.is_held(run_id)
            if waiting_here and stored.owner is None and not held:
                if self._deliver_kept(workflow, record):
                    continue  # events kept earlier went first (in order): look again
                try:
                    received, after = receive(
                        workflow,
                        record,
                        event,
                        message.payload,
                        now=self.clock.now(),  # not sent_at: after a wait, later than the holder's
                        worker=message.sender or "",
                        extra={"dedupe_key": dedupe_key} if dedupe_key else None,
                    )
                except FlowloopError:
                    raise
                except Exception as error:  # the state's handler (user code) refused it
                    raise EventRefused(record.state, event, error) from error
                boundary = Boundary(
                    events=[received], record=after, fence=Fence(None, stored.lease_epoch)
                )
                result = self.store.deliver(message, boundary)
                if result == "conflict":
                    time.sleep(SEND_RETRY_SECONDS)  # another writer moved the run: look again
                    continue
                if result == "applied":
                    self._tell(boundary)
                if result == "applied" and after.state in workflow.waits:
                    # It waits again (maybe in another wait state): take what was kept for it.
                    self._hand_over_kept(run_id)
            elif waiting_here and not buffer and not held and time.monotonic() < hold_until:
                # A worker holds the waiting run for a moment (its timeout is firing, or a
                # kept event is being handed over): look again once it lets go, so the
                # sender learns whether the event was taken or came too late, instead of
                # it being kept behind a timeout that may end the run.
                self._wait_while_held(run_id, stored.owner, hold_until)
                continue
            elif buffer or waiting_here:
                # Busy (a worker holds it) or not there yet: keep it for later, unless it
                # could never be taken (no wait state accepts it, or its payload is invalid).
                check_bufferable(
                    workflow, event, message.payload, state=record.state if waiting_here else None
                )
                if workflow.bounds.max_inbox is not None:
                    result = starts.keep_bounded(self._whole(), workflow, message)  # backpressure
                else:
                    result = self.store.deliver(message, None)
                if result == "buffered":
                    self._hand_over_kept(run_id)
            elif event in accepted(workflow, record.state):
                asleep = record.reason == j.ASLEEP
                raise NotWaiting(run_id, record.status, record.state, event, asleep=asleep)
            else:
                raise InvalidEvent(record.state, event, accepted(workflow, record.state))
            return SendResult(status=result, run=self.get(run_id))
        raise FlowloopError(f"run {run_id} kept changing while sending {event!r}; try again")

    def _declared_payloads(self, run_id: str, event: str) -> list[type[BaseModel]]:
        """The payload models the run's definition declares for ``event`` (none when it
        cannot be told here: what refuses the send is said below, as before)."""
        try:
            record = self._stored(run_id).record
            return declared_payloads(self._workflows.for_run(record), event)
        except (FlowloopError, KeyError):
            return []

    def is_held(self, run_id: str) -> bool:
        """Whether the run is a map's child held back by ``max_parallel`` (its turn has not
        come yet: it takes no event and runs no step before)."""
        return children.is_held(self.store, run_id)

    def _refuse_mismatch(self, workflow: Workflow, record: RunRecord) -> None:
        """Raise DefinitionMismatch (one line, nothing changed) when the deployed definition
        cannot take the run on (flowloop/verdicts.py); a worker parks such a run."""
        verdict = refusal(self.store, workflow, record)
        if verdict is not None:
            raise DefinitionMismatch(record.id, verdict.reason or "")

    def _hand_over_kept(self, run_id: str) -> int | None:
        """Give a waiting run the events kept for it that it accepts now (see
        :func:`try_deliver_pending`)."""
        return try_deliver_pending(
            self.store, self._workflows, run_id, now=self.clock.now(), worker=self.worker_id
        )

    def _wait_while_held(self, run_id: str, owner: str | None, until: float) -> None:
        """Poll until ``owner`` lets go of the run (or ``until``, on the monotonic clock)."""
        while time.monotonic() < until:
            time.sleep(SEND_RETRY_SECONDS)
            stored = self.store.get_run(run_id)
            if stored is None or stored.owner != owner:
                return

    def _deliver_kept(self, workflow: Workflow, record: RunRecord) -> bool:
        """Before an event is applied to a waiting run, hand it the events kept for it that
        it accepts now, oldest first: a sender's events are journaled in the order sent.
        True when the run may have moved (look again)."""
        if not any(
            accepts(workflow, record, message.event)
            for message in self.store.pending_events(record.id)
        ):
            return False
        # None: handing over failed (logged); go on rather than wait on it.
        return self._hand_over_kept(record.id) is not None

    def retry(
        self,
        run_id: str,
        *,
        from_state: str | None = None,
        set_fields: Mapping[str, Any] | None = None,
        by: str | None = None,
    ) -> RunInfo:
        """Run a failed or stopped run again, from its current state or from ``from_state``
        with the context recorded when the run entered it; ``set_fields`` edits that
        context (validated). The journal records who changed what."""
        stored = self._stored(run_id)
        run_id = stored.id
        record = stored.record
        if record.status not in ("failed", "stopped"):
            raise InvalidTransition(run_id, record.status, "retry")
        self.workflow(record.workflow)  # UnknownWorkflow unless registered
        workflow = self._workflows.for_run(record)
        state = from_state or record.state
        waits = state in workflow.waits
        # A run stopped asleep (step.sleep) before its final state is in it, not ended: its
        # retry enters it at once (the claim's sleep_ended ends the run), as a retry of a
        # run stopped asleep before a step or wait state starts or waits there at once.
        into_final = state == record.state and workflow.is_final(state)
        if not (into_final or retryable_from(workflow, state)):
            raise DefinitionError(
                workflow.name,
                f"cannot retry from {state!r}: not a step, wait, call or map state "
                f"(states: {', '.join([*workflow.steps, *workflow.waits, *workflow.composites])})",
            )
        entered = _context_entering(self.store.journal(run_id), state)
        if state == record.state and workflow.compensates(state):
            # the compensations owed go on from where they were
            entered = (record.context, record.context_version)
        if entered is None:
            raise FlowloopError(f"run {run_id} never reached state {state!r}; choose a visited one")
        context, version = entered
        data: dict[str, Any] = {"by": by or _user(), "from": state}
        if set_fields:
            _check_fields(workflow, set_fields)
            loaded = workflow.load_context(context, version).model_dump(mode="json")
            context = workflow.parse_context({**loaded, **set_fields}).model_dump_json()
            version = workflow.context_version
            # As JSON (a datetime, a UUID ...): the journal stores what was set.
            data["set"] = to_jsonable_python(dict(set_fields))
        if version != 1:
            data[j.CONTEXT_VERSION] = version
        if waits:
            # It waits again, as on entering the state: its timeout counted from now.
            data["due"] = entering(workflow, state, self.clock.now())["due"]
        fields = {"state": state, "context": context, "data": data}
        written = (
            self._retry_child(stored, **fields)
            if record.join is not None
            else self._operate(stored, j.RUN_RETRIED, **fields)
        )
        if not written:
            raise FlowloopError(f"run {run_id} changed while retrying; try again")
        if waits:
            self._hand_over_kept(run_id)  # events kept for it that it accepts now
        return self.get(run_id)


def _clears_request(kind: str, pending: str | None) -> bool:
    """Whether an operator's entry of ``kind`` takes the place of the request ``pending``
    on the run (its write then fenced on it, none included: a request made after the read
    refuses it): a stop and a retry do; a pause and an unpause a pause, or none (a stop
    asked for stays, for the run's next claim); a migration never."""
    if kind in (j.RUN_STOPPED, j.RUN_RETRIED):
        return True
    return kind in (j.RUN_PAUSED, j.RUN_UNPAUSED) and (pending is None or pending in PAUSES)


def _check_fields(workflow: Workflow, set_fields: Mapping[str, Any]) -> None:
    """An edit must name fields of the context: pydantic would drop an unknown (misspelt)
    one silently, and the journal would claim an edit that never happened."""
    if workflow.context.model_config.get("extra") != "allow":
        workflow.check_fields(set_fields)


def _context_entering(events: Sequence[JournalEvent], state: str) -> tuple[str, int] | None:
    """The context a run had when it last entered ``state`` — or the state a migration
    moved it there from (renamed, or mapped: the context it had there), with its context
    version."""
    for event in reversed(events):
        source = event.data.get("from_state") if event.kind == j.RUN_MIGRATED else None
        if event.state == state and isinstance(source, str) and source != state:
            state = source  # (before, a renamed state "never reached")
            continue
        # Entered by any transition that records the context it entered with: a step's
        # outcome, a wait state's event or timeout, a child run's result — or a debounced
        # start's context, which replaced the one it was created with before it ran
        # (passed over, a retry took the burst's first context).
        entered = (event.next_state == state) or (
            event.kind in (j.RUN_CREATED, j.RUN_RETRIED, j.RUN_DEBOUNCED) and event.state == state
        )
        if entered and event.context is not None:
            if event.kind == j.RUN_DEBOUNCED and j.CONTEXT_VERSION not in event.data:
                # (Written before it said its version: the run's then, as its fold has it.)
                return event.context, j.fold(events, until_seq=event.seq).context_version
            return event.context, int(event.data.get(j.CONTEXT_VERSION, 1))
    return None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def retryable_from(workflow: Workflow, state: str) -> bool:
    """Whether an operator's retry may start a run of ``workflow`` in ``state``: a step, a
    wait, or a call, map or compensating state (the dashboard's menu lists these)."""
    return (
        state in workflow.steps
        or state in workflow.waits
        or children.retryable_state(workflow, state)
    )
