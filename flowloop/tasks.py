"""Waiting for tasks the way a worker's shutdown and its idle loop need: a grace period,
then the rest cut off (with a bounded wait for their cut-offs to be journaled), and the
first of several waits. Kept apart from flowloop/executor.py, which uses them."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, Final

CUT_OFF_WRITE_SECONDS: Final = 5.0
"""How long, after the grace period, shutdown waits for the cut-offs to be journaled."""


async def finish_within(tasks: Sequence[asyncio.Task[Any]], grace: float | None) -> None:
    """Wait up to ``grace`` seconds (``None``: for as long as they take) for ``tasks``, then
    cancel the rest and wait for them to settle (a cancelled drive journals its cut-off
    before it ends)."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=grace)
    for task in pending:
        task.cancel()
    if pending:
        # Journaling the cut-offs needs the database: during an outage, give up after a
        # bounded time (the runs stay ``running`` and the next worker's recovery settles
        # them) rather than break the grace period's promise for good.
        await asyncio.wait(pending, timeout=CUT_OFF_WRITE_SECONDS)


async def first_of(waits: Sequence[Coroutine[Any, Any, Any]], timeout: float | None = None) -> None:
    """Wait until the first of ``waits`` is done (or ``timeout``); cancel the others."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
