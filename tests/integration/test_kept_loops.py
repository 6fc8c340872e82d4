"""The engine's kept event loops (flowloop.mainloop.ThreadLoops): ``Engine.run`` and
``Engine.run_until_idle`` run on one loop per calling thread, kept between calls (issue
13: ``asyncio.run`` built and closed a loop at every ``run_until_idle``), and a thread's
loop is closed when the thread ends (each had stayed open until the engine closed)."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop import journal as j


class C(BaseModel):
    n: int = 0


def recording_loops(name: str) -> tuple[Workflow, list[asyncio.AbstractEventLoop]]:
    """A one-step workflow whose step notes the event loop it runs on."""
    seen: list[asyncio.AbstractEventLoop] = []
    wf = Workflow(name, context=C)

    @wf.step(initial=True, next="done")
    async def only(ctx: C) -> None:
        seen.append(asyncio.get_running_loop())
        ctx.n += 1

    wf.final("done")
    return wf, seen


def test_run_until_idle__runs_on_the_threads_kept_loop(tmp_path: Path) -> None:
    wf, seen = recording_loops("kept")
    with Engine(f"sqlite:///{tmp_path / 'k.db'}", workflows=[wf]) as engine:
        assert engine.run(wf, C()).status == "succeeded"
        for _ in range(2):
            queued = engine.start(wf, C())
            engine.run_until_idle()
            assert engine.get(queued.id).status == "succeeded"
    assert len(seen) == 3
    assert seen[0] is seen[1] is seen[2]


def test_run_until_idle__inside_a_running_loop_is_refused_with_what_to_await(
    tmp_path: Path,
) -> None:
    wf, seen = recording_loops("refused")
    with Engine(f"sqlite:///{tmp_path / 'r.db'}", workflows=[wf]) as engine:
        queued = engine.start(wf, C())

        async def from_async_code() -> list[str]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with pytest.raises(RuntimeError, match=r"await engine\.arun_until_idle\(\)"):
                    engine.run_until_idle()
                gc.collect()  # a coroutine never awaited says so when it is collected
            return [str(warning.message) for warning in caught]

        messages = asyncio.run(from_async_code())
        assert not [message for message in messages if "never awaited" in message]
        assert engine.get(queued.id).status == "scheduled"  # nothing ran
        engine.run_until_idle()
        assert engine.get(queued.id).status == "succeeded"
    assert len(seen) == 1


def test_run_until_idle__from_a_def_step_of_engine_run(tmp_path: Path) -> None:
    """A plain ``def`` step that ``Engine.run`` calls on its own loop's thread may drive the
    queue itself (a loop of its own, as a nested ``Engine.run`` gets)."""
    inner, seen = recording_loops("inner")
    outer = Workflow("outer", context=C)
    engines: list[Engine] = []

    @outer.step(initial=True, next="done")
    def drive(ctx: C) -> None:
        engines[0].start(inner, C())
        ctx.n = engines[0].run_until_idle().steps

    outer.final("done")
    with Engine(f"sqlite:///{tmp_path / 'n.db'}", workflows=[inner, outer]) as engine:
        engines.append(engine)
        info = engine.run(outer, C())
        assert info.status == "succeeded" and info.context == C(n=1)
        assert len(seen) == 1


def _open_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


def test_threads_that_end_leave_no_event_loop_open(tmp_path: Path) -> None:
    """30 short-lived threads (a thread per request, say), each calling ``run`` and
    ``run_until_idle``: each thread's loop is closed when it ends. A list of every
    thread's runner had kept 3 descriptors (epoll, a socket pair) open per thread."""
    wf, seen = recording_loops("threads")
    with Engine(f"sqlite:///{tmp_path / 't.db'}", workflows=[wf]) as engine:
        engine.run(wf, C())  # this thread's loop and the store's connections, first
        engine.run_until_idle()  # nothing due
        before = _open_fds()
        failures: list[BaseException] = []

        def request() -> None:
            try:
                engine.run(wf, C())
                engine.start(wf, C())
                engine.run_until_idle()
            except BaseException as error:  # reported by the test, not lost in the thread
                failures.append(error)

        for _ in range(30):
            thread = threading.Thread(target=request)
            thread.start()
            thread.join()
        gc.collect()
        assert failures == []
        assert len(seen) == 1 + 30 * 2
        assert _open_fds() - before < 10
        assert all(loop.is_closed() for loop in seen[1:])


def _flowloop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("flowloop-") and t.is_alive()]


def test_threads_that_end_leave_no_executor_or_its_threads_behind(tmp_path: Path) -> None:
    """Each calling thread's ``run`` drives its run with an executor of its own (its lease
    threads and loop watchdog serve that thread's loop): closed when the thread ends, its
    threads end too, rather than one set per thread that ever called."""
    wf, _ = recording_loops("executors")
    with Engine(f"sqlite:///{tmp_path / 'e.db'}", workflows=[wf]) as engine:
        engine.run(wf, C())  # this thread's executor and its threads, first
        before = {thread.ident for thread in _flowloop_threads()}
        made: list[object] = []

        def request() -> None:
            assert engine.run(wf, C()).status == "succeeded"
            made.append(engine._executor())

        for _ in range(10):
            thread = threading.Thread(target=request)
            thread.start()
            thread.join()
        gc.collect()
        assert len({id(executor) for executor in made}) == 10  # (all kept alive by ``made``)
        assert engine._thread_executors.made() == [engine._executor()]  # this thread's alone
        poll(
            lambda: {thread.ident for thread in _flowloop_threads()} <= before,
            timeout=30.0,
            what="the ended threads' executors' threads to end",
            every=0.05,
        )


def test_run_until_idle__a_drive_cut_short_by_an_error_leaves_no_task_on_the_kept_loop(
    tmp_path: Path,
) -> None:
    """A store error that is not an outage ends the call while a run's task is in its
    step: the task is cancelled before the call returns (asyncio.run did so at its end),
    not resumed by the loop's next call."""
    entered = asyncio.Event()
    wf = Workflow("cut", context=C)

    @wf.step(initial=True, next="done")
    async def waits(ctx: C) -> None:
        entered.set()
        await asyncio.Event().wait()  # until cancelled

    wf.final("done")
    with Engine(f"sqlite:///{tmp_path / 'c.db'}", workflows=[wf]) as engine:
        queued = engine.start(wf, C())
        store: Any = engine.store
        real_claim = store.claim

        def claim_then_break(**kwargs: Any) -> Any:
            if entered.is_set():
                raise ValueError("the store broke")
            return real_claim(**kwargs)

        store.claim = claim_then_break
        with pytest.raises(ValueError, match="the store broke"):
            engine.run_until_idle()
        loop = engine._runner().get_loop()
        assert [task for task in asyncio.all_tasks(loop) if not task.done()] == []
        store.claim = real_claim
        # Cut off as asyncio.run's end cut it: journaled, to run again.
        assert engine.history(queued.id)[-1].kind == j.STEP_INTERRUPTED
        assert engine.get(queued.id).status == "retrying"
