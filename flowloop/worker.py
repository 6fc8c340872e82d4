"""The long-running worker: runs and loops on one event loop, one concurrency budget,
graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Final

from flowloop import backpressure_metrics, gates
from flowloop.alerts import Alert, Alerts, breaker_alert, lease_lost_alert, run_alerts
from flowloop.engine import Engine
from flowloop.errors import FlowloopError
from flowloop.executor import Executor
from flowloop.freshstack import on_fresh_stack
from flowloop.gates import BreakerChange
from flowloop.journal import JournalEvent, RunRecord
from flowloop.lifecycle import FINISHED
from flowloop.loops import IDLE, Idle, Iteration, Loop
from flowloop.metrics import BEGINS, DEFAULT_METRICS_HOST, Metrics
from flowloop.retry import seconds
from flowloop.scheduler import Capacity, Scheduler
from flowloop.store.admission import AdmissionStoreMixin
from flowloop.store.loops import LoopStoreMixin

log = logging.getLogger("flowloop.worker")

DEFAULT_GRACE_SECONDS: Final = 30.0
IDLE_THREAD_EXIT_SECONDS: Final = 0.5
EXIT_POOL_EXHAUSTED: Final = 3
"""The worker's exit code after hung sync steps used up its step pool's bound: a fresh
process (started by the supervisor) has all its threads again."""
THREAD_PREFIX: Final = "flowloop-"
"""Names of the threads that run sync steps (``flowloop-step``) and iterations."""


class IterationFailed(Exception):
    """A workflow loop's run did not succeed."""


