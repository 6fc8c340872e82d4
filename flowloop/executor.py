"""The worker loop: claim → step under its timeout → record → continue or release.

The journal protocol, which every write here keeps:

* **before**: a step's ``step_started`` is committed before its function is called;
* **after**: the outcome, the new run row and (when the run goes straight on) the next
  ``step_started`` are one transaction;
* boundaries of concurrently running runs share transactions (group commit): a run never
  goes on before its own previous boundary is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel, ValidationError

from flowloop import children, interruptions
from flowloop import journal as j
from flowloop.clock import Clock
from flowloop.compose import step_error
from flowloop.contexts import dump_context
from flowloop.definition import (
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
    StepTimeout,
)
from flowloop.events import accepted, accepts, check_visits, entering, receive, reject_kept
from flowloop.gates import Gates, share_limits
from flowloop.journal import JournalEvent, RunRecord
from flowloop.localdue import LocalDue
from flowloop.steppool import StepThreads
from flowloop.store import Boundary, Fence, InboxEvent, Store, StoredRun
from flowloop.store.outage import is_outage
from flowloop.verdicts import Verdict, judge
from flowloop.versions import workflow_for
from flowloop.watchdog import LoopWatchdog

log = logging.getLogger("flowloop")

DEFAULT_MAX_CONCURRENCY: Final = 16
DEFAULT_LEASE_SECONDS: Final = 30.0
DEFAULT_POLL_SECONDS: Final = 0.5
"""How often an idle worker looks for due runs and pending pause/stop requests."""
RECOVERY_BATCH: Final = 500
OUTAGE_BACKOFF_START: Final = 0.2
OUTAGE_BACKOFF_CAP: Final = 5.0
"""Seconds between attempts to reach a database that went away (at most; a third of the
lease when that is shorter, so a worker notices the database is back well within a lease)."""


def backoff_cap(lease_seconds: float) -> float:
    return min(OUTAGE_BACKOFF_CAP, max(OUTAGE_BACKOFF_START, lease_seconds / 3))


RECOVERY_EVERY_SECONDS: Final = 10.0
"""How often every worker settles runs whose lease expired (at most; half the lease when
that is shorter, so a run of a dead or frozen worker is taken over soon after its lease)."""

MAX_NOTE_CHARS: Final = 500
"""Of a step's notes (``Step.note``), kept in its journal entry."""
CUT_OFF_WRITE_SECONDS: Final = 5.0
"""How long, after the grace period, shutdown waits for the cut-offs to be journaled."""

Listener = Callable[[RunRecord, Sequence[JournalEvent]], None]
"""Called after each committed boundary with the run's new record and the events written."""


async def finish_within(tasks: Sequence[asyncio.Task[Any]], grace: float) -> None:
    """Wait up to ``grace`` seconds for ``tasks``, then cancel the rest and wait for them to
    settle (a cancelled drive journals its cut-off before it ends)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=grace)
    for task in pending:
        task.cancel()
    if pending:
        # Journaling the cut-offs needs the database: during an outage, give up after a
        # bounded time (the runs stay ``running`` and the next worker's recovery settles
        # them) rather than break the grace period's promise for good.
        await asyncio.wait(pending, timeout=CUT_OFF_WRITE_SECONDS)


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def owner_is_dead_here(owner: str) -> bool:
    """A worker on this host whose process is gone: its leases need not run out first."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def step_fields(workflow: str, record: RunRecord) -> dict[str, Any]:
    """The ``extra=`` fields of a step's log lines (keys of a JSON log line)."""
    return {
        "workflow": workflow,
        "run": record.id,
        "seq": record.last_seq,
        "state": record.state,
        "attempt": record.attempt,
    }


def error_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@dataclass
class _Active:
    task: asyncio.Task[None]
    step_task: asyncio.Future[Any] | None = None
    stopping_step: str | None = None  # "stop" when an operator stop cancelled the step


