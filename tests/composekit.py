"""Workflows and a process harness for the composition crash suite
(tests/acceptance/test_compose_crash.py): a saga with 3 compensations, a call, and a map
of 200 children with max_parallel=8.

Every step and every compensation appends ``(kind, run_id, state, attempt, pid)`` to a
side-effect ledger (its own SQLite file) before it returns, so the test sees each execution,
including those a SIGKILL cut off. Workers are forked from a zygote as in crashkit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import crashkit
from pydantic import BaseModel

from flowloop import ChildResult, Engine, Retry, Step, Workflow
from flowloop.errors import Interrupted

LEDGER: Path | None = None
CHILDREN = 200
MAX_PARALLEL = 8
PAUSE_S = 0.002
CRASH_RETRY = Retry(attempts=1_000, backoff="fixed", base=0, cap=0)


def create_ledger(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS ledger (kind TEXT, run_id TEXT, state TEXT, "
            "attempt INTEGER, pid INTEGER)"
        )


def record(kind: str, step: Step) -> None:
    if LEDGER is None:
        return
    with contextlib.closing(sqlite3.connect(LEDGER, timeout=30)) as conn, conn:
        conn.execute(
            "INSERT INTO ledger VALUES (?, ?, ?, ?, ?)",
            (kind, step.run_id, step.state, step.attempt, os.getpid()),
        )


def ledger_rows(path: Path) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
        return list(conn.execute("SELECT kind, run_id, state, attempt, pid FROM ledger"))


def has_worked(path: Path, pid: int) -> bool:
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
        return (
            conn.execute("SELECT 1 FROM ledger WHERE pid = ? LIMIT 1", (pid,)).fetchone()
            is not None
        )


async def pause() -> None:
    await asyncio.sleep(random.uniform(0, PAUSE_S))


class SagaCtx(BaseModel):
    n: int
    done: list[str] = []
    undone: list[str] = []


def saga() -> Workflow:
    wf = Workflow("crash_saga", context=SagaCtx)
    names = ["book_a", "book_b", "book_c"]
    for index, name in enumerate(names):
        nxt = names[index + 1] if index + 1 < len(names) else "fail"

        async def book(ctx: SagaCtx, step: Step, name: str = name) -> None:
            await pause()
            record("step", step)
            ctx.done.append(name)

        async def undo(ctx: SagaCtx, step: Step, name: str = name) -> None:
            await pause()
            record("undo", step)
            ctx.undone.append(name)

        wf.step(
            name=name,
            initial=index == 0,
            next=nxt,
            retry=CRASH_RETRY,
            compensate=undo,
            compensate_retry=CRASH_RETRY,
        )(book)

    # One attempt: cut off by a kill, it has none left, so Interrupted routes it too.
    @wf.step(
        next="ok", retry=Retry(attempts=1), on_error={"*": "cancelled", Interrupted: "cancelled"}
    )
    async def fail(ctx: SagaCtx, step: Step) -> None:
        await pause()
        record("step", step)
        raise RuntimeError(f"saga {ctx.n}: the last step fails")

    wf.final("ok")
    wf.final("cancelled", compensate=True)
    return wf


class Work(BaseModel):
    n: int
    out: int = 0
    trail: list[str] = []


def callee() -> Workflow:
    wf = Workflow("crash_callee", context=Work)

    @wf.step(initial=True, next="second", retry=CRASH_RETRY)
    async def first(ctx: Work, step: Step) -> None:
        await pause()
        record("step", step)
        ctx.trail.append("first")

    @wf.step(next="done", retry=CRASH_RETRY)
    async def second(ctx: Work, step: Step) -> None:
        await pause()
        record("step", step)
        ctx.out = ctx.n * 3

    wf.final("done")
    return wf


def caller(child: Workflow) -> Workflow:
    wf = Workflow("crash_caller", context=Work)
    wf.call(
        "sub",
        child=child,
        context=lambda ctx: Work(n=ctx.n),
        on={"succeeded": "after"},
        result=lambda ctx, sub: setattr(ctx, "out", sub.out),
        initial=True,
    )

    @wf.step(next="done", retry=CRASH_RETRY)
    async def after(ctx: Work, step: Step) -> None:
        await pause()
        record("step", step)
        ctx.trail.append(f"got {ctx.out}")

    wf.final("done")
    return wf


class Item(BaseModel):
    i: int
    sq: int = 0


class Fan(BaseModel):
    count: int
    total: int = 0
    seen: int = 0


def item() -> Workflow:
    wf = Workflow("crash_item", context=Item)

    @wf.step(initial=True, next="done", retry=CRASH_RETRY)
    async def square(ctx: Item, step: Step) -> None:
        await pause()
        record("step", step)
        ctx.sq = ctx.i * ctx.i

    wf.final("done")
    return wf


def mapper(child: Workflow) -> Workflow:
    wf = Workflow("crash_map", context=Fan)

    def reduce(ctx: Fan, results: list[ChildResult[Item]]) -> None:
        ctx.seen = len(results)
        ctx.total = sum(r.context.sq for r in results)

    wf.map(
        "fan",
        child=child,
        items=lambda ctx: range(ctx.count),
        context=lambda ctx, i: Item(i=i),
        max_parallel=MAX_PARALLEL,
        on={"done": "done"},
        reduce=reduce,
        initial=True,
    )
    wf.final("done")
    return wf


def all_workflows() -> list[Workflow]:
    return [saga(), caller(callee()), mapper(item())]


def exit_after_commits(store: Any, count: int) -> None:
    """Make this process die (``os._exit``) right after its ``count``-th committed store
    transaction: a crash at exactly that commit boundary."""
    done = [0]
    for name in ("_write", "_driver"):
        original = getattr(store, name)

        @contextlib.contextmanager
        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with _original(*args, **kwargs) as value:
                yield value
            done[0] += 1
            if done[0] >= count:
                crashkit.say(f"exiting {os.getpid()}")
                os._exit(9)

        setattr(store, name, counted)


def worker(command: dict[str, Any]) -> int:
    global LEDGER
    LEDGER = Path(command["ledger"])
    with Engine(command["db"], workflows=all_workflows()) as engine:
        if command.get("exit_after"):
            exit_after_commits(engine.store, int(command["exit_after"]))
        crashkit.say(f"started {os.getpid()}")
        engine.resume()
    crashkit.say(f"finished {os.getpid()}")
    return 0


def zygote() -> None:
    with contextlib.suppress(ImportError):
        import psycopg  # noqa: F401

    Engine("sqlite://", workflows=all_workflows()).close()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    crashkit.say("ready")
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
        crashkit.say(f"forked {pid}")


class Zygote(crashkit.Zygote):
    """crashkit's zygote harness, forking composekit workers."""

    def fork_exiting(self, db: str, ledger: Path, exit_after: int) -> int:
        """A worker that dies right after its ``exit_after``-th commit."""
        assert self.proc.stdin is not None
        command = {"db": db, "ledger": str(ledger), "exit_after": exit_after}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        pid = int(self.expect("forked", timeout=30).split()[1])
        self.forked.append(pid)
        return pid

    def __init__(self) -> None:
        import queue
        import threading

        here = Path(__file__).resolve()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(here), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.forked: list[int] = []
        self.expect("ready", timeout=30)


if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:
        raise SystemExit("usage: composekit.py zygote")
