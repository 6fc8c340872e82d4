"""Durable timers with real worker processes, on SQLite and PostgreSQL: a wait's timeout and
``step.sleep`` are stored due times, so a worker SIGKILLed in between and restarted fires
them once, on time (or at once when overdue). And many waiting runs cost nothing."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from waitkit import (
    ALL,
    TIMER_S,
    WorkerProcess,
    assert_journal_sound,
    clone_run,
    ctx,
    napper,
    parked,
    received,
    run_totals,
    timed,
    wait_until,
    workers,
)

from flowloop import Engine
from flowloop.engine import RunInfo
from flowloop.worker import Worker

STARTUP_S = 20.0
"""Bound for a worker process to start and act (imports included), on a slow machine."""
LATE_S = 3.0
"""A due timer fires within this of its due time (or of the restart, when overdue)."""


def parked_in(engine: Engine, run_id: str, state: str) -> RunInfo | None:
    """The run once it waits in ``state`` and no worker holds it."""
    info = engine.get(run_id)
    waits = info.state == state and info.status == "scheduled" and info.owner is None
    return info if waits else None


def finished(engine: Engine, run_id: str) -> RunInfo | None:
    info = engine.get(run_id)
    return info if info.finished else None


def start_both(engine: Engine, worker: WorkerProcess) -> tuple[str, str, float, float]:
    """A `timed` run (wait with a timeout) and a `napper` run (step.sleep), driven by
    ``worker`` until both wait on their stored due times: (ids, due times)."""
    timed_id = engine.start(timed, {}).id
    nap_id = engine.start(napper, {}).id
    holding = wait_until(
        lambda: parked_in(engine, timed_id, "hold"),
        timeout=STARTUP_S,
        what="the first worker drives `timed` into its wait",
        diagnose=worker.output,
    )
    sleeping = wait_until(
        lambda: parked_in(engine, nap_id, "after"),
        timeout=STARTUP_S,
        what="the first worker runs `nap`, which sleeps",
        diagnose=worker.output,
    )
    assert holding.next_run_at is not None and sleeping.next_run_at is not None
    return timed_id, nap_id, holding.next_run_at, sleeping.next_run_at


def check_fired_once(
    engine: Engine,
    timed_id: str,
    nap_id: str,
    timeout_due: float,
    sleep_due: float,
    by: Sequence[WorkerProcess],
) -> tuple[float, float]:
    """Each timer fired exactly once, not early, by one of ``by``; when each fired."""
    info = engine.get(timed_id)
    assert (info.status, info.state) == ("succeeded", "expired")
    [fired] = received(engine, timed_id, "timeout")
    assert fired.at >= timeout_due, "the timeout fired early"
    assert any(f":{w.pid}:" in (fired.worker or "") for w in by)
    nap = engine.get(nap_id)
    assert (nap.status, ctx(nap).after) == ("succeeded", 1)
    started = [e for e in engine.history(nap_id) if e.kind == "step_started"]
    assert [e.state for e in started] == ["nap", "after"]  # `after` started once
    assert started[1].at >= sleep_due, "the sleep ended early"
    assert any(f":{w.pid}:" in (started[1].worker or "") for w in by)
    assert_journal_sound(engine, timed_id)
    assert_journal_sound(engine, nap_id)
    return fired.at, started[1].at


def test_durable_timers__fire_once_after_worker_sigkill_on_time_or_at_once_when_overdue(
    store_url: str, tmp_path: Path
) -> None:
    with Engine(store_url, workflows=ALL) as engine, workers(store_url, tmp_path) as start:
        # 1. Killed before the timers are due, restarted at once: they fire on time.
        first = start()
        timed_id, nap_id, timeout_due, sleep_due = start_both(engine, first)
        assert min(timeout_due, sleep_due) > time.time()  # killed before either is due
        first.kill9()
        second = start()
        for run_id in (timed_id, nap_id):
            wait_until(
                functools.partial(finished, engine, run_id),
                timeout=STARTUP_S + TIMER_S,
                what="the restarted worker fires the timer",
                diagnose=second.output,
            )
        fired, woke = check_fired_once(
            engine, timed_id, nap_id, timeout_due, sleep_due, by=[second]
        )
        # On time, or at once if the restarted worker was ready only after the due time.
        assert fired - max(timeout_due, second.started_at) < LATE_S + STARTUP_S / 4
        assert woke - max(sleep_due, second.started_at) < LATE_S + STARTUP_S / 4
        print(
            f"\ntimeout fired {fired - timeout_due:+.3f}s, sleep ended {woke - sleep_due:+.3f}s"
            f" after due (restart {second.started_at - timeout_due:+.3f}s)"
        )

        # 2. Killed, and nothing runs until both are overdue; two restarted workers compete.
        timed_id, nap_id, timeout_due, sleep_due = start_both(engine, second)
        second.kill9()
        latest = max(timeout_due, sleep_due)
        wait_until(lambda: time.time() > latest + 0.5, timeout=TIMER_S + 2.0, what="overdue")
        assert parked_in(engine, timed_id, "hold") and parked_in(engine, nap_id, "after"), (
            "nobody may fire a timer while no worker runs"
        )
        third, fourth = start(), start()
        for run_id in (timed_id, nap_id):
            wait_until(
                functools.partial(finished, engine, run_id),
                timeout=STARTUP_S,
                what="a restarted worker fires the overdue timer",
                diagnose=lambda: third.output() + fourth.output(),
            )
        third.stop()  # both kept polling until now: still exactly once
        fourth.stop()
        fired, woke = check_fired_once(
            engine, timed_id, nap_id, timeout_due, sleep_due, by=[third, fourth]
        )
        assert max(fired, woke) - third.started_at < STARTUP_S
        print(
            f"overdue timers fired {fired - third.started_at:.2f}s / "
            f"{woke - third.started_at:.2f}s after the restart (process start included)"
        )


# -- many waiting runs ---------------------------------------------------------------------------

WAITING_RUNS = 10_000
IDLE_S = 2.0
CPU_BOUND_S = 0.5


async def idle_worker(engine: Engine, seconds: float) -> dict[str, Any]:
    """Run the worker (the one `flowloop worker` runs) in this process for ``seconds`` after
    a warm-up; sample its threads and busy slots; measure this process's CPU time."""
    worker = Worker(engine, [])
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.sleep(0.5)  # warm-up: recovery pass and first claims
    threads: list[int] = []
    busy: list[int] = []
    cpu = time.process_time()
    wall = time.perf_counter()
    while time.perf_counter() - wall < seconds:
        threads.append(threading.active_count())
        assert worker.executor is not None
        busy.append(worker.executor.busy)
        await asyncio.sleep(0.1)
    cpu = time.process_time() - cpu
    wall = time.perf_counter() - wall
    stop.set()
    await asyncio.wait_for(task, 30)
    assert worker.executor is not None
    return {
        "cpu": cpu,
        "wall": wall,
        "threads": max(threads),
        "busy": max(busy),
        "steps": worker.executor.stats.steps,
    }


