"""The crash-test kit: real worker processes, SIGKILLed where a test wants, then resumed
and compared. Used by every crash test: tests/acceptance/test_crash.py (the workflows
below), test_compose_crash.py (composekit), test_etl_crash.py and
test_etl_readings_crash.py (etlkit).

* **Zygote.** Starting Python and importing flowloop takes about half a second, so a test
  keeps one zygote process (``python tests/KIT.py zygote ARGS``, which calls :func:`serve`)
  that imports everything once and forks a fresh worker per command (a JSON object a
  line). It prints ``ready``, then ``forked <pid>`` per command, and ``exit <pid> <code>``
  when a worker is gone (a negative code is the signal that ended it). A forked worker is a
  new process with its own pid, so the next worker's recovery sees a dead owner on this
  host and takes its runs over at once. :func:`resume` is the usual worker.
* **Killing.** :func:`kill_when` waits (bounded) until a worker has reached a point — a
  predicate over the ledger or the database — and a chosen moment more, SIGKILLs it and
  waits until it is gone; :func:`kill_repeatedly` does that round after round at random
  instants; :func:`exit_after_commits` makes a worker die right after its N-th commit.
* **Ledger.** Steps append an :class:`Execution` to a side-effect ledger (its own SQLite
  file) before they return, so a test sees each execution that happened, including those
  whose outcome a kill cut off.
* **Replaying.** :func:`seed` and :func:`replayable`: a failure names the seed that replays
  its schedule of kills. :func:`final_contexts`: what uninterrupted runs end with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final, NamedTuple

from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow

TESTS: Final = Path(__file__).resolve().parent
ROOT: Final = TESTS.parent
DEADLINE_S: Final = 30.0
"""How long a worker may take to reach a point a test waits for (a bound, not a pace)."""
POLL_S: Final = 0.002
EXITED_AFTER_COMMITS: Final = 9
"""The exit code of a worker that :func:`exit_after_commits` ended."""

STATES = [f"s{i:02d}" for i in range(1, 21)]
LOOP_FROM, LOOP_TO = "s18", "s14"
"""s18 sends each run back to s14 once: visits greater than one are exercised too."""
VISITS_PER_RUN = len(STATES) + STATES.index(LOOP_FROM) - STATES.index(LOOP_TO) + 1
CRASH_RETRY = Retry(attempts=1_000, backoff="fixed", base=0, cap=0)
"""Interruptions count as attempts; a run may be cut off in the same step many times."""
SUICIDE_ATTEMPTS = 3
UNDO_SUICIDE_ATTEMPTS = 2

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


class Execution(NamedTuple):
    """One execution of a step (``kind`` "step") or of a compensation ("undo")."""

    kind: str
    run_id: str
    state: str
    visit: int
    attempt: int
    seq: int
    idempotency_key: str
    pid: int


def create_ledger(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("DROP TABLE IF EXISTS ledger")
        conn.execute(
            "CREATE TABLE ledger (kind TEXT, run_id TEXT, state TEXT, visit INTEGER,"
            " attempt INTEGER, seq INTEGER, idempotency_key TEXT, pid INTEGER)"
        )


def record(step: Step, kind: str = "step") -> None:
    """Append this execution of ``step`` to the ledger (if the process has one)."""
    if LEDGER is None:
        return
    with contextlib.closing(sqlite3.connect(LEDGER, timeout=30)) as conn:
        conn.execute("PRAGMA synchronous=OFF")  # survives a killed process, which is the point
        with conn:
            conn.execute(
                "INSERT INTO ledger VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    kind,
                    step.run_id,
                    step.state,
                    step.visit,
                    step.attempt,
                    step.seq,
                    step.idempotency_key,
                    os.getpid(),
                ),
            )


def ledger_rows(path: Path) -> list[Execution]:
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
        return [Execution(*row) for row in conn.execute("SELECT * FROM ledger")]


def has_worked(path: Path, pid: int) -> bool:
    """Whether the worker ``pid`` has executed at least one step."""
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
        found = conn.execute("SELECT 1 FROM ledger WHERE pid = ? LIMIT 1", (pid,)).fetchone()
    return found is not None


def executions(path: Path, run_id: str, state: str) -> list[Execution]:
    """The executions of ``state`` of ``run_id`` so far (each one's effect happened)."""
    return [e for e in ledger_rows(path) if e.run_id == run_id and e.state == state]


# -- workflows ----------------------------------------------------------------------------


def _advance(ctx: CrashCtx, index: int, state: str) -> str:
    ctx.trail.append(state)
    ctx.total += (index + 1) * (ctx.n + 1)
    if state == LOOP_FROM and ctx.laps < 1:
        ctx.laps += 1
        return "again"
    return "next"


def pause_s() -> float:
    """A pause of up to PAUSE_S for a step to hold still in, different in every call (from
    the clock: the random module's state is the same in every worker forked)."""
    return (time.perf_counter_ns() % 1000) / 1000 * PAUSE_S


def _step_function(index: int, state: str) -> Callable[..., Any]:
    if index % 2 == 0:

        async def async_step(ctx: CrashCtx, step: Step) -> str:
            record(step)
            await asyncio.sleep(pause_s())
            return _advance(ctx, index, state)

        return async_step

    def sync_step(ctx: CrashCtx, step: Step) -> str:
        record(step)
        time.sleep(pause_s())
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


def undo_suicide() -> Workflow:
    """``charge``'s compensation kills its own process every time (while ``ctx.n`` is not
    0): ``fail`` routes the run into the compensating ``cancelled``."""
    wf = Workflow("undo_suicide", context=CrashCtx)

    def refund(ctx: CrashCtx, step: Step) -> None:
        record(step, kind="undo")
        if ctx.n:
            os._exit(1)
        ctx.trail.append("refunded")

    @wf.step(
        initial=True,
        next="fail",
        compensate=refund,
        compensate_retry=Retry(attempts=UNDO_SUICIDE_ATTEMPTS, base=0),
    )
    def charge(ctx: CrashCtx, step: Step) -> None:
        record(step)

    @wf.step(next="done", retry=Retry(attempts=1), on_error={"*": "cancelled"})
    def fail(ctx: CrashCtx) -> None:
        raise RuntimeError("declined")

    wf.final("done")
    wf.final("cancelled", compensate=True)
    return wf


def all_workflows() -> list[Workflow]:
    return [crash20(), fragile(), suicide(), undo_suicide()]


# -- the zygote and its workers (worker side) ---------------------------------------------


def say(line: str) -> None:
    """One line to stdout in ONE write: the zygote and its workers share the pipe, and
    print() may split a line in two writes that another process's line can come between."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def _report_exits(signum: int, frame: FrameType | None) -> None:
    # SIGCHLD: reap every worker that is gone and say how it ended.
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


def serve(worker: Callable[[dict[str, Any]], int], warm: Callable[[], None] | None = None) -> None:
    """The zygote: ``warm()`` once (import and build what workers use: they fork from here,
    so nothing may be left open), then for each JSON command line fork a worker that runs
    ``worker(command)`` and exits with its result (3 and a traceback if it raises)."""
    with contextlib.suppress(ImportError):  # imported once here, not in every worker
        import psycopg  # noqa: F401

    if warm is not None:
        warm()
    signal.signal(signal.SIGCHLD, _report_exits)
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
                os._exit(EXITED_AFTER_COMMITS)

        setattr(store, name, counted)
    immediate = store._immediate  # SQLite's creation and row writes (store/immediate.py)

    def counted_immediate(body: Any) -> Any:
        value = immediate(body)
        done[0] += 1
        if done[0] >= count:
            os._exit(EXITED_AFTER_COMMITS)
        return value

    store._immediate = counted_immediate


def resume(command: Mapping[str, Any], workflows: Sequence[Workflow]) -> int:
    """The usual worker: resume every run in ``command["db"]`` with ``workflows`` to the
    end, steps recording to ``command["ledger"]``; with ``command["exit_after"]`` it dies
    right after that many commits."""
    global LEDGER
    LEDGER = Path(command["ledger"]) if command.get("ledger") else None
    with Engine(command["db"], workflows=list(workflows)) as engine:
        if command.get("exit_after"):
            exit_after_commits(engine.store, int(command["exit_after"]))
        say(f"started {os.getpid()}")
        engine.resume()
    say(f"finished {os.getpid()}")
    return 0


# -- the test's side ----------------------------------------------------------------------


class Zygote:
    """A running ``python tests/KIT.py zygote ARGS`` and what it (and its workers) print."""

    def __init__(self, kit: str = "crashkit", *args: str) -> None:
        path = [str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / f"{kit}.py"), "zygote", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(path)},
            cwd=ROOT,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: deque[str] = deque(maxlen=20)  # the last lines, for error messages
        self.exits: dict[int, int] = {}
        self._exited = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.forked: list[int] = []
        self.expect("ready", timeout=DEADLINE_S)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.strip()
            self.seen.append(line)
            if line.startswith("exit "):
                _, pid, code = line.split()
                with self._exited:
                    self.exits[int(pid)] = int(code)
                    self._exited.notify_all()
            else:
                self.lines.put(line)
        with self._exited:  # the zygote is gone: nobody waits for an exit line in vain
            self._exited.notify_all()

    def _trouble(self) -> str:
        return f"zygote exit code {self.proc.poll()}; last lines: {list(self.seen)[-10:]}"

    def expect(self, prefix: str, *, timeout: float, pid: int | None = None) -> str:
        """The next line starting with ``prefix`` (for ``pid``, if given); other lines of
        workers already gone are skipped."""
        deadline = time.monotonic() + timeout
        want = prefix if pid is None else f"{prefix} {pid}"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {want!r} line within {timeout}s ({self._trouble()})")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line.startswith(want):
                return line

    def fork(self, **command: Any) -> int:
        """A new worker running ``command`` (keyword arguments, sent as JSON); its pid."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        pid = int(self.expect("forked", timeout=DEADLINE_S).split()[1])
        self.forked.append(pid)
        return pid

    def exit_code(self, pid: int, timeout: float = DEADLINE_S) -> int:
        """How worker ``pid`` ended, once it has (negative: killed by that signal)."""
        with self._exited:
            ended = self._exited.wait_for(
                lambda: pid in self.exits or not self._reader.is_alive(), timeout
            )
            if not ended or pid not in self.exits:
                raise TimeoutError(
                    f"worker {pid} did not end within {timeout}s ({self._trouble()})"
                )
            return self.exits[pid]

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

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def zygote_process(kit: str = "crashkit", *args: str) -> Iterator[Zygote]:
    """A zygote for a (module-scoped) fixture: ``yield from crashkit.zygote_process()``."""
    with Zygote(kit, *args) as zygote:
        yield zygote


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
        time.sleep(POLL_S)


def wait_for(
    reached: Callable[[], bool], *, pid: int, timeout: float = DEADLINE_S, what: str = ""
) -> bool:
    """Until ``reached()`` holds (True) or process ``pid`` has ended first (False); an
    AssertionError when neither happens within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not reached():
        if not alive(pid):
            return reached()
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {pid}: {what or 'the point'} not reached in {timeout}s")
        time.sleep(POLL_S)
    return True


def kill_when(
    pid: int,
    reached: Callable[[], bool],
    *,
    delay: float = 0.0,
    timeout: float = DEADLINE_S,
    what: str = "",
) -> bool:
    """SIGKILL worker ``pid`` once ``reached()`` holds, ``delay`` seconds later, and wait
    until it is gone. True when this call killed it (False: it had ended by itself)."""
    wait_for(reached, pid=pid, timeout=timeout, what=what)
    if delay > 0:
        time.sleep(delay)  # the random instant of the kill, not a wait for anything
    killed = kill(pid)
    wait_gone(pid)
    return killed


def kill_repeatedly(
    zygote: Zygote,
    command: Mapping[str, Any],
    *,
    kills: int,
    rng: random.Random,
    max_delay: float,
    working: Callable[[int], bool],
    more: Callable[[], bool] = lambda: True,
    wait_share: float = 1.0,
) -> int:
    """Round after round: ``more()`` (False: nothing left to do, stop), fork a worker with
    ``command``, SIGKILL it at a random instant up to ``max_delay`` after ``working(pid)``
    holds (in a ``wait_share`` of the rounds; in the others wherever it is, starting up
    included). Until ``kills`` workers were killed, at most 5 * ``kills`` rounds. Returns
    how many were killed (a worker may finish before its kill)."""
    killed = 0
    for _ in range(5 * kills):
        if killed >= kills or not more():
            break
        pid = zygote.fork(**command)
        wait = rng.random() < wait_share
        at_work = (lambda pid=pid: working(pid)) if wait else (lambda: True)
        if kill_when(pid, at_work, delay=rng.uniform(0, max_delay), what="a step run"):
            killed += 1
    return killed


# -- replaying and comparing --------------------------------------------------------------


def seed(env: str = "FLOWLOOP_CRASH_SEED") -> int:
    """The seed of a random crash schedule: ``$env`` when set (to replay one), else new."""
    given = os.environ.get(env)
    return int(given) if given else random.SystemRandom().randrange(1 << 30)


@contextlib.contextmanager
def replayable(seed: int, env: str = "FLOWLOOP_CRASH_SEED") -> Iterator[None]:
    """Any failure inside names the seed that replays its schedule."""
    try:
        yield
    except BaseException as error:
        error.add_note(f"{env}={seed} replays this schedule")
        raise


def final_contexts(
    db: Path, workflows: Sequence[Workflow], start: Callable[[Engine], Sequence[str]]
) -> list[BaseModel | None]:
    """The final contexts of the runs ``start(engine)`` starts (their ids, in order), run
    uninterrupted on a fake clock in a database of their own: what the crashed runs must
    end with."""
    with Engine(str(db), clock=FakeClock(), workflows=list(workflows)) as engine:
        ids = start(engine)
        engine.run_until_idle()
        return [engine.get(run_id).context for run_id in ids]


def main() -> None:
    if sys.argv[1:] != ["zygote"]:
        raise SystemExit("usage: crashkit.py zygote")
    # Warm up what the first use imports or builds lazily (dialects, validators, machines).
    serve(
        lambda command: resume(command, all_workflows()),
        warm=lambda: Engine("sqlite://", workflows=all_workflows()).close(),
    )


if __name__ == "__main__":
    import crashkit  # the kit as the workers import it, not a second copy named __main__

    crashkit.main()
