"""Ctrl-C (or SIGTERM) while ``flowloop run`` or ``flowloop resume`` drives runs in the
foreground.

The first signal drains as SIGTERM does for a worker: nothing new starts, the steps in
flight finish and their outcomes are journaled, then their runs are handed back
(``run_released``, *released on shutdown*; status ``scheduled``) so ``flowloop resume``
continues them. With no step in flight (a retry's backoff) the runs are left as they are.
A second signal cuts the steps off: journaled as *cut off by shutdown* (an idempotent step
runs again on resume; a non-idempotent one fails as ``interrupted`` and waits for an
operator's ``retry``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from pydantic import BaseModel

from flowloop.definition import Workflow
from flowloop.engine import Engine, RunInfo
from flowloop.executor import Executor, Stats
from flowloop.journal import JournalEvent, RunRecord
from flowloop.lifecycle import FINISHED

EXIT_SIGNALLED: Final = 128
"""The shell's code for a process ended by a signal is this plus the signal's number."""
EXIT_INTERRUPTED: Final = EXIT_SIGNALLED + signal.SIGINT
"""The shell's code for a process ended by SIGINT (128 + 2)."""
HANDLED: Final = (signal.SIGINT, signal.SIGTERM)
"""The signals a foreground drive hands its runs back at (a worker's shutdown, as Ctrl-C)."""
STEP_THREAD_PREFIX: Final = "flowloop-"


@dataclass(frozen=True)
class Interrupted:
    """How a foreground run ended after Ctrl-C: its run (``None`` if it was never created)
    and how many SIGINTs arrived (1: drained, 2 or more: cut off)."""

    run: RunInfo | None
    signals: int
    first: int = signal.SIGINT
    """The first signal's number (SIGTERM is taken as Ctrl-C is): the exit code says it."""
    in_flight: bool = True
    """Whether a step was running at the first signal (not: the run waited for a retry's
    backoff or a timer, and no step had to finish)."""


class Caught(list[int]):
    """The signals a drive caught, in order; ``in_flight``: whether a step was running at
    the first."""

    in_flight: bool = False


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
        executor = engine._executor()
        executor.listeners.append(remember)

        def note_tracked() -> None:
            seen.extend(run_id for run_id in executor.tracked if run_id not in seen)

        with _signals(executor, notice, note_tracked) as caught:
            try:
                info: RunInfo | None = await engine.arun(workflow, context, key=key)
            except asyncio.CancelledError:
                if not caught:
                    raise
                info = None
            finally:
                executor.listeners.remove(remember)
        if info is not None and (not caught or info.status in FINISHED):
            return info  # a Ctrl-C that came as the run ended changes nothing
        run_id = info.id if info is not None else (seen[-1] if seen else None)
        run = engine.get(run_id) if run_id is not None else None
        return Interrupted(run, len(caught), caught[0], caught.in_flight)

    return asyncio.run(main())


def drive_interruptibly(
    engine: Engine, run_id: str, *, notice: Callable[[str], None] = lambda _: None
) -> RunInfo | Interrupted:
    """:meth:`Engine.drive` with the Ctrl-C behaviour of ``flowloop run`` (the module
    docstring): ``flowloop retry`` drives the retried run so. Its RunInfo when no signal
    came (or one came as the run ended), else :class:`Interrupted`."""

    async def main() -> RunInfo | Interrupted:
        executor = engine._executor()
        with _signals(executor, notice, lambda: None) as caught:
            try:
                info: RunInfo | None = await engine.adrive(run_id)
            except asyncio.CancelledError:
                if not caught:
                    raise
                info = None
        if info is not None and (not caught or info.status in FINISHED):
            return info  # a Ctrl-C that came as the run ended changes nothing
        return Interrupted(engine.get(run_id), len(caught), caught[0], caught.in_flight)

    return asyncio.run(main())


def resume_interruptibly(
    engine: Engine,
    *,
    notice: Callable[[str], None] = lambda _: None,
    idle: Callable[[float], None] | None = None,
) -> tuple[Stats, Caught]:
    """:meth:`Engine.resume` with the Ctrl-C behaviour of ``flowloop run`` (the module
    docstring), for every run it drives: a first SIGINT or SIGTERM lets the steps in
    flight finish and hands their runs back, a second cuts them off. The stats, and the
    signals that came (none: it went to its end). ``idle`` is told the seconds each time
    it waits for a run due later (a retry's backoff, a sleep's end)."""

    async def main() -> tuple[Stats, Caught]:
        executor = engine._new_executor()
        if idle is not None:
            executor.idle_waits.append(idle)
        try:
            with _signals(executor, notice, lambda: None) as caught:
                try:
                    # No grace period: the steps in flight finish however long they take
                    # (the second signal is what cuts them off).
                    stats = await executor.run(until_idle=True, grace=None)
                except asyncio.CancelledError:
                    if not caught:
                        raise
                    stats = executor.stats
        finally:
            executor.close()
        return stats, caught

    return asyncio.run(main())


@contextlib.contextmanager
def _signals(
    executor: Executor, notice: Callable[[str], None], noted: Callable[[], None]
) -> Iterator[Caught]:
    """SIGINT and SIGTERM handled on the running loop while the block runs: the first
    hands the executor's runs back once their steps in flight have finished (with none in
    flight, and at the second, the calling task is cancelled: cut off). Yields the
    signals caught, in order; ``noted`` is called at each (the runs in flight are known
    then)."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    caught = Caught()

    def on_signal(signum: int) -> None:
        caught.append(signum)
        noted()
        if len(caught) == 1:
            caught.in_flight = executor.busy > 0
        if len(caught) == 1 and executor.busy:
            notice(
                "interrupt: letting the step in flight finish, then stopping "
                "(Ctrl-C again to cut it off)"
            )
            executor.hand_back()
        else:
            # (none in flight — a retry's backoff, a timer — printed an empty line)
            busy = executor.busy
            notice("interrupt: cutting the step in flight off" if busy else "interrupt: stopping")
            task.cancel()

    for signum in HANDLED:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        yield caught
    finally:
        for signum in HANDLED:
            loop.remove_signal_handler(signum)
        executor.stop_handing_back()  # the engine's executor drives later runs again


def interrupted_line(outcome: Interrupted, *, resume: str, retry: str) -> str:
    """One line saying where a Ctrl-C left the run and the command that continues it;
    ``resume`` and ``retry`` are those commands with ``{run}`` for the run's id."""
    info = outcome.run
    if info is None:
        return "interrupted before the run was created; nothing to continue"
    how = "after its step finished" if outcome.signals == 1 else "cutting its step off"
    if not outcome.in_flight and outcome.signals == 1:
        how = "with no step in flight"  # (it said "after its step finished": none ran)
    where = f"run {info.id} stopped {how}: {info.status} in state {info.state}"
    if info.status in ("scheduled", "retrying", "running"):
        return f"interrupted: {where}; continue it with `{resume.format(run=info.id)}`"
    if info.status == "failed":
        why = f" ({info.error})" if info.error else ""
        return f"interrupted: {where}{why}; then `{retry.format(run=info.id)}`"
    return f"interrupted: {where}"


def leave(line: str, code: int = EXIT_INTERRUPTED) -> NoReturn:
    """Print ``line`` to stderr and exit with ``code`` (128 + the signal's). A sync step cut off
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
        os._exit(code)
    sys.exit(code)
