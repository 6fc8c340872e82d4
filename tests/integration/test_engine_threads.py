"""``Engine.run`` called from several threads at once on one engine (a thread per request of
a web app, say): each thread drives its run on an event loop of its own."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Step, Workflow
from flowloop.engine import RunInfo

LEASE_S = 0.6
"""The tests' short lease: on SQLite a loop that has not ticked for 1.8 s is wedged
(flowloop.leasethread.stall_bound), and its runs' renewals stop."""
OUTLAST_S = 4.0
"""How long the second run's step runs on once the first call has returned: more than the
stall bound plus a lease, within which a run no longer renewed is surely fenced off."""
WAIT_S = 30.0


class Ctx(BaseModel):
    n: int = 0


def test_a_run_outlasting_another_threads_call_keeps_its_lease(sqlite_url: str) -> None:
    """Thread A's call starts first and returns first; thread B's run goes on for several
    leases after it. Its lease stays renewed: B's loop is the one alive now, not A's."""
    b_running = threading.Event()
    a_returned = threading.Event()
    first = Workflow("first", context=Ctx)

    @first.step(initial=True, next="done")
    async def until_b_runs(ctx: Ctx) -> None:
        assert await asyncio.to_thread(b_running.wait, WAIT_S)

    first.final("done")
    second = Workflow("second", context=Ctx)

    @second.step(initial=True, next="done")
    async def outlast(ctx: Ctx) -> None:
        b_running.set()
        assert await asyncio.to_thread(a_returned.wait, WAIT_S)
        await asyncio.sleep(OUTLAST_S)
        ctx.n = 1

    second.final("done")
    results: dict[str, RunInfo] = {}

    with Engine(sqlite_url, workflows=[first, second], lease_seconds=LEASE_S) as engine:

        def call(name: str, workflow: Workflow) -> None:
            results[name] = engine.run(workflow, Ctx())
            if name == "a":
                a_returned.set()

        a = threading.Thread(target=call, args=("a", first))
        a.start()
        # B's call begins while A's run is in its step (A's loop was started first).
        engine_started = threading.Thread(target=call, args=("b", second))
        engine_started.start()
        a.join(WAIT_S)
        engine_started.join(WAIT_S + OUTLAST_S)
        assert results["a"].status == "succeeded"
        assert results["b"].status == "succeeded", (results["b"].status, results["b"].error)
        assert engine.get(results["b"].id).context.n == 1  # type: ignore[union-attr]


def _held(name: str, started: threading.Event, release: threading.Event) -> Workflow:
    """A run whose step says it started, then waits (off the loop) to be released."""
    wf = Workflow(name, context=Ctx)

    @wf.step(initial=True, next="done")
    async def until_released(ctx: Ctx) -> None:
        started.set()
        assert await asyncio.to_thread(release.wait, WAIT_S)

    wf.final("done")
    return wf


def test_a_stop_reaches_a_run_in_the_thread_that_neither_started_first_nor_last(
    sqlite_url: str,
) -> None:
    """Three threads' runs are in a step at once; the stop of the middle one's is handed to
    its own loop. (One executor for all handed it to the loop started last, whose thread
    cancelled the step's task on a loop it does not run: nothing woke that loop — only the
    first one started is ticked by the watchdog — and the step ran to its end.)"""
    target_run: list[str] = []
    cancelled = threading.Event()
    release = threading.Event()
    first_started, last_started = threading.Event(), threading.Event()
    first = _held("first", first_started, release)
    last = _held("last", last_started, release)
    target = Workflow("target", context=Ctx)

    @target.step(initial=True, next="done")
    async def long(ctx: Ctx, step: Step) -> None:
        target_run.append(step.run_id)
        try:
            await asyncio.sleep(10 * WAIT_S)  # nothing else wakes this loop meanwhile
        except asyncio.CancelledError:
            cancelled.set()
            raise

    target.final("done")
    results: dict[str, RunInfo] = {}
    workflows = [first, target, last]
    with Engine(sqlite_url, workflows=workflows, poll_seconds=0.05) as engine:

        def call(workflow: Workflow) -> None:
            results[workflow.name] = engine.run(workflow, Ctx())

        threads = {wf.name: threading.Thread(target=call, args=(wf,)) for wf in workflows}
        try:
            threads["first"].start()
            assert first_started.wait(WAIT_S)
            threads["target"].start()
            poll(lambda: target_run, timeout=WAIT_S, what="the target's step", every=0.01)
            threads["last"].start()
            assert last_started.wait(WAIT_S)
            engine.stop(target_run[0])
            assert cancelled.wait(WAIT_S)
            threads["target"].join(WAIT_S)
        finally:
            release.set()
            for thread in threads.values():
                thread.join(WAIT_S)
        stopped = results["target"]
        assert (stopped.status, stopped.reason) == ("stopped", "stopped during step")
        assert results["first"].status == results["last"].status == "succeeded"


