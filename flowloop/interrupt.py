"""Ctrl-C while ``flowloop run`` drives a run in the foreground.

The first SIGINT drains like SIGTERM does for a worker: nothing new starts, the step in
flight finishes and its outcome is journaled, then the run is handed back (``run_released``,
*released on shutdown*; status ``scheduled``) so ``flowloop resume`` continues it. With no
step in flight (a retry's backoff) the run is left as it is. A second SIGINT cuts the step
off: it is journaled as *cut off by shutdown* (an idempotent step runs again on resume; a
non-idempotent one fails as ``interrupted`` and waits for an operator's ``retry``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from pydantic import BaseModel

from flowloop.definition import Workflow
from flowloop.engine import Engine, RunInfo
from flowloop.journal import JournalEvent, RunRecord
from flowloop.lifecycle import FINISHED

EXIT_INTERRUPTED: Final = 130
"""The shell's code for a process ended by SIGINT (128 + 2)."""
STEP_THREAD_PREFIX: Final = "flowloop-"


@dataclass(frozen=True)
class Interrupted:
    """How a foreground run ended after Ctrl-C: its run (``None`` if it was never created)
    and how many SIGINTs arrived (1: drained, 2 or more: cut off)."""

    run: RunInfo | None
    signals: int


def run_interruptibly(
    engine: Engine,
    workflow: Workflow,
    context: BaseModel | Mapping[str, Any] | str,
    *,
    key: str | None = None,
    notice: Callable[[str], None] = lambda _: None,
) -> RunInfo | Interrupted:
    """:meth:`Engine.run` with the Ctrl-C behaviour described in the module docstring.

    Returns the run's :class:`RunInfo` when no SIGINT arrived, else :class:`Interrupted`.
    ``notice`` is told, at each SIGINT, what happens now (one line for the terminal)."""
    seen: list[str] = []

    def remember(record: RunRecord, _: Sequence[JournalEvent]) -> None:
        if record.workflow == workflow.name and record.id not in seen:
            seen.append(record.id)

    async def main() -> RunInfo | Interrupted:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        executor = engine._executor()
        executor.listeners.append(remember)
        signals = 0

        def on_sigint() -> None:
            nonlocal signals
            signals += 1
            seen.extend(run_id for run_id in executor.tracked if run_id not in seen)
            if signals == 1 and executor.busy:
                notice(
                    "interrupt: letting the step in flight finish, then stopping "
                    "(Ctrl-C again to cut it off)"
                )
                executor.hand_back()
            else:
                notice("interrupt: cutting the step in flight off" if executor.busy else "")
                task.cancel()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            try:
                info: RunInfo | None = await engine.arun(workflow, context, key=key)
            except asyncio.CancelledError:
                if signals == 0:
                    raise
                info = None
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            executor.listeners.remove(remember)
            executor.stop_handing_back()  # the engine's executor drives later runs again
        if info is not None and (signals == 0 or info.status in FINISHED):
            return info  # a Ctrl-C that came as the run ended changes nothing
        run_id = info.id if info is not None else (seen[-1] if seen else None)
        return Interrupted(engine.get(run_id) if run_id is not None else None, signals)

    return asyncio.run(main())


def interrupted_line(outcome: Interrupted, *, resume: str, retry: str) -> str:
    """One line saying where a Ctrl-C left the run and the command that continues it;
    ``resume`` and ``retry`` are those commands with ``{run}`` for the run's id."""
    info = outcome.run
    if info is None:
        return "interrupted before the run was created; nothing to continue"
    how = "after its step finished" if outcome.signals == 1 else "cutting its step off"
    where = f"run {info.id} stopped {how}: {info.status} in state {info.state}"
    if info.status in ("scheduled", "retrying", "running"):
        return f"interrupted: {where}; continue it with `{resume.format(run=info.id)}`"
    if info.status == "failed":
        why = f" ({info.error})" if info.error else ""
        return f"interrupted: {where}{why}; then `{retry.format(run=info.id)}`"
    return f"interrupted: {where}"


def leave(line: str) -> NoReturn:
    """Print ``line`` to stderr and exit with :data:`EXIT_INTERRUPTED`. A sync step cut off
    by a second Ctrl-C keeps running in its thread (threads cannot be killed) and Python
    would wait for it at exit: its cut-off is journaled already, so exit at once then."""
    sys.stderr.write(line + "\n")
    lingering = [
        thread
        for thread in threading.enumerate()
        if thread.name.startswith(STEP_THREAD_PREFIX) and thread.is_alive() and not thread.daemon
    ]
    for thread in lingering:
        thread.join(timeout=0.2)
    if any(thread.is_alive() for thread in lingering):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_INTERRUPTED)
    sys.exit(EXIT_INTERRUPTED)
