"""Workflows and a process harness for the crash suite (tests/acceptance/test_crash.py).

Every step appends ``(run_id, state, visit, attempt, seq, idempotency_key, pid)`` to a
side-effect *ledger* in its own SQLite file before it returns, so the test can see each
execution that happened, including those whose outcome a SIGKILL cut off.

Workers are real processes. Starting a Python interpreter and importing flowloop takes about
half a second, so the harness keeps one *zygote* (``python crashkit.py zygote``) that imports
everything once and forks a fresh worker per command; the test SIGKILLs that worker at a
random instant. A forked worker is a new process with its own pid, so the next worker's
recovery sees a dead owner on this host and takes its runs over at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from flowloop import Engine, Retry, Step, Workflow

STATES = [f"s{i:02d}" for i in range(1, 21)]
LOOP_FROM, LOOP_TO = "s18", "s14"
"""s18 sends each run back to s14 once: visits greater than one are exercised too."""
VISITS_PER_RUN = len(STATES) + STATES.index(LOOP_FROM) - STATES.index(LOOP_TO) + 1
CRASH_RETRY = Retry(attempts=1_000, backoff="fixed", base=0, cap=0)
"""Interruptions count as attempts; a run may be cut off in the same step many times."""
SUICIDE_ATTEMPTS = 3

LEDGER: Path | None = None
"""Where steps record their executions (set in the worker; ``None``: nowhere)."""
PAUSE_S = 0.002
"""Upper bound of the random pause inside a step, so kills land mid-step too."""


class CrashCtx(BaseModel):
    n: int
    laps: int = 0
    total: int = 0
    trail: list[str] = []


# -- the ledger ---------------------------------------------------------------------------


def create_ledger(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS ledger (run_id TEXT, state TEXT, visit INTEGER,"
            " attempt INTEGER, seq INTEGER, idempotency_key TEXT, pid INTEGER)"
        )
    conn.close()


def record(step: Step) -> None:
    if LEDGER is None:
        return
    conn = sqlite3.connect(LEDGER, timeout=30)
    try:
        conn.execute("PRAGMA synchronous=OFF")  # survives a killed process, which is the point
        with conn:
            conn.execute(
                "INSERT INTO ledger VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    step.run_id,
                    step.state,
                    step.visit,
                    step.attempt,
                    step.seq,
                    step.idempotency_key,
                    os.getpid(),
                ),
            )
    finally:
        conn.close()


def has_worked(path: Path, pid: int) -> bool:
    """Whether the worker ``pid`` has executed at least one step."""
    conn = sqlite3.connect(path, timeout=30)
    try:
        found = conn.execute("SELECT 1 FROM ledger WHERE pid = ? LIMIT 1", (pid,)).fetchone()
        return found is not None
    finally:
        conn.close()


def ledger_rows(path: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path, timeout=30)
    try:
        return list(
            conn.execute(
                "SELECT run_id, state, visit, attempt, seq, idempotency_key, pid FROM ledger"
            )
        )
    finally:
        conn.close()


# -- workflows ----------------------------------------------------------------------------


def _advance(ctx: CrashCtx, index: int, state: str) -> str:
    ctx.trail.append(state)
    ctx.total += (index + 1) * (ctx.n + 1)
    if state == LOOP_FROM and ctx.laps < 1:
        ctx.laps += 1
        return "again"
    return "next"


def _pause() -> float:
    return (time.perf_counter_ns() % 1000) / 1000 * PAUSE_S


def _step_function(index: int, state: str) -> Callable[..., Any]:
    if index % 2 == 0:

        async def async_step(ctx: CrashCtx, step: Step) -> str:
            record(step)
            await asyncio.sleep(_pause())
            return _advance(ctx, index, state)

        return async_step

    def sync_step(ctx: CrashCtx, step: Step) -> str:
        record(step)
        time.sleep(_pause())
        return _advance(ctx, index, state)

    return sync_step


def crash20() -> Workflow:
    """Twenty steps, alternately async and sync, with one loop back (25 step visits)."""
    wf = Workflow("crash20", context=CrashCtx)
    for index, state in enumerate(STATES):
        nxt = STATES[index + 1] if index + 1 < len(STATES) else "done"
        on = {"next": nxt, "again": LOOP_TO} if state == LOOP_FROM else {"next": nxt}
        wf.step(name=state, initial=index == 0, on=on, retry=CRASH_RETRY)(
            _step_function(index, state)
        )
    wf.final("done")
    return wf


def fragile() -> Workflow:
    """``charge`` is not idempotent and hangs after its effect (the test kills it there)."""
    wf = Workflow("fragile", context=CrashCtx)

    @wf.step(initial=True, next="charge")
    def prepare(ctx: CrashCtx, step: Step) -> None:
        record(step)

    @wf.step(next="done", idempotent=False)
    def charge(ctx: CrashCtx, step: Step) -> None:
        record(step)
        time.sleep(60)  # killed long before

    wf.final("done")
    return wf


def suicide() -> Workflow:
    """``boom`` kills its own process every time."""
    wf = Workflow("suicide", context=CrashCtx)

    @wf.step(initial=True, next="boom")
    def prepare(ctx: CrashCtx, step: Step) -> None:
        record(step)

    @wf.step(next="done", retry=Retry(attempts=SUICIDE_ATTEMPTS, base=0))
    def boom(ctx: CrashCtx, step: Step) -> None:
        record(step)
        os._exit(1)

    wf.final("done")
    return wf


def all_workflows() -> list[Workflow]:
    return [crash20(), fragile(), suicide()]


# -- the worker (a forked child of the zygote) --------------------------------------------


def say(line: str) -> None:
    """One line to stdout in ONE write: the zygote and its workers share the pipe, and
    print() may split a line in two writes that another process's line can come between."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def worker(command: dict[str, Any]) -> int:
    global LEDGER
    LEDGER = Path(command["ledger"])
    with Engine(command["db"], workflows=all_workflows()) as engine:
        say(f"started {os.getpid()}")
        engine.resume()
    say(f"finished {os.getpid()}")
    return 0


