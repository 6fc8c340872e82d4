"""Sync steps that hang past their timeouts (issue 20, items 2 and 3): a hung step costs its
own thread, not the process's ability to run steps; at the pool's bound the worker stops
for its supervisor; and a process that is done exits although a hung step still runs."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Retry, Workflow, stepping
from flowloop.metrics import Metrics
from flowloop.steppool import StepThreads
from flowloop.worker import EXIT_POOL_EXHAUSTED, Worker

TIMEOUT_S = 0.2
FINISH_BOUND_S = 60.0
"""Generous for a loaded machine; without the fix the runs never finish at all."""


class Ctx(BaseModel):
    n: int = 0


def workflows(gate: threading.Event) -> tuple[Workflow, Workflow]:
    hang = Workflow("hang", context=Ctx)

    @hang.step(initial=True, next="done", timeout=TIMEOUT_S, retry=Retry(attempts=1))
    def stuck(ctx: Ctx) -> None:
        gate.wait(120)

    hang.final("done")
    quick = Workflow("quick", context=Ctx)

    @quick.step(initial=True, next="done")
    def work(ctx: Ctx) -> None:
        ctx.n += 1

    quick.final("done")
    return hang, quick


def test_hung_sync_steps_do_not_use_up_the_thread_pool(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    gate = threading.Event()
    hang, quick = workflows(gate)
    caplog.set_level(logging.WARNING, logger="flowloop")
    with Engine(sqlite_url, workflows=[hang, quick], max_concurrency=2) as engine:
        hung = [engine.start(hang, Ctx()).id for _ in range(3)]
        fine = [engine.start(quick, Ctx()).id for _ in range(4)]
        done = threading.Event()
        thread = threading.Thread(target=lambda: (engine.run_until_idle(), done.set()))
        thread.start()
        try:
            finished = done.wait(FINISH_BOUND_S)
        finally:
            gate.set()
            thread.join(60)
        assert finished, "a hung step kept the other runs' steps from running"
        assert {engine.get(i).status for i in fine} == {"succeeded"}
        for run_id in hung:
            info = engine.get(run_id)
            assert info.status == "failed", info
            assert "took longer than 0.2s" in (info.error or "")
    text = caplog.text
    assert "still runs in its thread after its timeout" in text
    assert "abandoned step thread(s), bound 2" in text
    assert "hang past their timeouts (the bound is 2)" in text


def test_worker_at_the_bound_hands_runs_back_and_exits_for_its_supervisor(
    sqlite_url: str,
) -> None:
    gate = threading.Event()
    hang, quick = workflows(gate)
    metrics = Metrics()
    engine = Engine(sqlite_url, workflows=[hang, quick], max_concurrency=1)
    try:
        for _ in range(2):
            engine.start(hang, Ctx())
        later = engine.start(quick, Ctx()).id
        worker = Worker(engine, concurrency=1, grace=1.0, metrics=metrics)
        seen: list[float] = []

        async def main() -> None:
            await asyncio.wait_for(worker.run(asyncio.Event()), FINISH_BOUND_S)
            # The hung step still runs (the gate is closed): the metric shows its thread.
            seen.append(metrics.registry.get_sample_value("flowloop_abandoned_step_threads") or 0)

        try:
            asyncio.run(main())
        finally:
            gate.set()
        assert worker.exit_code == EXIT_POOL_EXHAUSTED
        assert seen == [1.0]
        # The worker handed back what it had not started: another process can take it.
        info = engine.get(later)
        assert info.owner is None and info.status in ("scheduled", "succeeded"), info
    finally:
        engine.close()


SCRIPT = """
import threading, sys
from pydantic import BaseModel
from flowloop import Engine, Retry, Workflow

class Ctx(BaseModel):
    n: int = 0

wf = Workflow("hang", context=Ctx)
forever = threading.Event()

@wf.step(initial=True, next="done", timeout=0.2, retry=Retry(attempts=1))
def stuck(ctx: Ctx) -> None:
    forever.wait()

wf.final("done")
with Engine(sys.argv[1], workflows=[wf]) as engine:
    info = engine.run(wf, Ctx())
