"""One step of a run: call its function under its timeout, journal the outcome, go on.

The :class:`Stepping` half of the executor (flowloop/executor.py claims and drives runs;
this runs the step a driven run is in and commits what it led to, in one boundary with the
next step's start when the run goes straight on).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextvars import ContextVar, copy_context
from typing import TYPE_CHECKING, Any, Final, cast

from pydantic import BaseModel, ValidationError

from flowloop import children, compose, frozen, interruptions, owed
from flowloop import journal as j
from flowloop.clock import Clock
from flowloop.compose import step_error
from flowloop.contexts import context_from, dump_context, unstorable
from flowloop.definition import (
    NEXT_EVENT,
    TIMEOUT_EVENT,
    Sleep,
    Step,
    StepSpec,
    Workflow,
    describe_validation,
)
from flowloop.errors import (
    ContextNotSerializable,
    InvalidEvent,
    MaxVisitsExceeded,
    StepExited,
    StepTimeout,
    error_line,
    error_trace,
    exits_as_errors,
    retry_cannot_help,
)
from flowloop.events import check_visits, entering, keeping_context, receive, wait_due
from flowloop.gates import gated
from flowloop.journal import JournalEvent, RunRecord
from flowloop.kept import failed_on_claim, take_kept, try_deliver_pending
from flowloop.outcome_log import (
    FAILED,
    FAILED_UNWRITTEN,
    SUCCEEDED,
    SUCCEEDED_UNWRITTEN,
    step_fields,
)
from flowloop.steppool import late_result
from flowloop.store import Boundary, Fence, Store
from flowloop.straight import PlainNexts, plain_step

if TYPE_CHECKING:
    from flowloop.committer import Stats
    from flowloop.executor import Executor, _Active
    from flowloop.gates import Gates
    from flowloop.leasekeeper import LeaseKeeper
    from flowloop.outcome_log import OutcomeLog
    from flowloop.steppool import StepThreads
    from flowloop.watchdog import LoopWatchdog, RunningStep

log = logging.getLogger("flowloop")

SYNC_STEPS_INLINE: ContextVar[bool] = ContextVar("flowloop_sync_steps_inline", default=False)
"""Set by ``Engine.run`` in the task that drives its run: plain ``def`` steps without a
timeout are then called on the loop's own thread (:meth:`Stepping._inline`)."""

_INLINE = threading.local()
"""``depth``: how many inline steps this thread is inside (see :func:`in_inline_step`)."""


def in_inline_step() -> bool:
    """Whether this thread runs a plain ``def`` step called on its own event loop's thread
    (``Engine.run``): an ``Engine.run`` from inside it needs a loop of its own."""
    return bool(getattr(_INLINE, "depth", 0))


MAX_NOTE_CHARS: Final = 500
"""Of a step's notes (``Step.note``), kept in its journal entry."""
CUT_OFF_GRACE_SECONDS: Final = 60.0
"""How long a sync step cut off (not timed out) may run on in its thread before the thread
counts towards the step pool's bound (a worker at the bound exits with code 3)."""


