"""The worker loop: claim → step under its timeout → record → continue or release.

The journal protocol, which every write here keeps:

* **before**: a step's ``step_started`` is committed before its function is called;
* **after**: the outcome, the new run row and (when the run goes straight on) the next
  ``step_started`` are one transaction;
* boundaries of concurrently running runs share transactions (group commit): a run never
  goes on before its own previous boundary is durable.

The executor is in five rooms: this module claims and drives runs; flowloop/stepping.py
runs one step and commits its outcome; flowloop/recovery.py settles runs a dead worker
left; flowloop/leasekeeper.py renews leases and fences this worker off in time;
flowloop/commits.py commits a boundary and tells what follows; and flowloop/committer.py
groups boundaries into transactions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from flowloop import children, compose, interruptions, outagelog
from flowloop import journal as j
from flowloop.clock import Clock
from flowloop.commits import Commits
from flowloop.committer import (
    OUTAGE_BACKOFF_CAP,
    OUTAGE_BACKOFF_START,
    Committer,
    Stats,
    backoff_cap,
)
from flowloop.definition import Workflow
from flowloop.drivefailures import FailedDrives
from flowloop.errors import error_line
from flowloop.gates import Gates, share_limits
from flowloop.holding import Held, context_holding, database_of
from flowloop.journal import JournalEvent, RunRecord
from flowloop.kept import StrandedLooks
from flowloop.leasekeeper import LeaseKeeper, new_worker_id, owner_is_dead_here
from flowloop.lifecycle import CONTROLS, STOP
from flowloop.localdue import LocalDue
from flowloop.outcome_log import OutcomeLog, step_fields
from flowloop.recovery import RECOVERY_BATCH, Recovery
from flowloop.run_requests import Requests
from flowloop.stepping import MAX_NOTE_CHARS, Stepping
from flowloop.steppool import StepThreads
from flowloop.store import Boundary, Fence, Store, StoredRun
from flowloop.store.outage import is_outage
from flowloop.straight import PlainNexts
from flowloop.tasks import CUT_OFF_WRITE_SECONDS, finish_within, first_of
from flowloop.versions import workflow_for
from flowloop.watchdog import LoopWatchdog, RunningStep

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = [
    "CUT_OFF_WRITE_SECONDS",
    "DEFAULT_LEASE_SECONDS",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_POLL_SECONDS",
    "MAX_NOTE_CHARS",
    "OUTAGE_BACKOFF_CAP",
    "OUTAGE_BACKOFF_START",
    "RECOVERY_BATCH",
    "RECOVERY_EVERY_SECONDS",
    "Committer",
    "Executor",
    "Listener",
    "Stats",
    "backoff_cap",
    "error_line",
    "finish_within",
    "new_worker_id",
    "owner_is_dead_here",
    "step_fields",
]

log = logging.getLogger("flowloop")

DEFAULT_MAX_CONCURRENCY: Final = 16
DEFAULT_LEASE_SECONDS: Final = 30.0
DEFAULT_POLL_SECONDS: Final = 0.5
"""How often an idle worker looks for due runs and pending pause/stop requests."""
RECOVERY_EVERY_SECONDS: Final = 10.0
"""How often every worker settles runs whose lease expired (at most; half the lease when
that is shorter, so a run of a dead or frozen worker is taken over soon after its lease)."""

YIELD_EVERY_SECONDS: Final = 0.05
"""At least how often a run going straight from step to step lets the event loop turn."""

Listener = Callable[[RunRecord, Sequence[JournalEvent]], None]
"""Called after each committed boundary with the run's new record and the events written."""


IDLE_HORIZON_SECONDS: Final = 300.0
"""How far ahead ``run(until_idle=True)`` waits for a run's due time (a retry's backoff, a
durable sleep) by default: a run due later is left for a worker."""


@dataclass
class _Active:
    task: asyncio.Task[None]
    workflow: str
    step_task: asyncio.Future[Any] | None = None
    stopping_step: str | None = None  # "stop" when an operator stop cancelled the step
    lost: bool = False
    """This drive gave the run up (its lease is lost): a later claim of the run is driven
    by a task of its own, with a mark of its own."""
    epoch: int = 0
    """The lease epoch of the claim this drive holds (its fence's)."""
    record: RunRecord | None = None
    """The run as this drive's last committed boundary left it, for a cut-off to follow
    (a compensating drive's record, the claim's, misses its ``compensation_started``)."""