def test_waiting_runs__ten_thousand_cost_no_cpu_and_hold_no_thread(store_url: str) -> None:
    with Engine(store_url, workflows=ALL) as engine:
        template = engine.run(parked, {})
        assert (template.state, template.next_run_at, template.owner) == ("parked", None, None)
        clones = clone_run(store_url, template.id, WAITING_RUNS - 1)
        before = run_totals(store_url)
        assert before[0] == WAITING_RUNS and before[3] == 0
        threads_before = threading.active_count()

        figures = asyncio.run(idle_worker(engine, IDLE_S))

        after = run_totals(store_url)
        backend = store_url.split(":")[0]
        print(
            f"\n{WAITING_RUNS} waiting runs, {backend}: worker CPU {figures['cpu']:.3f}s over "
            f"{figures['wall']:.2f}s idle; threads {threads_before} before, at most "
            f"{figures['threads']} while it ran; runs held at once: {figures['busy']}"
        )
        assert after == before, "the worker claimed (or wrote) waiting runs"
        assert figures["busy"] == 0 and figures["steps"] == 0
        assert figures["threads"] <= threads_before + 1, "threads grew while runs wait"
        assert figures["cpu"] < CPU_BOUND_S
        # The clones are real waiting runs: one takes its event like any other.
        assert engine.send(clones[-1], "go").run.state == "done"
        assert_journal_sound(engine, clones[-1])
