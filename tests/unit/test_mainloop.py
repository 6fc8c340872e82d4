"""flowloop.mainloop.run_on: Runner.run's Ctrl-C semantics on a kept loop, with SIGINT's
handler back as it was after every call (real signals, sent to this process)."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import os
import signal
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from flowloop import mainloop
from flowloop.mainloop import ThreadLoops, run_on

SEEN: contextvars.ContextVar[str] = contextvars.ContextVar("SEEN", default="unset")


@pytest.fixture
def runner() -> Iterator[asyncio.Runner]:
    with asyncio.Runner() as kept:
        yield kept


def main_thread_only() -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT reaches the main thread only")


async def ctrl_c_then_wait() -> None:
    """Send this process a real Ctrl-C, then wait for ever: a cancellation comes out of
    the wait (the handler runs at the next bytecode, before the wait begins)."""
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.Event().wait()


def test_run_on__returns_the_result_on_the_same_loop_and_restores_sigint(
    runner: asyncio.Runner,
) -> None:
    async def loop_of() -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    first, second = run_on(runner, loop_of()), run_on(runner, loop_of())
    assert first is second is runner.get_loop()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_run_on__each_call_runs_in_a_copy_of_the_callers_context(
    runner: asyncio.Runner,
) -> None:
    async def read_then_set() -> str:
        seen = SEEN.get()
        SEEN.set("inside")
        return seen

    token = SEEN.set("caller")
    try:
        assert run_on(runner, read_then_set()) == "caller"
        assert SEEN.get() == "caller"  # the call's own change stays in its copy
        assert run_on(runner, read_then_set()) == "caller"
    finally:
        SEEN.reset(token)


def test_run_on__an_error_of_the_coroutine_surfaces_and_sigint_is_restored(
    runner: asyncio.Runner,
) -> None:
    async def fails() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_on(runner, fails())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_run_on__ctrl_c_cancels_the_task_then_raises_keyboard_interrupt(
    runner: asyncio.Runner,
) -> None:
    main_thread_only()
    cut: list[bool] = []

    async def waits_forever() -> None:
        try:
            await ctrl_c_then_wait()
        except asyncio.CancelledError:
            cut.append(True)  # cancelled at its await, as a run's task is
            raise

    with pytest.raises(KeyboardInterrupt):
        run_on(runner, waits_forever())
    assert cut == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_run_on__a_second_ctrl_c_raises_at_once(runner: asyncio.Runner) -> None:
    main_thread_only()

    async def ignores_cancellation() -> None:
        try:
            await ctrl_c_then_wait()
        except asyncio.CancelledError:
            await ctrl_c_then_wait()  # the second: raised in the handler, at once

    with pytest.raises(KeyboardInterrupt):
        run_on(runner, ignores_cancellation())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.timeout(30)  # the failure this guards against is a loop that never stops
def test_run_on__a_ctrl_c_before_the_tasks_first_step_raises_keyboard_interrupt(
    runner: asyncio.Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The task stops its loop when it ends (no run_until_complete); one cancelled before
    it ever ran ends without running that code: the handler stops the loop then."""
    main_thread_only()
    install = mainloop._install
    ran: list[bool] = []

    def install_then_ctrl_c(*args: Any) -> Any:
        handler = install(*args)
        os.kill(os.getpid(), signal.SIGINT)  # handled here: before the loop runs at all
        return handler

    async def never_runs() -> None:
        ran.append(True)

    monkeypatch.setattr(mainloop, "_install", install_then_ctrl_c)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no "coroutine was never awaited" either)
        with pytest.raises(KeyboardInterrupt):
            run_on(runner, never_runs())
        gc.collect()
    assert ran == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.undo()
    assert run_on(runner, _answer()) == 42  # the kept loop serves the next call


async def _answer() -> int:
    await asyncio.sleep(0)
    return 42


def test_run_on__a_task_a_second_ctrl_c_left_running_does_not_stop_a_later_call(
    runner: asyncio.Runner,
) -> None:
    """A second Ctrl-C leaves its call's task pending on the kept loop; when it ends
    during a later call, that call's loop is not stopped by it."""
    main_thread_only()
    go_on = asyncio.Event()

    async def left_running() -> None:
        try:
            await ctrl_c_then_wait()
        except asyncio.CancelledError:
            # The second, raised out of the loop (a callback's), not out of this task:
            asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGINT)
            await go_on.wait()  # pending on the loop after the call raised

    with pytest.raises(KeyboardInterrupt):
        run_on(runner, left_running())
    assert [t for t in asyncio.all_tasks(runner.get_loop()) if not t.done()]

    async def later() -> int:
        go_on.set()  # the old task ends in this call's next turn
        for _ in range(5):
            await asyncio.sleep(0)
        return 7

    assert run_on(runner, later()) == 7


def test_run_on__another_sigint_handler_is_left_alone(runner: asyncio.Runner) -> None:
    main_thread_only()
    received: list[int] = []

    def theirs(signum: int, frame: object) -> None:
        received.append(signum)

    previous = signal.signal(signal.SIGINT, theirs)
    try:

        async def interrupted() -> str:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(0)
            return "went on"

        assert run_on(runner, interrupted()) == "went on"
        assert received == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is theirs
    finally:
        signal.signal(signal.SIGINT, previous)