@dataclass
class Stats:
    steps: int = 0
    commits: int = 0
    boundaries: int = 0
    lost_leases: int = 0
    recovered: int = 0
    outage_retries: int = 0


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

    def _flush(self) -> None:
        self._scheduled = False
        self._timer = None
        retried, self._retrying = self._retrying, []
        # A cancelled waiter (its run was abandoned: lease lost, cut off) must not have
        # its boundary written after the fact.
        batch = [(b, f) for b, f in retried + self._pending if not f.cancelled()]
        self._pending = []
        if not batch:
            return
        try:
            results = self.store.write([boundary for boundary, _ in batch])
        except Exception as error:
            if not is_outage(error):
                self._backoff = 0.0
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                return
            self._retry_later(batch, error)
            return
        self._backoff = 0.0
        self.stats.commits += 1
        self.stats.boundaries += len(batch)
        retried_ids = {id(boundary) for boundary, _ in retried}
        for (boundary, future), applied in zip(batch, results, strict=True):
            if not applied and id(boundary) in retried_ids:
                applied = self._already_applied(boundary)
            if applied and boundary.release:
                self.released.add(boundary.run_id)
            if not future.done():
                future.set_result(applied)

    def _retry_later(
        self, batch: list[tuple[Boundary, asyncio.Future[bool]]], error: Exception
    ) -> None:
        self._retrying = batch
        self._backoff = min(self.cap, max(OUTAGE_BACKOFF_START, self._backoff * 2))
        self.stats.outage_retries += 1
        log.warning(
            "database unreachable (%s); %d boundary write(s) kept, retrying in %.1fs",
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


class Executor:
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
        self.workflows = workflows
        self.clock = clock
        self.worker_id = worker_id
        self.max_concurrency = max_concurrency
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.listeners = list(listeners)
        self.lease_lost: list[Callable[[str, str], None]] = []
        """Called with (run id, why) when this worker stops driving a run it lost."""
        self.stats = Stats()
        self.committer = Committer(store, self.stats, cap=backoff_cap(lease_seconds))
        self._threads = StepThreads(max_concurrency)
        self.pool_exhausted: list[Callable[[int], None]] = []
        """Called (with the number of abandoned threads) when hung sync steps reach the
        step pool's bound (see flowloop.steppool)."""
        self._active: dict[str, _Active] = {}
        self._controls: dict[str, str] = {}
        self._draining = False
        self.handing_back = False
        """Set by :meth:`hand_back`: claim nothing more and stop once the steps in flight
        have finished (their runs are released)."""
        self.async_steps: dict[str, Step] = {}
        """The async steps in flight by run id, named by the loop watchdog on a stall."""
        self.watchdog = LoopWatchdog(self.async_steps)
        self._given_up: set[str] = set()
        """Runs this worker abandoned (lost lease): recovering one later says so."""
        self._wake: asyncio.Event | None = None
        self._per_workflow: dict[str, int] = {}
        self._lease_until: dict[str, float] = {}
        """Per driven run: by this process's monotonic clock, the earliest its lease can end
        (the time just before the claim, renewal or owned write that set it, plus the lease)."""
        self.tracked: set[str] = set()
        self.committed: dict[str, tuple[RunRecord, float]] = {}
        """The last committed record (and its time) of each ``tracked`` run, for the engine's
        fast path (so it need not read the row back); the reader removes both."""
        self.due_here = LocalDue(clock)
        """Due times of runs this executor handed back, on the monotonic clock too (a wall
        clock set back must not stall a 3 s retry for an hour)."""
        self.reserved: Callable[[], int] = lambda: 0
        self.gates = Gates(store, worker_id, clock)
        """Breakers and rate limits checked before calls (flowloop/gates.py)."""
        """Slots of ``max_concurrency`` taken by others (a worker's loop iterations)."""

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
        idle_horizon: float = 300.0,
        stop: asyncio.Event | None = None,
        grace: float = 30.0,
        initial: Sequence[StoredRun] = (),
    ) -> Stats:
        """Claim and drive due runs. With ``until_idle``, return when no run is due and none
        is running (waiting for retry backoff that ends within ``idle_horizon`` seconds);
        otherwise run until ``stop`` is set, then drain within ``grace`` seconds.
        ``initial`` runs are already claimed and started by the caller."""
        self._wake = asyncio.Event()
        share_limits(self.store, self.workflows)  # as now configured (config overrides)
        for stored in initial:
            self.spawn(stored, starting=False)
        helpers = [asyncio.create_task(self.heartbeat())]
        try:
            # Recovery, the first one included, is inside the outage handling: a worker or
            # `resume` starting while the database refuses writes waits for it.
            last_recovery: float | None = None
            outage = 0.0
            while not (stop is not None and stop.is_set()) and not self.handing_back:
                try:
                    if last_recovery is None or self.clock.monotonic() - last_recovery > min(
                        RECOVERY_EVERY_SECONDS, self.lease_seconds / 2
                    ):
                        await self.recover()
                        if last_recovery is None:
                            self._park_stranded_waits()
                        last_recovery = self.clock.monotonic()
                    claimed = self._claim(run_ids)
                    due = (
                        self.store.next_due(workflows=list(self.workflows), run_ids=run_ids)
                        if until_idle and not claimed and not self._active
                        else None
                    )
                    outage = 0.0
                except Exception as error:
                    if not is_outage(error):
                        raise
                    cap = backoff_cap(self.lease_seconds)
                    outage = min(cap, max(OUTAGE_BACKOFF_START, outage * 2))
                    log.warning(
                        "database unreachable (%s); retrying in %.1fs", error_line(error), outage
                    )
                    if stop is None:
                        await asyncio.sleep(outage)
                    else:  # a shutdown asked for during an outage does not wait it out
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), outage)
                    continue
                if claimed:
                    continue
                if until_idle and not self._active:
                    # Only the runs this call drives: another due run it may not claim
                    # must not keep it spinning.
                    wait = None if due is None else max(0.0, due - self.clock.now())
                    local = self.due_here.next_wait(run_ids)
                    if local is not None and (wait is None or local < wait):
                        wait = local  # the wall clock was set back: trust the monotonic one
                    if wait is None or wait > idle_horizon:
                        break
                    await self.clock.sleep(wait)
                    continue
                await self._wait_for_work(stop)
            await self.drain(grace)
        finally:
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
            # Drained, not retired: the engine keeps this executor, and a later engine.run
            # must go straight on from step to step instead of handing back at each one.
            self._draining = self.handing_back
        return self.stats

    def _claim(self, run_ids: Sequence[str] | None) -> int:
        free = self.max_concurrency - len(self._active) - self.reserved()
        eligible = [
            name
            for name, workflow in self.workflows.items()
            if workflow.max_concurrency is None
            or self._per_workflow.get(name, 0) < workflow.max_concurrency
        ]
        if free <= 0 or not eligible:
            return 0
        rows: list[StoredRun] = []
        overdue, at = self.due_here.overdue(run_ids)
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
        if free > 0:
            rows += self.store.claim(
                worker=self.worker_id,
                now=self.clock.now(),
                limit=free,
                lease_seconds=self.lease_seconds,
                workflows=eligible,
                run_ids=run_ids,
            )
        taken = 0
        for stored in rows:
            workflow = workflow_for(self.workflows, stored.record)
            count = self._per_workflow.get(workflow.name, 0)
            if workflow.max_concurrency is not None and count >= workflow.max_concurrency:
                self.store.release(worker=self.worker_id, run_ids=[stored.id])
                continue
            self.spawn(stored, starting=True)
            taken += 1
        return taken

    async def _wait_for_work(self, stop: asyncio.Event | None) -> None:
        assert self._wake is not None
        waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(self._wake.wait())]
        if stop is not None:
            waiters.append(asyncio.ensure_future(stop.wait()))
        try:
            await asyncio.wait(
                waiters,
                timeout=self.gates.wake_in(self.poll_seconds),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
            self._wake.clear()

    def spawn(self, stored: StoredRun, *, starting: bool) -> asyncio.Task[None]:
        """Drive one claimed run in its own task."""
        name = stored.record.workflow
        self._per_workflow[name] = self._per_workflow.get(name, 0) + 1
        task = asyncio.create_task(self._drive(stored, starting=starting))
        self._active[stored.id] = active = _Active(task)
        self._lease_until[stored.id] = time.monotonic() + self.lease_seconds
        self.committer.released.discard(stored.id)
        self.due_here.forget((stored.id,))

        def done(_: asyncio.Task[None]) -> None:
            self._per_workflow[name] -= 1
            if self._active.get(stored.id) is not active:
                return  # the run was claimed again and is driven by a newer task
            self._active.pop(stored.id, None)
            self._controls.pop(stored.id, None)
            self._lease_until.pop(stored.id, None)
            self.committer.released.discard(stored.id)
            if self._wake is not None:
                self._wake.set()

        task.add_done_callback(done)
        return task

    def hand_back(self) -> None:
        """Claim nothing more, let the steps in flight finish and journal their outcome,
        then release their runs (``run_released``: released on shutdown) and stop: what a
        first Ctrl-C does to ``flowloop run``. Cancelling the driving task then cuts off."""
        self.handing_back = True
        self._draining = True
        if self._wake is not None:
            self._wake.set()

    def stop_handing_back(self) -> None:
        """Drive runs again after :meth:`hand_back` (its caller got what it waited for)."""
        self.handing_back = False
        self._draining = False

    async def drain(self, grace: float) -> None:
        """Let in-flight steps finish (their runs are released, not continued) for up to
        ``grace`` seconds, then cut the rest off: their journal shows the interruption."""
        self._draining = True
        await finish_within([active.task for active in self._active.values()], grace)

    # -- leases and control ----------------------------------------------------------------

    async def heartbeat(self) -> None:
        """Renew held leases every lease/3, pick up pause/stop requests every poll, and fence
        this worker off every run whose lease it could not renew in time.

        Lease arithmetic uses the real monotonic clock (a test's fake clock does not move
        the database's): the lease was set by the database at or after the local instant
        noted before the request that set it, so it ends no earlier than that + lease."""
        # Ticks at most lease/12 apart: a run is fenced off with lease/6 to spare at the
        # latest one tick (lease/12) after that point, so with lease/12 left at worst.
        tick = max(0.01, min(self.poll_seconds, self.lease_seconds / 12))
        self._watch_loop_while_beating()
        last_renewal = last_poll = time.monotonic()
        failing = False
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            try:
                called = False
                if now - last_poll >= self.poll_seconds or failing:
                    self._poll_controls()
                    last_poll, called = now, True
                if now - last_renewal >= self.lease_seconds / 3:
                    self._renew()
                    last_renewal, called = now, True
                if failing and called:
                    log.info("heartbeat: database reachable again")
                    failing = False
            except Exception as error:  # keep beating (retrying every tick) through a hiccup
                if not failing:
                    log.warning("heartbeat failed (retrying): %s", error_line(error))
                failing = True
            self._fence_expiring()

    def _watch_loop_while_beating(self) -> None:
        """The loop watchdog (flowloop/watchdog.py) runs as long as a heartbeat does."""
        beating = asyncio.current_task()
        if beating is not None:
            self.watchdog.start()
            beating.add_done_callback(lambda _: self.watchdog.stop())

    def _renew(self) -> None:
        released = self.committer.released
        held = [
            run_id
            for run_id, active in self._active.items()
            if run_id not in released and not active.task.done()
        ]
        if not held:
            return
        before = time.monotonic()
        kept = self.store.renew(
            worker=self.worker_id, run_ids=held, lease_seconds=self.lease_seconds
        )
        for run_id in kept:
            self._lease_until[run_id] = before + self.lease_seconds
        for run_id in set(held) - kept:
            if run_id in released:  # let go meanwhile (cannot happen while renew blocks)
                continue
            self._abandon(run_id, "lost its lease (expired, or taken over by another worker)")

    def _fence_expiring(self) -> None:
        """Self-fencing: a run whose lease could not be renewed is abandoned when a sixth of
        the lease is left (a twelfth at worst, given the heartbeat's tick), so this worker
        never steps a run that another worker may already have taken over."""
        limit = time.monotonic() + self.lease_seconds / 6
        for run_id, until in list(self._lease_until.items()):
            active = self._active.get(run_id)
            if (
                until <= limit
                and active is not None
                and not active.task.done()
                and run_id not in self.committer.released
                and self._controls.get(run_id) != "lost"
            ):
                late = time.monotonic() - until
                self._abandon(
                    run_id,
                    "could not renew its lease in time; abandoning it before "
                    "the lease ends (self-fencing)"
                    if late < 0
                    else "could not renew its lease in time and was blocked past its end "
                    f"({late:.1f}s, in a database call); abandoning it (self-fencing)",
                )

    def _abandon(self, run_id: str, why: str) -> None:
        """Stop driving a run this worker no longer (surely) holds; write nothing more for it."""
        log.warning("run %s: %s", run_id, why, extra={"run": run_id, "event": "lease_lost"})
        self._given_up.add(run_id)
        self.stats.lost_leases += 1
        self._lease_lost(run_id, why)
        self._controls[run_id] = "lost"
        self._lease_until.pop(run_id, None)
        active = self._active.get(run_id)
        if active is not None:
            active.task.cancel()

    def _poll_controls(self) -> None:
        for run_id, action in self.store.pending_controls(worker=self.worker_id).items():
            self._controls[run_id] = action
            active = self._active.get(run_id)
            if action == "stop" and active is not None and active.step_task is not None:
                active.stopping_step = "stop"
                active.step_task.cancel()

    # -- recovery --------------------------------------------------------------------------

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
            boundaries = [self._interrupted(row) for row in rows]
            results = self.store.write(boundaries)
            self.stats.commits += 1
            for boundary, applied in zip(boundaries, results, strict=True):
                if applied:
                    recovered += 1
                    self.stats.recovered += 1
                    self._notify(boundary)

    def _interrupted(self, row: StoredRun, cause: str | None = None) -> Boundary:
        record = row.record
        workflow = workflow_for(self.workflows, record)
        spec = workflow.steps.get(record.state)
        now = self.clock.now()
        if cause is None:  # found by recovery: this worker's own lease, or another's
            mine = row.id in self._given_up or row.id in self._active
            cause = interruptions.LEASE_LOST if mine else interruptions.WORKER_GONE
        self._given_up.discard(row.id)
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
        data, message, route = children.interrupted(workflow, record, data, message, now)
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
        log.log(
            logging.ERROR if "reason" in data else logging.WARNING,
            "run %s seq %d: %s attempt %d interrupted: %s",
            record.id,
            record.last_seq,
            record.state,
            record.attempt,
            message,
            extra={
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

    def _park_stranded_waits(self) -> None:
        """Waiting runs without a timeout are never claimed: park, once at start, those
        the loaded definitions cannot take (flowloop/parking.py)."""
        from flowloop.parking import park_stranded_waits
        from flowloop.store.sql import SQLStore

        if isinstance(self.store, SQLStore):
            park_stranded_waits(
                self.store, self.workflows, worker=self.worker_id, now=self.clock.now()
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
        event = JournalEvent(
            run_id=record.id,
            seq=record.last_seq + 1,
            kind=j.RUN_PAUSED,
            at=now,
            state=record.state,
            error_message=f"interrupted in attempt {record.attempt}; {verdict.message}",
            worker=self.worker_id,
            data={"reason": verdict.reason, "interrupted": record.attempt},
        )
        log.warning("run %s parked: %s", record.id, verdict.reason)
        return Boundary(
            events=[event],
            record=j.apply(record, event),
            fence=Fence(self.worker_id, row.lease_epoch),
            release=True,
        )

    # -- one run ---------------------------------------------------------------------------

    def _lease_lost(self, run_id: str, why: str) -> None:
        for hook in self.lease_lost:
            try:
                hook(run_id, why)
            except Exception:  # a hook must never break the worker
                log.exception("lease-lost hook failed")

    def _notify(self, boundary: Boundary) -> None:
        for listener in self.listeners:
            try:
                listener(boundary.record, boundary.events)
            except Exception:  # a listener must never break the journal
                log.exception("listener failed")

    async def _commit(self, boundary: Boundary) -> bool:
        before = time.monotonic()
        applied = await self.committer.submit(boundary, alone=len(self._active) <= 1)
        if applied and boundary.release:
            self.due_here.note(boundary.run_id, boundary.record.next_run_at)
        if applied:
            if boundary.run_id in self.tracked:
                self.committed[boundary.run_id] = (
                    boundary.record,
                    boundary.events[-1].at if boundary.events else 0.0,
                )
            if not boundary.release and boundary.run_id in self._lease_until:
                # Owned writes renew the lease too.
                self._lease_until[boundary.run_id] = before + self.lease_seconds
            self._notify(boundary)
        else:
            self.stats.lost_leases += 1
            why = "write refused (lease lost or run changed by another writer); abandoning it"
            log.warning(
                "run %s: %s",
                boundary.run_id,
                why,
                extra={"run": boundary.run_id, "event": "lease_lost"},
            )
            self._given_up.add(boundary.run_id)
            self._lease_lost(boundary.run_id, why)
        return applied

    def _event(self, record: RunRecord, kind: str, offset: int = 1, **fields: Any) -> JournalEvent:
        return JournalEvent(
            run_id=record.id,
            seq=record.last_seq + offset,
            kind=kind,
            at=self.clock.now(),
            worker=self.worker_id,
            **fields,
        )

    async def _finish(
        self, record: RunRecord, fence: Fence, events: list[JournalEvent], **flags: bool
    ) -> None:
        for event in events:
            record = j.apply(record, event)
        await self._commit(
            Boundary(events=events, record=record, fence=fence, release=True, **flags)
        )

    async def _drive(self, stored: StoredRun, *, starting: bool) -> None:
        record, fence = stored.record, Fence(self.worker_id, stored.lease_epoch)
        workflow = workflow_for(self.workflows, record)
        try:
            problem = self._cannot_run(workflow, stored)
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
            if stored.control in ("pause", "stop"):
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
                waited = await self._end_wait(workflow, record, fence)
                if waited is None:
                    return
                record = waited
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
            while record.status == "running":
                next_record = await self._step(workflow, record, fence)
                if next_record is None:
                    return
                record = next_record
        except asyncio.CancelledError:
            if self._controls.get(record.id) != "lost" and record.status == "running":
                await asyncio.shield(self._cut_off(record, fence))
            raise

    def _cannot_run(self, workflow: Workflow, stored: StoredRun) -> tuple[str, str, str] | None:
        record = stored.record
        if stored.problem is not None:
            return j.RUN_FAILED, "invalid_row", stored.problem
        verdict = self._verdict(workflow, record)
        if verdict.goes_on:
            return None
        # The reason says why, so `status` shows it without digging in the journal.
        kind = j.RUN_PAUSED if verdict.outcome == "paused" else j.RUN_FAILED
        return kind, verdict.reason or "", verdict.message or ""

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
        )

    async def _honour_control(self, record: RunRecord, fence: Fence) -> bool:
        action = self._controls.get(record.id)
        if action not in ("pause", "stop"):
            return False
        kind = j.RUN_PAUSED if action == "pause" else j.RUN_STOPPED
        await self._finish(
            record, fence, [self._event(record, kind, state=record.state)], clear_control=True
        )
        return True

    async def _cut_off(self, record: RunRecord, fence: Fence) -> None:
        """A step cancelled by shutdown or an operator's stop: journal it, then let go."""
        active = self._active.get(record.id)
        if active is not None and active.stopping_step == "stop":
            event = self._event(
                record, j.RUN_STOPPED, state=record.state, data={"reason": "stopped during step"}
            )
            await self._finish(record, fence, [event], clear_control=True)
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
            await self._commit(boundary)

    async def _step(self, workflow: Workflow, record: RunRecord, fence: Fence) -> RunRecord | None:
        """Run the started step of ``record``; commit its outcome. Returns the record when
        the run goes straight on with its next step, else ``None``."""
        spec = workflow.steps[record.state]
        step = Step(
            run_id=record.id,
            workflow=workflow.name,
            state=record.state,
            attempt=record.attempt,
            visit=record.visit(record.state),
            seq=record.last_seq,
            worker=self.worker_id,
            error=step_error(record) if record.error else None,
        )
        # The step's own copy, carried to the current context version (issue 16).
        ctx = workflow.load_context(record.context, record.context_version)
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
            if record.deadline is None:
                returned = await self._call(record.id, spec, ctx, step)
            else:  # the run's deadline cuts the step off (a thread's result is discarded)
                returned = await children.within_deadline(
                    self._call(record.id, spec, ctx, step), record, self.clock
                )
            event = workflow.event_for(record.state, returned)
            next_state = workflow.next_state(record.state, event)
            context = dump_context(ctx, workflow=workflow.name, state=record.state)
            workflow.context.model_validate_json(context)
            check_visits(workflow, record, next_state)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            duration = self.clock.monotonic() - started
            if isinstance(error, children.DeadlineCut):
                return await children.past_deadline(self, workflow, record, fence)
            self.gates.called(spec, error)
            return await self._failed(workflow, spec, record, fence, error, duration)
        duration = self.clock.monotonic() - started
        self.gates.called(spec, None)
        self.stats.steps += 1
        delay = returned.delay if isinstance(returned, Sleep) else 0.0
        succeeded = self._event(
            record,
            j.STEP_SUCCEEDED,
            state=record.state,
            attempt=record.attempt,
            event=str(event),
            next_state=next_state,
            context=context,
            duration=duration,
            data=entering(workflow, next_state, self.clock.now(), delay=delay)
            | ({"note": "; ".join(step.notes)[:MAX_NOTE_CHARS]} if step.notes else {}),
        )
        if logged:
            log.info(
                "run %s seq %d: %s attempt %d succeeded in %.1f ms (%s -> %s)",
                record.id,
                record.last_seq,
                record.state,
                record.attempt,
                duration * 1000,
                event,
                next_state,
                extra={
                    **step_fields(workflow.name, record),
                    "event": "step_finished",
                    "outcome": "succeeded",
                    "duration": duration,
                    "next_state": next_state,
                },
            )
        return await self._advance(workflow, record, fence, succeeded)

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
        if action in ("pause", "stop") or self._draining:
            events = [transition]
            if action in ("pause", "stop"):
                kind = j.RUN_PAUSED if action == "pause" else j.RUN_STOPPED
                events.append(self._event(record, kind, offset=2, state=target))
            else:  # draining: say so in the journal (the due time stays the transition's)
                reason = interruptions.RELEASED_ON_SHUTDOWN
                due = after.next_run_at
                released = {"due": due, "reason": reason}
                events.append(
                    self._event(record, j.RUN_RELEASED, offset=2, state=target, data=released)
                )
            await self._finish(record, fence, events, clear_control=action is not None)
            if action is None and target in workflow.waits:
                self._deliver(record.id)  # draining: still hand it what was kept for it
            return None
        if target in workflow.composites and (after.deadline or transition.at + 1) > transition.at:
            # A call/map state: fan out now (the entry committed with it), no claim first.
            return await children.drive(self, workflow, record, fence, entered=transition)
        if target not in workflow.steps or (after.next_run_at or 0.0) > transition.at:
            # Waiting or sleeping: hand the run back; its due time (if any) is stored. (A
            # call, map or compensating state is due now: a claim takes it on.)
            applied = await self._commit(
                Boundary(events=[transition], record=after, fence=fence, release=True)
            )
            if applied and target in workflow.waits:
                self._deliver(record.id)
            elif applied and self._wake is not None and target not in workflow.waits:
                self._wake.set()
            return None
        held = await self.gates.check(workflow, after, target, attempt=0)
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
        self, workflow: Workflow, record: RunRecord, fence: Fence
    ) -> RunRecord | None:
        """A claimed waiting run: take a buffered event it accepts (rejecting, one by one,
        those it cannot take), else its timeout when it is due; else (claimed early:
        unpaused, or created in its wait state) hand it back with its stored due time
        (``None`` without a timeout)."""
        now = self.clock.now()
        for message in self.store.pending_events(record.id):
            if message.event not in workflow.waits[record.state].on:
                continue
            entry, after = take_kept(workflow, record, message, now=now, worker=self.worker_id)
            # On this claim: applied and handed back (the run moved on), or rejected and
            # kept (it still waits here: the next kept event, else the timeout).
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
            elif self._wake is not None:
                self._wake.set()
            return None
        # Claimed because its stored due time (the timeout's) has come; anything else (no
        # timeout, or a clock that disagrees) goes back to waiting unchanged.
        due = record.next_run_at if workflow.waits[record.state].timeout is not None else None
        if due is None or due > now:
            released = self._event(
                record,
                j.RUN_RELEASED,
                state=record.state,
                data={"due": due, "reason": "waiting for an event"},
            )
            await self._finish(record, fence, [released])
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

    def _deliver(self, run_id: str) -> None:
        delivered = try_deliver_pending(
            self.store, self.workflows, run_id, now=self.clock.now(), worker=self.worker_id
        )
        if delivered and self._wake is not None:
            self._wake.set()

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
        )
        retryable = not definitive and spec.retry.should_retry(error, record.attempt)
        data: dict[str, Any]
        route = None if retryable else children.error_route(workflow, spec, record, error)
        if retryable:
            delay = spec.retry.delay(record.attempt)
            data = {"retry_at": self.clock.now() + delay}
        elif route is not None:  # on_error: the run moves on; the error stays visible
            data = {**entering(workflow, route[1], self.clock.now()), "route": "on_error"}
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
            traceback="".join(traceback.format_exception(error))[-8000:],
            retryable=retryable,
            data=data,
            event=None if route is None else route[0],
            next_state=None if route is None else route[1],
        )
        level = logging.INFO if retryable or route is not None else logging.ERROR
        outcome = (
            "timed_out" if isinstance(error, StepTimeout) else "retried" if retryable else "failed"
        )
        log.log(
            level,
            "run %s seq %d: %s attempt %d %s in %.1f ms: %s: %s",
            record.id,
            record.last_seq,
            record.state,
            record.attempt,
            outcome,
            duration * 1000,
            type(error).__name__,
            message,
            extra={
                **step_fields(workflow.name, record),
                "event": "step_finished",
                "outcome": outcome,
                "duration": duration,
                "error_type": type(error).__name__,
                "retryable": retryable,
            },
        )
        if route is not None:
            return await self._advance(workflow, record, fence, failed)
        await self._finish(record, fence, [failed])
        if retryable and self._wake is not None:
            self._wake.set()
        return None

    async def _call(self, run_id: str, spec: StepSpec, ctx: BaseModel, step: Step) -> Any:
        if not spec.is_async:
            return await self._invoke(run_id, spec, ctx, step)
        self.async_steps[run_id] = step
        try:
            return await self._invoke(run_id, spec, ctx, step)
        finally:
            self.async_steps.pop(run_id, None)

    async def _invoke(self, run_id: str, spec: StepSpec, ctx: BaseModel, step: Step) -> Any:
        args = (ctx, step) if spec.wants_step else (ctx,)
        abandoned: list[bool] = []
        thread: Future[Any] | None = None
        active = self._active.get(run_id)
        if spec.is_async and spec.timeout is None and active is not None:
            # No timeout to enforce: await the coroutine inline instead of wrapping it in a
            # Task (a Task costs its creation and two event-loop turns per step). A stop
            # or a lost lease then cancels the run's own task, which cuts the step off.
            active.step_task = active.task
            try:
                return await spec.fn(*args)
            finally:
                active.step_task = None
        if spec.is_async:
            future: asyncio.Future[Any] = asyncio.ensure_future(spec.fn(*args))
        else:
            work = self._threads.submit(spec.fn, *args)
            work.add_done_callback(functools.partial(_late_result, run_id, spec.name, abandoned))
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
        except BaseException:
            abandoned.append(True)
            if thread is not None:
                self._abandoned(run_id, spec.name, thread)
            raise
        finally:
            if active is not None:
                active.step_task = None

    def _abandoned(self, run_id: str, state: str, work: Future[Any]) -> None:
        """A sync step given up on: its thread is replaced (within the pool's bound)."""
        if not self._threads.abandon(work):
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
        if count >= bound:
            log.error(
                "%d sync step thread(s) hang past their timeouts (the bound is %d): "
                "each further one takes a slot of this process",
                count,
                bound,
                extra={"event": "step_pool_exhausted", "abandoned": count},
            )
            for hook in self.pool_exhausted:
                try:
                    hook(count)
                except Exception:  # a hook must never break the worker
                    log.exception("pool-exhausted hook failed")

    def close(self) -> None:
        self.watchdog.close()
        self._threads.shutdown()


