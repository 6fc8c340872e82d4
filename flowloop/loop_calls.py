"""Calling a loop's function: what it raises, as the iteration's error.

Not in :mod:`flowloop.errors` (the pure core, which imports no asyncio)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from flowloop.errors import RaisedBaseException, StepExited

T = TypeVar("T")


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