def test_a_pause_seen_by_another_threads_executor_does_not_stick_to_the_run(
    sqlite_url: str,
) -> None:
    """Every executor of an engine reads the pause and stop requests of its worker id. The
    run paused in thread B's call, then unpaused and driven on by thread A's executor (A's
    step calls ``arun`` with its idempotency key), runs to its end: A's executor had kept
    the pause it read while B drove the run, and paused it again."""
    a_started, go_a, b_started, release_b = (threading.Event() for _ in range(4))
    executors: dict[str, Any] = {}
    second = Workflow("second", context=Ctx)

    @second.step(initial=True, next="then")
    async def first_step(ctx: Ctx) -> None:
        executors["b"] = engine._executor()
        b_started.set()
        assert await asyncio.to_thread(release_b.wait, WAIT_S)

    @second.step(next="done")
    async def then(ctx: Ctx) -> None:
        ctx.n = 2

    second.final("done")
    first = Workflow("first", context=Ctx)

    @first.step(initial=True, next="done")
    async def drive_b_on(ctx: Ctx) -> None:
        executors["a"] = engine._executor()
        a_started.set()
        assert await asyncio.to_thread(go_a.wait, WAIT_S)
        info = await engine.arun(second, Ctx(), idempotency_key="b")
        ctx.n = info.context.n  # type: ignore[attr-defined]

    first.final("done")
    results: dict[str, RunInfo] = {}
    with Engine(sqlite_url, workflows=[first, second], poll_seconds=0.05) as engine:

        def call(name: str, workflow: Workflow, key: str | None = None) -> None:
            results[name] = engine.run(workflow, Ctx(), idempotency_key=key)

        a = threading.Thread(target=call, args=("a", first))
        b = threading.Thread(target=call, args=("b", second, "b"))
        try:
            a.start()
            assert a_started.wait(WAIT_S)
            b.start()
            assert b_started.wait(WAIT_S)
            (b_run,) = [run for run in engine.runs() if run.workflow == "second"]
            guards = [executors[name].leases.guard for name in ("a", "b")]
            handed = [guard.handed for guard in guards]
            engine.pause(b_run.id)
            # Both executors have read the request (and been handed it) while B drives the run.
            poll(
                lambda: all(g.handed > before for g, before in zip(guards, handed, strict=True)),
                timeout=WAIT_S,
                what="both threads' executors to read the pause",
                every=0.01,
            )
            release_b.set()
            b.join(WAIT_S)
            assert results["b"].status == "paused"
            engine.unpause(b_run.id)
            go_a.set()
            a.join(WAIT_S)
        finally:
            release_b.set()
            go_a.set()
            for thread in (a, b):
                thread.join(WAIT_S)
        assert results["a"].status == "succeeded", results["a"].error
        assert engine.get(b_run.id).status == "succeeded"
        assert engine.get(results["a"].id).context.n == 2  # type: ignore[union-attr]