def deliver_pending(
    store: Store, workflows: Mapping[str, Workflow], run_id: str, *, now: float, worker: str
) -> int:
    """Hand a waiting run the oldest buffered events its current state accepts, one after
    another (each may lead to another wait); one it cannot take is rejected (journaled, out
    of the inbox) and the next is tried. Returns how many left the inbox."""
    consumed = 0
    while True:
        pending = store.pending_events(run_id)
        if not pending:  # the usual case: one read, nothing kept for this run
            return consumed
        stored = store.get_run(run_id)
        if stored is None or stored.record.workflow not in workflows:
            return consumed
        workflow = workflow_for(workflows, stored.record)
        record = stored.record
        if stored.owner is not None or not accepted(workflow, record.state):
            return consumed
        message = next((m for m in pending if accepts(workflow, record, m.event)), None)
        if message is None:
            return consumed
        entry, after = take_kept(workflow, record, message, now=now, worker=worker)
        boundary = Boundary(events=[entry], record=after, fence=Fence(None, stored.lease_epoch))
        if store.deliver(message, boundary) != "applied":
            return consumed
        consumed += 1


def take_kept(
    workflow: Workflow, record: RunRecord, message: InboxEvent, *, now: float, worker: str
) -> tuple[JournalEvent, RunRecord]:
    """The journal entry for a kept event offered to a waiting run that accepts it:
    ``event_received``, or ``event_rejected`` when the state cannot take it after all (its
    handler raised, …) — a kept event never fails the run it was sent to. A stored
    context that no longer validates is the run's problem, not the event's: it raises."""
    workflow.load_context(record.context, record.context_version)
    try:
        return receive(
            workflow,
            record,
            message.event,
            message.payload,
            now=now,
            worker=worker,
            extra={"buffered_at": message.sent_at},
        )
    except Exception as error:
        log.warning(
            "run %s: kept event %r rejected in state %s: %s",
            record.id,
            message.event,
            record.state,
            error_line(error),
            extra={"run": record.id, "event": "event_rejected"},
        )
        return reject_kept(
            record, message.event, error, sent_at=message.sent_at, now=now, worker=worker
        )


def try_deliver_pending(
    store: Store, workflows: Mapping[str, Workflow], run_id: str, *, now: float, worker: str
) -> int | None:
    """:func:`deliver_pending` that logs instead of raising (``None``: it failed, e.g. a
    handler raised on a kept event). The run stays waiting; the next send or claim retries."""
    try:
        return deliver_pending(store, workflows, run_id, now=now, worker=worker)
    except Exception as error:
        log.warning("run %s: could not deliver buffered events: %s", run_id, error_line(error))
        return None


def _late_result(run_id: str, state: str, abandoned: list[bool], work: Future[Any]) -> None:
    # A thread cannot be killed: when a timed-out or cut-off sync step finishes anyway, its
    # result is discarded (that attempt's outcome is already in the journal) and logged.
    if abandoned and not work.cancelled():
        log.warning(
            "run %s: step %s finished after its timeout or cancellation; result discarded",
            run_id,
            state,
        )
