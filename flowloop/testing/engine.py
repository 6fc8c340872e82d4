"""TestEngine: the real engine on a temporary SQLite file, with a fake clock that jumps to
the next due timer, in-process crash injection, and step overrides."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import inspect
import math
import os
import random
import shutil
import tempfile
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, TypeVar

from pydantic import BaseModel
from sqlalchemy import make_url

from flowloop import mainloop
from flowloop.clock import FakeClock
from flowloop.definition import StepFunction, Workflow, _wants_step
from flowloop.engine import Engine, RunInfo
from flowloop.errors import DefinitionError, FlowloopError
from flowloop.executor import DEFAULT_LEASE_SECONDS, DEFAULT_MAX_CONCURRENCY, Executor, Stats
from flowloop.loops import Loop
from flowloop.retry import Retry, seconds
from flowloop.specs import check_retry
from flowloop.store import SQLStore
from flowloop.store.dialect import DEFAULT_SYNCHRONOUS
from flowloop.store.loops import LoopEvent
from flowloop.store.urls import normalize_url, sqlite_url
from flowloop.testing import assertions
from flowloop.testing.crash import (
    DRIVING,
    Commit,
    CrashingStore,
    CrashState,
    SimulatedCrash,
    Trigger,
    When,
    _Death,
    at_commit,
    at_state,
    snapshot,
)

T = TypeVar("T")

MAX_JUMPS: Final = 10_000
"""How many times :meth:`TestEngine.run_until_idle` may move the clock to the next due
time before it decides the workflows never go idle (a run sleeping in an endless cycle)."""
RUN_ID_NAMESPACE: Final = uuid.UUID("6f1c9f0e-4a7e-4a43-9b7e-0f10f1005eed")
_KEPT_HOOKS: Final = ("listeners", "direct_listeners", "trace_new", "trace_forget")
"""Engine attributes a resumed test engine carries over from its dead incarnation."""
TEST_POLL_SECONDS: Final = 0.05
"""How often the test engine's heartbeat looks for pause/stop requests (real seconds)."""


