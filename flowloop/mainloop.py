"""A coroutine run to its end on a kept event loop, Ctrl-C cancelling it: what
``asyncio.Runner.run`` does, at a fraction of its cost per call.

``Engine.run`` keeps one loop per thread (building one costs more than a commit) and calls
it once per run. ``Runner.run`` swaps the SIGINT handler in and out at every call through
``signal.signal``/``signal.getsignal``, which convert each handler to an enum and, failing,
format it — its handler is a ``partial`` holding the task, so the task's repr is built
twice per call (≈ 40-90 µs per call measured on the 2-core test machine; the swap through
``_signal``, the C module ``signal`` wraps, ≈ 2 µs).

Semantics kept from ``Runner.run``: in the main thread, while no one else handles SIGINT, a
first Ctrl-C cancels the task (the run is cut off at its next await and says so in its
journal) and the call then raises ``KeyboardInterrupt``; a second one raises at once. One
difference: each call runs in a copy of the caller's context (as ``asyncio.run`` does), not
in one context shared by every call of the runner. And where ``run_until_complete`` stops
the loop from the task's done callback, a loop turn after the task ended, the task stops
it itself as it ends (:func:`_stopping`; the handler does for a task cancelled before it
ran): one loop turn less per call.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C module: no enum conversion
import asyncio
import contextlib
import signal
import threading
import weakref
from collections.abc import Callable, Coroutine
from types import FrameType
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class _Call:
    """One :func:`run_on` call: its loop and task, and whether the call still runs them."""

    __slots__ = ("active", "loop", "task")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.task: asyncio.Task[Any] | None = None
        self.active = True

    def stop_if_ended(self) -> None:
        """On the loop: stop it when the call's task has ended (a task cancelled before its
        first step never runs :func:`_stopping`, which stops it otherwise)."""
        if self.active and self.task is not None and self.task.done():
            self.loop.stop()


async def _stopping(call: _Call, coro: Coroutine[Any, Any, T]) -> T:
    """``coro``, then the call's loop stopped in the same turn: ``run_until_complete``
    stops it from the task's done callback, one loop turn later (~2 % of a 1-step
    ``Engine.run``'s instructions). A task left running by a call that has returned (a
    second Ctrl-C) stops no later call's loop."""
    try:
        return await coro
    finally:
        if call.active:
            call.loop.stop()


class _CancelOnCtrlC:
    """The SIGINT handler of one call: the first Ctrl-C cancels the task, the next raises."""

    __slots__ = ("call", "count", "loop", "task")

    def __init__(self, call: _Call, task: asyncio.Task[Any]) -> None:
        self.call = call
        self.loop = call.loop
        self.task = task
        self.count = 0

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 1 and not self.task.done():
            self.task.cancel()
            # Wakes a loop blocked in select(), and stops it if the task ended cancelled
            # without running (cancelled before its first step).
            self.loop.call_soon_threadsafe(self.call.stop_if_ended)
            return
        raise KeyboardInterrupt()

    def __repr__(self) -> str:  # cheap: the task's own repr is what Runner.run pays for
        return "<flowloop: Ctrl-C cancels the run>"


def _install(call: _Call, task: asyncio.Task[Any]) -> _CancelOnCtrlC | None:
    """This call's handler, when SIGINT is ours to take (main thread, default handler)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if _signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return None
    handler = _CancelOnCtrlC(call, task)
    try:
        _signal.signal(signal.SIGINT, handler)
    except ValueError:  # an embedded interpreter without signals
        return None
    return handler


def refuse_inside_a_loop(call: str = "run", awaited: str = "arun(...)") -> None:
    """Raise when this thread runs an event loop (its caller must ``await`` instead)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # none: the usual case
    raise RuntimeError(
        f"Engine.{call} cannot be called from a running event loop: await engine.{awaited}"
    )


def run_on(
    runner: asyncio.Runner,
    coro: Coroutine[Any, Any, T],
    *,
    call: str = "run",
    awaited: str = "arun(...)",
) -> T:
    """Run ``coro`` to its end on ``runner``'s loop (see the module's docstring). ``call``
    and ``awaited`` name the Engine method and its coroutine in the error raised when this
    thread already runs a loop."""
    try:
        refuse_inside_a_loop(call, awaited)
    except RuntimeError:
        coro.close()  # never to run: no "coroutine was never awaited" later
        raise
    loop = runner.get_loop()
    this = _Call(loop)
    task = loop.create_task(_stopping(this, coro))
    this.task = task
    handler = _install(this, task)
    try:
        # loop.run_until_complete(task), the task stopping the loop itself (_stopping)
        loop.run_forever()
        if not task.done():  # someone else stopped the loop (as run_until_complete says)
            raise RuntimeError("Event loop stopped before Future completed.")
        return task.result()
    except asyncio.CancelledError as cancelled:
        if handler is not None and handler.count > 0 and task.uncancel() == 0:
            raise KeyboardInterrupt() from cancelled
        raise
    finally:
        this.active = False
        if task.done():  # (a task cancelled before its first step never started coro)
            coro.close()
        if handler is not None and _signal.getsignal(signal.SIGINT) is handler:
            _signal.signal(signal.SIGINT, signal.default_int_handler)


