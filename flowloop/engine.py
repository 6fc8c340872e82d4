"""The public facade: start runs, drive them, look at them, and act on them as an operator.

:class:`Engine` starts, drives and reads runs here; what an operator does to runs is
flowloop/operations.py and to loops flowloop/engine_loops.py (mixed in); what users get
back is flowloop/runinfo.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, TypeVar

from pydantic import BaseModel

from flowloop import frozen, gates, mainloop, runids, starts, tracecontext
from flowloop import journal as j
from flowloop.admission import AdmissionError
from flowloop.clock import Clock, SystemClock
from flowloop.dbclock import DatabaseClock
from flowloop.definition import Workflow
from flowloop.driving import drive_family, refuse_a_held_back_run
from flowloop.engine_loops import LoopControls
from flowloop.errors import (
    FlowloopError,
    InvalidContext,
    UnknownWorkflow,
)
from flowloop.events import (
    entering,
)
from flowloop.executor import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_POLL_SECONDS,
    IDLE_HORIZON_SECONDS,
    Executor,
    Listener,
    Stats,
    new_worker_id,
)
from flowloop.flowcontrol import limit_key_of
from flowloop.freshstack import steady_call
from flowloop.holding import (
    HELD,
    claimed_later,
    database_of,
    queued,
    refuse_held_back,
)
from flowloop.journal import RunRecord
from flowloop.limits import check_finite, check_key, check_priority, check_run_at
from flowloop.operations import Operations
from flowloop.reading import RunReading
from flowloop.retry import seconds
from flowloop.runinfo import (
    INVALID_JSON_KEY,
    Replay,
    RunInfo,
    SendResult,
    StartedRuns,
    Stranded,
    info_of,
)
from flowloop.stepping import SYNC_STEPS_INLINE, in_inline_step
from flowloop.store import (
    NewRun,
    SQLStore,
    Store,
)
from flowloop.store.dialect import DEFAULT_SYNCHRONOUS
from flowloop.store.urls import DEFAULT_URL, ENV_DB, default_url, normalize_url
from flowloop.versions import Registry

__all__ = [
    "DEFAULT_URL",
    "ENV_DB",
    "INVALID_JSON_KEY",
    "START_BATCH",
    "Engine",
    "Replay",
    "RunInfo",
    "SendResult",
    "StartedRuns",
    "Stranded",
    "default_url",
]

if TYPE_CHECKING:
    import graphviz


START_BATCH: Final = 1_000
"""Runs per transaction in :meth:`Engine.start_many`: few commits, short write locks."""
T = TypeVar("T")


class Engine(Operations, LoopControls, RunReading):
    """flowloop over one database.

    ``url`` is a SQLAlchemy URL or a file path; default ``$FLOWLOOP_DB`` or ``./flowloop.db``
    (SQLite, WAL). ``synchronous`` is SQLite's durability mode: ``NORMAL`` (default) survives
    process crashes, ``FULL`` also survives power loss at the price of an fsync per commit.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        workflows: Iterable[Workflow] = (),
        clock: Clock | None = None,
        max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        poll_seconds: float = DEFAULT_POLL_SECONDS,
        synchronous: str = DEFAULT_SYNCHRONOUS,
        worker_id: str | None = None,
        store: Store | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise FlowloopError("max_concurrency must be at least 1")
        for what, value in (("lease_seconds", lease_seconds), ("poll_seconds", poll_seconds)):
            if (seconds(value, what) or 0.0) <= 0:
                raise FlowloopError(f"{what}={value!r}: must be positive")
        self.url = normalize_url(url) if url else default_url()
        self.store: Store = store or SQLStore(self.url, synchronous=synchronous)
        try:
            self._set_up(workflows, clock, max_concurrency, lease_seconds, poll_seconds, worker_id)
        except BaseException:
            if store is None:  # ours: not left open (and its threads running) by a failure
                self.store.close()
            raise

    def _set_up(
        self,
        workflows: Iterable[Workflow],
        clock: Clock | None,
        max_concurrency: int,
        lease_seconds: float,
        poll_seconds: float,
        worker_id: str | None,
    ) -> None:
        self.clock: Clock = clock or self._default_clock()
        self.max_concurrency = max_concurrency
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.worker_id = worker_id or new_worker_id()
        if isinstance(self.store, SQLStore):
            self.store.set_write_lease(lease_seconds)
        self.listeners: list[Listener] = []
        self.direct_listeners: list[Listener] = []
        """Told of what this engine writes itself, outside an executor: a run it creates
        (``start``/``run``), an event sent to a waiting run, an operator's pause, stop or
        retry. Tracing needs them."""
        self.trace_new: Callable[[str, Mapping[str, str] | None], Mapping[str, Any]] | None = None
        """Set by ``flowloop.tracing.instrument``: ``(run_id, trace_context)`` → the trace
        context a new run journals (the caller's current span when none is given);
        ``None``: tracing is off."""
        self.trace_forget: Callable[[str], None] | None = None
        """Set with :attr:`trace_new`: forgets the trace of a new run that was not made
        (its key found another run, or the call was refused)."""
        self._workflows = Registry()
        self._thread_executors: mainloop.PerThread[Executor] = mainloop.PerThread(Executor.close)
        self._listening = threading.RLock()
        """Held while a thread's executor copies the listeners and is kept, and while a
        listener is added to the executors kept (:meth:`listen`): neither misses the other."""
        self._loops = mainloop.ThreadLoops()
        self.register(*workflows)

    def _default_clock(self) -> Clock:
        """The system clock; on PostgreSQL corrected to the server's (see flowloop.dbclock)."""
        store = self.store
        if not isinstance(store, SQLStore) or store.engine.dialect.name != "postgresql":
            return SystemClock()
        clock = DatabaseClock(store.db_now)
        with contextlib.suppress(Exception):  # unreachable now: measured at the next sweep
            clock.refresh()
        return clock

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._loops.close()
        self._thread_executors.close()
        self.store.close()

    # -- workflows -------------------------------------------------------------------------

    def register(self, *workflows: Workflow, save: bool = True) -> None:
        """Make workflows runnable by this engine (validates them) and store their
        definitions; ``save=False``: known to this engine only (a command that reads)."""
        for workflow in workflows:
            workflow.validate()
            for child in workflow.children:  # a parent's children run where it runs
                if self._workflows.get(child.name) is not child:
                    self.register(child, save=save)
            if save:
                self.store.save_definition(
                    workflow.fingerprint,
                    workflow.name,
                    workflow.version,
                    json.dumps(workflow.definition_record(), sort_keys=True),
                )
            self._workflows.add(workflow)
        gates.share_limits(self.store, self._workflows)

    @property
    def workflows(self) -> Mapping[str, Workflow]:
        """The newest registered version of each workflow, by name."""
        return dict(self._workflows)

    def versions_of(self, name: str) -> list[Workflow]:
        """Every registered version of workflow ``name``, oldest first (several live)."""
        return self._workflows.versions(name)

    def version_of(self, name: str, version: int) -> Workflow:
        """The registered ``version`` of workflow ``name``; UnknownWorkflow otherwise."""
        found = self._workflows.version(name, version)
        if found is None and not self.versions_of(name):  # (misspelt, or not loaded at all)
            known = ", ".join(sorted(self.workflows)) or "none"
            raise FlowloopError(
                f"no workflow {name!r} is loaded (loaded: {known}); load the file that "
                "defines it (-w)"
            )
        if found is None:
            loaded = ", ".join(f"v{w.version}" for w in self.versions_of(name)) or "none"
            raise FlowloopError(
                f"workflow {name!r} version {version} is not loaded (loaded: {loaded}); "
                "load the file that defines it (-w)"
            )
        return found

    def _workflow_for(self, record: RunRecord) -> Workflow | None:
        """The registered definition a stored run follows (its own version while it is
        registered, else the newest); ``None`` when its workflow is not registered."""
        if record.workflow not in self._workflows:
            return None
        return self._workflows.for_run(record)

    def workflow(self, name: str) -> Workflow:
        try:
            return self._workflows[name]
        except KeyError:
            raise UnknownWorkflow(name, self._workflows) from None

    # -- starting --------------------------------------------------------------------------

    def _new_run(
        self,
        workflow: Workflow,
        context: BaseModel | Mapping[str, Any] | str,
        *,
        key: str | None,
        idempotency_key: str | None,
        priority: int,
        run_at: float | datetime | None,
        owner: str | None,
        trace_context: Mapping[str, str] | None = None,
        recurring: bool = False,
    ) -> NewRun:
        if not self._workflows.holds(workflow):
            self.register(workflow)
        ctx = workflow.parse_new_context(context)
        now = self.clock.now()
        run_at, priority = check_run_at(run_at, now), check_priority(priority)
        business_key = check_key("key", key if key is not None else workflow.business_key(ctx))
        # (An empty one is none, as the store looks runs up: kept, a second start with
        # it broke the unique index instead of finding the first.)
        idempotency_key = check_key("idempotency key", idempotency_key) or None
        limit_key = limit_key_of(workflow, ctx)
        text = ctx.model_dump_json()
        # Checked once its text is made: the check encodes a dump, which would exhaust an
        # iterator (a field typed Iterable) that the text must still hold. (What such a
        # field yields is not checked: it is read once, by the text.)
        check_finite("context", ctx.model_dump())
        # A debounced/throttled run does not own its key (its runs recur): no id from it.
        id_key = None if recurring else business_key
        run_id = self._new_run_id(workflow.name, id_key, idempotency_key)
        initial = workflow.initial
        data = {
            "workflow": workflow.name,
            "version": workflow.version,
            "fingerprint": workflow.fingerprint,
            "key": business_key,
            "due": self._first_due(workflow, now, run_at),
            **workflow.context_stamp(),
        }
        if limit_key is not None:
            data["limit_key"] = limit_key
        if workflow.deadline:  # the whole run's deadline: a durable due time
            data["deadline"] = now + workflow.deadline
        data.update(self._trace_data(run_id, trace_context))
        created = j.new_event(
            {
                "run_id": run_id,
                "seq": 1,
                "kind": j.RUN_CREATED,
                "at": now,
                "state": initial,
                "context": text,
                "worker": self.worker_id,
                "data": data,
            }
        )
        events = [created]
        record = j.create(created)
        if owner is not None and initial in workflow.steps:
            started = j.new_event(
                {
                    "run_id": run_id,
                    "seq": 2,
                    "kind": j.STEP_STARTED,
                    "at": now,
                    "state": initial,
                    "attempt": 1,
                    "worker": owner,
                }
            )
            events.append(started)
            record = j.apply(record, started)
        return frozen.build(  # NewRun(...) without its generated __init__ (one per run)
            NewRun,
            {
                "record": record,
                "events": events,
                "idempotency_key": idempotency_key,
                "priority": priority,
                "owner": owner,
                "lease_seconds": self.lease_seconds,
                "limit_key": limit_key,
            },
        )

    def _trace_data(self, run_id: str, carrier: Mapping[str, str] | None) -> dict[str, Any]:
        """The run's trace context for its ``run_created`` data: nothing (and no cost) while
        tracing is off and no context is given."""
        if self.trace_new is not None:
            return {tracecontext.TRACE_KEY: self.trace_new(run_id, carrier)}
        if carrier is None:
            return {}
        return {tracecontext.TRACE_KEY: tracecontext.new_run_trace(carrier).to_data()}

    def _new_run_id(self, workflow: str, key: str | None, idempotency_key: str | None) -> str:
        """A new run's id: time-ordered, random after the millisecond (flowloop.runids;
        flowloop.testing's TestEngine makes it reproducible)."""
        return runids.new_run_id()

    @staticmethod
    def _first_due(workflow: Workflow, now: float, run_at: float | None) -> float | None:
        """When a new run is first due: ``run_at``/now for a step, the timeout (or never)
        for a wait state."""
        start = run_at if run_at is not None else now
        if workflow.initial in workflow.waits:
            due: float | None = entering(workflow, workflow.initial, start)["due"]
            return due
        return start

    def start(
        self,
        workflow: Workflow,
        context: BaseModel | Mapping[str, Any] | str,
        *,
        key: str | None = None,
        idempotency_key: str | None = None,
        priority: int = 0,
        run_at: float | datetime | None = None,
        trace_context: Mapping[str, str] | None = None,
        debounce: float | timedelta | None = None,
        throttle: tuple[int, float | timedelta] | None = None,
    ) -> RunInfo:
        """Enqueue a run (a worker or :meth:`run_until_idle` executes it).

        Starting with a ``key`` (or the workflow's key field) or ``idempotency_key`` that an
        existing run has returns that run instead of creating another. ``trace_context``: a
        W3C carrier (``{"traceparent": ...}``) whose span the run's trace span is a child
        of (see ``flowloop.tracing``); stored with the run, so it survives a crash.

        ``debounce`` (seconds or a timedelta) turns a burst of starts with one ``key`` into
        one run with the last context, due that long after the last start; ``throttle=(n,
        period)`` refuses (:class:`~flowloop.admission.StartThrottled`) more than ``n``
        starts with one key per period. See :mod:`flowloop.admission`.
        """
        if debounce is not None or throttle is not None:
            if idempotency_key is not None or run_at is not None:
                raise AdmissionError(
                    "debounce=/throttle= decide the due time and identity: "
                    "drop idempotency_key= and run_at="
                )
            return self._info(
                starts.admitted_start(
                    self,
                    workflow,
                    context,
                    key=key,
                    priority=priority,
                    debounce=debounce,
                    throttle=throttle,
                    trace_context=trace_context,
                )
            )
        new = self._new_run(
            workflow,
            context,
            key=key,
            idempotency_key=idempotency_key,
            priority=priority,
            run_at=run_at,
            owner=None,
            trace_context=trace_context,
        )
        with self._making(new):
            if workflow.bounds.max_queued is not None:
                stored, created = starts.bounded_start(self, workflow, new)  # backpressure
            else:
                stored, created = self.store.create_run(new)
        if not created:
            self._unmade(new)
            starts.refuse_foreign(stored, workflow, new)
        elif self.direct_listeners:
            self._tell_created(new)
        return self._info(stored)

    def _unmade(self, new: NewRun) -> None:
        """A new run that is not made (found by its key, or refused): its trace is not
        kept (each such start left one behind until the table was cleared)."""
        if self.trace_forget is not None:
            self.trace_forget(new.record.id)

    @contextlib.contextmanager
    def _making(self, new: NewRun) -> Iterator[None]:
        """:meth:`_unmade` when making ``new`` raises (a queue full, a throttle, the
        database): forgetting a trace is always safe (a run's is read back if need be)."""
        try:
            yield
        except BaseException:
            self._unmade(new)
            raise

    def start_many(
        self,
        workflow: Workflow,
        contexts: Iterable[BaseModel | Mapping[str, Any] | str],
        *,
        priority: int = 0,
        run_at: float | datetime | None = None,
        batch_size: int = START_BATCH,
        progress: Callable[[int, int], None] | None = None,
    ) -> StartedRuns:
        """Enqueue one run per context (fan-out: a run per order, per file), ``batch_size``
        runs per transaction instead of a commit each.

        Every context is validated before anything is written: an invalid one raises
        InvalidContext naming its position (from 1). A context whose business key an
        existing run — or an earlier context of the list — has gets that run back, as with
        :meth:`start`, so starting the same list again after a crash adds only what is
        missing. ``progress(done, total)`` is called after each committed batch.
        """
        if batch_size < 1:
            raise FlowloopError("batch_size must be at least 1")
        news = []
        for position, context in enumerate(contexts, 1):
            try:
                new = self._new_run(
                    workflow,
                    context,
                    key=None,
                    idempotency_key=None,
                    priority=priority,
                    run_at=run_at,
                    owner=None,
                )
            except InvalidContext as error:
                raise InvalidContext(workflow.name, error.problems, position=position) from None
            news.append(new)
        if workflow.bounds.max_queued is not None:  # backpressure, as start() honours it
            return starts.bounded_many(self, workflow, news, progress=progress)
        infos: list[RunInfo] = []
        created = 0
        for first in range(0, len(news), batch_size):
            batch = news[first : first + batch_size]
            try:
                results = self.store.create_runs(batch)
            except BaseException:
                for new in news[first:]:  # (this batch's, and the ones never tried)
                    self._unmade(new)
                raise
            for new, (_, is_new) in zip(batch, results, strict=True):
                if not is_new:
                    self._unmade(new)
            infos.extend(self._info(stored) for stored, _ in results)
            created += sum(1 for _, is_new in results if is_new)
            if progress is not None:
                progress(len(infos), len(news))
        return StartedRuns(tuple(infos), created)

    def run(
        self,
        workflow: Workflow,
        context: BaseModel | Mapping[str, Any] | str,
        *,
        key: str | None = None,
        idempotency_key: str | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> RunInfo:
        """Start a run and drive it until it finishes or waits (this process executes it).

        The run is created already claimed, with its first ``step_started``, in one commit.
        """
        # It costs the same whatever the caller's depth (flowloop/freshstack.py).
        return steady_call(self._run, workflow, context, key, idempotency_key, trace_context)

    def _run(
        self,
        workflow: Workflow,
        context: BaseModel | Mapping[str, Any] | str,
        key: str | None,
        idempotency_key: str | None,
        trace_context: Mapping[str, str] | None,
    ) -> RunInfo:
        mainloop.refuse_inside_a_loop()  # (a def step's own loop is hidden from it)
        work = self.arun(
            workflow,
            context,
            key=key,
            idempotency_key=idempotency_key,
            trace_context=trace_context,
        )
        if in_inline_step():  # called by a def step that runs on this thread's loop
            with asyncio.Runner() as own:
                nested: RunInfo = own.run(work)
            return nested
        info: RunInfo = mainloop.run_on(self._runner(), _steps_inline(work))
        return info

    def _runner(self) -> asyncio.Runner:
        """This thread's kept event loop: asyncio.run builds and tears down a loop each time
        (~150 us, more than a commit)."""
        return self._loops.runner()

    async def arun(
        self,
        workflow: Workflow,
        context: BaseModel | Mapping[str, Any] | str,
        *,
        key: str | None = None,
        idempotency_key: str | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> RunInfo:
        """:meth:`run` for callers already inside an event loop."""
        new = self._new_run(
            workflow,
            context,
            key=key,
            idempotency_key=idempotency_key,
            priority=0,
            run_at=None,
            trace_context=trace_context,
            # Claimed at birth when it starts with a step; a run that starts waiting
            # holds nothing.
            # A limited or gated first step is claimed like any other (its limits are
            # decided in the claim / before the call).
            owner=self.worker_id
            if workflow.initial in workflow.steps and not gates.gated_start(workflow)
            else None,
        )
        # A step waiting for a run its own run's (and callers') limit slots hold back: a
        # new run is refused before it is written, one found by its key once found.
        held_back = workflow.limited and bool(HELD.get())
        keyed = new.record.key is not None or new.idempotency_key is not None
        if held_back and not keyed and workflow.initial not in workflow.waits:
            self._unmade(new)
            refuse_held_back(database_of(self.store), workflow, new.limit_key)
        sent = time.monotonic()  # the lease is counted from before the request that set it
        try:  # what ``with self._making(new)`` does, without a generator per run
            stored, created = self.store.create_run(new)
        except BaseException:
            self._unmade(new)
            raise
        if not created:
            self._unmade(new)
            starts.refuse_foreign(stored, workflow, new)
        elif self.direct_listeners:
            self._tell_created(new)
        if (
            held_back
            and keyed
            and claimed_later(stored, workflow, self.clock.now(), IDLE_HORIZON_SECONDS)
        ):
            refuse_held_back(database_of(self.store), workflow, stored.limit_key, queued=stored.id)
        executor = self._executor()
        if created and stored.owner is not None:
            # Fast path: drive the run we just created and claimed, without polling the
            # queue; the lease threads keep its lease alive through long steps.
            caller = asyncio.current_task()
            # Requests to cancel the caller made before this call are not this call's.
            cancels_before = caller.cancelling() if caller is not None else 0
            executor.leases.begin()
            executor.tracked.add(stored.id)
            try:
                task = executor.spawn(stored, starting=False, claimed_at=sent, awaited=True)
                # Awaited directly (asyncio.wait: a loop turn more per run). A CancelledError
                # is the caller's or the run's own end, told apart below (the task has ended).
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                if caller is not None and caller.cancelling() > cancels_before:
                    # The caller was cancelled meanwhile (Ctrl-C): the run's task was
                    # cancelled with it (cut off, journaled) — or went on to its end, had a
                    # step swallowed the cancellation. The caller's cancellation comes out.
                    if not task.done():  # (awaiting the task waited for its end)
                        task.cancel()
                        await asyncio.wait([task])
                    raise asyncio.CancelledError
                # Else a task ended cancelled by an operator's stop or a lost lease: that is
                # the run's outcome, read below, not the caller's cancellation.
            finally:
                # The executor is the engine's, kept between calls: a run cancelled (Ctrl-C)
                # or failed here must not stay tracked, nor its last record kept, for ever.
                executor.tracked.discard(stored.id)
                known = executor.committed.pop(stored.id, None)
                parsed = executor.last_parsed.pop(stored.id, None)
                # Ended before this returns: the loop is kept, not run, between calls, and a
                # watchdog left watching it would warn of an "event loop blocked" at the
                # caller's next line of its own.
                executor.leases.end()
            if not task.cancelled():
                task.result()  # an error of the drive loop itself surfaces here
        else:
            known = parsed = None
        if created and known is not None and known[0].status != "running":
            # The row is what this process committed last: no need to read it back.
            record, at = known  # (the row let go: no owner; parsed: the last step's parse)
            workflow_of = self._workflow_for(record)
            info = info_of(record, None, stored.created_at, at, workflow_of, parsed)
        else:
            info = self.get(stored.id)
        if queued(info, workflow) and not executor.handing_back:  # (a first Ctrl-C: stop)
            # Retry backoff or a durable sleep: wait for it like run_until_idle would; a
            # run in a call or map state is driven with its children until it moves on.
            info = await drive_family(self, executor, workflow, info)
        return info

    # -- driving ---------------------------------------------------------------------------

    def drive(self, run_id: str) -> RunInfo:
        """Drive one run (and its children) in this process until it finishes or waits, as
        :meth:`run` drives the run it starts; other due runs are left to workers. What
        ``flowloop retry`` does after its retry."""
        return steady_call(self._drive_run, run_id)

    def _drive_run(self, run_id: str) -> RunInfo:
        mainloop.refuse_inside_a_loop("drive", "adrive(run_id)")
        work = self.adrive(run_id)
        if in_inline_step():  # called by a def step that runs on this thread's loop
            with asyncio.Runner() as own:
                nested: RunInfo = own.run(work)
            return nested
        driven: RunInfo = mainloop.run_on(
            self._runner(), work, call="drive", awaited="adrive(run_id)"
        )
        return driven

    async def adrive(self, run_id: str) -> RunInfo:
        """:meth:`drive` for callers already inside an event loop."""
        info = self.get(run_id)
        workflow = self.version_of(info.workflow, info.version)
        if not queued(info, workflow):  # finished, paused, or waiting for an event
            return info
        refuse_a_held_back_run(self, workflow, info.id)
        return await drive_family(self, self._executor(), workflow, info)

    def _executor(self, *, max_concurrency: int | None = None) -> Executor:
        """This thread's executor for in-process driving, kept: its thread pool and prepared
        state are reused across calls. One per calling thread, as its event loop is: the
        lease threads hand a lost lease or a stop to the loop of the runs they keep, and
        renew them while that loop ticks (shared, they served one thread's loop)."""
        limit = max_concurrency or self.max_concurrency
        executor = self._thread_executors.get()
        if executor is None or executor.max_concurrency != limit:
            with self._listening:
                executor = self._thread_executors.put(self._new_executor(max_concurrency=limit))
        return executor

    def listen(self, listener: Listener, *, direct: bool = False) -> None:
        """Tell ``listener`` of every boundary this engine's executors commit, those kept
        already by threads that drove runs included; ``direct``: of what the engine writes
        itself too (:attr:`direct_listeners`)."""
        with self._listening:
            self.listeners.append(listener)
            if direct:
                self.direct_listeners.append(listener)
            for executor in self._thread_executors.made():
                executor.listeners.append(listener)

    def _new_executor(self, *, max_concurrency: int | None = None) -> Executor:
        return Executor(
            self.store,
            self._workflows,
            clock=self.clock,
            worker_id=self.worker_id,
            max_concurrency=max_concurrency or self.max_concurrency,
            lease_seconds=self.lease_seconds,
            poll_seconds=self.poll_seconds,
            listeners=self.listeners,
        )

    def run_until_idle(self, *, idle_horizon: float = 300.0) -> Stats:
        """Recover interrupted runs, then execute due runs of the registered workflows until
        none is due or running. Waits for retry backoff ending within ``idle_horizon`` s."""
        # As Engine.run: it costs the same whatever the caller's depth (freshstack.py).
        return steady_call(self._run_until_idle, idle_horizon)

    def _run_until_idle(self, idle_horizon: float) -> Stats:
        # Before any coroutine is built: refused, it is never left un-awaited.
        mainloop.refuse_inside_a_loop("run_until_idle", "arun_until_idle()")
        work = self.arun_until_idle(idle_horizon=idle_horizon)
        if in_inline_step():  # called by a def step that runs on this thread's loop
            with asyncio.Runner() as own:
                nested: Stats = own.run(work)
            return nested
        # The thread's kept loop, as Engine.run: asyncio.run built and closed a loop per
        # call (~180 us of the ~1 ms a call that finds nothing due cost).
        stats: Stats = mainloop.run_on(
            self._runner(),
            mainloop.cancelling_what_it_leaves(work),
            call="run_until_idle",
            awaited="arun_until_idle()",
        )
        return stats

    async def arun_until_idle(self, *, idle_horizon: float = 300.0) -> Stats:
        executor = self._new_executor()
        try:
            return await executor.run(until_idle=True, idle_horizon=idle_horizon)
        finally:
            executor.close()

    def resume(self) -> Stats:
        """Settle runs interrupted by a crash and drive everything due to the end."""
        return self.run_until_idle()

    # -- reading ---------------------------------------------------------------------------

    def diagram(self, run_id: str | None = None) -> graphviz.Digraph:
        """Run ``run_id`` drawn on its workflow (visited states and transitions with counts,
        the current state, the failed one with its error); without ``run_id``, the lifecycle
        every run follows. The run's workflow must be registered with this engine.

        Raises UnknownRun, UnknownWorkflow."""
        from flowloop import render  # lazy: only diagrams need graphviz

        if run_id is None:
            return render.lifecycle_digraph()
        stored = self._stored(run_id)
        workflow = self.workflow(stored.record.workflow)
        events = self.store.journal(stored.id)
        return render.run_digraph(workflow, events, held=self.is_held(stored.id))

    def check(self, workflow: Workflow) -> list[Stranded]:
        """Live runs of ``workflow``'s name that this definition would park or fail (see
        flowloop/checking.py for the whole report); older versions registered with this
        engine keep their runs (pinning)."""
        from flowloop.checking import check_runs

        workflow.validate()
        if not isinstance(self.store, SQLStore):
            raise FlowloopError("check needs a SQL store")
        pinned = {
            w.fingerprint: w
            for w in self.versions_of(workflow.name)
            if w.fingerprint != workflow.fingerprint
        }
        report = check_runs(self.store, workflow, pinned=pinned)
        return [
            Stranded(run.run_id, run.state, run.status, run.reason or "")
            for run in report.runs
            if run.kind in ("parks", "fails")
        ]


async def _steps_inline(work: Coroutine[Any, Any, T]) -> T:
    """``work`` with plain ``def`` steps called on this loop's thread (``Engine.run``: the
    loop is the engine's own and drives this run only; see Stepping._inline). The tasks it
    spawns copy the flag with the context."""
    token = SYNC_STEPS_INLINE.set(True)
    try:
        return await work
    finally:  # the flag is this call's only
        SYNC_STEPS_INLINE.reset(token)
