"""Loops (``@loop``, ``Loop``) on the test engine's fake clock: the worker's scheduler and
executor, driven slot by slot — fire what is due, let the iterations finish, jump the clock
to the next slot — instead of a worker sleeping between slots."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from flowloop.alerts import Alerts
from flowloop.errors import FlowloopError
from flowloop.executor import Executor
from flowloop.loops import Loop
from flowloop.scheduler import Capacity, Scheduler
from flowloop.store.loops import LoopEvent, LoopStoreMixin
from flowloop.worker import Worker

if TYPE_CHECKING:
    from flowloop.testing.engine import TestEngine

SETTLE_TICK_SECONDS: Final = 0.005
"""Real seconds between looks at running iterations (a sync one runs in a thread)."""
SETTLE_TURNS: Final = 20
"""Event-loop turns a quiet look waits for a thread's late callbacks before the clock moves."""
STUCK_SECONDS: Final = 10.0
"""Real seconds running iterations may make no progress, with nothing due, before the
kit gives up on them (an iteration waiting for something that never comes)."""


async def drive_loops(
    engine: TestEngine, loops: Sequence[Loop], *, until: float, max_jumps: int
) -> list[LoopEvent]:
    """Run ``loops`` on ``engine`` until its fake clock reaches ``until``; returns the loop
    journal entries written meanwhile, in order."""
    store = engine.store
    if not isinstance(store, LoopStoreMixin):
        raise FlowloopError("this store does not keep loops")
    worker = Worker(engine, loops, alerts=Alerts())  # registers the loops' workflows
    executor = engine._new_executor(max_concurrency=worker.concurrency)
    capacity = Capacity(worker.concurrency, runs_busy=lambda: executor.busy)
    executor.reserved = lambda: capacity.loops_busy
    scheduler = Scheduler(
        store,
        worker.loops,
        clock=engine.clock,
        worker_id=engine.worker_id,
        run_iteration=worker._run_iteration,
        capacity=capacity,
        lease_seconds=engine.lease_seconds,
        alert=worker._alert,
    )
    worker.executor, worker.scheduler = executor, scheduler
    seen = {loop.name: _last_seq(engine, loop.name) for loop in loops}
    stop = asyncio.Event()
    runs = asyncio.create_task(executor.run(until_idle=False, stop=stop, grace=0.0))
    try:
        await scheduler.start()
        for _ in range(max_jumps + 1):
            await _fire_and_settle(engine, scheduler, executor, worker, until)
            wait = scheduler._seconds_to_next()
            if wait is None or engine.clock.now() + wait > until:
                break
            engine.clock.advance(wait)
        else:
            raise FlowloopError(
                f"loops still had slots due after {max_jumps} jumps of the clock; "
                "drive them for a shorter time"
            )
        if engine.clock.now() < until:
            engine.clock.set(until)
            await _fire_and_settle(engine, scheduler, executor, worker, until)
    finally:
        # As the worker's end: an iteration still running is cancelled, and a loop function
        # abandoned still running (it ignores cancellation) is left out of the event loop's
        # tasks, which asyncio.run waits for as it ends (for ever, for such a function).
        left = [running.task for running in scheduler._running.values()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        scheduler._timed.forget()
        stop.set()
        await asyncio.gather(runs, return_exceptions=True)
        executor.close()
        if worker._threads is not None:
            worker._threads.shutdown(wait=True)
        worker.alerts.close()
    events = [
        event
        for name, after in seen.items()
        for event in engine.loop_history(name)
        if event.seq > after
    ]
    return sorted(events, key=lambda event: (event.at, event.loop, event.seq))


def _last_seq(engine: TestEngine, name: str) -> int:
    store = engine.store
    assert isinstance(store, LoopStoreMixin)
    row = store.get_loop(name)
    return 0 if row is None else row.last_seq


async def _fire_and_settle(
    engine: TestEngine, scheduler: Scheduler, executor: Executor, worker: Worker, until: float
) -> None:
    """Fire every loop due now, then wait until no iteration runs. An iteration waiting
    for a run that waits on a timer (a workflow loop) gets the clock moved to that timer
    (``until`` bounds when slots fire, not how long a started iteration may take) — not
    while a plain ``def`` loop function still runs in its thread: its outcome (a retry's
    due time) is counted from the clock as it ends."""
    for name in [*scheduler._take_waiting(), *scheduler._pop_due()]:
        scheduler._wake_loop(name)
    quiet_since = time.monotonic()
    while scheduler._running:
        tasks = [running.task for running in scheduler._running.values()]
        done, _ = await asyncio.wait(tasks, timeout=SETTLE_TICK_SECONDS)
        now = engine.clock.now()
        if done or _calling(worker) or executor.busy or engine.store.count_due(now=now):
            quiet_since = time.monotonic()
            continue
        if not await _still_quiet(worker, tasks):
            quiet_since = time.monotonic()
            continue
        due = engine.store.next_due(workflows=list(engine.workflows))
        if due is not None:
            # An iteration that began within the duration runs to its end, past it if
            # need be.
            engine.clock.set(due)
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > STUCK_SECONDS:
            raise FlowloopError(
                f"loop iteration(s) of {', '.join(scheduler._running)} made no progress for "
                f"{STUCK_SECONDS:g}s with nothing due (a run waiting for an event?)"
            )
    # Iterations ending may have made others due (fixed_delay, capacity): fire those too.
    for name in [*scheduler._take_waiting(), *scheduler._pop_due()]:
        scheduler._wake_loop(name)
    if scheduler._running:
        await _fire_and_settle(engine, scheduler, executor, worker, until)


def _calling(worker: Worker) -> bool:
    """Whether a plain ``def`` loop function runs in its thread."""
    return any(not call.done() for call in worker._sync_calls.values())


async def _still_quiet(worker: Worker, tasks: Sequence[asyncio.Task[object]]) -> bool:
    """Quiet by one look, still quiet once the callbacks a thread's end scheduled have run:
    the iteration it ended goes on first (a retry's backoff, its next call) — before the
    clock is moved past it."""
    for _ in range(SETTLE_TURNS):
        await asyncio.sleep(0)
        if _calling(worker) or any(task.done() for task in tasks):
            return False
    return True
