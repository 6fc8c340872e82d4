"""Calling a loop's function: what it raises, as the iteration's error, and its timeout.

Not in :mod:`flowloop.errors` (the pure core, which imports no asyncio)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

from flowloop.errors import RaisedBaseException, StepExited, StepTimeout, error_line
from flowloop.tasks import CUT_OFF_WRITE_SECONDS

T = TypeVar("T")

log = logging.getLogger("flowloop.loops")

CUT_OFF_GRACE_SECONDS: Final = 1.0
"""How long a loop function cut off by its timeout or a lost lease has to end before it is
abandoned, still running: one that swallows ``CancelledError`` never ends."""
CANCEL_GRACE_SECONDS: Final = CUT_OFF_WRITE_SECONDS - CUT_OFF_GRACE_SECONDS
"""How long a loop function cancelled by a stop or the worker's drain has to end before it
is abandoned (its loop said held): cleaning up after a cancellation (a flush, closing a
connection) takes a while, and the lease is renewed meanwhile. The drain's wait for its
cut-offs (:data:`~flowloop.tasks.CUT_OFF_WRITE_SECONDS`) less a second for the outcome."""


async def loop_errors(call: Awaitable[T], name: str) -> T:
    """Await ``call`` (an iteration of loop ``name``) with ``SystemExit`` turned into
    :class:`StepExited` and any other ``BaseException`` but a cancellation into
    :class:`RaisedBaseException`: inside the task that runs it (``asyncio.wait_for``
    makes one), whose ``KeyboardInterrupt`` would otherwise leave the event loop."""
    try:
        return await call
    except (Exception, asyncio.CancelledError, GeneratorExit):
        raise
    except SystemExit as exited:
        raise StepExited(f"loop {name!r}", exited.code) from None
    except BaseException as error:
        raise RaisedBaseException(f"loop {name!r}", error) from error


class TimedCalls:
    """Loop functions called in a task of their own, under their ``timeout=`` if any: a
    timeout, or a cancellation of the iteration (a stop, the worker's drain, a lost lease),
    ends the iteration even when the function swallows the cancellation (awaited in the
    iteration's own task, or by ``asyncio.wait_for``, it is waited for to its end: for
    ever, then — with or without ``timeout=``). Such a function is abandoned, still
    running: the scheduler holds the loop until it ends (:meth:`ended`), and the loop's
    next call waits for it first (never two calls of one loop at once), under its own
    timeout."""

    def __init__(self, on_abandoned: Callable[[str, str], None] | None = None) -> None:
        self.runaways: dict[str, asyncio.Task[Any]] = {}
        """The calls abandoned still running, by loop (each dropped as it ends)."""
        self.on_abandoned = on_abandoned
        """Called with the loop's name and its grace and what cut it off (``1s of its
        timeout (5s)``) when its function did not end within the whole grace of its
        cancellation (to make the held loop visible)."""
        self._closed: set[asyncio.Task[Any]] = set()
        """Calls closed by :meth:`forget` (their end is not the function's: not logged)."""
        self._stops: dict[str, bool] = {}
        """Loops whose iteration is being cancelled: by a stop or the drain (True: the
        longer :data:`CANCEL_GRACE_SECONDS`), or a lost lease (False)."""
        self._raised: dict[str, str] = {}
        """What a function cut off raised as it ended, by loop (for its iteration's error)."""
        self._cutting: dict[str, tuple[asyncio.Task[Any], float]] = {}
        """The calls in their grace after a cancellation, by loop: the call, and when its
        grace ends (the event loop's clock; :meth:`cut_short` may move it sooner)."""

    def cancelling(self, name: str, *, stop: bool) -> None:
        """Loop ``name``'s iteration is about to be cancelled: by a stop or the worker's
        drain (``stop``: its function gets :data:`CANCEL_GRACE_SECONDS` to end), or by a lost
        lease (:data:`CUT_OFF_GRACE_SECONDS`, which the lease's margin covers)."""
        self._stops[name] = stop

    def cut_short(self, name: str) -> None:
        """Loop ``name``'s lease may end soon (lost, or fenced off): a function already
        ending after a stop's or the drain's cancellation (:data:`CANCEL_GRACE_SECONDS`) is
        cancelled again, the rest of its grace cut to :data:`CUT_OFF_GRACE_SECONDS`, which
        the lease's margin covers (before, it went on cleaning up past the lease's end in
        the database)."""
        cutting = self._cutting.get(name)
        if cutting is None:
            return
        task, deadline = cutting
        sooner = asyncio.get_running_loop().time() + CUT_OFF_GRACE_SECONDS
        self._cutting[name] = (task, min(deadline, sooner))
        task.cancel()

    def raised(self, name: str) -> str | None:
        """What loop ``name``'s function raised as it ended after its cut-off, if anything
        (once: taken)."""
        return self._raised.pop(name, None)

    async def call(
        self, start: Callable[[], Awaitable[T]], *, name: str, timeout: float | None
    ) -> T:
        """``start()`` (a call of loop ``name``'s function) under :func:`loop_errors`, cut
        off after ``timeout`` seconds (None: never) with a :class:`StepTimeout`; a
        cancellation of the caller cuts it off too."""
        previous = self.running(name)
        self._stops.pop(name, None)  # (one set for a cancellation that came between calls)
        self._raised.pop(name, None)
        task = asyncio.ensure_future(_after(previous, start, name))
        try:
            done, _ = await asyncio.wait([task], timeout=timeout)
        except asyncio.CancelledError:
            stop = self._stops.pop(name, False)
            grace = CANCEL_GRACE_SECONDS if stop else CUT_OFF_GRACE_SECONDS
            await self._cut_off(task, previous, name, "the cancellation of its iteration", grace)
            raise
        if task in done:
            return task.result()
        assert timeout is not None  # (without one, only a cancellation ends the wait)
        await self._cut_off(task, previous, name, f"its timeout ({timeout:g}s)")
        raised = self.raised(name)
        also = f"; its function raised as it ended: {raised}" if raised else ""
        raise StepTimeout(f"loop {name!r} iteration took longer than {timeout:g}s{also}")

    def running(self, name: str) -> asyncio.Task[Any] | None:
        """Loop ``name``'s call abandoned still running, if any."""
        task = self.runaways.get(name)
        return task if task is not None and not task.done() else None

    async def ended(self, name: str) -> None:
        """Wait until loop ``name``'s abandoned call, if any, has ended."""
        while (task := self.running(name)) is not None:
            await asyncio.wait([task])

    async def _cut_off(
        self,
        task: asyncio.Task[Any],
        previous: asyncio.Task[Any] | None,
        name: str,
        why: str,
        grace: float | None = None,
    ) -> None:
        """Cancel ``task`` (loop ``name``'s call, for ``why``) and give it ``grace`` seconds
        (:data:`CUT_OFF_GRACE_SECONDS`) to end; abandoned, still running, after."""
        if grace is None:
            grace = CUT_OFF_GRACE_SECONDS
        task.cancel()
        # Tracked before the wait: a second cancellation during it (a stop, the worker's
        # end) must not lose the call still running (before, the next call overlapped it
        # and asyncio.run waited for it for ever).
        self.runaways[name] = task
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._cutting[name] = (task, started + grace)
        waited = False
        try:
            await asyncio.wait([task], timeout=grace)
            waited = True
        finally:
            _, deadline = self._cutting.pop(name, (task, started + grace))
            grace = min(grace, deadline - started)  # (cut short: a lease lost meanwhile)
            if task.done():
                self._ended(task, name, previous, abandoned=False)
                self._said_raised(task, name, why)
            else:
                task.add_done_callback(
                    functools.partial(self._ended, name=name, previous=previous, abandoned=True)
                )
                if waited:
                    self._abandoned(task, name, why, grace)
                else:
                    # Cut short by a second cancellation (a stop, the worker's end, a lost
                    # lease): the function may merely be cleaning up, so it is not said to
                    # be stuck yet; still running once the rest of its grace has passed,
                    # it is (before, such a loop was held without a note or an alert).
                    log.info(
                        "loop %s: its iteration was cancelled again while its function was "
                        "still ending; the loop is held until it ends",
                        name,
                        extra={"loop": name, "event": "iteration_cut_off_again"},
                    )
                    loop.call_at(deadline, self._abandoned, task, name, why, grace)

    def _said_raised(self, task: asyncio.Task[Any], name: str, why: str) -> None:
        """``task`` (loop ``name``'s call, cut off by ``why``) ended within its grace: what
        it raised then (an error in its cleanup) is said, and kept for the iteration's error
        (before, a stop's dropped it: journaled ``iteration_stopped``, the error nowhere)."""
        error = None if task.cancelled() else task.exception()
        if error is None or isinstance(error, asyncio.CancelledError):
            return
        line = f"{type(error).__name__}: {error_line(error)}"
        self._raised[name] = line
        log.warning(
            "loop %s: its function raised as it ended after %s: %s",
            name,
            why,
            line,
            extra={"loop": name, "event": "iteration_cut_off_raised", "error": line},
        )

    def _abandoned(self, task: asyncio.Task[Any], name: str, why: str, grace: float) -> None:
        """``task`` (loop ``name``'s call, cut off by ``why``) has had its whole grace: if it
        still runs (and is still tracked: not left behind by :meth:`forget`), say so, and
        tell :attr:`on_abandoned`."""
        if task.done() or self.runaways.get(name) is not task:
            return
        log.warning(
            "loop %s: its function did not end within %gs of the cancellation of its "
            "iteration; abandoned, still running (the loop is held until it ends)",
            name,
            grace,
            extra={"loop": name, "event": "iteration_runaway"},
        )
        if self.on_abandoned is not None:
            try:
                self.on_abandoned(name, f"{grace:g}s of {why}")
            except Exception:  # (telling must never lose the call's tracking)
                log.exception("loop %s: could not report its abandoned function", name)

    def _ended(
        self,
        task: asyncio.Task[Any],
        name: str,
        previous: asyncio.Task[Any] | None,
        *,
        abandoned: bool,
    ) -> None:
        """``task`` (a call cut off) has ended: its outcome retrieved (an abandoned one's
        logged: it is no iteration's any more), and the loop's abandoned call is the one it
        waited for again, if that still runs."""
        if self.runaways.get(name) is task:
            if previous is not None and not previous.done():
                self.runaways[name] = previous
            else:
                del self.runaways[name]
        error = None if task.cancelled() else task.exception()
        if task in self._closed:
            self._closed.discard(task)  # (closed by forget: its error is the closing's)
            return
        if abandoned:
            outcome = "cancelled" if task.cancelled() else "returned"
            if error is not None:
                outcome = f"raised {type(error).__name__}: {error}"
            log.log(
                logging.WARNING if error is not None else logging.INFO,
                "loop %s: its abandoned function ended: %s",
                name,
                outcome,
                extra={"loop": name, "event": "iteration_runaway_ended"},
            )

    def forget(self) -> None:
        """At the scheduler's end: cancel the abandoned calls once more, and leave those
        that still run out of the event loop's tasks, which ``asyncio.run`` cancels and
        then waits for as it ends — for ever, for such a call (the worker hung there).

        No public asyncio call takes a task out of ``asyncio.all_tasks()``; the private
        ``asyncio.tasks._unregister_task`` (CPython's since 3.7, the hook for third-party
        task implementations; tested here on 3.11) does, and the function runs on until the
        process exits. A Python without it (or where it did not take the task out) gets
        the public fallback: the call's coroutine is closed (``GeneratorExit`` at its
        ``await``: its ``finally`` blocks run), so the next cancellation ends the task."""
        for name, task in list(self.runaways.items()):
            if task.done():
                continue
            task.cancel()
            unregister = getattr(asyncio.tasks, "_unregister_task", None)
            if unregister is not None:
                unregister(task)
            if unregister is None or task in asyncio.all_tasks():
                self._close(task, name)
                continue
            log.error("loop %s: its function still runs as the worker stops; left behind", name)
        self.runaways.clear()

    def _close(self, task: asyncio.Task[Any], name: str) -> None:
        """End ``task`` (loop ``name``'s abandoned call) by closing its coroutine."""
        self._closed.add(task)
        try:
            task.get_coro().close()
        except RuntimeError as error:  # (it awaited again in a finally: "ignored")
            log.error("loop %s: its function still runs as the worker stops: %s", name, error)
        else:
            log.error("loop %s: its function still ran as the worker stopped; closed", name)
        task.cancel()  # (the step the cancellation takes ends the closed coroutine)


async def finish_within(
    timed: TimedCalls, tasks: Mapping[str, asyncio.Task[Any]], grace: float | None
) -> None:
    """The worker's drain of its loop iterations (``tasks``, by loop): wait up to ``grace``
    seconds (None: for as long as they take), then cancel the rest, their functions given
    :data:`CANCEL_GRACE_SECONDS` to end, and wait for them to be recorded up to
    :data:`~flowloop.tasks.CUT_OFF_WRITE_SECONDS` (as :func:`flowloop.tasks.finish_within`
    waits for a run's steps; before, a loop function without ``timeout=`` got only
    :data:`CUT_OFF_GRACE_SECONDS` of it, its cleanup cut short as the worker exited)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(list(tasks.values()), timeout=grace)
    for name, task in tasks.items():
        if task in pending:
            timed.cancelling(name, stop=True)
            task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=CUT_OFF_WRITE_SECONDS)


async def _after(
    previous: asyncio.Task[Any] | None, start: Callable[[], Awaitable[T]], name: str
) -> T:
    """``start()`` once ``previous`` (the loop's abandoned call, if any) has ended."""
    if previous is not None:
        await asyncio.wait([previous])
    return await loop_errors(start(), name)
