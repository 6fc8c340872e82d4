"""Calling a loop's function: what it raises, as the iteration's error, and its timeout.

Not in :mod:`flowloop.errors` (the pure core, which imports no asyncio)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from flowloop.errors import RaisedBaseException, StepExited, StepTimeout

T = TypeVar("T")

log = logging.getLogger("flowloop.loops")

CUT_OFF_GRACE_SECONDS: Final = 1.0
"""How long a loop function cancelled (its timeout, a stop, a lost lease) has to end before
it is abandoned, still running: one that swallows ``CancelledError`` never ends."""


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
    """Loop functions called under their ``timeout=``, which ends the iteration even when
    the function swallows the cancellation (``asyncio.wait_for`` waits for the function
    to end: for ever, then). Such a function is abandoned, still running; the loop's next
    call waits for it first (never two calls of one loop at once), under its own timeout."""

    def __init__(self) -> None:
        self.runaways: dict[str, asyncio.Task[Any]] = {}
        """The calls abandoned still running, by loop."""

    async def call(self, start: Callable[[], Awaitable[T]], *, name: str, timeout: float) -> T:
        """``start()`` (a call of loop ``name``'s function) under :func:`loop_errors`, cut
        off after ``timeout`` seconds with a :class:`StepTimeout`; a cancellation of the
        caller cuts it off too."""
        previous = self.runaways.get(name)
        if previous is not None and previous.done():
            del self.runaways[name]
            previous = None
        task = asyncio.ensure_future(_after(previous, start, name))
        try:
            done, _ = await asyncio.wait([task], timeout=timeout)
        except asyncio.CancelledError:
            await self._cut_off(task, name)
            raise
        if task in done:
            return task.result()
        await self._cut_off(task, name)
        raise StepTimeout(f"loop {name!r} iteration took longer than {timeout:g}s")

    async def _cut_off(self, task: asyncio.Task[Any], name: str) -> None:
        task.cancel()
        await asyncio.wait([task], timeout=CUT_OFF_GRACE_SECONDS)
        if task.done():
            if not task.cancelled():
                task.exception()  # (retrieved: the iteration's outcome is its cut-off)
            return
        self.runaways[name] = task
        log.warning(
            "loop %s: its function ignores the cancellation of its iteration and still "
            "runs; abandoned (the loop's next iteration waits for it)",
            name,
            extra={"loop": name, "event": "iteration_runaway"},
        )

    def forget(self) -> None:
        """At the scheduler's end: cancel the abandoned calls once more, and leave those
        that still run out of the event loop's tasks, which ``asyncio.run`` cancels and
        then waits for as it ends — for ever, for such a call (the worker hung there)."""
        for name, task in self.runaways.items():
            if task.done():
                continue
            task.cancel()
            unregister = getattr(asyncio.tasks, "_unregister_task", None)
            if unregister is not None:
                unregister(task)
            log.error("loop %s: its function still runs as the worker stops; left behind", name)
        self.runaways.clear()


async def _after(
    previous: asyncio.Task[Any] | None, start: Callable[[], Awaitable[T]], name: str
) -> T:
    """``start()`` once ``previous`` (the loop's abandoned call, if any) has ended."""
    if previous is not None:
        await asyncio.wait([previous])
    return await loop_errors(start(), name)