class Stepping:
    """Mixed into :class:`~flowloop.executor.Executor`, whose state it uses."""

    if TYPE_CHECKING:
        store: Store
        workflows: Mapping[str, Workflow]
        clock: Clock
        worker_id: str
        stats: Stats
        gates: Gates
        async_steps: dict[str, RunningStep]
        pool_exhausted: list[Callable[[int], None]]
        _exhaustion_check: asyncio.TimerHandle | None
        _active: dict[str, _Active]
        _controls: dict[str, str]
        _draining: bool
        _threads: StepThreads
        watchdog: LoopWatchdog
        leases: LeaseKeeper
        outcomes: OutcomeLog

        _handed_seen: int
        tracked: set[str]
        last_parsed: dict[str, tuple[str, BaseModel]]
        _plains: PlainNexts

        async def _commit(self, boundary: Boundary) -> bool: ...
        async def _take_a_turn(self) -> None: ...
        async def _finish(
            self,
            record: RunRecord,
            fence: Fence,
            events: list[JournalEvent],
            *,
            honoured: str | None = None,
            refused_is_lost: bool = True,
        ) -> bool: ...
        def _confirmed_control(self, run_id: str) -> str | None: ...
        async def _commit_honouring(
            self,
            record: RunRecord,
            fence: Fence,
            action: str,
            entries: Callable[[str], list[JournalEvent]],
        ) -> bool | None: ...
        def _event(
            self, record: RunRecord, kind: str, offset: int = 1, **fields: Any
        ) -> JournalEvent: ...
        def _notify(self, boundary: Boundary) -> None: ...
        def wake(self, run_id: str | None = None) -> None: ...

    def _whole(self) -> Executor:
        """This object as the executor it is part of (composition takes the executor)."""
        return cast("Executor", self)

    def _step_object(self, workflow: Workflow, record: RunRecord) -> Step:
        """The :class:`Step` handed to a function that takes one."""
        return frozen.build(  # Step(...) without its frozen __init__ (5.5 us a step)
            Step,
            {
                "run_id": record.id,
                "workflow": workflow.name,
                "state": record.state,
                "attempt": record.attempt,
                "visit": record.visit(record.state),
                "seq": record.last_seq,
                "worker": self.worker_id,
                "error": step_error(record) if record.error else None,
            },
        )

    async def _step(
        self, workflow: Workflow, record: RunRecord, fence: Fence, loaded: BaseModel | None
    ) -> tuple[RunRecord, BaseModel | None] | None:
        """Run the started step of ``record``; commit its outcome. Returns the record when
        the run goes straight on with its next step, else ``None``; with it the next
        step's context when this one already parsed it (``loaded``, see below). When the
        run does not go on, a tracked run's parse is kept for the engine's RunInfo
        (``last_parsed``)."""
        spec = workflow.steps[record.state]
        # Built only for a function that takes it: nothing else reads it (the watchdog
        # names a stalled async step from the record as well).
        step = self._step_object(workflow, record) if spec.wants_step else None
        # The step's own copy, carried to the current context version (issue 16) — or
        # parsed by the previous step from this very text (the check of what it stored).
        ctx = (
            loaded
            if loaded is not None
            else workflow.load_context(record.context, record.context_version)
        )
        # One line when the step starts and one when it ends (fields for JSON logs); built
        # only when someone listens: this is the hot path.
        logged = log.isEnabledFor(logging.INFO)
        if logged:
            log.info(
                "run %s seq %d: %s attempt %d started",
                record.id,
                record.last_seq,
                record.state,
                record.attempt,
                extra={**step_fields(workflow.name, record), "event": "step_started"},
            )
        started = self.clock.monotonic()
        try:
            if record.deadline is None and self._inline(spec):
                # (The loop looked up once: on CPython 3.11 each lookup asks the kernel for
                # the process id.)
                loop = asyncio.get_running_loop()
                returned = self._call_inline(loop, spec, ctx, step)
                # What arrived since the last turn (a stop or pause polled by the lease
                # thread during this step or the previous commit, a Ctrl-C's cancellation)
                # lands now, before this outcome is committed: a loop turn, taken when
                # something did arrive (one every step cost more than the step).
                this = asyncio.current_task(loop)
                if self.leases.handed != self._handed_seen or (
                    this is not None and this.cancelling()
                ):
                    await self._take_a_turn()
            elif record.deadline is None:
                returned = await self._call(record, spec, ctx, step)
            else:  # the run's deadline cuts the step off (a thread's result is discarded)
                returned = await children.within_deadline(
                    self._call(record, spec, ctx, step), record, self.clock
                )
            # A next= step's usual success: decided once per state (flowloop/straight.py).
            plain = self._plains[workflow, record.state] if returned is None else None
            if plain is None:
                event = workflow.event_for(record.state, returned)
                next_state = workflow.next_state(record.state, event)
            else:
                event, next_state = NEXT_EVENT, plain.target
            context = dump_context(ctx, workflow=workflow.name, state=record.state)
            parsed = context_from(workflow.context, context)  # what a resume loads
            if plain is None or plain.limit is not None:
                check_visits(workflow, record, next_state)
        except asyncio.CancelledError:
            raise
        except (Exception, SystemExit) as caught:
            error = StepExited.instead_of(caught, f"step {record.state!r}")
            error = unstorable(error, ctx, workflow=workflow.name, state=record.state)
            duration = self.clock.monotonic() - started
            self.stats.attempts += 1
            if isinstance(error, children.DeadlineCut):
                moved = await children.past_deadline(self._whole(), workflow, record, fence)
            else:
                self.gates.called(spec, record, error)
                moved = await self._failed(workflow, spec, record, fence, error, duration)
            return None if moved is None else (moved, None)
        duration = self.clock.monotonic() - started
        self.gates.called(spec, record, None)
        self.stats.steps += 1
        self.stats.attempts += 1
        delay = returned.delay if isinstance(returned, Sleep) else 0.0
        now = self.clock.now()
        data = dict(plain.data) if plain else entering(workflow, next_state, now, delay=delay)
        if step is not None and step.notes:
            data = {**data, "note": "; ".join(step.notes)[:MAX_NOTE_CHARS]}
        if spec.compensate is not None:  # the undo it owes, journaled (flowloop/owed.py)
            data = owed.with_undo(data, spec.compensate)
        if logged:  # said once its entry is committed (flowloop/outcome_log.py)
            self.outcomes.hold(
                record.id,
                record.last_seq + 1,
                logging.INFO,
                SUCCEEDED,
                SUCCEEDED_UNWRITTEN,
                (
                    record.id,
                    record.last_seq,
                    record.state,
                    record.attempt,
                    duration * 1000,
                    event,
                    next_state,
                ),
                {
                    **step_fields(workflow.name, record),
                    "event": "step_finished",
                    "outcome": "succeeded",
                    "duration": duration,
                    "next_state": next_state,
                },
            )
        try:
            if self._straight_on(workflow, record, next_state, delay, now, plain is not None):
                after = await self._went_on(
                    record,
                    fence,
                    at=now,
                    event=str(event),
                    next_state=next_state,
                    context=context,
                    duration=duration,
                    data=data,
                )
            else:
                succeeded = self._event(
                    record,
                    j.STEP_SUCCEEDED,
                    state=record.state,
                    attempt=record.attempt,
                    event=str(event),
                    next_state=next_state,
                    context=context,
                    duration=duration,
                    data=data,
                )
                after = await self._advance(workflow, record, fence, succeeded)
        except BaseException:
            self.outcomes.drop(record.id)
            raise
        if logged:
            self.outcomes.settle(record.id)
        if after is None:
            if record.id in self.tracked:
                self.last_parsed[record.id] = (context, parsed)
            return None
        # The next step's own copy is this parse of the text it starts from (the same
        # text parses to the same model), unless the run moved on through other states.
        same = j.holds_context(after, context, workflow.context_version)
        return after, parsed if same else None

    def _straight_on(
        self,
        workflow: Workflow,
        record: RunRecord,
        target: str,
        delay: float,
        now: float,
        plain: bool = False,
    ) -> bool:
        """Whether a success into ``target`` at ``now`` is the usual boundary
        :meth:`_went_on` commits: ``target`` a step due at once (no durable sleep) that no
        gate can hold, the run's deadline not passed, and nothing asked of the run (a
        pause, a stop) or of this worker (a drain). :meth:`_advance` would then start
        ``target`` in the same commit; every other success goes there. ``plain``: the
        definition's half is known to hold (flowloop/straight.py decided it)."""
        if (
            delay
            or (record.deadline is not None and now >= record.deadline)
            or record.id in self._controls
            or self._draining
        ):
            return False
        return plain or plain_step(workflow, target)

    async def _went_on(
        self,
        record: RunRecord,
        fence: Fence,
        *,
        at: float,
        event: str,
        next_state: str,
        context: str,
        duration: float,
        data: Mapping[str, Any],
    ) -> RunRecord | None:
        """Commit a success and the next step's start (:meth:`_straight_on` said so) in one
        boundary, both events and the record after them built at once (flowloop.journal's
        ``went_on``: what :meth:`_advance` folds from them one by one). The record when it
        was written, else ``None``."""
        succeeded, started, after = j.went_on(
            record,
            at=at,
            worker=self.worker_id,
            event=event,
            next_state=next_state,
            context=context,
            duration=duration,
            data=data,
            started=self.gates.granted(record.id),
        )
        boundary = frozen.build(  # Boundary(...) without its generated __init__ (per step)
            Boundary, {"events": [succeeded, started], "record": after, "fence": fence}
        )
        if not await self._commit(boundary):
            return None
        return after

    async def _advance(
        self, workflow: Workflow, record: RunRecord, fence: Fence, transition: JournalEvent
    ) -> RunRecord | None:
        """Commit a transition (a step's success or a wait's event). Returns the record when
        the run goes straight on with its next step, else ``None`` (finished, waiting,
        sleeping, paused, or handed back because the worker is draining)."""
        after = j.apply(record, transition)
        target = after.state
        if after.status != "scheduled":
            await self._commit(
                Boundary(events=[transition], record=after, fence=fence, release=True)
            )
            return None
        action = self._controls.get(record.id)
        if action is not None:
            action = self._confirmed_control(record.id)  # may be withdrawn or a stop now
        if action is not None:

            def entries(honour: str) -> list[JournalEvent]:
                kind, data = j.control_entry(honour)
                entry = self._event(record, kind, offset=2, state=target, data=data)
                return [transition, entry]

            if await self._commit_honouring(record, fence, action, entries) is not None:
                return None
            # (withdrawn meanwhile: nothing written, the run goes on)
        if self._draining:  # say so in the journal (the due time stays the transition's)
            reason = interruptions.RELEASED_ON_SHUTDOWN
            released = {"due": after.next_run_at, "reason": reason}
            event = self._event(record, j.RUN_RELEASED, offset=2, state=target, data=released)
            await self._finish(record, fence, [transition, event])
            if target in workflow.waits:
                self._deliver(record.id)  # still hand it what was kept for it
            return None
        if (
            target in workflow.composites
            and (after.deadline or transition.at + 1) > transition.at
            and (after.next_run_at or transition.at) <= transition.at  # (not after a sleep)
        ):
            # A call/map state: fan out now (the entry committed with it), no claim first.
            return await children.drive(self._whole(), workflow, record, fence, entered=transition)
        if (
            target not in workflow.steps
            or (after.next_run_at or 0.0) > transition.at
            or compose.deadline_passed(after, transition.at)
        ):
            # Waiting or sleeping: hand the run back; its due time (if any) is stored. (A
            # call, map or compensating state is due now: a claim takes it on; so is a
            # step past the run's deadline, moved on by the claim with no attempt begun.)
            applied = await self._commit(
                Boundary(events=[transition], record=after, fence=fence, release=True)
            )
            if applied and target in workflow.waits:
                self._deliver(record.id)
            elif applied and target not in workflow.waits:
                self.wake(record.id)
            return None
        spec = workflow.steps[target]
        held = (
            await self.gates.check(workflow, after, target, attempt=0)
            if gated(workflow, spec)
            else None
        )
        if held is not None:  # not called now: deferred (rate limit, breaker) or failed
            await self._finish(record, fence, [transition, held])
            return None
        # The usual case: the outcome and the next step_started in one commit.
        nxt = self._event(
            record,
            j.STEP_STARTED,
            offset=2,
            state=target,
            attempt=1,
            data=self.gates.granted(record.id),
        )
        after = j.apply(after, nxt)
        if not await self._commit(Boundary(events=[transition, nxt], record=after, fence=fence)):
            return None
        return after

    async def _end_wait(
        self,
        workflow: Workflow,
        record: RunRecord,
        fence: Fence,
        *,
        written_at: float | None = None,
    ) -> RunRecord | None:
        """A claimed waiting run: take a buffered event it accepts (rejecting, one by one,
        those it cannot take), else its timeout when it is due; else (claimed early:
        unpaused, or created in its wait state) hand it back with its stored due time
        (``None`` without a timeout). A run asleep before the state enters it first."""
        if record.reason == j.ASLEEP:
            return await self._end_sleep(workflow, record, fence)
        now = self.clock.now()
        try:
            for message in self.store.pending_events(record.id):
                if message.event not in workflow.waits[record.state].on:
                    continue
                entry, after = take_kept(workflow, record, message, now=now, worker=self.worker_id)
                # Applied and handed back (moved on), or rejected (waits: the next, the timeout)
                moved = entry.kind == j.EVENT_RECEIVED
                boundary = Boundary(events=[entry], record=after, fence=fence, release=moved)
                if self.store.deliver(message, boundary) != "applied":
                    # Refused (another writer moved the run): do not sit on the claim.
                    self.store.release(worker=self.worker_id, run_ids=[record.id])
                    return None
                self._notify(boundary)
                if not moved:
                    record = after
                    continue
                if after.state in workflow.waits:
                    self._deliver(record.id)  # waits again: take what was kept for it
                else:
                    self.wake(record.id)
                return None
        except Exception as error:  # counted, the run let go; parked at the third
            await failed_on_claim(self._whole(), workflow, record, fence, error)
            return None
        # Claimed because its stored due time (the timeout's) has come; anything else (no
        # timeout, or a clock that disagrees) goes back to waiting unchanged.
        due = record.next_run_at if workflow.waits[record.state].timeout is not None else None
        if due is not None and due <= now and _made_due_at_once(record, due, written_at):
            # The timeout is the one its entry into the state set (read then only: a poll
            # looping through a wait would read a growing journal at every timeout).
            due = max(due, wait_due(workflow, record.state, self.store.journal(record.id)) or due)
        if due is None or due > now:
            released = self._event(
                record,
                j.RUN_RELEASED,
                state=record.state,
                data={"due": due, "reason": "waiting for an event"},
            )
            if await self._finish(record, fence, [released]):
                # An event kept after this claim read the inbox (a sender that found the
                # run held, by this worker or by its map) is handed over now: nothing
                # else would come for it while the run waits without a due time.
                self._deliver(record.id)
            return None
        try:
            received, _ = receive(
                workflow, record, TIMEOUT_EVENT, None, now=now, worker=self.worker_id
            )
        except Exception as error:  # the timeout's own target refuses it (max_visits, …)
            await self._finish(
                record,
                fence,
                [
                    self._event(
                        record,
                        j.RUN_FAILED,
                        state=record.state,
                        error_message=error_line(error),
                        data={"reason": "timeout_rejected"},
                    )
                ],
            )
            return None
        return await self._advance(workflow, record, fence, received)

    async def _end_sleep(
        self, workflow: Workflow, record: RunRecord, fence: Fence
    ) -> RunRecord | None:
        """A run claimed asleep (``step.sleep``) before its wait or final state: when the
        sleep is over it enters the state now (``sleep_ended``: a wait's timeout counts
        from here, and it takes the events kept for it; a final state ends the run); a
        claim before then hands it back asleep, due when the sleep ends."""
        now, due = self.clock.now(), record.next_run_at
        if due is not None and due > now:
            released = self._event(record, j.RUN_RELEASED, state=record.state, data={"due": due})
            await self._finish(record, fence, [released])
            return None
        data = entering(workflow, record.state, now)
        data.pop(j.CONTEXT_VERSION, None)  # (it writes no context)
        woke = self._event(record, j.SLEEP_ENDED, state=record.state, data=data)
        return await self._advance(workflow, record, fence, woke)

    def _deliver(self, run_id: str) -> None:
        delivered = try_deliver_pending(
            self.store, self.workflows, run_id, now=self.clock.now(), worker=self.worker_id
        )
        if delivered:
            self.wake(run_id)

    async def _failed(
        self,
        workflow: Workflow,
        spec: StepSpec,
        record: RunRecord,
        fence: Fence,
        error: Exception,
        duration: float,
    ) -> RunRecord | None:
        definitive = isinstance(
            error, (InvalidEvent, MaxVisitsExceeded, ValidationError, ContextNotSerializable)
        ) or retry_cannot_help(error)
        retryable = not definitive and spec.retry.should_retry(error, record.attempt)
        data: dict[str, Any]
        route = None if retryable else children.error_route(workflow, spec, record, error)
        if retryable:
            delay = spec.retry.delay(record.attempt)
            data = {"retry_at": self.clock.now() + delay}
        elif route is not None:  # on_error: the run moves on; the error stays visible
            entered = entering(workflow, route[1], self.clock.now())
            data = {**keeping_context(entered, record), "route": "on_error"}
        else:
            data = {"reason": "error"}
        message = (
            describe_validation(error) if isinstance(error, ValidationError) else error_line(error)
        )
        failed = self._event(
            record,
            j.STEP_FAILED,
            state=record.state,
            attempt=record.attempt,
            duration=duration,
            error_type=type(error).__name__,
            error_message=message,
            traceback=error_trace(error),
            retryable=retryable,
            data=data,
            event=None if route is None else route[0],
            next_state=None if route is None else route[1],
        )
        level = logging.INFO if retryable or route is not None else logging.ERROR
        outcome = (
            "timed_out" if isinstance(error, StepTimeout) else "retried" if retryable else "failed"
        )
        self.outcomes.hold(  # said once its entry is committed (flowloop/outcome_log.py)
            record.id,
            failed.seq,
            level,
            FAILED,
            FAILED_UNWRITTEN,
            (
                record.id,
                record.last_seq,
                record.state,
                record.attempt,
                outcome,
                duration * 1000,
                type(error).__name__,
                message,
            ),
            {
                **step_fields(workflow.name, record),
                "event": "step_finished",
                "outcome": outcome,
                "duration": duration,
                "error_type": type(error).__name__,
                "retryable": retryable,
            },
        )
        try:
            if route is not None:
                moved = await self._advance(workflow, record, fence, failed)
            else:
                moved = None
                await self._finish(record, fence, [failed])
        except BaseException:
            self.outcomes.drop(record.id)
            raise
        self.outcomes.settle(record.id)
        if retryable:
            self.wake(record.id)
        return moved

    def _inline(self, spec: StepSpec) -> bool:
        """Whether a plain ``def`` step is called on the loop's thread: under
        ``Engine.run`` (its loop drives this one run and nothing else), with no timeout to
        enforce (a thread could be given up on, a call here cannot), and with no other run
        in flight here. The thread hop costs more than a trivial step and its commit."""
        return (
            not spec.is_async
            and spec.timeout is None
            and len(self._active) <= 1
            and SYNC_STEPS_INLINE.get()
        )

    def _call_inline(
        self, loop: asyncio.AbstractEventLoop, spec: StepSpec, ctx: BaseModel, step: Step | None
    ) -> Any:
        """The step on this thread, its ``loop`` (the running one) hidden from it as it
        would be in a thread: it may run an event loop of its own (``asyncio.run``, a
        nested ``Engine.run``)."""
        _INLINE.depth = getattr(_INLINE, "depth", 0) + 1
        asyncio.events._set_running_loop(None)
        self.watchdog.excuse()
        try:
            return spec.fn(ctx, step) if spec.wants_step else spec.fn(ctx)
        finally:
            self.watchdog.end_excuse()
            asyncio.events._set_running_loop(loop)
            asyncio.set_event_loop(loop)  # an asyncio.run in the step resets it to None
            _INLINE.depth -= 1

    async def _call(
        self, record: RunRecord, spec: StepSpec, ctx: BaseModel, step: Step | None
    ) -> Any:
        """The started step of ``record`` called (``step``: what a function that takes one
        gets, else ``None``)."""
        run_id = record.id
        if not spec.is_async:
            return await self._invoke(run_id, spec, ctx, step)
        self.async_steps[run_id] = step if step is not None else record
        try:
            active = self._active.get(run_id)
            if spec.timeout is None and active is not None:
                # No timeout to enforce: await the coroutine inline instead of wrapping it
                # in a Task (a Task costs its creation and two event-loop turns per step).
                # A stop or a lost lease then cancels the run's own task, which cuts the
                # step off.
                active.step_task = active.task
                try:
                    return await (spec.fn(ctx, step) if spec.wants_step else spec.fn(ctx))
                finally:
                    active.step_task = None
            return await self._invoke(run_id, spec, ctx, step)
        finally:
            self.async_steps.pop(run_id, None)

    async def _invoke(self, run_id: str, spec: StepSpec, ctx: BaseModel, step: Step | None) -> Any:
        """The step in a task of its own (an ``async def`` step with a timeout) or a thread."""
        args = (ctx, step) if spec.wants_step else (ctx,)
        abandoned: list[bool] = []
        thread: Future[Any] | None = None
        active = self._active.get(run_id)
        if spec.is_async:
            future: asyncio.Future[Any] = asyncio.ensure_future(
                exits_as_errors(spec.fn(*args), "step", spec.name)
            )
        else:
            # In the run task's context, as asyncio.to_thread would: what the run holds
            # (flowloop.holding) and the caller's context variables reach the step. Not
            # this executor's inline steps: an engine called from the thread has its own.
            context = copy_context()
            context.run(SYNC_STEPS_INLINE.set, False)
            work = self._threads.submit(context.run, spec.fn, *args)
            work.add_done_callback(functools.partial(late_result, run_id, spec.name, abandoned))
            future = asyncio.wrap_future(work)
            thread = work
        if active is not None:
            active.step_task = future
        try:
            if spec.timeout is None:
                return await future
            try:
                return await asyncio.wait_for(future, spec.timeout)
            except TimeoutError:
                raise StepTimeout(
                    f"step {spec.name!r} took longer than {spec.timeout:g}s"
                ) from None
        except BaseException as error:
            abandoned.append(True)
            if thread is not None:
                timed_out = isinstance(error, StepTimeout)
                self._abandoned(run_id, spec.name, thread, timed_out=timed_out)
            raise
        finally:
            if active is not None:
                active.step_task = None

    def _abandoned(self, run_id: str, state: str, work: Future[Any], *, timed_out: bool) -> None:
        """A sync step given up on: its thread is replaced (within the pool's bound)."""
        if not self._threads.abandon(work, timed_out=timed_out):
            return
        count, bound = self._threads.abandoned, self._threads.spare
        log.warning(
            "run %s: step %s still runs in its thread after its timeout or cancellation "
            "(%d abandoned step thread(s), bound %d)",
            run_id,
            state,
            count,
            bound,
            extra={"run": run_id, "event": "thread_abandoned", "abandoned": count},
        )
        if self._threads.hung(CUT_OFF_GRACE_SECONDS) >= bound:
            self._pool_is_exhausted("hang past their timeouts")
        elif count >= bound:
            # Some were cut off (a lost lease, a stop), not timed out: such a step may end
            # soon after (a worker frozen past its lease cut every step off at once). Each
            # counts only if its thread still runs it a while after its cut-off.
            self._judge_later()

    def _judge_later(self) -> None:
        """Look at the pool again when the oldest cut-off thread still running would count."""
        at = self._threads.next_hung(CUT_OFF_GRACE_SECONDS, self._threads.spare)
        if self._exhaustion_check is None and at is not None:
            delay = max(0.0, at - time.monotonic())
            loop = asyncio.get_running_loop()
            self._exhaustion_check = loop.call_later(delay, self._still_exhausted)

    def _still_exhausted(self) -> None:
        self._exhaustion_check = None
        if self._threads.hung(CUT_OFF_GRACE_SECONDS) >= self._threads.spare:
            self._pool_is_exhausted(f"still run steps cut off over {CUT_OFF_GRACE_SECONDS:g}s ago")
        elif self._threads.exhausted:
            self._judge_later()  # cut off later: their turn comes when enough have waited

    def _pool_is_exhausted(self, why: str) -> None:
        count, bound = self._threads.abandoned, self._threads.spare
        log.error(
            "%d sync step thread(s) %s (the bound is %d): each further one takes a slot of "
            "this process",
            count,
            why,
            bound,
            extra={"event": "step_pool_exhausted", "abandoned": count},
        )
        for hook in self.pool_exhausted:
            try:
                hook(count)
            except Exception:  # a hook must never break the worker
                log.exception("pool-exhausted hook failed")


def _made_due_at_once(record: RunRecord, due: float, written_at: float | None) -> bool:
    """Whether a waiting run's due time may be a writer's "at once" rather than its
    timeout's: set no later than the row's last write (``written_at``; unknown: maybe), as
    an unpause by a process without the definition sets it, or a child of a call or map
    (a map's child held back is made due at once when its turn comes, by its sibling's
    end: the turn journaled on it, ``run_deferred``, only when it rests in a wait)."""
    return written_at is None or due <= written_at or record.join is not None