print(info.status, flush=True)
"""


def test_a_script_exits_after_a_sync_step_timed_out(sqlite_url: str, tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(script), sqlite_url], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "failed"
    print(f"script exited {time.monotonic() - started:.1f}s after start")


async def _until(probe: Any, what: str) -> None:
    """Poll ``probe`` on the event loop (the worker runs on it) until it is truthy."""
    deadline = time.monotonic() + FINISH_BOUND_S
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _cut_off_twice(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, *, threads_end: bool
) -> Worker:
    """A worker of concurrency 2 whose two sync steps (no timeout) an operator's stop cuts
    off: both threads abandoned, the bound reached, the pool judged later. ``threads_end``:
    the steps then return and the pool is judged at once (the grace is long); else the
    grace is short and the worker ends itself when its check finds them still running."""
    monkeypatch.setattr(stepping, "CUT_OFF_GRACE_SECONDS", 60.0 if threads_end else 0.2)
    gate, started = threading.Event(), threading.Semaphore(0)
    slow = Workflow("slow", context=Ctx)

    @slow.step(initial=True, next="done")
    def wait_for_gate(ctx: Ctx) -> None:
        started.release()
        gate.wait(FINISH_BOUND_S)

    slow.final("done")
    engine = Engine(sqlite_url, workflows=[slow], max_concurrency=2, poll_seconds=0.05)
    runs = [engine.start(slow, Ctx()).id for _ in range(2)]
    worker = Worker(engine, concurrency=2, grace=1.0)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        for _ in runs:
            assert await asyncio.to_thread(started.acquire, timeout=FINISH_BOUND_S)
        for run_id in runs:
            engine.stop(run_id)
        await _until(lambda: worker.executor is not None, "the worker's executor")
        executor: Any = worker.executor
        threads = executor._threads
        await _until(lambda: threads.abandoned == 2, "both step threads abandoned")
        if threads_end:
            assert executor._exhaustion_check is not None  # cut off, not timed out: later
            gate.set()
            await _until(lambda: threads.abandoned == 0, "the cut-off steps to return")
            executor._exhaustion_check.cancel()
            executor._still_exhausted()  # the check, now: nothing hangs any more
            assert not task.done()
        else:
            await _until(task.done, "the worker to end itself")
        stop.set()
        await asyncio.wait_for(task, FINISH_BOUND_S)

    try:
        asyncio.run(main())
        assert {engine.get(run_id).status for run_id in runs} == {"stopped"}
    finally:
        gate.set()
        engine.close()
    return worker


def test_steps_cut_off_whose_threads_return_do_not_end_the_worker(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, a worker frozen past its lease (every step cut off at once) or an operator
    stopping as many sync steps as its concurrency exited at once with code 3, "sync step
    threads hang past their timeouts", though the steps returned moments later."""
    worker = _cut_off_twice(sqlite_url, monkeypatch, threads_end=True)
    assert worker.exit_code == 0


def test_steps_cut_off_whose_threads_still_run_later_end_the_worker(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = _cut_off_twice(sqlite_url, monkeypatch, threads_end=False)
    assert worker.exit_code == EXIT_POOL_EXHAUSTED


def test_each_cut_off_gets_its_own_grace() -> None:
    """The pool counts a cut-off thread as hung once its own grace has passed, not the
    first cut-off's, and the bound is reached when enough of them have: the time to look
    again is the last needed one's (before, the first's: past it, the worker's check was
    re-armed at once, again and again, until the later one's grace had passed)."""
    pool = StepThreads(2)
    gates = [threading.Event() for _ in range(4)]
    started = [threading.Event() for _ in range(4)]

    def step(number: int) -> None:
        started[number].set()
        gates[number].wait(FINISH_BOUND_S)

    def running(number: int) -> Any:
        work = pool.submit(step, number)
        assert started[number].wait(FINISH_BOUND_S)  # in its thread: abandoned, not cancelled
        return work

    try:
        first_work, second_work = running(0), running(1)
        assert pool.abandon(first_work, timed_out=False)
        first = pool.next_hung(60.0, 1)
        assert first is not None and pool.hung(60.0) == 0 and pool.hung(0.0) == 1
        assert pool.next_hung(60.0, 2) is None  # one cut-off cannot reach a bound of 2
        assert pool.abandon(second_work, timed_out=False)
        second = pool.next_hung(60.0, 2)
        assert second is not None and second > first  # the later cut-off's grace
        assert pool.abandon(running(2), timed_out=True)
        assert pool.hung(60.0) == 1  # a timed-out step's thread counts at once
        assert pool.next_hung(60.0, 2) == first  # it and the oldest cut-off make two
        gates[0].set()
        poll(
            lambda: pool.next_hung(60.0, 2) == second,
            timeout=FINISH_BOUND_S,
            what="the first cut-off step to return",
            every=0.01,
        )
    finally:
        for gate in gates:
            gate.set()
        pool.shutdown()