class Executor(Commits, Stepping, Recovery, Requests):
    """Drives runs of registered workflows from one asyncio event loop."""

    def __init__(
        self,
        store: Store,
        workflows: Mapping[str, Workflow],
        *,
        clock: Clock,
        worker_id: str,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        poll_seconds: float = DEFAULT_POLL_SECONDS,
        listeners: Sequence[Listener] = (),
    ) -> None:
        self.store = store
        self._database = database_of(store)
        """Which database this is, for the slots its limited runs hold (flowloop.holding)."""
        self.workflows = workflows
        self.clock = clock
        self.worker_id = worker_id
        self.max_concurrency = max_concurrency
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.listeners = list(listeners)
        self.outcomes = OutcomeLog()
        self.stats = Stats()
        self.committer = Committer(store, self.stats, cap=backoff_cap(lease_seconds))
        self._threads = StepThreads(max_concurrency)
        self.pool_exhausted: list[Callable[[int], None]] = []
        """Called (with the number of abandoned threads) when hung sync steps reach the
        step pool's bound (see flowloop.steppool)."""
        self.idle_waits: list[Callable[[float], None]] = []
        """Told the seconds each time ``run(until_idle=True)`` waits for a run due later."""
        self._exhaustion_check: asyncio.TimerHandle | None = None
        self._active: dict[str, _Active] = {}
        self._parked_for: frozenset[tuple[str, str]] | None = None
        self._kept_looks = StrandedLooks()
        self._controls: dict[str, str] = {}
        self._polled_pauses: set[str] = set()
        """The runs whose pause the last poll's requests held (:meth:`apply_controls`)."""
        self._draining = False
        self.handing_back = False
        """Set by :meth:`hand_back`: claim nothing more and stop once the steps in flight
        have finished (their runs are released)."""
        self.async_steps: dict[str, RunningStep] = {}
        """The async steps in flight by run id, named by the loop watchdog on a stall."""
        self.watchdog = LoopWatchdog(self.async_steps)
        self._wakes: list[tuple[frozenset[str] | None, asyncio.Event]] = []
        """The runs (None: all) and the wake event of each :meth:`run` call in progress (a
        nested ``Engine.arun`` waiting out a retry runs one inside another's step, possibly
        on an event loop of its own): what :meth:`wake` sets."""
        self._fanned: set[str] = set()  # (of those runs: see fanned_out)
        self.failed_drives = FailedDrives()
        self._per_workflow: dict[str, int] = {}
        self._next_turn = 0.0
        self._handed_seen = 0
        """The lease threads' count of calls handed to the loop (LeaseGuard.handed) as of
        the last turn this executor's runs took: every call counted by then has run."""
        self.leases = LeaseKeeper(self)
        self.committer.fenced = self.leases.fenced_runs.__contains__  # (no call: a set)
        self.lease_lost = self.leases.hooks
        """Called with (run id, why) when this worker stops driving a run it lost."""
        self.tracked: set[str] = set()
        self.committed: dict[str, tuple[RunRecord, float]] = {}
        """The last committed record (and its time) of each ``tracked`` run, for the engine's
        fast path (so it need not read the row back); the reader removes both."""
        self._plains = PlainNexts()  # (flowloop/straight.py)
        self.last_parsed: dict[str, tuple[str, BaseModel]] = {}
        """Of each ``tracked`` run whose step succeeded without going on to the next (it
        ended the run, or the run waits, sleeps, pauses or was refused): the context text
        that step stored and its parse (the check of what it stored). The engine's RunInfo
        takes it when the committed row holds that very text, instead of parsing it once
        more; the reader removes it."""
        self.due_here = LocalDue(clock)
        """Due times of runs this executor handed back, on the monotonic clock too (a wall
        clock set back must not stall a 3 s retry for an hour)."""
        self.reserved: Callable[[], int] = lambda: 0
        """Slots of ``max_concurrency`` taken by others (a worker's loop iterations)."""
        self.gates = Gates(store, worker_id, clock)
        """Breakers and rate limits checked before calls (flowloop/gates.py)."""

    @property
    def abandoned_threads(self) -> int:
        """Threads still running a sync step this executor gave up on (timed out, cut off)."""
        return self._threads.abandoned

    @property
    def busy(self) -> int:
        """Runs being driven right now."""
        return len(self._active)

    def driving(self, run_id: str) -> asyncio.Task[None] | None:
        active = self._active.get(run_id)
        return None if active is None else active.task

    # -- the main loop ---------------------------------------------------------------------

    async def run(
        self,
        *,
        until_idle: bool,
        run_ids: Sequence[str] | None = None,
        idle_horizon: float = IDLE_HORIZON_SECONDS,
        stop: asyncio.Event | None = None,
        grace: float | None = 30.0,
        initial: Sequence[StoredRun] = (),
        idle_ids: Sequence[str] | None = None,
    ) -> Stats:
        """Claim and drive due runs. With ``until_idle``, return when no run is due and none
        is running (waiting for retry backoff that ends within ``idle_horizon`` seconds);
        otherwise run until ``stop`` is set, then drain within ``grace`` seconds.
        ``initial`` runs are already claimed and started by the caller.

        ``run_ids`` limits all of it, the idle test and the drain included, to those runs:
        the executor may be driving others meanwhile, such as the run whose step called
        ``Engine.arun`` and now waits for this call to return. ``idle_ids``: those of them
        whose due times an idle call waits for (default: all)."""
        if stop is not None and run_ids is not None:
            # Scoped, its runs are not asked to hand back by a drain (hand_back asks all).
            raise ValueError("run(): a call limited to run_ids ends idle, not on a stop")
        scope = None if run_ids is None else frozenset(run_ids)
        wake = asyncio.Event()
        helpers: list[asyncio.Task[None]] = []
        self._wakes.append((scope, wake))
        try:
            share_limits(self.store, self.workflows)  # as now configured (config overrides)
            for stored in initial:
                self.spawn(stored, starting=False)
            helpers.append(asyncio.create_task(self.heartbeat()))
            # Recovery, the first one included, is inside the outage handling: a worker or
            # `resume` starting while the database refuses writes waits for it.
            last_recovery: float | None = None
            outage = 0.0
            claims = outagelog.Part("claims")
            due_unclaimed = False  # the last turn found a run due, and claimed nothing
            waited = run_ids if idle_ids is None else idle_ids  # (whose due times idle waits for)
            while not (stop is not None and stop.is_set()) and not self.handing_back:
                if until_idle and self.failed_drives.pending(scope):
                    break  # (drained below, then raised)
                try:
                    if last_recovery is None or self.clock.monotonic() - last_recovery > min(
                        RECOVERY_EVERY_SECONDS, self.lease_seconds / 2
                    ):
                        await self.recover()
                        if last_recovery is None:
                            self._park_stranded_waits()
                        else:  # (a worker killed before handing kept events over)
                            self._hand_over_kept()
                        last_recovery = self.clock.monotonic()
                    claimed, more = self._claim(run_ids, scope)
                    idle = until_idle and not claimed and not self._driving_any(scope)
                    due = (
                        self.store.next_due(workflows=list(self.workflows), run_ids=waited)
                        if idle and (waited is None or len(waited) > 0)
                        else None
                    )
                    outage = 0.0
                    claims.answered()
                except Exception as error:
                    if not is_outage(error):
                        raise
                    cap = backoff_cap(self.lease_seconds)
                    outage = min(cap, max(OUTAGE_BACKOFF_START, outage * 2))
                    log.log(
                        claims.failed(),
                        "claims: database %s (%s); retrying in %.1fs",
                        outagelog.cause(error),
                        error_line(error),
                        outage,
                    )
                    if stop is None:
                        await asyncio.sleep(outage)
                    else:  # a shutdown asked for during an outage does not wait it out
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), outage)
                    continue
                if claimed:
                    due_unclaimed = False
                    if more:
                        continue
                    # The claim found fewer due runs than it could take: another finds one
                    # once something ends or comes due (a wake, or the next poll). Claiming
                    # again at once cost an empty write transaction per claim.
                    await self._wait_for_work(stop, wake)
                    continue
                if until_idle and not self._driving_any(scope):
                    if scope is not None and not self._fanned.isdisjoint(scope):
                        self._fanned -= scope
                        break  # (its caller drives their children now: see fanned_out)
                    # Only the runs this call drives: another due run it may not claim
                    # must not keep it spinning.
                    wait = None if due is None else max(0.0, due - self.clock.now())
                    local = self.due_here.next_wait(waited)
                    if local is not None and (wait is None or local < wait):
                        wait = local  # the wall clock was set back: trust the monotonic one
                    if wait is None or wait > idle_horizon:
                        break
                    if wait > 0 or not due_unclaimed:
                        due_unclaimed = wait <= 0  # (it may have come due since the claim)
                        await self._sleep_unless_woken(wait, wake)
                        continue
                    # Due, and again nothing claimed (a limit, a gate): poll, do not spin.
                else:
                    due_unclaimed = False
                await self._wait_for_work(stop, wake)
            await self.drain(grace, scope)
            if until_idle:
                self.failed_drives.raise_any(scope)
        finally:
            self._wakes.remove((scope, wake))
            self._fanned -= scope or set()
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            # Drained, not retired: the engine keeps this executor, and a later engine.run
            # must go straight on from step to step instead of handing back at each one.
            if scope is None:
                self._draining = self.handing_back
        return self.stats

    def _driving_any(self, scope: Collection[str] | None) -> bool:
        """Some run of ``scope`` (None: any run) is being driven."""
        if scope is None:
            return bool(self._active)
        return any(run_id in scope for run_id in self._active)

    def _claim(
        self, run_ids: Sequence[str] | None, scope: Collection[str] | None = None
    ) -> tuple[int, bool]:
        """Claim and spawn what is due, within this executor's ``max_concurrency`` and its
        count of each workflow's runs. With ``scope``, only the runs of the scope count: a
        run outside it may be the very caller waiting for this call (as ``Engine.run``'s
        own run is spawned without counting). A workflow's limits in the store (across
        workers, flowloop/store/limits.py) still count every run holding a slot.

        Returns how many runs it took, and whether more may be due now: the claim was cut
        short by the free places, gave runs back (their workflow's count here is full), or
        counted slots in the store (a limited claim looks at a window of candidates and
        may take fewer than are due and fit)."""
        running, per_workflow = self._driving(scope)
        free = self.max_concurrency - running - self.reserved()
        eligible = [
            name
            for name, workflow in self.workflows.items()
            if workflow.max_concurrency is None
            or per_workflow.get(name, 0) < workflow.max_concurrency
        ]
        if free <= 0 or not eligible:
            return 0, False
        rows: list[StoredRun] = []
        overdue, at = self.due_here.overdue(run_ids)
        before = time.monotonic()  # the leases claimed below end no earlier than this + lease
        if overdue:
            # Due by this process's monotonic clock although the wall clock (set back)
            # says not yet: claim them as of their stored due time.
            self.due_here.forget(overdue)
            rows = self.store.claim(
                worker=self.worker_id,
                now=at,
                limit=free,
                lease_seconds=self.lease_seconds,
                workflows=eligible,
                run_ids=overdue,
            )
            free -= len(rows)
        more = free <= 0  # the overdue runs took every free place
        if free > 0:
            claimed = self.store.claim(
                worker=self.worker_id,
                now=self.clock.now(),
                limit=free,
                lease_seconds=self.lease_seconds,
                workflows=eligible,
                run_ids=run_ids,
            )
            more = len(claimed) >= free or any(self.workflows[name].limited for name in eligible)
            rows += claimed
        taken = 0
        for stored in rows:
            workflow = workflow_for(self.workflows, stored.record)
            count = per_workflow.get(workflow.name, 0)
            if workflow.max_concurrency is not None and count >= workflow.max_concurrency:
                self.store.release(worker=self.worker_id, run_ids=[stored.id])
                more = True  # it took a place a run of another workflow may take
                continue
            self.spawn(stored, starting=True, claimed_at=before)
            per_workflow[workflow.name] = count + 1
            taken += 1
        return taken, more

    def _driving(self, scope: Collection[str] | None) -> tuple[int, dict[str, int]]:
        """How many runs of ``scope`` (None: all) are being driven, in all and by workflow."""
        if scope is None:
            return len(self._active), dict(self._per_workflow)
        per_workflow: dict[str, int] = {}
        running = 0
        for run_id, active in self._active.items():
            if run_id in scope:
                running += 1
                name = active.workflow
                per_workflow[name] = per_workflow.get(name, 0) + 1
        return running, per_workflow

    async def _wait_for_work(self, stop: asyncio.Event | None, wake: asyncio.Event) -> None:
        waits = [wake.wait()] if stop is None else [wake.wait(), stop.wait()]
        await first_of(waits, timeout=self.gates.wake_in(self.poll_seconds))
        wake.clear()

    async def _sleep_unless_woken(self, seconds: float, wake: asyncio.Event) -> None:
        """Sleep until a run is due, or until something wakes the loop first: a first
        Ctrl-C (:meth:`hand_back`) must not wait out a backoff while a run outside this
        call's ``run_ids`` keeps the executor busy (Ctrl-C cancels an idle one)."""
        for told in self.idle_waits:
            told(seconds)
        await first_of([self.clock.sleep(seconds), wake.wait()])
        wake.clear()

    def fanned_out(self, run_id: str) -> None:
        """``run_id`` waits for new children: a :meth:`run` of runs it is among returns once
        idle, for its caller (``engine.run``) to drive them (it waited for a deadline)."""
        self._fanned.update(run_id for scope, _ in self._wakes if scope and run_id in scope)
        self.wake(run_id)

    def wake(self, run_id: str | None = None) -> None:
        """Wake the :meth:`run` calls waiting for work that ``run_id`` concerns (None: all):
        it ended, or is due at once. (Waking all of them made N calls waiting out a backoff
        each claim at every other run's end.)"""
        for scope, wake in self._wakes:
            if run_id is None or scope is None or run_id in scope:
                wake.set()

    def spawn(
        self,
        stored: StoredRun,
        *,
        starting: bool,
        claimed_at: float | None = None,
        awaited: bool = False,
    ) -> asyncio.Task[None]:
        """Drive a claimed run in a task (``awaited``: the caller takes its result, else
        FailedDrives its error); its lease ends no earlier than ``claimed_at`` + lease."""
        name = stored.record.workflow
        self._per_workflow[name] = self._per_workflow.get(name, 0) + 1
        workflow = self.workflows.get(name)
        limited = workflow is not None and workflow.limited
        drive = self._drive(stored, starting=starting)
        if limited:
            # Its steps hold its slot: a call of theirs waiting on that slot is refused.
            slot = Held(self._database, name, stored.limit_key)
            task = asyncio.create_task(drive, context=context_holding(slot))
        else:
            task = asyncio.create_task(drive)
        self._active[stored.id] = active = _Active(task, name, epoch=stored.lease_epoch)
        self.leases.held_from(stored.id, time.monotonic() if claimed_at is None else claimed_at)
        self.committer.released.discard(stored.id)
        self.due_here.forget((stored.id,))
        self.failed_drives.forget(stored.id)
        # A run given up here while its old task lives on (a step swallowed the cancel), now
        # claimed again, has a new lease: what the old drive was asked is not its own.
        self._controls.pop(stored.id, None)
        self._polled_pauses.discard(stored.id)

        def done(_: asyncio.Task[None]) -> None:
            self._per_workflow[name] -= 1
            if not awaited:
                self.failed_drives.ended(stored.id, task, self._active.get(stored.id) is active)
            if self._active.get(stored.id) is not active:
                return  # the run was claimed again and is driven by a newer task
            self._active.pop(stored.id, None)
            self._controls.pop(stored.id, None)
            self.leases.forget(stored.id)
            self.committer.released.discard(stored.id)
            # A limited workflow's slot (the cluster's, in the store) is free again: a call
            # waiting for another run of it may claim now.
            self.wake(None if limited else stored.id)

        task.add_done_callback(done)
        return task

    def hand_back(self) -> None:
        """Claim nothing more, let the steps in flight finish and journal their outcome,
        then release their runs (``run_released``: released on shutdown) and stop: what a
        first Ctrl-C does to ``flowloop run``. Cancelling the driving task then cuts off."""
        self.handing_back = True
        self._draining = True
        self.wake()

    def stop_handing_back(self) -> None:
        """Drive runs again after :meth:`hand_back` (its caller got what it waited for)."""
        self.handing_back = False
        self._draining = False

    async def drain(self, grace: float | None, scope: Collection[str] | None = None) -> None:
        """Let in-flight steps finish (their runs are released, not continued) for up to
        ``grace`` seconds, then cut the rest off: their journal shows the interruption.
        With ``scope``, wait only for those runs: a run outside it may be waiting for this
        call (it would be cut off after ``grace``, its step never done), nor ask the others
        to hand back (:meth:`hand_back` does, when every run must)."""
        if scope is None:
            self._draining = True
        tasks = [
            active.task
            for run_id, active in self._active.items()
            if scope is None or run_id in scope
        ]
        await finish_within(tasks, grace)

    # -- leases and control (the lease work is flowloop/leasekeeper.py) -------------------

    async def heartbeat(self) -> None:
        """Renew leases, pick up pause/stop requests, fence off what could not be renewed."""
        await self.leases.heartbeat()

    def driven(self) -> Iterator[str]:
        """The runs this executor is driving right now (their task has not ended)."""
        return (run_id for run_id, active in self._active.items() if not active.task.done())

    def lost(self, run_id: str) -> bool:
        """This executor gave up its current drive of the run (its lease lost, unrenewed)."""
        active = self._active.get(run_id)
        return active is not None and active.lost

    def cancel_lost(self, run_id: str) -> None:
        """Stop driving a run whose lease is gone: its task is cancelled, no cut-off."""
        active = self._active.get(run_id)
        if active is not None:
            active.lost = True
            active.task.cancel()

    # -- one run (its step: flowloop/stepping.py; recovery: flowloop/recovery.py) --------

    def _event(self, record: RunRecord, kind: str, offset: int = 1, **fields: Any) -> JournalEvent:
        fields.update(
            run_id=record.id,
            seq=record.last_seq + offset,
            kind=kind,
            at=self.clock.now(),
            worker=self.worker_id,
        )
        return j.new_event(fields)

    async def _finish(
        self,
        record: RunRecord,
        fence: Fence,
        events: list[JournalEvent],
        *,
        honoured: str | None = None,
        refused_is_lost: bool = True,
    ) -> bool:
        """Commit the run's last boundary here, letting it go; ``honoured``: the request
        (a pause, a stop) it honours, cleared with it while the row still holds it.
        Whether it was applied (see :meth:`_commit`)."""
        for event in events:
            record = j.apply(record, event)
        boundary = Boundary(
            events=events,
            record=record,
            fence=fence,
            release=True,
            clear_control=honoured is not None,
            seen_control=honoured,
        )
        return await self._commit(boundary, refused_is_lost=refused_is_lost)

    async def _drive(self, stored: StoredRun, *, starting: bool) -> None:
        record, fence = stored.record, Fence(self.worker_id, stored.lease_epoch)
        workflow = workflow_for(self.workflows, record)
        try:
            problem, checked = self._checked(workflow, stored)
            if problem is not None:
                kind, reason, message = problem
                await self._finish(
                    record,
                    fence,
                    [
                        self._event(
                            record,
                            kind,
                            state=record.state,
                            error_message=message,
                            data={"reason": reason},
                        )
                    ],
                )
                return
            if stored.control in CONTROLS:
                self._controls[stored.id] = stored.control
            if (
                starting
                and record.state not in workflow.steps
                and (record.state not in workflow.waits or record.deadline is not None)
            ):
                # Composition: a call/map state, a compensating state, a passed deadline.
                if await self._honour_control(record, fence):
                    return
                moved = await children.claimed(self, workflow, record, fence)
                if moved is None:
                    return
                record = moved
            elif starting and record.state in workflow.waits:
                # A waiting run claimed because its timeout is due.
                if await self._honour_control(record, fence):
                    return
                waited = await self._end_wait(workflow, record, fence, written_at=stored.updated_at)
                if waited is None:
                    return
                record = waited
            elif starting and compose.deadline_passed(record, self.clock.now()):
                # A step's run claimed past its deadline (it passed during a retry's backoff
                # or a sleep): moved on before an attempt that would never run is journaled.
                if await self._honour_control(record, fence):
                    return
                moved = await children.past_deadline(self, workflow, record, fence)
                if moved is None:
                    return
                record = moved
            elif starting:
                if await self._honour_control(record, fence):
                    return
                held = await self.gates.check(
                    workflow, record, record.state, attempt=record.attempt
                )
                if held is not None:  # not called now: deferred or failed (flowloop/gates.py)
                    await self._finish(record, fence, [held])
                    return
                started = self._event(
                    record,
                    j.STEP_STARTED,
                    state=record.state,
                    attempt=record.attempt + 1,
                    data=self.gates.granted(record.id),
                )
                record = j.apply(record, started)
                if not await self._commit(Boundary(events=[started], record=record, fence=fence)):
                    return
            # The context the check above loaded, when the run still holds that very text
            # (a wait ended or a composite moved on may have changed it): its first step
            # need not parse it again.
            first = stored.record
            same = j.holds_context(record, first.context, first.context_version)
            loaded = checked if same else None
            while record.status == "running":
                went_on = await self._step(workflow, record, fence, loaded)
                if went_on is None:
                    return
                record, loaded = went_on
                # (Checked here: no coroutine a step.) A call the lease threads handed over
                # since the last turn (a stop, a pause, a lost lease) lands before the next
                # boundary, not up to YIELD_EVERY_SECONDS later.
                if self.leases.handed != self._handed_seen or time.monotonic() >= self._next_turn:
                    await self._take_a_turn()
        except asyncio.CancelledError:
            # Given up (lost), or claimed again meanwhile by a newer task (one that may have
            # ended since: this task's own entry goes only once it has ended): its fence is
            # stale, and the run's journal is no longer this task's to write.
            active = self._active.get(record.id)
            given_up = active is None or active.lost or active.task is not asyncio.current_task()
            if given_up:
                raise
            assert active is not None
            # (The newer of the two: this one's may be a composition's older, the other
            # one's older when a boundary of this drive was cancelled in flight.)
            if active.record is not None and active.record.last_seq > record.last_seq:
                record = active.record
            if record.status == "running":
                await asyncio.shield(self._cut_off(workflow, record, fence))
            raise

    async def _take_a_turn(self) -> None:
        """Give the event loop a turn (steps that never suspend would give none: no timer
        would fire, e.g. the watchdog's ticks that tell the lease renewer the loop lives,
        nor would what the lease threads hand over run): every YIELD_EVERY_SECONDS at
        least, and after a hand-over."""
        # Counted once queued (LeaseGuard._to_loop): every call counted here runs in it.
        handed = self.leases.handed
        self._next_turn = time.monotonic() + YIELD_EVERY_SECONDS
        await asyncio.sleep(0)
        self._handed_seen = handed

    async def _cut_off(self, workflow: Workflow, record: RunRecord, fence: Fence) -> None:
        """A step or compensation cancelled by shutdown or an operator's stop: journal it,
        then let go. Stopped, its attempt is not counted (no ``step_interrupted``): a
        retry calls it again from attempt 1, as it does a stopped run's step."""
        active = self._active.get(record.id)
        if active is not None and active.stopping_step == "stop":
            during = "compensation" if workflow.compensates(record.state) else "step"
            event = self._event(
                record,
                j.RUN_STOPPED,
                state=record.state,
                data={"reason": f"stopped during {during}"},
            )
            await self._finish(record, fence, [event], honoured=STOP)
            return
        row = StoredRun(
            record=record,
            idempotency_key=None,
            priority=0,
            owner=fence.owner,
            lease_expires_at=None,
            lease_epoch=fence.epoch,
            control=None,
            created_at=0.0,
            updated_at=0.0,
        )
        boundary = self._interrupted(row, interruptions.CUT_OFF)
        with contextlib.suppress(Exception):
            await self.outcomes.said(record.id, self._commit(boundary))

    def close(self) -> None:
        if self._exhaustion_check is not None:  # (the loop is the thread's, kept: no timer)
            self._exhaustion_check.cancel()
            self._exhaustion_check = None
        self.watchdog.close()
        self.leases.close()
        self._threads.shutdown()
