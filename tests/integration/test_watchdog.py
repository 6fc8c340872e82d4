"""A blocking call inside `async def` is caught: the loop watchdog logs a WARNING naming the
async step that blocked (and where), and the worker's metrics count the stall.

The step really blocks the event loop (time.sleep for longer than the stall threshold); the
test waits (bounded) for the log record, it asserts no durations beyond generous bounds."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time

import pytest
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Step, Workflow, watchdog
from flowloop.metrics import Metrics
from flowloop.watchdog import DEFAULT_STALL_SECONDS
from flowloop.worker import Worker

BLOCK_S = DEFAULT_STALL_SECONDS * 2.5
WAIT_S = 30.0


class Ctx(BaseModel):
    n: int = 0


def blocking(*, takes_step: bool = True) -> Workflow:
    """A workflow whose async step blocks the loop: with a ``Step`` parameter and a timeout
    (the step in a task of its own), or neither (awaited in the run's task, and no
    ``Step`` built for it: the watchdog names it from the run's record)."""
    wf = Workflow("blocky", context=Ctx)
    if takes_step:

        @wf.step(name="crunch", initial=True, next="done", timeout=BLOCK_S * 10)
        async def crunch(ctx: Ctx, step: Step) -> None:
            time.sleep(BLOCK_S)  # the mistake: blocks every run on this event loop
            ctx.n += 1

    else:

        @wf.step(name="crunch", initial=True, next="done")
        async def crunch_plain(ctx: Ctx) -> None:
            time.sleep(BLOCK_S)  # the mistake: blocks every run on this event loop
            ctx.n += 1

    wf.final("done")
    return wf


def quick() -> Workflow:
    """A workflow of one trivial async step (no stall of its own)."""
    wf = Workflow("quick", context=Ctx)

    @wf.step(initial=True, next="done")
    async def only(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


def stall_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.name == "flowloop.watchdog" and r.levelno == logging.WARNING
    ]


def long_stalls(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The watchdog's records of a stall as long as a blocking step (a slow commit on a
    loaded machine may stall the loop briefly: not one of these)."""
    return [
        r
        for r in caplog.records
        if r.name == "flowloop.watchdog" and getattr(r, "lag", 0.0) >= BLOCK_S * 0.8
    ]


@pytest.mark.parametrize("takes_step", [True, False], ids=["with_step", "ctx_only"])
def test_watchdog__engine_run_warns_naming_the_blocking_async_step(
    sqlite_url: str, caplog: pytest.LogCaptureFixture, takes_step: bool
) -> None:
    caplog.set_level(logging.INFO, logger="flowloop.watchdog")
    wf = blocking(takes_step=takes_step)
    with Engine(sqlite_url) as engine:
        info = engine.run(wf, Ctx())
    assert info.status == "succeeded"  # it still works; it just stopped everything else
    # A slow commit on a loaded machine may stall the loop too: find the step's warning.
    (warning,) = [w for w in stall_warnings(caplog) if "blocky.crunch" in w.getMessage()]
    message = warning.getMessage()
    assert f"blocky.crunch (run {info.id}, attempt 1)" in message, message
    function = "crunch" if takes_step else "crunch_plain"
    assert "test_watchdog.py" in message and f"in {function};" in message, message
    assert warning.steps == [f"blocky.crunch (run {info.id}, attempt 1)"]  # type: ignore[attr-defined]
    # The whole stall, measured once the loop ran again (the step's task ended) — or, for
    # the step awaited in the run's own task, which leaves the loop no turn before the run
    # ends, when Engine.run stops watching.
    ended = [
        r for r in caplog.records if r.name == "flowloop.watchdog" and r.levelno == logging.INFO
    ]
    crunch = [r for r in ended if r.steps]  # type: ignore[attr-defined]
    assert len(crunch) == 1 and DEFAULT_STALL_SECONDS <= crunch[0].lag < WAIT_S  # type: ignore[attr-defined]


def test_watchdog__silent_while_the_program_does_other_work_between_runs(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``Engine.run`` keeps its loop between calls but does not run it: the watchdog stops
    watching when the call returns, so the caller's own work after it (here a sleep past
    the stall threshold) is no "event loop blocked" warning."""
    caplog.set_level(logging.INFO, logger="flowloop.watchdog")
    wf = quick()
    # No garbage collection inside the runs: late in a suite's process a full collection
    # took 0.66 s within the second run, a real stall the watchdog rightly warned of.
    gc.collect()
    gc.disable()
    try:
        with Engine(sqlite_url) as engine:
            assert engine.run(wf, Ctx()).status == "succeeded"
            time.sleep(BLOCK_S)  # the caller's own work, off the loop: nothing to warn about
            assert engine.run(wf, Ctx()).status == "succeeded"
    finally:
        gc.enable()
    assert stall_warnings(caplog) == []
    assert long_stalls(caplog) == []  # nor measured when a run ends


def test_watchdog__its_thread_idles_between_runs_and_wakes_for_the_next(
    sqlite_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between calls the watchdog's thread sleeps until the next run starts (an engine
    keeps an executor, and so a watchdog, per calling thread): a stall in the next run is
    still warned of while it lasts, although the idle thread would look again only after
    a minute."""
    monkeypatch.setattr(watchdog, "IDLE_WAIT_SECONDS", 60.0)
    caplog.set_level(logging.INFO, logger="flowloop.watchdog")
    with Engine(sqlite_url) as engine:
        assert engine.run(quick(), Ctx()).status == "succeeded"
        dog = engine._executor().watchdog
        assert dog._thread is not None
        poll(lambda: _idling(dog._thread), timeout=WAIT_S, what="the thread idle", every=0.01)
        assert engine.run(blocking(), Ctx()).status == "succeeded"
    assert [w for w in stall_warnings(caplog) if "blocky.crunch" in w.getMessage()]


def _idling(thread: threading.Thread) -> bool:
    """Whether ``thread`` is in the watchdog's idle sleep now."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "_idle":
            return True
        frame = frame.f_back
    return False


def test_watchdog__a_long_inline_def_step_is_no_stall(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``Engine.run`` calls a plain ``def`` step without a timeout on the loop's thread on
    purpose: however long it runs, the loop is busy in a step, not stalled — neither warned
    of while it runs nor measured when the run ends."""
    caplog.set_level(logging.INFO, logger="flowloop.watchdog")
    wf = Workflow("slowdef", context=Ctx)

    @wf.step(initial=True, next="done")
    def crunch(ctx: Ctx) -> None:
        time.sleep(BLOCK_S)  # on the loop's thread, excused
        ctx.n += 1

    wf.final("done")
    with Engine(sqlite_url) as engine:
        assert engine.run(wf, Ctx()).status == "succeeded"
    assert long_stalls(caplog) == []


def test_watchdog__worker_counts_the_stall_in_its_metrics(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="flowloop.watchdog")
    wf = blocking()

    async def scenario() -> tuple[float, str]:
        with Engine(sqlite_url, workflows=[wf], poll_seconds=0.05) as engine:
            run_id = engine.start(wf, Ctx()).id
            metrics = Metrics()
            worker = Worker(engine, grace=1.0, metrics=metrics)
            stop = asyncio.Event()
            task = asyncio.create_task(worker.run(stop))

            def stalls() -> float:
                return {n: v for n, _, v in metrics.samples()}["flowloop_event_loop_stalls_total"]

            try:
                deadline = time.monotonic() + WAIT_S
                while not (engine.get(run_id).finished and stalls()):
                    assert time.monotonic() < deadline, "no stall counted"
                    await asyncio.sleep(0.05)
            finally:
                stop.set()
                await asyncio.wait_for(task, WAIT_S)
            return stalls(), run_id

    stalls, run_id = asyncio.run(scenario())
    assert stalls >= 1  # the step's stall (a slow commit on a loaded machine may add one)
    assert any(
        f"blocky.crunch (run {run_id}, attempt 1)" in w.getMessage() for w in stall_warnings(caplog)
    )


def test_watchdog__a_wait_for_the_database_is_not_blamed_on_async_steps(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Another connection takes the write lock while a plain `def` step runs, so the step's
    # outcome commit (on the loop thread) waits for it past the threshold: the warning says
    # the loop waits for the database, not "a blocking call in async def". The lock is
    # released once that warning is logged (bounded): no timing luck either way.
    import sqlite3
    import threading

    caplog.set_level(logging.INFO, logger="flowloop.watchdog")
    wf = Workflow("plain", context=Ctx)
    entered, locked = threading.Event(), threading.Event()

    @wf.step(initial=True, next="done")
    def work(ctx: Ctx) -> None:
        entered.set()
        assert locked.wait(WAIT_S)  # the lock is held before this step's outcome is written

    wf.final("done")
    path = sqlite_url.removeprefix("sqlite:///")

    def hold_the_lock() -> None:
        assert entered.wait(WAIT_S)
        holder = sqlite3.connect(path, timeout=WAIT_S)
        try:
            holder.execute("BEGIN IMMEDIATE")
            locked.set()
            deadline = time.monotonic() + WAIT_S
            while time.monotonic() < deadline and not stall_warnings(caplog):
                time.sleep(0.02)
        finally:
            holder.rollback()
            holder.close()

    with Engine(sqlite_url, workflows=[wf]) as engine:
        holder = threading.Thread(target=hold_the_lock)
        holder.start()
        try:
            info = engine.run(wf, Ctx())
        finally:
            holder.join()
        assert info.status == "succeeded"
    warnings = stall_warnings(caplog)
    assert warnings, "no stall warning while the commit waited"
    message = warnings[0].getMessage()
    assert "waiting for the database" in message, message
    assert "async def" not in message, message


def test_watchdog__runs_on_one_loop_share_one_pending_tick(sqlite_url: str) -> None:
    """``Engine.run`` watches per run: a run's watch takes over the tick the run before
    left pending on the kept loop (one timer for many runs, not one made and cancelled per
    run), and the stall test still measures from the run's own start (a second run after
    the caller's own work past the threshold: test above)."""
    wf = quick()
    with Engine(sqlite_url) as engine:
        assert engine.run(wf, Ctx()).status == "succeeded"
        dog = engine._executor().watchdog
        pending = dog._ticker
        assert pending is not None and not pending.cancelled()
        for _ in range(3):
            assert engine.run(wf, Ctx()).status == "succeeded"
        # (The same one, unless a run as slow as a tick let it come and schedule anew.)
        assert dog._ticker is not None and not dog._ticker.cancelled()
        assert dog.stalls == 0


def test_watchdog__a_tick_while_nothing_is_watched_ends_the_ticking() -> None:
    """The tick a watch left pending, coming while nothing is watched, measures nothing
    and schedules no next one; a watch on another loop ticks on that loop, not on the one
    the tick was left pending on."""
    dog = watchdog.LoopWatchdog({}, threshold=0.01)

    async def leave_pending() -> asyncio.TimerHandle | None:
        dog.start()
        dog.stop()
        return dog._ticker

    async def watch_and_wait(left: asyncio.TimerHandle | None) -> None:
        loop = asyncio.get_running_loop()
        dog.start()
        ticker = dog._ticker
        assert ticker is not None and ticker is not left
        assert ticker in loop._scheduled  # type: ignore[attr-defined]
        dog.stop()
        await asyncio.sleep(watchdog.TICK_SECONDS * 3)  # the tick comes, unwatched
        assert dog._ticker is None
        assert not [h for h in loop._scheduled if not h.cancelled()]  # type: ignore[attr-defined]

    try:
        left = asyncio.run(leave_pending())  # pending on a loop now closed
        asyncio.run(watch_and_wait(left))
        assert dog.stalls == 0
    finally:
        dog.close()


def test_watchdog__a_thread_that_switches_loops_keeps_one_tick(sqlite_url: str) -> None:
    """Review: a watch on another loop (``asyncio.run(engine.arun(...))`` between
    ``Engine.run`` calls on one thread: one executor, two loops) left the tick pending on
    the kept loop, where it ticked on beside the next one: a chain more per switch."""
    wf = quick()

    def ticks(loop: asyncio.AbstractEventLoop) -> list[asyncio.TimerHandle]:
        tick = watchdog.LoopWatchdog._tick
        return [
            handle
            for handle in loop._scheduled  # type: ignore[attr-defined]
            if not handle.cancelled() and getattr(handle._callback, "__func__", None) is tick
        ]

    with Engine(sqlite_url) as engine:
        assert engine.run(wf, Ctx()).status == "succeeded"
        kept_loop = engine._runner().get_loop()
        for _ in range(3):
            assert asyncio.run(engine.arun(wf, Ctx())).status == "succeeded"
            assert engine.run(wf, Ctx()).status == "succeeded"
            assert len(ticks(kept_loop)) == 1