def test_run_on__a_cancellation_not_from_ctrl_c_stays_a_cancellation(
    runner: asyncio.Runner,
) -> None:
    async def cancels_itself() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)

    with pytest.raises(asyncio.CancelledError):
        run_on(runner, cancels_itself())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_run_on__a_run_that_takes_the_ctrl_c_and_returns_returns(runner: asyncio.Runner) -> None:
    main_thread_only()

    async def swallows() -> str:
        try:
            await ctrl_c_then_wait()
        except asyncio.CancelledError:
            return "handled it"
        return "not cancelled"

    assert run_on(runner, swallows()) == "handled it"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_run_on__refused_inside_a_running_loop_without_a_stray_coroutine(
    runner: asyncio.Runner,
) -> None:
    async def nothing() -> None:
        return None

    async def nested() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(RuntimeError, match="cannot be called from a running event loop"):
                run_on(runner, nothing())
            gc.collect()  # a coroutine never awaited says so when it is collected
        return [str(warning.message) for warning in caught]

    with asyncio.Runner() as other:
        messages = other.run(nested())
    assert not [message for message in messages if "never awaited" in message]


def _open_fds() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/fd"))


async def _loop_of() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def test_thread_loops__one_kept_loop_per_thread() -> None:
    loops = ThreadLoops()
    try:
        here = run_on(loops.runner(), _loop_of()), run_on(loops.runner(), _loop_of())
        there: list[asyncio.AbstractEventLoop] = []
        thread = threading.Thread(target=lambda: there.append(run_on(loops.runner(), _loop_of())))
        thread.start()
        thread.join()
        assert here[0] is here[1]
        assert there[0] is not here[0]
    finally:
        loops.close()


def test_thread_loops__a_threads_loop_is_closed_when_the_thread_ends() -> None:
    # A list of every thread's runner kept each loop (an epoll fd and a socket pair)
    # open until the engine closed: 30 short-lived threads left 90 descriptors open.
    loops = ThreadLoops()
    seen: list[asyncio.AbstractEventLoop] = []
    before = _open_fds()
    try:

        def call() -> None:
            seen.append(run_on(loops.runner(), _loop_of()))

        for _ in range(30):
            thread = threading.Thread(target=call)
            thread.start()
            thread.join()
        gc.collect()
        assert len(seen) == 30
        assert all(loop.is_closed() for loop in seen)
        assert _open_fds() - before < 5
    finally:
        loops.close()


def test_thread_loops__close_closes_live_threads_loops_and_a_later_call_gets_a_new_one() -> None:
    loops = ThreadLoops()
    first = run_on(loops.runner(), _loop_of())
    loops.close()
    assert first.is_closed()
    second = run_on(loops.runner(), _loop_of())
    try:
        assert second is not first and not second.is_closed()
    finally:
        loops.close()


def test_thread_loops__a_thread_that_ends_leaves_nothing_of_its_loop_behind() -> None:
    """Its loop is closed, not run, as the thread's locals are cleared: Runner.close would
    unset the thread's current loop, and CPython then builds that thread's state again,
    never freed (≈ 600 bytes per ended thread, measured; ≈ 50 without)."""
    import tracemalloc

    loops = ThreadLoops()

    def call() -> None:
        run_on(loops.runner(), _loop_of())

    def threads(count: int) -> None:
        for _ in range(count):
            thread = threading.Thread(target=call)
            thread.start()
            thread.join()
        gc.collect()

    try:
        threads(50)  # warm: whatever the first threads allocate once
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            threads(300)
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
        assert grown / 300 < 300, f"{grown / 300:.0f} bytes kept per ended thread"
    finally:
        loops.close()


def test_thread_loops__close_from_another_thread_leaves_a_call_in_progress_alone() -> None:
    """``engine.close()`` while another thread's ``run_until_idle`` runs: that call goes on
    to its end on its loop (closing it would cancel its tasks from a foreign thread), and
    the closing thread's own current loop is left as it was."""
    loops = ThreadLoops()
    inside = threading.Event()
    go_on: list[asyncio.Event] = []
    their: list[asyncio.AbstractEventLoop] = []
    results: list[str] = []

    async def waits_for_the_close() -> str:
        go_on.append(asyncio.Event())
        their.append(asyncio.get_running_loop())
        inside.set()
        await go_on[0].wait()
        return "ended normally"

    def call() -> None:
        results.append(run_on(loops.runner(), waits_for_the_close()))

    mine = asyncio.new_event_loop()
    asyncio.set_event_loop(mine)
    thread = threading.Thread(target=call)
    try:
        thread.start()
        assert inside.wait(30)
        their_loop = their[0]
        loops.close()
        assert their_loop.is_running() and not their_loop.is_closed()
        their_loop.call_soon_threadsafe(go_on[0].set)
        thread.join(30)
        assert results == ["ended normally"]
        assert asyncio.get_event_loop() is mine
    finally:
        asyncio.set_event_loop(None)
        mine.close()
        loops.close()
