"""A wedged event loop loses its leases (flowloop/leasethread.py): an async step that
blocks the loop (a blocking call with no timeout) cannot be timed out — the loop never
runs — so renewing its lease from the lease thread would keep the run from every other
worker for ever. The renewer renews only while the loop ticks (within
:func:`flowloop.leasethread.stall_bound`): past it, the run is fenced off and another
worker takes it over and finishes it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from pydantic import BaseModel

from flowloop import Engine, RunInfo, Step, Workflow
from flowloop.executor import Executor
from flowloop.leasethread import stall_bound

LEASE_S = 1.2
"""Long enough that the renewer, every 0.4 s, outlasts a host hiccup of half a second
(0.6 s was fenced by one in CI: see :meth:`Outcome.wedge_detected`)."""
TAKEOVER_LIMIT_S = 40.0
"""Bound of the whole scenario (the stall bound is 3.6 s on SQLite, 5.4 s on PostgreSQL);
without the fix it is reached: the wedged worker keeps renewing and nobody takes over."""


class Ctx(BaseModel):
    by: str = ""


def wedging_flow(entered: threading.Event, finished: threading.Event) -> Workflow:
    wf = Workflow("wedges", context=Ctx)

    @wf.step(initial=True, next="end")
    async def block(ctx: Ctx, step: Step) -> None:
        if step.attempt == 1:
            entered.set()
            # Wedged: the loop does nothing else until the run was finished elsewhere.
            finished.wait(TAKEOVER_LIMIT_S + 10)
            ctx.by = "wedged"
            return
        ctx.by = "other"

    wf.final("end")
    return wf


class Worker:
    """An executor driving runs on an event loop of its own, in a thread."""

    def __init__(self, engine: Engine) -> None:
        self.executor: Executor = engine._new_executor()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop: asyncio.Event | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    async def _main(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        self.ready.set()
        try:
            await self.executor.run(until_idle=False, stop=self.stop, grace=5)
        finally:
            self.executor.close()

    def end(self) -> None:
        assert self.loop is not None and self.stop is not None
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        assert not self.thread.is_alive()


@dataclass
class Outcome:
    info: RunInfo
    lines: list[str]
    took: float
    bound: float

    def wedge_detected(self) -> bool:
        """Whether the renewer stopped for the wedge before the run was fenced for another
        reason: a host that starved the lease thread itself (a frozen disk, a descheduled
        process) for the rest of the lease fences the run first, as it must — such a run
        says nothing about the wedge detection, with or without it."""
        for line in self.lines:
            if WEDGED in line:
                return True
            if FENCED_LINE in line:
                return False
        return False


WEDGED = "no longer renewing the leases"
FENCED_LINE = "lease deadline passed, abandoning it"
ATTEMPTS = 3


def wedge_and_take_over(store_url: str) -> Outcome:
    entered, finished = threading.Event(), threading.Event()
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Lines(logging.INFO)
    logger = logging.getLogger("flowloop")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    wf = wedging_flow(entered, finished)
    kwargs = {"workflows": [wf], "lease_seconds": LEASE_S, "poll_seconds": 0.05}
    try:
        with Engine(store_url, **kwargs) as a, Engine(store_url, **kwargs) as b:  # type: ignore[arg-type]
            run_id = a.start(wf, Ctx()).id
            wedged = Worker(a)
            try:
                assert entered.wait(30), "the step never started"
                other = Worker(b)  # only now: the wedged worker holds the run
                try:
                    deadline = time.monotonic() + TAKEOVER_LIMIT_S
                    while a.get(run_id).status != "succeeded":
                        assert time.monotonic() < deadline, "never taken over from the wedged loop"
                        time.sleep(0.05)
                    took = time.monotonic() - (deadline - TAKEOVER_LIMIT_S)
                finally:
                    finished.set()
                    other.end()
            finally:
                finished.set()
                wedged.end()
            return Outcome(a.get(run_id), lines, took, stall_bound(a.store, LEASE_S))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_a_wedged_loop_loses_its_lease_to_another_worker(store_url: str) -> None:
    for attempt in range(1, ATTEMPTS + 1):
        outcome = wedge_and_take_over(store_url)
        assert outcome.info.status == "succeeded"
        assert isinstance(outcome.info.context, Ctx), outcome.info.context
        assert outcome.info.context.by == "other", outcome.info.context
        if outcome.wedge_detected():
            break
        print(f"attempt {attempt}: fenced before the wedge was detected: {outcome.lines}")
    else:
        raise AssertionError(f"the wedge was never what fenced the run: {outcome.lines}")
    assert sum(WEDGED in line for line in outcome.lines) == 1, outcome.lines
    print(
        f"stall bound {outcome.bound:.1f}s; taken over and finished {outcome.took:.1f}s "
        f"after the start (attempt {attempt})"
    )