class TestEngine(Engine):
    """The real :class:`~flowloop.Engine` for tests: a real SQLite file (WAL, the same
    store and guarantees as production) in a temporary directory unless ``db`` names one,
    driven on a :class:`~flowloop.FakeClock`.

    * :meth:`run_until_idle` jumps the clock to each next due time (a wait's timeout, a
      ``step.sleep``, a retry's backoff) instead of sleeping; :meth:`advance` moves it by a
      given amount, firing everything due on the way, in order.
    * :meth:`crash_at` / :meth:`crash_at_commit` make the engine "die" at a journal point
      as SIGKILL would; :meth:`resume` goes on with a fresh engine on the same database.
    * :meth:`override` swaps one step's function for a test; the definition is unchanged.

    * :meth:`run_loops` drives ``@loop`` schedules slot by slot on the same clock.

    Leases and fencing keep working however far the fake clock jumps: leases are judged by
    the database's clock, due times by the engine's (fake) clock. Run ids are reproducible:
    derived from a run's key or idempotency key when it has one, else (and for a debounced
    or throttled start, whose key has many runs) drawn from a generator seeded with
    ``seed`` — the same test script gives the same ids (and so the same
    ``step.idempotency_key`` values) every time.
    """

    __test__ = False  # a class named Test* is not a pytest test class
    clock: FakeClock

    def __init__(
        self,
        db: str | os.PathLike[str] | None = None,
        *,
        workflows: Iterable[Workflow] = (),
        clock: FakeClock | None = None,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        poll_seconds: float = TEST_POLL_SECONDS,
        synchronous: str = DEFAULT_SYNCHRONOUS,
        seed: int | None = 0,
    ) -> None:
        self._ids = random.Random(seed)
        self._tmpdir: str | None = None
        if db is None:
            self._tmpdir = tempfile.mkdtemp(prefix="flowloop-test-")
            db = Path(self._tmpdir) / "flowloop.db"
        url = normalize_url(os.fspath(db))
        _from_template(url)
        self._crash = CrashState(on_crash=self._stop_driving)
        self._synchronous = synchronous
        self._executors: weakref.WeakSet[Executor] = weakref.WeakSet()
        self._incarnation = 1
        store = CrashingStore(url, state=self._crash, synchronous=synchronous)
        try:
            super().__init__(
                url,
                workflows=workflows,
                clock=clock if clock is not None else FakeClock(),
                max_concurrency=max_concurrency,
                lease_seconds=lease_seconds,
                poll_seconds=poll_seconds,
                worker_id=self._next_worker_id(),
                store=store,
            )
        except BaseException:  # a refused workflow: nothing of this engine is left behind
            store.close()
            if self._tmpdir is not None:
                shutil.rmtree(self._tmpdir, ignore_errors=True)
            raise

    def _new_run_id(self, workflow: str, key: str | None, idempotency_key: str | None) -> str:
        # Reproducible ids, so two runs of one test script get the same ids and hence the
        # same idempotency keys (a crashed run compares with an uninterrupted one field by
        # field): derived from the run's key when it has one (a start repeated after a
        # crash gets the same id), else drawn from a generator seeded with ``seed`` (the
        # engine passes no key for a debounced or throttled start: the key's runs recur).
        if idempotency_key is not None or key is not None:
            name = f"{workflow}\0{key}\0{idempotency_key}"
            return uuid.uuid5(RUN_ID_NAMESPACE, name).hex
        while True:
            # Another engine with the same seed on this database drew the same ones: skip.
            candidate = uuid.UUID(int=self._ids.getrandbits(128), version=4).hex
            if self.store.get_run(candidate) is None:
                return candidate

    def _next_worker_id(self) -> str:
        return f"testengine:{id(self):x}:{self._incarnation}"

    def __enter__(self) -> TestEngine:
        return self

    def close(self) -> None:
        with contextlib.suppress(Exception, _Death):
            super().close()
        self._executors.clear()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- driving on the fake clock ---------------------------------------------------------

    def _new_executor(self, *, max_concurrency: int | None = None) -> Executor:
        executor = super()._new_executor(max_concurrency=max_concurrency)
        self._executors.add(executor)
        return executor

    def run_until_idle(
        self,
        *,
        idle_horizon: float = math.inf,
        skip_time: bool = True,
        max_jumps: int = MAX_JUMPS,
    ) -> Stats:
        """Execute everything due; with ``skip_time`` (default) jump the fake clock to the
        next due time (wait timeouts, durable sleeps, retry backoff) — at most
        ``idle_horizon`` seconds ahead of now — and go on, until nothing is due any more.

        Raises SimulatedCrash when an armed crash point is reached, FlowloopError when the
        runs never go idle (more than ``max_jumps`` jumps: use :meth:`advance`)."""
        mainloop.refuse_inside_a_loop("run_until_idle", "arun_until_idle()")
        return asyncio.run(
            self.arun_until_idle(
                idle_horizon=idle_horizon, skip_time=skip_time, max_jumps=max_jumps
            )
        )

    async def arun_until_idle(
        self,
        *,
        idle_horizon: float = math.inf,
        skip_time: bool = True,
        max_jumps: int = MAX_JUMPS,
    ) -> Stats:
        """:meth:`run_until_idle` inside a running event loop (an async test)."""
        limit = self.clock.now() + idle_horizon if skip_time else -math.inf
        return await self._driving(self._drive(limit=limit, land=None, max_jumps=max_jumps))

    def advance(self, delta: timedelta | float, *, max_jumps: int = MAX_JUMPS) -> Stats:
        """Move the fake clock forward by ``delta`` (a timedelta or seconds), executing on
        the way everything that falls due, in time order, then what is due at the end."""
        mainloop.refuse_inside_a_loop("advance", "aadvance(delta)")
        return asyncio.run(self.aadvance(delta, max_jumps=max_jumps))

    async def aadvance(self, delta: timedelta | float, *, max_jumps: int = MAX_JUMPS) -> Stats:
        """:meth:`advance` inside a running event loop."""
        seconds = delta.total_seconds() if isinstance(delta, timedelta) else float(delta)
        if seconds < 0:
            raise FlowloopError("advance: time only moves forward (got a negative delta)")
        target = self.clock.now() + seconds
        return await self._driving(self._drive(limit=target, land=target, max_jumps=max_jumps))

    async def _drive(self, *, limit: float, land: float | None, max_jumps: int) -> Stats:
        total = Stats()
        for _ in range(max_jumps + 1):
            await self._pass(total)
            due = self.store.next_due(workflows=list(self.workflows))
            # Due but not taken (a lease held elsewhere): nothing more to do in this pass.
            if due is None or due <= self.clock.now() or due > limit:
                break
            self.clock.set(due)
        else:
            raise FlowloopError(
                f"runs still had timers due after {max_jumps} jumps of the clock: a workflow "
                "that never goes idle (a cycle of sleeps?); drive it with advance(…) instead"
            )
        if land is not None and self.clock.now() < land:
            self.clock.set(land)
            await self._pass(total)
        return total

    async def _pass(self, total: Stats) -> None:
        """One executor pass over what is due now (a new executor: a finished one drains)."""
        executor = self._new_executor()
        try:
            stats = await executor.run(until_idle=True, idle_horizon=-math.inf)
        finally:
            executor.close()
        for name, value in dataclasses.asdict(stats).items():
            setattr(total, name, getattr(total, name) + value)

    async def arun(
        self,
        workflow: Workflow,
        context: BaseModel | Mapping[str, Any] | str,
        **options: Any,
    ) -> RunInfo:
        """:meth:`Engine.arun` as "the process" (an armed crash raises SimulatedCrash);
        ``options`` are Engine.arun's (``key``, ``idempotency_key`` …)."""
        return await self._driving(super().arun(workflow, context, **options))

    async def _driving(self, work: Awaitable[T]) -> T:
        """Run engine work as "the process": a crash inside it becomes SimulatedCrash."""
        if self._crash.crashed is not None:
            _close(work)
            raise SimulatedCrash(self._crash.crashed)
        token = DRIVING.set(True)
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()

        def quiet_death(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            # A group commit flushed from a loop callback dies there: the crash, no error.
            if isinstance(context.get("exception"), _Death):
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(quiet_death)
        try:
            return await work
        except _Death:
            raise SimulatedCrash(self._crash.crashed or "earlier") from None
        except asyncio.CancelledError:
            if self._crash.crashed is None:
                raise
            raise SimulatedCrash(self._crash.crashed) from None
        finally:
            loop.set_exception_handler(previous)
            DRIVING.reset(token)

    def _stop_driving(self) -> None:
        """At the crash: every run task of this engine stops where it is (it can write
        nothing more: the store refuses every call)."""
        for executor in self._executors:
            for active in list(executor._active.values()):
                active.task.add_done_callback(_retrieve)
                active.task.cancel()

    def run_loops(
        self, loops: Sequence[Loop], duration: timedelta | float, *, max_jumps: int = MAX_JUMPS
    ) -> list[LoopEvent]:
        """Run ``loops`` (``@loop`` functions or workflow loops) for ``duration`` of fake
        time, as a worker would: each slot fires when the clock reaches it, its iteration
        runs to the end (retries included), then the clock jumps to the next slot. Returns
        the loop journal entries written meanwhile (``iteration_succeeded``, ``missed`` …);
        ``loop(name)`` and ``loop_history(name)`` read the rest."""
        mainloop.refuse_inside_a_loop("run_loops", "arun_loops(loops, duration)")
        return asyncio.run(self.arun_loops(loops, duration, max_jumps=max_jumps))

    async def arun_loops(
        self, loops: Sequence[Loop], duration: timedelta | float, *, max_jumps: int = MAX_JUMPS
    ) -> list[LoopEvent]:
        """:meth:`run_loops` inside a running event loop."""
        from flowloop.testing.loops import drive_loops  # the worker's modules, when needed

        for given in loops:
            if not isinstance(given, Loop):
                raise FlowloopError(
                    f"run_loops takes loops (@loop functions or Loop(...)), not "
                    f"{type(given).__name__} {getattr(given, 'name', given)!r}: a workflow "
                    "runs with run_until_idle; a workflow loop is Loop(name, workflow, ...)"
                )
        seconds = duration.total_seconds() if isinstance(duration, timedelta) else duration
        if seconds < 0:
            raise FlowloopError("run_loops: time only moves forward (got a negative duration)")
        until = self.clock.now() + seconds
        return await self._driving(drive_loops(self, loops, until=until, max_jumps=max_jumps))

    # -- crashes ---------------------------------------------------------------------------

    def crash_at(self, state: str, when: When = "inside", *, occurrence: int = 1) -> None:
        """Arm a crash at ``state``'s journal point (the next drive or start reaching it
        raises SimulatedCrash; then call :meth:`resume`):

        * ``"before"``: just before the commit that starts the state (its
          ``step_started``; for a wait or final state, the transition into it);
        * ``"inside"``: the step function has run, its outcome is not committed (for a
          wait state: the event or timeout it takes is not committed);
        * ``"after"``: just after its outcome is committed.

        ``occurrence`` picks a later visit or attempt (the n-th matching commit)."""
        if not self.workflows:
            raise FlowloopError(
                f"crash_at({state!r}): no workflow is registered yet; register it (or pass "
                "workflows= to TestEngine) first"
            )
        known = [wf for wf in self.workflows.values() if state in wf.states]
        if not known:
            raise DefinitionError(", ".join(self.workflows), f"has no state {state!r} to crash at")
        if when != "before" and all(state in wf.finals for wf in known):
            # Nothing runs or is taken in a final state: only its entry is a commit.
            raise FlowloopError(
                f"crash_at({state!r}, {when!r}): {state!r} is a final state, reached by a "
                "transition: crash 'before' it (or 'after' the state that leads there)"
            )
        is_step = any(state in wf.steps for wf in known)
        self._crash.trigger = at_state(state, when, is_step=is_step, occurrence=occurrence)

    def crash_at_commit(self, number: int, when: str = "after") -> None:
        """Arm a crash just ``"before"`` or ``"after"`` the ``number``-th journal commit of
        this engine (counted from 1 across resumes; see :attr:`commits`)."""
        if when not in ("before", "after"):
            raise FlowloopError(f"crash_at_commit: when must be 'before' or 'after', not {when!r}")
        self._crash.trigger = at_commit(number, "before" if when == "before" else "after")

    def _arm(self, trigger: Trigger) -> None:
        """Arm a crash at any point a :class:`~flowloop.testing.crash.Trigger` names."""
        self._crash.trigger = trigger

    def disarm(self) -> None:
        """Forget an armed crash that has not happened."""
        self._crash.trigger = None

    @property
    def crashed(self) -> str | None:
        """The crash point's description while this engine is dead, else ``None``."""
        return self._crash.crashed

    @property
    def commits(self) -> list[Commit]:
        """Every journal commit this engine made (or was about to make when it crashed
        before one), across resumes, numbered from 1."""
        return list(self._crash.commits)

    def writes_after_crash(self) -> list[str]:
        """While the engine is dead (after a crash, before :meth:`resume`): what reached the
        database after the crash instant — journal entries and run rows that differ from the
        snapshot taken at the crash, one line each. Empty, as after a real SIGKILL."""
        before = self._crash.at_crash
        if self._crash.crashed is None or before is None:
            raise FlowloopError("writes_after_crash: this engine has not crashed (or resumed)")
        store = SQLStore(self.url, create=False, check_schema=False)  # read only
        try:
            entries, rows = snapshot(store)
        finally:
            store.close()
        lines = [f"journal entry written after the crash: {e}" for e in sorted(entries - before[0])]
        lines += [f"journal entry gone after the crash: {e}" for e in sorted(before[0] - entries)]
        changed = {row[0] for row in rows ^ before[1]}
        lines += [f"run row {run_id} changed after the crash" for run_id in sorted(changed)]
        return lines

    def resume(self, *, skip_time: bool = True) -> Stats:
        """After a crash: a fresh engine (new worker id, new connections, nothing of the
        dead one's memory) takes over the database — the dead worker's leases are expired,
        as a restarted worker on its host would see it dead — and drives everything to
        idle like :meth:`run_until_idle` (``skip_time=False``: only what is due now).
        Without a crash it just runs until idle."""
        mainloop.refuse_inside_a_loop("resume", "aresume()")
        if self._crash.crashed is not None:
            self._reincarnate()
        return self.run_until_idle(skip_time=skip_time)

    async def aresume(self, *, skip_time: bool = True) -> Stats:
        """:meth:`resume` inside a running event loop (an async test)."""
        if self._crash.crashed is not None:
            self._reincarnate()
        return await self.arun_until_idle(skip_time=skip_time)

    def _reincarnate(self) -> None:
        dead = self.worker_id
        workflows = list(self.workflows.values())
        # The test's own hooks (listeners; tracing's, where the engine has them) are the
        # test's, not the dead process's state: the new incarnation keeps them.
        hooks = {name: getattr(self, name) for name in _KEPT_HOOKS if hasattr(self, name)}
        with contextlib.suppress(Exception, _Death):
            Engine.close(self)  # the dead store refuses writes: closing writes nothing
        self._executors = weakref.WeakSet()
        self._incarnation += 1
        store = CrashingStore(
            self.url, state=self._crash, synchronous=self._synchronous, check_schema=False
        )
        store.expire_leases([dead])
        store.expire_loop_leases([dead])
        self._crash.crashed = None
        Engine.__init__(
            self,
            self.url,
            workflows=workflows,
            clock=self.clock,
            max_concurrency=self.max_concurrency,
            lease_seconds=self.lease_seconds,
            poll_seconds=self.poll_seconds,
            worker_id=self._next_worker_id(),
            store=store,
        )
        for name, value in hooks.items():
            if isinstance(value, list):
                getattr(self, name).extend(value)
            else:
                setattr(self, name, value)

    # -- step overrides --------------------------------------------------------------------

    @contextlib.contextmanager
    def override(
        self,
        workflow: Workflow | str,
        state: str,
        function: StepFunction | None = None,
        *,
        retry: Retry | None = None,
        timeout: float | timedelta | None = None,
    ) -> Iterator[Workflow]:
        """Replace ``state``'s step function with ``function`` (sync or async, ``(ctx)`` or
        ``(ctx, step)``) — and/or its ``retry`` policy or ``timeout`` — inside the ``with``
        block; restored after. The definition's structure (states, transitions) and so its
        fingerprint stay the same: runs started before continue under the override and
        back.

        The swap is made on the Workflow object itself: in the block, every engine of this
        process that runs the workflow uses it."""
        wf = self.workflow(workflow) if isinstance(workflow, str) else workflow
        if wf.name not in self.workflows:
            self.register(wf)
        steps = wf._draft.steps  # the definition's own table (as Workflow.tune_step edits)
        original = steps.get(state)
        if original is None:
            raise DefinitionError(
                wf.name, f"has no step {state!r} to override (steps: {', '.join(wf.steps)})"
            )
        _check_override(wf.name, state, function, retry, timeout)
        replacement = original
        if function is not None:
            replacement = dataclasses.replace(
                replacement,
                fn=function,
                is_async=inspect.iscoroutinefunction(function),
                wants_step=_wants_step(wf.name, state, function),
            )
        if retry is not None:
            replacement = dataclasses.replace(replacement, retry=retry)
        if timeout is not None:
            replacement = dataclasses.replace(replacement, timeout=seconds(timeout))
        steps[state] = replacement
        try:
            yield wf
        finally:
            steps[state] = original

    # -- reading the journal ---------------------------------------------------------------

    def path(self, run: assertions.RunRef) -> list[str]:
        """The states ``run`` entered, in order (see :func:`flowloop.testing.path`)."""
        return assertions.path(self, run)

    def attempts(
        self, run: assertions.RunRef, state: str | None = None
    ) -> list[assertions.Attempt]:
        """Every attempt of the run's steps (of ``state`` only, if given)."""
        return assertions.attempts(self, run, state)

    def context_at(self, run: assertions.RunRef, seq: int) -> dict[str, Any]:
        """The run's context after journal entry ``seq``."""
        return assertions.context_at(self, run, seq)


def _check_override(
    workflow: str,
    state: str,
    function: object,
    retry: object,
    timeout: float | timedelta | None,
) -> None:
    """Refuse what the definition itself refuses: else the test fails later, at the step
    (a retry that is no Retry took the engine down mid-run)."""
    if function is not None and not callable(function):
        raise DefinitionError(
            workflow,
            f"state {state!r}: the override must be a function taking (ctx) or (ctx, step), "
            f"not {type(function).__name__}",
        )
    check_retry(workflow, state, "retry", retry)
    limit = seconds(timeout, "timeout")
    if limit is not None and limit <= 0:
        raise DefinitionError(workflow, f"state {state!r}: timeout must be positive")


_TEMPLATE: list[Path] = []
"""A SQLite file holding an empty schema at head, made once per process."""


def _from_template(url: str) -> None:
    """Create a new SQLite database file as a copy of a schema-ready template: building
    the schema through the migrations costs tens of milliseconds, a copy almost nothing
    (the crash sweep makes a database per crash point). Other URLs are left alone."""
    parsed = make_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return
    if database.startswith("file:") or Path(database).exists():
        return
    if not _TEMPLATE or not _TEMPLATE[0].exists():
        folder = tempfile.mkdtemp(prefix="flowloop-template-")
        atexit.register(shutil.rmtree, folder, True)
        template = Path(folder) / "template.db"
        SQLStore(sqlite_url(template)).close()  # the last close checkpoints the WAL
        _TEMPLATE[:] = [template]
    if not Path(database).parent.is_dir():
        return  # the store reports the missing directory
    data = _TEMPLATE[0].read_bytes()
    # Readable by the owner only, as the store creates its files.
    fd = os.open(database, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a dead run task's exception (the crash itself) as seen: it is no error."""
    if not task.cancelled():
        task.exception()


def _close(work: Awaitable[Any]) -> None:
    """Close a coroutine that will not run (avoids the "never awaited" warning)."""
    close: Callable[[], None] | None = getattr(work, "close", None)
    if close is not None:
        close()
