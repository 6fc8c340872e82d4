"""The long-running worker: runs and loops on one event loop, one concurrency budget,
graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from collections.abc import Sequence
from typing import Any, Final

from flowloop.alerts import Alerts
from flowloop.engine import Engine
from flowloop.errors import FlowloopError
from flowloop.executor import Executor
from flowloop.lifecycle import FINISHED
from flowloop.loops import Iteration, Loop
from flowloop.scheduler import Capacity, Scheduler
from flowloop.store.loops import LoopStoreMixin

log = logging.getLogger("flowloop.worker")

DEFAULT_GRACE_SECONDS: Final = 30.0


class IterationFailed(Exception):
    """A workflow loop's run did not succeed."""


class Worker:
    """Executes due runs of ``engine``'s workflows and iterations of ``loops`` until stopped.

    The first SIGTERM/SIGINT stops claiming and lets in-flight steps and iterations finish
    within ``grace`` seconds; the rest are cut off and released (their journal shows it).
    A second signal exits at once (the journal still holds every committed boundary).
    """

    def __init__(
        self,
        engine: Engine,
        loops: Sequence[Loop] = (),
        *,
        concurrency: int | None = None,
        grace: float = DEFAULT_GRACE_SECONDS,
        alerts: Alerts | None = None,
    ) -> None:
        self.engine = engine
        self.loops = {loop.name: loop for loop in loops}
        for loop in loops:
            if loop.workflow is not None:
                engine.register(loop.workflow)
        self.concurrency = concurrency or engine.max_concurrency
        self.grace = grace
        self.alerts = alerts or Alerts()
        self.stop_event: asyncio.Event | None = None
        self.executor: Executor | None = None
        self.scheduler: Scheduler | None = None
        self._signals = 0

    async def run(self, stop: asyncio.Event | None = None) -> None:
        self.stop_event = stop = stop or asyncio.Event()
        executor = self.engine._new_executor(max_concurrency=self.concurrency)
        capacity = Capacity(self.concurrency, runs_busy=lambda: executor.busy)
        executor.reserved = lambda: capacity.loops_busy
        self.executor = executor
        store = self.engine.store
        if not isinstance(store, LoopStoreMixin):
            raise TypeError("this store does not support loops")
        self.scheduler = Scheduler(
            store, self.loops, clock=self.engine.clock, worker_id=self.engine.worker_id,
            run_iteration=self._run_iteration, capacity=capacity,
            lease_seconds=self.engine.lease_seconds, alert=self.alerts,
        )
        log.info("worker %s: %d workflow(s), %d loop(s), concurrency %d", self.engine.worker_id,
                 len(self.engine.workflows), len(self.loops), self.concurrency)
        try:
            await asyncio.gather(
                executor.run(until_idle=False, stop=stop, grace=self.grace),
                self.scheduler.run(stop, grace=self.grace),
            )
        finally:
            executor.close()
        log.info("worker %s stopped", self.engine.worker_id)

    async def _run_iteration(self, loop: Loop, iteration: Iteration) -> Any:
        if loop.fn is not None:
            if loop.is_async:
                return await loop.fn(iteration)
            return await asyncio.get_running_loop().run_in_executor(
                None, functools.partial(loop.fn, iteration)
            )
        return await self._run_workflow(loop, iteration)

    async def _run_workflow(self, loop: Loop, iteration: Iteration) -> str:
        assert loop.workflow is not None and self.executor is not None
        engine = self.engine
        key = f"{iteration.idempotency_key}:a{iteration.attempt}"
        new = engine._new_run(
            loop.workflow, loop.context_for(iteration), key=None, idempotency_key=key,
            priority=0, run_at=None, owner=engine.worker_id,
        )
        stored, created = engine.store.create_run(new)
        if created:
            self.executor.spawn(stored, starting=False)
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

    def request_stop(self) -> None:
        """Begin a graceful shutdown (what the first SIGTERM/SIGINT does)."""
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting at once (the journal holds)")
            os._exit(1)
        log.info("stopping: no new work; in-flight work has %gs to finish", self.grace)
        if self.stop_event is not None:
            self.stop_event.set()

    def run_forever(self) -> None:
        """Run until SIGTERM/SIGINT, then shut down gracefully."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop)
            await self.run(self.stop_event)

        asyncio.run(main())