async def cancelling_what_it_leaves(work: Coroutine[Any, Any, T]) -> T:
    """``work``, then the tasks it started and left running (an error cut its drive
    short) cancelled and awaited: what ``asyncio.run`` does at its end, and a kept loop
    would otherwise resume them at its next call."""
    before = asyncio.all_tasks()
    try:
        return await work
    finally:
        left = asyncio.all_tasks() - before
        for task in left:
            task.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)


class _Kept:
    """One thread's kept runner and its loop. Held only by that thread's locals (and weakly
    by its :class:`ThreadLoops`), so it is dropped, and its loop closed, when the thread
    ends."""

    __slots__ = ("__weakref__", "loop", "owner", "runner")

    def __init__(self) -> None:
        self.runner = asyncio.Runner()
        self.loop = self.runner.get_loop()
        self.owner = threading.get_ident()

    def close(self) -> None:
        """From its own thread: the runner's whole close (async generators, the default
        executor, the thread's current loop unset). From another thread: the loop closed
        if it is not running now — a call in progress there is left to end (its thread's
        next call makes a new loop); nothing of the closing thread's own state touched."""
        with contextlib.suppress(Exception):  # a loop left broken must not fail a close
            if self.owner == threading.get_ident():
                self.runner.close()
            elif not self.loop.is_running():
                self.loop.close()

    def __del__(self) -> None:
        # Its thread is ending (its locals are being cleared): close the loop without
        # running it. Runner.close would run it and unset the thread's current loop, which
        # makes CPython build that thread's state again, never to be freed (~600 B a thread).
        with contextlib.suppress(Exception):
            if not self.loop.is_running():
                self.loop.close()


class ThreadLoops:
    """One event loop per calling thread, kept between calls (building and closing one
    costs more than a commit), for :func:`run_on`.

    A loop is closed when its thread ends or at :meth:`close`: kept in a list instead, each
    thread that ever called (a thread per request, say) left its loop open — three file
    descriptors each — until the engine closed."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._kept: weakref.WeakSet[_Kept] = weakref.WeakSet()
        self._lock = threading.Lock()  # a first call in one thread while another closes

    def runner(self) -> asyncio.Runner:
        """This thread's runner (made at its first call)."""
        kept: _Kept | None = getattr(self._local, "kept", None)
        if kept is None:
            kept = _Kept()
            self._local.kept = kept
            with self._lock:
                self._kept.add(kept)
        return kept.runner

    def close(self) -> None:
        """Close every thread's loop that is not running a call now (see
        :meth:`_Kept.close`); a later call makes a new one."""
        with self._lock:
            kept, self._kept = list(self._kept), weakref.WeakSet()
            self._local = threading.local()
        for one in kept:
            one.close()


class _Own:
    """One thread's object of a :class:`PerThread`: held only by that thread's locals (and
    weakly by the :class:`PerThread`), so it is closed when the thread ends."""

    __slots__ = ("__weakref__", "closer", "value")

    def __init__(self, value: Any, closer: Callable[[Any], None]) -> None:
        self.value = value
        self.closer: Callable[[Any], None] | None = closer

    def close(self) -> None:
        closer, self.closer = self.closer, None
        if closer is not None:
            with contextlib.suppress(Exception):  # one left broken must not fail a close
                closer(self.value)

    def __del__(self) -> None:
        self.close()


class PerThread(Generic[T]):
    """One object per calling thread (``Engine.run``'s executor: a thread's runs are driven
    on its own loop, and an executor's lease threads and loop watchdog serve one loop at a
    time), :meth:`put` by the thread and closed with ``closer`` when the thread ends or at
    :meth:`close`."""

    def __init__(self, closer: Callable[[T], None]) -> None:
        self._closer = closer
        self._local = threading.local()
        self._made: weakref.WeakSet[_Own] = weakref.WeakSet()
        self._lock = threading.Lock()

    def get(self) -> T | None:
        """This thread's object, if it has one."""
        own: _Own | None = getattr(self._local, "own", None)
        return None if own is None else own.value

    def put(self, value: T) -> T:
        """Make ``value`` this thread's object (closing the one it had)."""
        old: _Own | None = getattr(self._local, "own", None)
        if old is not None:
            old.close()
        own = _Own(value, self._closer)
        self._local.own = own
        with self._lock:
            self._made.add(own)
        return value

    def made(self) -> list[T]:
        """The objects of the threads that have one now."""
        with self._lock:
            return [own.value for own in self._made if own.closer is not None]

    def close(self) -> None:
        """Close every thread's object (a thread's next :meth:`get` finds none)."""
        with self._lock:
            made, self._made = list(self._made), weakref.WeakSet()
            self._local = threading.local()
        for own in made:
            own.close()