class Worker:
    """Executes due runs of ``engine``'s workflows and iterations of ``loops`` until stopped.

    The first SIGTERM/SIGINT stops claiming and lets in-flight steps and iterations finish
    within ``grace`` seconds; the rest are cut off and released (their journal shows it).
    A second signal exits at once (the journal still holds every committed boundary).

    Observability: ``alerts`` (default: to the log, off the event loop) get a critical
    alert for every failed run (saying so when a non-idempotent step was interrupted) and
    loop paused after ``max_failures``, a warning when a loop keeps skipping slots or this
    worker loses a lease. ``metrics`` (created when ``metrics_port`` is given) counts runs,
    steps, iterations and lease losses; with ``metrics_port`` it is served on
    ``metrics_host`` (default 127.0.0.1) for as long as the worker runs.
    """

    def __init__(
        self,
        engine: Engine,
        loops: Sequence[Loop] = (),
        *,
        concurrency: int | None = None,
        grace: float = DEFAULT_GRACE_SECONDS,
        alerts: Alerts | None = None,
        metrics: Metrics | None = None,
        metrics_port: int | None = None,
        metrics_host: str = DEFAULT_METRICS_HOST,
    ) -> None:
        self.engine = engine
        self.loops = {loop.name: loop for loop in loops}
        for loop in loops:
            if loop.workflow is not None:
                engine.register(loop.workflow)
        self.concurrency = concurrency or engine.max_concurrency
        self.grace = seconds(grace, "grace") or 0.0
        if self.grace < 0:
            raise FlowloopError(f"grace={grace!r}: must not be negative")
        self.alerts = alerts if alerts is not None else Alerts(background=True)
        self.metrics = metrics if metrics is not None or metrics_port is None else Metrics()
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics_bound: int | None = None
        """The port metrics are served on (``metrics_port=0`` picks a free one)."""
        self.stop_event: asyncio.Event | None = None
        self.executor: Executor | None = None
        self.scheduler: Scheduler | None = None
        self._signals = 0
        self.exit_code = 0
        """Non-zero when the worker stopped by itself (EXIT_POOL_EXHAUSTED)."""
        self._threads: ThreadPoolExecutor | None = None
        self._sync_calls: dict[str, Future[Any]] = {}

    async def run(self, stop: asyncio.Event | None = None) -> None:
        self.stop_event = stop = stop or asyncio.Event()
        executor = self.engine._new_executor(max_concurrency=self.concurrency)
        capacity = Capacity(self.concurrency, runs_busy=lambda: executor.busy)
        executor.reserved = lambda: capacity.loops_busy
        executor.pool_exhausted.append(self._pool_exhausted)
        self.executor = executor
        store = self.engine.store
        if not isinstance(store, LoopStoreMixin):
            raise TypeError("this store does not support loops")
        self.scheduler = Scheduler(
            store,
            self.loops,
            clock=self.engine.clock,
            worker_id=self.engine.worker_id,
            run_iteration=self._run_iteration,
            capacity=capacity,
            lease_seconds=self.engine.lease_seconds,
            alert=self._alert,
        )
        self._observe(executor, self.scheduler)
        if self.metrics is not None and self.metrics_port is not None:
            self.metrics_bound = self.metrics.serve(self.metrics_port, self.metrics_host)
        log.info(
            "worker %s: %d workflow(s), %d loop(s), concurrency %d",
            self.engine.worker_id,
            len(self.engine.workflows),
            len(self.loops),
            self.concurrency,
        )
        try:
            await asyncio.gather(
                executor.run(until_idle=False, stop=stop, grace=self.grace),
                self.scheduler.run(stop, grace=self.grace),
            )
        finally:
            executor.close()
            if self._threads is not None:
                self._threads.shutdown(wait=False, cancel_futures=True)
            if self.metrics is not None:
                self.metrics.close()
            self.alerts.close()
        log.info("worker %s stopped", self.engine.worker_id)

    # -- observability ---------------------------------------------------------------------

    def _observe(self, executor: Executor, scheduler: Scheduler) -> None:
        worker = self.engine.worker_id
        executor.listeners.append(self._on_boundary)
        executor.lease_lost.append(
            lambda run_id, why: self._alert(lease_lost_alert("run", run_id, why, worker))
        )
        scheduler.lease_lost.append(
            lambda name, why: self._alert(lease_lost_alert("loop", name, why, worker))
        )
        executor.gates.changed.append(self._breaker_changed)
        metrics = self.metrics
        if metrics is None:
            return
        executor.listeners.append(metrics.listener)
        executor.listeners.append(metrics.deferrals)
        executor.watchdog.listeners.append(metrics.stall)
        executor.lease_lost.append(metrics.lease_lost("run"))
        scheduler.lease_lost.append(metrics.lease_lost("loop"))
        scheduler.iteration_listeners.append(metrics.iteration)
        store, clock, names = self.engine.store, self.engine.clock, list(self.engine.workflows)
        metrics.track_queue(lambda: store.count_due(now=clock.now(), workflows=names))
        metrics.track_begins(lambda run_id: store.first_entry(run_id, BEGINS))
        metrics.track_in_flight(lambda: executor.busy)
        if isinstance(store, AdmissionStoreMixin):
            backpressure_metrics.track(metrics.registry, store.backpressure_usage, names)
        metrics.known(
            {name: list(wf.steps) for name, wf in self.engine.workflows.items()}, self.loops
        )
        metrics.track_abandoned_threads(lambda: executor.abandoned_threads)

    def _pool_exhausted(self, abandoned: int) -> None:
        if self.exit_code:
            return
        self.exit_code = EXIT_POOL_EXHAUSTED
        log.error(
            "stopping: %d sync step thread(s) hang past their timeouts; this worker hands "
            "its runs back and exits with code %d for its supervisor to start a fresh one",
            abandoned,
            EXIT_POOL_EXHAUSTED,
        )
        self._signals += 1  # a later signal exits at once, as after a first SIGTERM
        if self.stop_event is not None:
            self.stop_event.set()

    def _breaker_changed(self, change: BreakerChange) -> None:
        if self.metrics is not None:
            self.metrics.breaker(change.name, change.kind)
        alert = breaker_alert(change.name, change.kind, change.worker, change.error)
        if alert is not None:
            self._alert(alert)

    def _alert(self, alert: Alert) -> None:
        if self.metrics is not None:
            self.metrics.alert(alert.level, alert.what)
        self.alerts(alert)

    def _idempotent(self, workflow: str, state: str) -> bool:
        found = self.engine.workflows.get(workflow)
        spec = found.steps.get(state) if found is not None else None
        return spec is None or spec.idempotent

    def _on_boundary(self, record: RunRecord, events: Sequence[JournalEvent]) -> None:
        for alert in run_alerts(record, events, idempotent=self._idempotent):
            self._alert(alert)

    async def _run_iteration(self, loop: Loop, iteration: Iteration) -> Any:
        if loop.fn is not None:
            if loop.is_async:
                return await loop.fn(iteration)
            return await self._run_in_thread(loop, iteration)
        return await self._run_workflow(loop, iteration)

    async def _run_in_thread(self, loop: Loop, iteration: Iteration) -> Any:
        assert loop.fn is not None
        previous = self._sync_calls.get(loop.name)
        if previous is not None and not previous.done():
            # A call cut off by its timeout still runs in its thread (threads cannot be
            # killed): never two iterations of one loop at once, so wait for it first.
            await asyncio.wait([asyncio.wrap_future(previous)])
        # Our own pool, not the loop's default one: asyncio.run would wait for a sync
        # iteration cut off at the end of the grace period before the process could exit.
        if self._threads is None:
            self._threads = ThreadPoolExecutor(
                max_workers=self.concurrency, thread_name_prefix=THREAD_PREFIX + "loop"
            )
        call = self._threads.submit(loop.fn, iteration)
        self._sync_calls[loop.name] = call
        return await asyncio.wrap_future(call)

    async def _run_workflow(self, loop: Loop, iteration: Iteration) -> str | Idle:
        assert loop.workflow is not None and self.executor is not None
        engine = self.engine
        key = f"{iteration.idempotency_key}:a{iteration.attempt}"
        context = loop.context_for(iteration)
        if context is None or context is IDLE:
            return IDLE  # nothing to do in this slot: no run
        workflow = loop.workflow
        new = engine._new_run(
            workflow,
            context,
            key=None,
            idempotency_key=key,
            priority=0,
            run_at=None,
            # Claimed at birth, its first step started, as by Engine.run: only a run that
            # starts with a step no limit decides (one that starts with a call, a map or a
            # wait, created claimed, had nothing to go on with until its lease ran out).
            owner=engine.worker_id
            if workflow.initial in workflow.steps and not gates.gated_start(workflow)
            else None,
        )
        sent = time.monotonic()  # the lease is counted from before the request that set it
        with engine._making(new):
            stored, created = engine.store.create_run(new)
        if created and stored.owner is not None:
            if self.metrics is not None:  # (its step_started is the creation's, at seq 2)
                self.metrics.listener(new.record, new.events)
            self.executor.spawn(stored, starting=False, claimed_at=sent)
        elif created:
            self.executor.wake(stored.id)  # claimed like any other run
        else:
            engine._unmade(new)  # this slot's run, found by its key (a retried iteration)
        try:
            while True:
                task = self.executor.driving(stored.id)
                if task is not None:
                    await asyncio.wait([task])
                info = engine.store.get_run(stored.id)
                assert info is not None
                if info.record.status in FINISHED:
                    break
                await asyncio.sleep(engine.poll_seconds)
        except asyncio.CancelledError:
            if self.scheduler is not None and self.scheduler.stopping(loop.name):
                # Stopping the loop stops its iteration, and the iteration is this run.
                with contextlib.suppress(FlowloopError):
                    engine.stop(stored.id)
            raise
        if info.record.status != "succeeded":
            status, error = info.record.status, info.record.error or ""
            raise IterationFailed(f"run {stored.id} {status}: {error}")
        return stored.id

    def request_stop(self, signum: int | None = None) -> None:
        """Begin a graceful shutdown (what the first SIGTERM/SIGINT does); a second signal
        exits at once, with the shell's code for it (128 + its number)."""
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting at once (the journal holds)")
            os._exit(128 + signum if signum is not None else 1)
        log.info("stopping: no new work; in-flight work has %gs to finish", self.grace)
        if self.stop_event is not None:
            self.stop_event.set()

    def run_forever(self) -> None:
        """Run until SIGTERM/SIGINT, then shut down gracefully."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop, sig)
            await self.run(self.stop_event)

        # The worker's loop at the same place whatever the caller's depth (freshstack.py).
        on_fresh_stack(asyncio.run, main())
        _exit_if_threads_linger(self.exit_code)
        if self.exit_code:
            raise SystemExit(self.exit_code)


def _exit_if_threads_linger(code: int = 0) -> None:
    """A sync step or iteration cut off at the end of the grace period keeps running in its
    thread (threads cannot be killed) and Python would wait for it at exit. Its cut-off is
    journaled already, so leave now: the grace period is a promise to the operator."""
    lingering = [
        thread
        for thread in threading.enumerate()
        if thread.name.startswith(THREAD_PREFIX) and thread.is_alive() and not thread.daemon
    ]
    # Idle pool threads exit as soon as they see the pool's shutdown: give them a moment,
    # so only threads still running a step count.
    deadline = time.monotonic() + IDLE_THREAD_EXIT_SECONDS
    for thread in lingering:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    lingering = [thread for thread in lingering if thread.is_alive()]
    if not lingering:
        return
    log.warning(
        "exiting with %d step or iteration thread(s) still running after the grace "
        "period (already journaled as cut off)",
        len(lingering),
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
