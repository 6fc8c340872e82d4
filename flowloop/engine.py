"""The public facade: start runs, drive them, look at them, and act on them as an operator."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import getpass
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final, overload

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from flowloop import children, gates, ids, loop_requests, starts, tracecontext
from flowloop import journal as j
from flowloop.admission import AdmissionError
from flowloop.clock import Clock, SystemClock
from flowloop.dbclock import DatabaseClock
from flowloop.definition import Workflow
from flowloop.errors import (
    DefinitionError,
    DefinitionMismatch,
    FlowloopError,
    InvalidContext,
    InvalidEvent,
    InvalidTransition,
    UnknownLoop,
    UnknownRun,
    UnknownWorkflow,
)
from flowloop.events import (
    NotWaiting,
    accepted,
    accepts,
    check_bufferable,
    entering,
    receive,
    wait_due,
)
from flowloop.executor import (
    DEFAULT_LEASE_SECONDS,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_POLL_SECONDS,
    Executor,
    Listener,
    Stats,
    new_worker_id,
    try_deliver_pending,
)
from flowloop.flowcontrol import concurrency_key_of
from flowloop.journal import JournalEvent, RunRecord
from flowloop.lifecycle import CLAIMABLE, FINISHED
from flowloop.limits import MAX_NAME_LENGTH, check_finite, check_key, check_text
from flowloop.retry import seconds
from flowloop.store import (
    Boundary,
    Fence,
    InboxEvent,
    NewRun,
    RunFilter,
    SQLStore,
    Store,
    StoredRun,
)
from flowloop.store.dialect import DEFAULT_SYNCHRONOUS, normalize_url
from flowloop.store.loops import LoopEvent, LoopRow, LoopStoreMixin
from flowloop.verdicts import judge
from flowloop.versions import Registry

if TYPE_CHECKING:
    import graphviz

    from flowloop.migration import Moved

SEND_ATTEMPTS: Final = 200
SEND_RETRY_SECONDS: Final = 0.01
SEND_HOLD_SECONDS: Final = 2.0
"""How long ``send`` (without ``buffer``) waits for a worker to let go of a waiting run."""
DEFAULT_URL: Final = "sqlite:///flowloop.db"
ENV_DB: Final = "FLOWLOOP_DB"
INVALID_JSON_KEY: Final = "_invalid_json"
"""``RunInfo.context`` of a run whose stored context is not a JSON object: the raw text."""
START_BATCH: Final = 1_000
"""Runs per transaction in :meth:`Engine.start_many`: few commits, short write locks."""


def default_url() -> str:
    """``$FLOWLOOP_DB`` or ``./flowloop.db``."""
    return normalize_url(os.environ.get(ENV_DB) or DEFAULT_URL)


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """A run as users see it."""

    id: str
    workflow: str
    version: int
    status: str
    state: str
    context: BaseModel | dict[str, Any]
    attempt: int
    key: str | None
    reason: str | None
    error: str | None
    next_run_at: float | None
    owner: str | None
    last_seq: int
    created_at: float
    updated_at: float
    visits: Mapping[str, int]
    fingerprint: str = ""
    """The definition the run follows (its structure is stored under this fingerprint)."""

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass(frozen=True)
class StartedRuns(Sequence[RunInfo]):
    """What :meth:`Engine.start_many` enqueued: one run per context, in order (iterate or
    index it like a list), and how many of them it created — the others already held
    their key (an existing run, or an earlier context of the same call)."""

    runs: tuple[RunInfo, ...]
    created: int

    def __len__(self) -> int:
        return len(self.runs)

    @overload
    def __getitem__(self, index: int) -> RunInfo: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RunInfo]: ...

    def __getitem__(self, index: int | slice) -> RunInfo | Sequence[RunInfo]:
        return self.runs[index]


@dataclass(frozen=True, kw_only=True)
class Replay:
    """A journal folded: the record at ``seq``, and whether the full fold equals the row."""

    run_id: str
    seq: int
    record: RunRecord
    events: list[JournalEvent]
    differences: list[str]

    @property
    def matches(self) -> bool:
        return not self.differences


@dataclass(frozen=True)
class SendResult:
    """``applied`` (the run took the event), ``buffered`` or ``duplicate``."""

    status: str
    run: RunInfo


@dataclass(frozen=True)
class Stranded:
    """A live run the current definition cannot continue."""

    run_id: str
    state: str
    status: str
    reason: str


class Engine:
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
        self._workflows = Registry()
        self._shared: Executor | None = None
        self._runners = threading.local()
        self._all_runners: list[asyncio.Runner] = []
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
        for runner in self._all_runners:
            with contextlib.suppress(Exception):
                runner.close()
        self._all_runners.clear()
        if self._shared is not None:
            self._shared.close()
            self._shared = None
        self.store.close()

    # -- workflows -------------------------------------------------------------------------

    def register(self, *workflows: Workflow) -> None:
        """Make workflows runnable by this engine (validates them)."""
        for workflow in workflows:
            workflow.validate()
            for child in workflow.children:  # a parent's children run where it runs
                if self._workflows.get(child.name) is not child:
                    self.register(child)
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
        if found is None:
            loaded = ", ".join(f"v{w.version}" for w in self.versions_of(name)) or "none"
            raise FlowloopError(
                f"workflow {name!r} version {version} is not loaded (loaded: {loaded}); "
                "load the file that defines it (-w)"
            )
        return found

    def migrate(self, run_id: str, *, to: int, by: str | None = None) -> RunInfo:
        """Move a live run to version ``to`` of its workflow (registered, declaring
        ``migrates_from`` for the run's version); journaled with who, from and to. A run
        parked for a mismatch goes on. Raises FlowloopError saying why it cannot move."""
        from flowloop.migration import migrate_run

        stored = self._stored(run_id)
        migrate_run(self, stored, to=to, by=by or _user())
        return self.get(stored.id)

    def migrate_workflow(self, name: str, *, to: int, by: str | None = None) -> list[Moved]:
        """:meth:`migrate` every live run of ``name`` below version ``to``."""
        from flowloop.migration import migrate_all

        return migrate_all(self, name, to=to, by=by or _user())

    def operate(self, stored: StoredRun, kind: str, **fields: Any) -> bool:
        """Write one operator entry on a run nobody owns (fenced); False if it moved."""
        return self._operate(stored, kind, **fields)

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
        run_at: float | None,
        owner: str | None,
        trace_context: Mapping[str, str] | None = None,
    ) -> NewRun:
        if not self._workflows.holds(workflow):
            self.register(workflow)
        ctx = workflow.parse_context(context)
        check_finite("context", ctx.model_dump())
        now = self.clock.now()
        business_key = check_key("key", key if key is not None else workflow.business_key(ctx))
        check_key("idempotency key", idempotency_key)
        limit_key = (
            None
            if workflow.concurrency_key is None
            else concurrency_key_of(workflow.name, workflow.concurrency_key, ctx)
        )
        run_id = self._new_run_id(workflow.name, business_key, idempotency_key)
        created = JournalEvent(
            run_id=run_id,
            seq=1,
            kind=j.RUN_CREATED,
            at=now,
            state=workflow.initial,
            context=ctx.model_dump_json(),
            worker=self.worker_id,
            data={
                "workflow": workflow.name,
                "version": workflow.version,
                "fingerprint": workflow.fingerprint,
                "key": business_key,
                "due": self._first_due(workflow, now, run_at),
                **workflow.context_stamp(),
                **({"limit_key": limit_key} if limit_key is not None else {}),
                # The whole run's deadline: a durable due time (waiting, retrying included).
                **({"deadline": now + workflow.deadline} if workflow.deadline else {}),
                **self._trace_data(run_id, trace_context),
            },
        )
        events = [created]
        record = j.create(created)
        if owner is not None and workflow.initial in workflow.steps:
            started = JournalEvent(
                run_id=created.run_id,
                seq=2,
                kind=j.STEP_STARTED,
                at=now,
                state=workflow.initial,
                attempt=1,
                worker=owner,
            )
            events.append(started)
            record = j.apply(record, started)
        return NewRun(
            record=record,
            events=events,
            idempotency_key=idempotency_key,
            priority=priority,
            owner=owner,
            lease_seconds=self.lease_seconds,
            limit_key=limit_key,
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
        """A new run's id: random (flowloop.testing's TestEngine makes it reproducible)."""
        return uuid.uuid4().hex

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
        run_at: float | None = None,
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
        if workflow.bounds.max_queued is not None:
            stored, created = starts.bounded_start(self, workflow, new)  # backpressure
        else:
            stored, created = self.store.create_run(new)
        if created and self.direct_listeners:
            self._tell_created(new)
        return self._info(stored)

    def start_many(
        self,
        workflow: Workflow,
        contexts: Iterable[BaseModel | Mapping[str, Any] | str],
        *,
        priority: int = 0,
        run_at: float | None = None,
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
        infos: list[RunInfo] = []
        created = 0
        for first in range(0, len(news), batch_size):
            results = self.store.create_runs(news[first : first + batch_size])
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
        return self._runner().run(
            self.arun(
                workflow,
                context,
                key=key,
                idempotency_key=idempotency_key,
                trace_context=trace_context,
            )
        )

    def _runner(self) -> asyncio.Runner:
        """One event loop per calling thread, kept between calls: asyncio.run builds and
        tears down a loop each time (~150 us, more than a commit)."""
        runner: asyncio.Runner | None = getattr(self._runners, "runner", None)
        if runner is None:
            runner = asyncio.Runner()
            self._runners.runner = runner
            self._all_runners.append(runner)
        return runner

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
        stored, created = self.store.create_run(new)
        if created and self.direct_listeners:
            self._tell_created(new)
        executor = self._executor()
        if created and stored.owner is not None:
            # Fast path: drive the run we just created and claimed, without polling the
            # queue; the heartbeat keeps its lease alive through long steps.
            heartbeat = asyncio.create_task(executor.heartbeat())
            executor.tracked.add(stored.id)
            task = executor.spawn(stored, starting=False)
            try:
                # Not `await task`: a run cut off by an operator's stop or a lost lease ends
                # its task cancelled, which is the run's outcome, not the caller's
                # cancellation (its status is read below).
                await asyncio.wait([task])
            except asyncio.CancelledError:
                task.cancel()
                await asyncio.wait([task])
                raise
            finally:
                heartbeat.cancel()
            if not task.cancelled():
                task.result()  # an error of the drive loop itself surfaces here
        executor.tracked.discard(stored.id)
        known = executor.committed.pop(stored.id, None)
        if created and known is not None and known[0].status != "running":
            # The row is what this process committed last: no need to read it back.
            record, at = known
            info = self._info(
                dataclasses.replace(
                    stored, record=record, owner=None, lease_expires_at=None, updated_at=at
                )
            )
        else:
            info = self.get(stored.id)
        if (
            info.status in ("scheduled", "retrying")
            and info.state not in workflow.waits
            and not executor.handing_back  # a first Ctrl-C (flowloop.interrupt): stop here
        ):
            # Retry backoff or a durable sleep: wait for it like run_until_idle would; a
            # run in a call or map state is driven with its children until it moves on.
            while True:
                await executor.run(until_idle=True, run_ids=children.family(self.store, stored.id))
                before, info = info, self.get(stored.id)
                if info.state not in workflow.composites or info.status not in CLAIMABLE:
                    break
                if (before.state, before.last_seq) == (info.state, info.last_seq):
                    break  # nothing of its family is due (children waiting for events)
        return info

    # -- driving ---------------------------------------------------------------------------

    def _executor(self, *, max_concurrency: int | None = None) -> Executor:
        """The engine's executor for in-process driving (kept: its thread pool and prepared
        state are reused across calls)."""
        limit = max_concurrency or self.max_concurrency
        if self._shared is None or self._shared.max_concurrency != limit:
            if self._shared is not None:
                self._shared.close()
            self._shared = self._new_executor(max_concurrency=limit)
        return self._shared

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
        return asyncio.run(self.arun_until_idle(idle_horizon=idle_horizon))

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

    def _stored(self, run_id: str) -> StoredRun:
        """The run ``run_id`` names: its whole id or a unique prefix (see flowloop.ids)."""
        stored = self.store.get_run(run_id)
        if stored is None:
            stored = self.store.get_run(ids.resolve(self.store, run_id))
        if stored is None:
            raise UnknownRun(run_id)
        return stored

    def resolve(self, run_id: str) -> str:
        """The whole id of the run that ``run_id`` (an id or a unique prefix of at least
        four characters) names. Raises UnknownRun, AmbiguousRunId."""
        return self._stored(run_id).id

    def _info(self, stored: StoredRun) -> RunInfo:
        record = stored.record
        workflow = self._workflow_for(record)
        context: BaseModel | dict[str, Any]
        try:
            context = (
                workflow.load_context(record.context, record.context_version)
                if workflow is not None
                else json.loads(record.context)
            )
        except (ValueError, FlowloopError):
            # A stored context that no longer validates (or parses) must not make the run
            # unreadable: show what is there.
            try:
                context = json.loads(record.context)
            except ValueError:
                context = {INVALID_JSON_KEY: record.context}
            if not isinstance(context, dict):
                context = {INVALID_JSON_KEY: record.context}
        return RunInfo(
            id=record.id,
            workflow=record.workflow,
            version=record.version,
            status=record.status,
            state=record.state,
            context=context,
            attempt=record.attempt,
            key=record.key,
            reason=record.reason,
            error=record.error,
            next_run_at=record.next_run_at,
            owner=stored.owner,
            last_seq=record.last_seq,
            created_at=stored.created_at,
            updated_at=stored.updated_at,
            visits=dict(record.visits),
            fingerprint=record.fingerprint,
        )

    def get(self, run_id: str) -> RunInfo:
        return self._info(self._stored(run_id))

    def runs(
        self,
        *,
        workflow: str | None = None,
        status: str | Sequence[str] | None = None,
        key: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[RunInfo]:
        """Runs, newest first; ``after`` (a run id or prefix): the ones listed after it."""
        statuses = [status] if isinstance(status, str) else status
        if limit < 0:
            raise FlowloopError(f"limit {limit} is negative: give 0 or more")
        check_key("key", key)
        start = None
        if after is not None:
            stored = self._stored(after)
            start = (stored.created_at, stored.id)
        found = self.store.find_runs(
            RunFilter(workflow=workflow, statuses=statuses, key=key, limit=limit, after=start)
        )
        return [self._info(stored) for stored in found]

    def find(self, workflow: Workflow | str, *, key: str) -> RunInfo | None:
        """The newest run of ``workflow`` with business key ``key``."""
        name = workflow if isinstance(workflow, str) else workflow.name
        found = self.runs(workflow=name, key=key, limit=1)
        return found[0] if found else None

    def history(self, run_id: str) -> list[JournalEvent]:
        return self.store.journal(self._stored(run_id).id)

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
        return render.run_digraph(workflow, self.store.journal(stored.id))

    def replay(self, run_id: str, *, at: int | None = None) -> Replay:
        """Fold the journal; the record at ``at`` (default: the end) and the differences
        between the full fold and the stored row (none, unless something is wrong)."""
        stored = self._stored(run_id)
        run_id = stored.id
        events = self.store.journal(run_id)
        if at is not None and not 1 <= at <= len(events):
            raise FlowloopError(f"run {run_id} has seq 1..{len(events)}; --at {at} is outside")
        full = j.fold(events)
        differences = j.compare(full, stored.record)
        record = full if at is None else j.fold(events, until_seq=at)
        return Replay(
            run_id=run_id,
            seq=record.last_seq,
            record=record,
            events=events,
            differences=differences,
        )

    # -- operating -------------------------------------------------------------------------

    def _operate(self, stored: StoredRun, kind: str, **fields: Any) -> bool:
        """Write one operator event on a run nobody owns. False if someone owns it."""
        record = stored.record
        event = JournalEvent(
            run_id=record.id,
            seq=record.last_seq + 1,
            kind=kind,
            at=self.clock.now(),
            worker=f"operator:{_user()}",
            **fields,
        )
        boundary = Boundary(
            events=[event],
            record=j.apply(record, event),
            fence=Fence(None, stored.lease_epoch),
            clear_control=True,
        )
        written = self.store.write([boundary])[0]
        if written:
            self._tell(boundary)
        return written

    def _tell(self, boundary: Boundary) -> None:
        self._tell_events(boundary.record, boundary.events)

    def _tell_created(self, new: NewRun) -> None:
        self._tell_events(new.record, new.events)

    def _tell_events(self, record: RunRecord, events: Sequence[JournalEvent]) -> None:
        for listener in self.direct_listeners:
            try:
                listener(record, events)
            except Exception:  # a listener must never break an operator's write
                logging.getLogger("flowloop.engine").exception("listener failed")

    def pause(self, run_id: str) -> RunInfo:
        """Pause a run: at once if it is queued, else at its next step boundary."""
        return self._control(run_id, "pause", j.RUN_PAUSED)

    def stop(self, run_id: str) -> RunInfo:
        """Stop a run for good (until an operator retries it); a running step is cancelled."""
        return self._control(run_id, "stop", j.RUN_STOPPED)

    def _control(self, run_id: str, action: str, kind: str) -> RunInfo:
        stored = self._stored(run_id)
        run_id = stored.id
        status = stored.record.status
        if action == "pause" and status == "paused":
            return self._info(stored)
        if status in FINISHED:
            raise InvalidTransition(run_id, status, action)
        # Stop and pause cascade to the run's live children (and theirs).
        children.cascade(
            self.store, run_id, action, lambda child, act: self._control(child, act, kind)
        )
        if status != "running" and self._operate(stored, kind, state=stored.record.state):
            return self.get(run_id)
        # Owned (running): its worker honours the request at the next boundary.
        self.store.request_control(run_id, action)
        return self.get(run_id)

    def unpause(self, run_id: str) -> RunInfo:
        stored = self._stored(run_id)
        run_id = stored.id
        if stored.record.status != "paused":
            if stored.control == "pause":
                self.store.request_control(run_id, None)
                return self.get(run_id)
            raise InvalidTransition(run_id, stored.record.status, "unpause")
        record = stored.record
        workflow = self._workflow_for(record)
        data: dict[str, Any] = {}
        if workflow is not None and record.state in workflow.waits:
            # Back to waiting: due when its timeout was due (at once if that has passed),
            # never before, and not at all without a timeout.
            data["due"] = wait_due(workflow, record.state, self.store.journal(run_id))
        elif record.join is not None and children.is_held(self.store, run_id):
            data["due"] = None  # a map's child paused before its turn: held again
        if not self._operate(stored, j.RUN_UNPAUSED, state=record.state, data=data):
            raise FlowloopError(f"run {run_id} changed while unpausing; try again")
        if "due" in data:
            # Events kept while it was paused: the run takes them now.
            self._hand_over_kept(run_id)
        for child in children.paused_children(self.store, run_id):
            with contextlib.suppress(FlowloopError):  # unpaused or ended meanwhile
                self.unpause(child)
        return self.get(run_id)

    def send(
        self,
        run_id: str,
        event: str,
        payload: Mapping[str, Any] | BaseModel | None = None,
        *,
        dedupe_key: str | None = None,
        buffer: bool = False,
    ) -> SendResult:
        """Send ``event`` to a run waiting in a wait state that accepts it: the payload is
        validated and merged into the context, the event journaled, and the run moves on.

        Not accepted now: with ``buffer=True`` the event is kept until the run reaches a
        state that accepts it, else InvalidEvent lists what the state accepts. The same
        ``dedupe_key`` twice for one run has effect once (``status == "duplicate"``).
        """
        if isinstance(payload, BaseModel):
            payload = payload.model_dump(mode="json")
        run_id = self.resolve(run_id)
        check_key("dedupe key", dedupe_key)
        check_finite("payload", payload)
        check_text("event", event, MAX_NAME_LENGTH)
        message = InboxEvent(
            run_id=run_id,
            event=event,
            payload=None if payload is None else json.dumps(payload, sort_keys=True),
            dedupe_key=dedupe_key,
            sent_at=self.clock.now(),
            sender=f"{_user()}@{self.worker_id}",
        )
        hold_until = time.monotonic() + SEND_HOLD_SECONDS
        for _ in range(SEND_ATTEMPTS):
            stored = self._stored(run_id)
            if dedupe_key is not None and self.store.has_message(run_id, dedupe_key):
                return SendResult(status="duplicate", run=self._info(stored))
            record = stored.record
            if record.status in FINISHED:
                raise InvalidTransition(run_id, record.status, f"send {event!r} to")
            self.workflow(record.workflow)  # UnknownWorkflow unless registered
            workflow = self._workflows.for_run(record)
            self._refuse_mismatch(workflow, record)
            waiting_here = accepts(workflow, record, event)
            if waiting_here and stored.owner is None:
                if self._deliver_kept(workflow, record):
                    continue  # events kept earlier went first (in order): look again
                received, after = receive(
                    workflow,
                    record,
                    event,
                    message.payload,
                    now=self.clock.now(),  # not sent_at: after a wait, later than the holder's
                    worker=message.sender or "",
                    extra={"dedupe_key": dedupe_key} if dedupe_key else None,
                )
                boundary = Boundary(
                    events=[received], record=after, fence=Fence(None, stored.lease_epoch)
                )
                result = self.store.deliver(message, boundary)
                if result == "conflict":
                    time.sleep(SEND_RETRY_SECONDS)  # another writer moved the run: look again
                    continue
                if result == "applied":
                    self._tell(boundary)
                if result == "applied" and after.state in workflow.waits:
                    # It waits again (maybe in another wait state): take what was kept for it.
                    self._hand_over_kept(run_id)
            elif waiting_here and not buffer and time.monotonic() < hold_until:
                # A worker holds the waiting run for a moment (its timeout is firing, or a
                # kept event is being handed over): look again once it lets go, so the
                # sender learns whether the event was taken or came too late, instead of
                # it being kept behind a timeout that may end the run.
                self._wait_while_held(run_id, stored.owner, hold_until)
                continue
            elif buffer or waiting_here:
                # Busy (a worker holds it) or not there yet: keep it for later, unless it
                # could never be taken (no wait state accepts it, or its payload is invalid).
                check_bufferable(
                    workflow, event, message.payload, state=record.state if waiting_here else None
                )
                if workflow.bounds.max_inbox is not None:
                    result = starts.keep_bounded(self, workflow, message)  # backpressure
                else:
                    result = self.store.deliver(message, None)
                if result == "buffered":
                    self._hand_over_kept(run_id)
            elif event in accepted(workflow, record.state):
                raise NotWaiting(run_id, record.status, record.state, event)
            else:
                raise InvalidEvent(record.state, event, accepted(workflow, record.state))
            return SendResult(status=result, run=self.get(run_id))
        raise FlowloopError(f"run {run_id} kept changing while sending {event!r}; try again")

    def _refuse_mismatch(self, workflow: Workflow, record: RunRecord) -> None:
        """Raise DefinitionMismatch (one line, nothing changed) when the deployed definition
        cannot take the run on (flowloop/verdicts.py); a worker parks such a run."""
        if record.fingerprint == workflow.fingerprint and (
            record.context_version == workflow.context_version
        ):
            return
        verdict = judge(
            workflow,
            state=record.state,
            fingerprint=record.fingerprint,
            context=record.context,
            context_version=record.context_version,
            old=self.store.definition(record.fingerprint),
        )
        if not verdict.goes_on:
            raise DefinitionMismatch(record.id, verdict.reason or "")

    def _hand_over_kept(self, run_id: str) -> int | None:
        """Give a waiting run the events kept for it that it accepts now (see
        :func:`try_deliver_pending`)."""
        return try_deliver_pending(
            self.store, self._workflows, run_id, now=self.clock.now(), worker=self.worker_id
        )

    def _wait_while_held(self, run_id: str, owner: str | None, until: float) -> None:
        """Poll until ``owner`` lets go of the run (or ``until``, on the monotonic clock)."""
        while time.monotonic() < until:
            time.sleep(SEND_RETRY_SECONDS)
            stored = self.store.get_run(run_id)
            if stored is None or stored.owner != owner:
                return

    def _deliver_kept(self, workflow: Workflow, record: RunRecord) -> bool:
        """Before an event is applied to a waiting run, hand it the events kept for it that
        it accepts now, oldest first: a sender's events are journaled in the order sent.
        True when the run may have moved (look again)."""
        if not any(
            accepts(workflow, record, message.event)
            for message in self.store.pending_events(record.id)
        ):
            return False
        # None: handing over failed (logged); go on rather than wait on it.
        return self._hand_over_kept(record.id) is not None

    def retry(
        self,
        run_id: str,
        *,
        from_state: str | None = None,
        set_fields: Mapping[str, Any] | None = None,
        by: str | None = None,
    ) -> RunInfo:
        """Run a failed or stopped run again, from its current state or from ``from_state``
        with the context recorded when the run entered it; ``set_fields`` edits that
        context (validated). The journal records who changed what."""
        stored = self._stored(run_id)
        run_id = stored.id
        record = stored.record
        if record.status not in ("failed", "stopped"):
            raise InvalidTransition(run_id, record.status, "retry")
        self.workflow(record.workflow)  # UnknownWorkflow unless registered
        workflow = self._workflows.for_run(record)
        state = from_state or record.state
        if state not in workflow.steps and not children.retryable_state(workflow, state):
            raise DefinitionError(
                workflow.name,
                f"cannot retry from {state!r}: not a state with a step "
                f"(states: {', '.join(workflow.steps)})",
            )
        entered = _context_entering(self.store.journal(run_id), state)
        if state == record.state and workflow.compensates(state):
            # the compensations owed go on from where they were
            entered = (record.context, record.context_version)
        if entered is None:
            raise FlowloopError(f"run {run_id} never reached state {state!r}; choose a visited one")
        context, version = entered
        data: dict[str, Any] = {"by": by or _user(), "from": state}
        if set_fields:
            _check_fields(workflow, set_fields)
            loaded = workflow.load_context(context, version).model_dump(mode="json")
            context = workflow.parse_context({**loaded, **set_fields}).model_dump_json()
            version = workflow.context_version
            # As JSON (a datetime, a UUID ...): the journal stores what was set.
            data["set"] = to_jsonable_python(dict(set_fields))
        if version != 1:
            data[j.CONTEXT_VERSION] = version
        if not self._operate(stored, j.RUN_RETRIED, state=state, context=context, data=data):
            raise FlowloopError(f"run {run_id} changed while retrying; try again")
        return self.get(run_id)

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

    # -- loops -----------------------------------------------------------------------------

    def _loop_store(self) -> LoopStoreMixin:
        if not isinstance(self.store, LoopStoreMixin):
            raise FlowloopError("this store does not keep loops")
        return self.store

    def loops(self) -> list[LoopRow]:
        """Every loop a worker has registered in this database."""
        return self._loop_store().list_loops()

    def loop(self, name: str) -> LoopRow:
        row = self._loop_store().get_loop(name)
        if row is None:
            raise UnknownLoop(name)
        return row

    def loop_history(self, name: str, *, limit: int = 1000) -> list[LoopEvent]:
        self.loop(name)
        return self._loop_store().loop_journal(name, limit=limit)

    def pause_loop(self, name: str) -> LoopRow:
        """Pause a loop: at once if it is waiting, after the running iteration otherwise."""
        return self._loop_control(name, "pause")

    def stop_loop(self, name: str) -> LoopRow:
        """Stop a loop; a running iteration is cancelled."""
        return self._loop_control(name, "stop")

    def unpause_loop(self, name: str) -> LoopRow:
        """Resume a paused (or stopped) loop; its worker picks the next slot from now."""
        row = self.loop(name)
        if row.status not in ("paused", "stopped"):
            if row.control == "pause":
                self._loop_store().request_loop_control(name, None)
                return self.loop(name)
            raise InvalidTransition(name, row.status, "unpause")
        self._loop_write(
            row,
            "loop_unpaused",
            {
                "status": "scheduled",
                "next_fire_at": None,
                "reason": None,
                "consecutive_failures": 0,
            },
        )
        return self.loop(name)

    def trigger_loop(self, name: str) -> LoopRow:
        """Ask the loop's worker for one iteration now, journaled ``manual`` (never while
        another iteration of the loop runs); the schedule is unchanged."""
        loop_requests.ask(
            self._loop_store(), self.loop(name), loop_requests.TRIGGER, now=self.clock.now()
        )
        return self.loop(name)

    def backfill_loop(self, name: str, request: loop_requests.BackfillRequest) -> LoopRow:
        """Ask the loop's worker to run the slots of ``request``'s range that never started,
        one at a time (journaled ``backfill``, ended by ``backfill_finished``)."""
        loop_requests.ask(
            self._loop_store(),
            self.loop(name),
            loop_requests.BACKFILL,
            request,
            now=self.clock.now(),
        )
        return self.loop(name)

    def _loop_control(self, name: str, action: str) -> LoopRow:
        row = self.loop(name)
        target = "paused" if action == "pause" else "stopped"
        if row.status == target:
            return row
        if row.status == "stopped":
            raise InvalidTransition(name, row.status, action)
        if row.status == "running" or not self._loop_write(
            row,
            f"loop_{target}",
            {"status": target, "next_fire_at": None, "reason": f"{target} by {_user()}"},
        ):
            self._loop_store().request_loop_control(name, action)
        return self.loop(name)

    def _loop_write(self, row: LoopRow, kind: str, changes: dict[str, Any]) -> bool:
        now = self.clock.now()
        event = LoopEvent(loop=row.name, kind=kind, at=now, worker=f"operator:{_user()}")
        return self._loop_store().write_loop(
            name=row.name,
            owner=None,
            epoch=row.lease_epoch,
            follows_seq=row.last_seq,
            changes={**changes, "control": None, "updated_at": now},
            events=[event],
        )


def _check_fields(workflow: Workflow, set_fields: Mapping[str, Any]) -> None:
    """An edit must name fields of the context: pydantic would drop an unknown (misspelt)
    one silently, and the journal would claim an edit that never happened."""
    model = workflow.context
    if model.model_config.get("extra") == "allow":
        return
    known = set(model.model_fields) | {
        f.alias for f in model.model_fields.values() if f.alias is not None
    }
    unknown = sorted(set(set_fields) - known)
    if unknown:
        raise InvalidContext(
            workflow.name,
            f"no field(s) {', '.join(map(repr, unknown))} in {model.__name__} "
            f"(fields: {', '.join(model.model_fields)})",
        )


def _context_entering(events: Sequence[JournalEvent], state: str) -> tuple[str, int] | None:
    """The context a run had when it last entered ``state``, with its context version."""
    for event in reversed(events):
        # Entered by any transition that records the context it entered with: a step's
        # outcome, a wait state's event or timeout, a child run's result.
        entered = (event.next_state == state) or (
            event.kind in (j.RUN_CREATED, j.RUN_RETRIED) and event.state == state
        )
        if entered and event.context is not None:
            return event.context, int(event.data.get(j.CONTEXT_VERSION, 1))
    return None


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"