def zygote() -> None:
    """Read one JSON command per line; fork a worker for each and print its pid."""
    with contextlib.suppress(ImportError):  # imported once here, not in every worker
        import psycopg  # noqa: F401

    # Warm up what the first use imports or builds lazily (dialects, validators, machines);
    # nothing may be left open: the workers fork from here.
    Engine("sqlite://", workflows=all_workflows()).close()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    say("ready")
    for line in sys.stdin:
        command = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 3
            try:
                code = worker(command)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        say(f"forked {pid}")


# -- the test's side of the harness -------------------------------------------------------


class Zygote:
    """A running zygote process and the lines it (and its workers) print."""

    def __init__(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
            ),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []  # the last lines, for error messages
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.forked: list[int] = []
        self.expect("ready", timeout=30)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, *, timeout: float, pid: int | None = None) -> str:
        """The next line starting with ``prefix`` (for ``pid``, if given); other lines of
        workers already gone are skipped."""
        deadline = time.monotonic() + timeout
        want = prefix if pid is None else f"{prefix} {pid}"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no {want!r} line within {timeout}s (zygote exit code "
                    f"{self.proc.poll()}; last lines: {self.seen[-10:]})"
                )
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            self.seen = [*self.seen[-20:], line]
            if line.startswith(want):
                return line

    def fork(self, db: str, ledger: Path) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"db": db, "ledger": str(ledger)}) + "\n")
        self.proc.stdin.flush()
        pid = int(self.expect("forked", timeout=30).split()[1])
        self.forked.append(pid)
        return pid

    def close(self) -> None:
        for pid in self.forked:
            kill(pid)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def kill(pid: int) -> bool:
    """SIGKILL ``pid`` if it still runs; True when this call killed it."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} still there after {timeout}s")
        time.sleep(0.002)


def zygote_process() -> Iterator[Zygote]:
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:
        raise SystemExit("usage: crashkit.py zygote")
