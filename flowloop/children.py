"""Child runs at run time: a call or map state fans out, waits, and joins.

A run that enters a call or map state is due at once. The worker that claims it:

1. computes the children's contexts and validates every one (an invalid item fails the
   run, naming the item's index and the field, before any child exists);
2. opens the visit's join row and creates the children in batches (ids derived from parent,
   state, visit and index: doing it again after a crash finds them instead);
3. journals ``children_started`` and lets go: the run waits with no due time, holding no
   worker or thread. Each child's final transaction counts it in the join row; the last one
   makes the parent due (see :mod:`flowloop.store.joins`);
4. claimed again with every child ended, it reads their final contexts in batches, lets
   ``result``/``reduce`` merge them, and journals ``children_joined`` along the call's or
   map's ``on``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Final, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from flowloop import compose, tracecontext
from flowloop import journal as j
from flowloop.clock import Clock
from flowloop.compose import CallSpec, ChildResult, Composite, MapSpec, ParallelSpec
from flowloop.contexts import context_from
from flowloop.definition import StepSpec, Workflow, describe_validation
from flowloop.errors import FlowloopError, Interrupted, InvalidContext, error_line
from flowloop.events import check_visits, entering, keeping_context, slept_past_deadline
from flowloop.flowcontrol import InvalidConcurrencyKey, limit_key_of
from flowloop.journal import JournalEvent, RunRecord
from flowloop.lifecycle import CONTROLS, FINISHED, PARENT_PAUSE, PARENT_PAUSED, PAUSES, STOP
from flowloop.store import Boundary, Fence, NewRun, Store, StoredRun
from flowloop.store.joins import JoinRow, JoinStoreMixin

if TYPE_CHECKING:
    from flowloop.executor import Executor

log = logging.getLogger("flowloop")

CREATE_BATCH: Final = 500
"""Children created per transaction."""
STOP_ATTEMPTS: Final = 4
"""Writes of a child's stop at its parent's deadline, the child read again after each
refusal; then its stop is asked for (its next claim honours it)."""
Tell = Callable[[Boundary], object]
"""Told of a boundary written for a run nobody holds (the executor's listeners)."""


T = TypeVar("T")


class ChildContextError(FlowloopError):
    """A map item (or a call) gives a child context that does not validate."""


class JoinFunctionError(FlowloopError):
    """A call's ``result=`` or a map's ``reduce=`` raised: the parent fails ``join_failed``."""


def called(where: str, function: Callable[..., T], *args: Any, error: type[FlowloopError]) -> T:
    """``function(*args)`` — a user's ``context=``, ``items=``, ``result=`` or ``reduce=``
    — with what it raises said with ``where`` it was called: a bare ``KeyError: 'a.csv'``
    named neither the state nor the item (API audit)."""
    try:
        return function(*args)
    except FlowloopError:
        raise
    except ValidationError as raised:
        raise error(f"{where} is invalid: {describe_validation(raised)}") from None
    except SystemExit as exited:  # (it ended the worker, the run left running: review)
        raise error(f"{where} called sys.exit({exited.code!r})") from None
    except Exception as raised:
        raise error(f"{where} raised {type(raised).__name__}: {error_line(raised)}") from None


def joins_of(executor: Executor) -> JoinStoreMixin:
    store = executor.store
    if not isinstance(store, JoinStoreMixin):
        raise FlowloopError("call and map states need the SQL store")
    return store


class ChildStart(NamedTuple):
    """What a child run is created with: its context as JSON and its per-key limit key."""

    context: str
    limit_key: str | None


def child_contexts(spec: Composite, ctx: BaseModel) -> list[ChildStart]:
    """Every child's context as JSON, validated against the child workflow's model, and
    its ``concurrency_key`` (computed as for a run started directly), before any child is
    created. Raises ChildContextError naming the item's index and field (or the key's
    problem)."""
    bad = ChildContextError
    if isinstance(spec, CallSpec):
        where = [f"call state {spec.name!r}"]
        values: list[Any] = [called(f"{where[0]}: context=", spec.context, ctx, error=bad)]
    elif isinstance(spec, ParallelSpec):
        where = [f"parallel state {spec.name!r}: branch {name!r}" for name in spec.branches]
        values = [
            called(f"{label}: context=", make, ctx, error=bad)
            for label, (_, make) in zip(where, spec.branches.values(), strict=True)
        ]
    else:
        state = f"map state {spec.name!r}"
        items = _items(state, spec, ctx)
        if len(items) > spec.max_items:  # (read no further than one past it)
            raise ChildContextError(
                f"{state}: more than max_items={spec.max_items} items; raise max_items or "
                "split the work"
            )
        where = [f"{state}: item {index}" for index in range(len(items))]
        values = [
            called(f"{label}: context=", spec.context, ctx, item, error=bad)
            for label, item in zip(where, items, strict=True)
        ]
    out = []
    for index, (label, value) in enumerate(zip(where, values, strict=True)):
        child = child_workflow(spec, index)
        try:
            # As a run started directly takes it: a field the child's model has not is
            # refused (it was dropped, from a mapping or another model alike).
            model = child.parse_new_context(value)
        except InvalidContext as error:
            raise ChildContextError(
                f"{label}: context for {child.name!r} is invalid: {error.problems}"
            ) from None
        try:
            limit_key = limit_key_of(child, model)
        except InvalidConcurrencyKey as error:
            raise ChildContextError(f"{label}: {error}") from None
        out.append(ChildStart(model.model_dump_json(), limit_key))
    return out


def _items(state: str, spec: MapSpec, ctx: BaseModel) -> list[Any]:
    """``items(ctx)`` read up to one item past ``max_items`` (an endless generator read
    whole hung the worker): a generator's error, raised as it is read, and a value that is
    no iterable are said as the function's own (both were said bare, with no state named:
    "'NoneType' object is not iterable")."""
    where = f"{state}: items="
    given = called(where, spec.items, ctx, error=ChildContextError)
    try:
        iterator = iter(given)
    except TypeError:
        raise ChildContextError(
            f"{where} returned {type(given).__name__}, not an iterable of items"
        ) from None
    head = itertools.islice(iterator, spec.max_items + 1)
    return called(where, list, head, error=ChildContextError)


def child_workflow(spec: Composite, index: int) -> Workflow:
    """The workflow of the composite's child number ``index``."""
    if isinstance(spec, ParallelSpec):
        return list(spec.branches.values())[index][0]
    return spec.child


def new_child(
    executor: Executor,
    parent: RunRecord,
    child: Workflow,
    *,
    join_id: str,
    index: int,
    context: str,
    due: bool,
    now: float,
    limit_key: str | None = None,
    parent_trace: tracecontext.RunTrace | None = None,
) -> NewRun:
    """A child run to create: due now (or at its wait's timeout) or held for its turn; in
    its parent's trace, under the parent's run span, when the parent journaled one."""
    run_id = compose.child_id(parent.id, parent.state, parent.visit(parent.state), index)
    traced = (
        {}
        if parent_trace is None
        else {tracecontext.TRACE_KEY: tracecontext.child_run_trace(parent_trace, run_id).to_data()}
    )
    first_due: float | None = entering(child, child.initial, now).get("due", now)
    created = JournalEvent(
        run_id=run_id,
        seq=1,
        kind=j.RUN_CREATED,
        at=now,
        state=child.initial,
        context=context,
        worker=executor.worker_id,
        data={
            "workflow": child.name,
            "version": child.version,
            "fingerprint": child.fingerprint,
            "key": None,
            "due": first_due if due else None,
            "join": join_id,
            "parent": parent.id,
            **child.context_stamp(),
            **({"limit_key": limit_key} if limit_key is not None else {}),
            **({"deadline": now + child.deadline} if child.deadline is not None else {}),
            **traced,
        },
    )
    return NewRun(
        record=j.create(created),
        events=[created],
        idempotency_key=f"child:{run_id}",
        parent_id=parent.id,
        child_index=index,
        held=not due,
        limit_key=limit_key,
    )


async def drive(
    executor: Executor,
    workflow: Workflow,
    record: RunRecord,
    fence: Fence,
    *,
    entered: JournalEvent | None = None,
) -> RunRecord | None:
    """A claimed run in a call or map state: fan out, wait again, or join. Returns the
    record when the run goes straight on with a step (as ``_advance`` does).

    ``entered``: the transition into the state, not committed yet (``record`` is the
    record before it), when an owned run goes on into the state: it is committed in the
    fan-out's transaction when that is one (a call, a small map), else first, alone."""
    if entered is not None:
        record = j.apply(record, entered)
    pending = [entered] if entered is not None else []

    async def flush() -> bool:
        if not pending:
            return True
        boundary = Boundary(events=list(pending), record=record, fence=fence)
        pending.clear()
        return await executor._commit(boundary)

    spec = workflow.composites[record.state]
    store = joins_of(executor)
    visit = record.visit(record.state)
    join = store.find_join(
        compose.join_id(record.id, record.state, visit), record.id, record.state, visit
    )
    # (Derived from the state's name; a migration that renamed the state kept its own.)
    join_id = compose.join_id(record.id, record.state, visit) if join is None else join.id
    made_before = join is not None and join.created >= join.total  # (an unpause, a recovery)
    if join is not None and join.complete:
        if not await flush():
            return None
        return await _join(executor, workflow, spec, record, fence, join_id)
    if join is None or join.created < join.total:
        ctx = workflow.load_context(record.context, record.context_version)
        try:
            contexts = child_contexts(spec, ctx)
        except Exception as error:
            if await flush():
                await _fail(executor, record, fence, error, "invalid_child_context")
            return None
        now = executor.clock.now()
        row = JoinRow(
            id=join_id,
            parent_id=record.id,
            state=record.state,
            visit=visit,
            child_workflow=spec.child.name,
            total=len(contexts),
            created=0,
            max_parallel=1 if isinstance(spec, CallSpec) else spec.max_parallel,
        )

        # Children join their parent's trace (one read of its first entry per fan-out).
        trace = tracecontext.stored_trace(executor.store.journal(record.id, until_seq=1))

        def batch_of(first: int) -> Callable[[int], list[NewRun]]:
            batch = contexts[first : first + CREATE_BATCH]

            def build(runnable: int) -> list[NewRun]:
                return [
                    new_child(
                        executor,
                        record,
                        child_workflow(spec, first + offset),
                        join_id=join_id,
                        index=first + offset,
                        context=start.context,
                        due=first + offset < runnable,
                        now=now,
                        limit_key=start.limit_key,
                        parent_trace=trace,
                    )
                    for offset, start in enumerate(batch)
                ]

            return build

        if join is None and 0 < len(contexts) <= CREATE_BATCH:
            # The usual case (a call, a small map): the join row, the children and the
            # parent's children_started in ONE transaction.
            boundary = _waiting(
                executor, spec, record, fence, join_id, len(contexts), pending=pending
            )
            if store.start_children(row, batch_of(0), boundary, at=now):
                executor.note_committed(boundary)  # the row as written (wait_join's may not be)
                _waited(executor, boundary)
                honour_left_request(executor, record.id)
            return None
        if not await flush():
            return None
        join = store.open_join(row, at=now)
        for first in range(join.created, len(contexts), CREATE_BATCH):
            store.create_children(join_id, first, batch_of(first))
            executor.stats.commits += 1
        if not contexts:  # nothing to wait for: join at once
            return await _join(executor, workflow, spec, record, fence, join_id)
    if not await flush():
        return None
    # Waiting for them again when it said so already (a crash between a large map's last
    # batch of children and its children_started leaves this claim the first to say it).
    again = made_before and any(
        event.kind == j.CHILDREN_STARTED and event.data.get("join") == join_id
        for event in executor.store.journal(record.id)
    )
    boundary = _waiting(executor, spec, record, fence, join_id, join.total, again=again)
    if store.wait_join(boundary, join_id):
        _waited(executor, boundary)
        honour_left_request(executor, record.id)
    return None


def honour_left_request(executor: Executor, run_id: str) -> None:
    """A pause or stop asked of a parent while its worker fanned out: the operator's
    cascade read the children there were then, and the fan-out's boundary let the parent
    go waiting with the request on it — which no claim would come to honour (shown
    ``scheduled`` for ever), the children made since neither stopped nor paused. Honoured
    now, as for a run nobody holds (fenced on the request: an operator doing the same
    meanwhile writes it once), and carried to every child."""
    store, worker = executor.store, executor.worker_id
    if not isinstance(store, JoinStoreMixin) or store.request_left(run_id) is None:
        return  # (the usual fan-out: its write found no request on the parent)
    stored = store.get_run(run_id)
    if stored is None or stored.owner is not None or stored.control not in CONTROLS:
        return
    action, now = stored.control, executor.clock.now()
    _, data = j.control_entry(action)
    honoured = _honouring(stored, action, data, now=now, worker=worker)
    if not store.write([honoured])[0]:
        return  # moved meanwhile: whoever moved it has the request in hand
    tell = executor._notify  # (listeners — metrics, tracing — hear of it as of a worker's)
    tell(honoured)
    if action == STOP:
        reason = "its parent was stopped"
        stop_children(store, run_id, now=now, worker=worker, reason=reason, tell=tell)
    else:
        pause_children(store, run_id, now=now, worker=worker, tell=tell)


def _honouring(
    stored: StoredRun, action: str, data: dict[str, Any], *, now: float, worker: str
) -> Boundary:
    """The boundary that pauses or stops (``action``) a run nobody holds, fenced on its row
    as read, the request it held then included (a request made since refuses it)."""
    kind, _ = j.control_entry(action)
    event = JournalEvent(
        run_id=stored.id,
        seq=stored.record.last_seq + 1,
        kind=kind,
        at=now,
        state=stored.record.state,
        worker=worker,
        data=data,
    )
    return Boundary(
        events=[event],
        record=j.apply(stored.record, event),
        fence=Fence(None, stored.lease_epoch),
        clear_control=True,
        seen_control=stored.control,
    )


def _waiting(
    executor: Executor,
    spec: Composite,
    record: RunRecord,
    fence: Fence,
    join_id: str,
    total: int,
    *,
    pending: Sequence[JournalEvent] = (),
    again: bool = False,
) -> Boundary:
    """The parent's boundary that leaves it waiting for its children (released), after
    the ``pending`` events that led ``record`` here (already applied to it); ``again``:
    they were all made before (the entry says so: no child was started now)."""
    data: dict[str, Any] = {
        "join": join_id,
        "children": total,
        "child_workflow": ",".join(wf.name for wf in spec.workflows()),
    }
    if again:
        data["again"] = True
    started = executor._event(record, j.CHILDREN_STARTED, state=record.state, data=data)
    return Boundary(
        events=[*pending, started], record=j.apply(record, started), fence=fence, release=True
    )


def _waited(executor: Executor, boundary: Boundary) -> None:
    executor.committer.released.add(boundary.run_id)
    executor.stats.commits += 1
    executor._notify(boundary)
    executor.fanned_out(boundary.run_id)  # its children are due


async def _join(
    executor: Executor,
    workflow: Workflow,
    spec: Composite,
    record: RunRecord,
    fence: Fence,
    join_id: str,
) -> RunRecord | None:
    store = joins_of(executor)
    ctx = workflow.load_context(record.context, record.context_version)
    results: list[ChildResult[Any]] = []
    try:
        for row in store.join_results(join_id):
            results.append(
                ChildResult(
                    index=row.index,
                    status=row.status,
                    context=child_workflow(spec, row.index).load_context(
                        row.context, row.context_version
                    ),
                    error=row.error,
                    branch=list(spec.branches)[row.index]
                    if isinstance(spec, ParallelSpec)
                    else None,
                )
            )
    except Exception as error:  # a child's context unreadable: the parent fails, not hangs
        await _fail(executor, record, fence, error, "child_unreadable")
        return None
    counts = {"succeeded": 0, "failed": 0, "stopped": 0}
    for result in results:
        counts[compose.call_outcome(result.status)] += 1
    outcome = "error"
    try:
        if isinstance(spec, CallSpec):
            outcome = compose.call_outcome(results[0].status)
            if spec.result is not None:
                where = f"call state {spec.name!r}: result="
                called(where, spec.result, ctx, results[0].context, error=JoinFunctionError)
        else:
            failed = len(results) - counts["succeeded"]
            outcome = compose.map_outcome(spec.tolerate_failures, len(results), failed)
            if spec.reduce is not None:
                where = f"{spec.kind} state {spec.name!r}: reduce="
                called(where, spec.reduce, ctx, results, error=JoinFunctionError)
        target = spec.on.get(outcome)
        if target is None:
            raise FlowloopError(
                f"{spec.kind} state {spec.name!r}: children ended {outcome!r} and the state "
                f"declares no on={{{outcome!r}: ...}}"
            )
        check_visits(workflow, record, target)
        context = ctx.model_dump_json()
        context_from(workflow.context, context)
    except Exception as error:
        # (A result= or reduce= that raised failed the run "child_succeeded": join_failed.)
        reason = "join_failed" if isinstance(error, JoinFunctionError) else f"child_{outcome}"
        await _fail(executor, record, fence, error, reason)
        return None
    joined = executor._event(
        record,
        j.CHILDREN_JOINED,
        state=record.state,
        event=outcome,
        next_state=target,
        context=context,
        data={**entering(workflow, target, executor.clock.now()), "join": join_id, **counts},
    )
    return await executor._advance(workflow, record, fence, joined)


async def _fail(
    executor: Executor, record: RunRecord, fence: Fence, error: BaseException, reason: str
) -> None:
    message = error_line(error)
    log.error(
        "run %s: %s: %s",
        record.id,
        record.state,
        message,
        extra={"run": record.id, "event": "run_failed"},
    )
    failed = executor._event(
        record,
        j.RUN_FAILED,
        state=record.state,
        error_type=type(error).__name__,
        error_message=message,
        data={"reason": reason},
    )
    await executor._finish(record, fence, [failed])


def cascade(store: Any, run_id: str, action: str, operate: Any) -> int:
    """Stop or pause (``action``: STOP or PARENT_PAUSE) every live child of ``run_id``, and
    theirs: ``operate(child_id, action)`` is the engine's own control of one run. A child
    paused already, or asked to pause, keeps its own pause. Returns how many."""
    if not isinstance(store, JoinStoreMixin):
        return 0
    count = 0
    # Last child first: a map's held children stop before the running ones, whose ends
    # would otherwise give them their turn (due, claimed, a first step run) on the way.
    for child in reversed(store.live_children(run_id)):
        if action in PAUSES and (child.record.status == "paused" or child.control in PAUSES):
            continue
        try:
            operate(child.id, action)
            count += 1
        except FlowloopError as error:  # ended meanwhile
            log.info("run %s: child %s not %sd: %s", run_id, child.id, action, error)
    return count


def has_live_children(store: Any, run_id: str) -> bool:
    """Whether the run has a live child (a stop of it cascades)."""
    return isinstance(store, JoinStoreMixin) and bool(store.live_children(run_id))


# -- the executor's composition hooks -----------------------------------------------------


class DeadlineCut(Exception):
    """Raised inside a step's drive when the run's deadline passes (never a user's error)."""


async def within_deadline(call: Coroutine[Any, Any, Any], record: RunRecord, clock: Clock) -> Any:
    """Await a step's call, cut off when the run's deadline passes (an async step is
    cancelled; a thread's late result is discarded, as after a timeout)."""
    assert record.deadline is not None
    remaining = record.deadline - clock.now()
    if remaining <= 0:
        call.close()
        raise DeadlineCut
    try:
        async with asyncio.timeout(remaining) as scope:
            return await call
    except TimeoutError:
        if scope.expired():
            raise DeadlineCut from None
        raise


async def past_deadline(
    executor: Executor, workflow: Workflow, record: RunRecord, fence: Fence
) -> RunRecord | None:
    """Move a run whose deadline passed to ``on_deadline`` (the context as it was)."""
    now = executor.clock.now()
    assert workflow.on_deadline is not None
    event = compose.deadline_event(
        workflow,
        record,
        now=now,
        worker=executor.worker_id,
        data=keeping_context(entering(workflow, workflow.on_deadline, now), record),
    )
    log.warning(
        "run %s: deadline passed in state %s; going to %s",
        record.id,
        record.state,
        workflow.on_deadline,
        extra={"run": record.id, "event": "deadline_passed"},
    )
    if record.state in workflow.composites:  # its children are no longer waited for
        # Stopped before the parent moves on: stopped after, a crash between left them
        # live for ever (a finished parent's children are recovered by nothing); stopped
        # first, a crash between leaves the parent past its deadline, and its next claim
        # comes back here.
        stopped = stop_children(
            executor.store, record.id, now=now, worker=executor.worker_id, tell=executor._notify
        )
        log.info("run %s: deadline passed; %d child run(s) stopped", record.id, stopped)
    return await executor._advance(workflow, record, fence, event)


def stop_children(
    store: Store,
    run_id: str,
    *,
    now: float,
    worker: str,
    reason: str = "its parent's deadline passed",
    tell: Tell | None = None,
) -> int:
    """Stop the live children of ``run_id`` (and theirs): at once when nobody holds one,
    else by a request its worker honours at the next boundary. Returns how many."""
    if not isinstance(store, JoinStoreMixin):
        return 0
    count = 0
    for child in reversed(store.live_children(run_id)):  # (last first: see cascade)
        count += stop_children(store, child.id, now=now, worker=worker, reason=reason, tell=tell)
        count += _control_child(
            store, child, STOP, now=now, worker=worker, reason=reason, tell=tell
        )
    return count


def pause_children(
    store: Store, run_id: str, *, now: float, worker: str, tell: Tell | None = None
) -> int:
    """Pause the live children of ``run_id`` (and theirs) as a parent's pause does (reason
    "parent paused", so that its unpause unpauses them): at once when nobody holds one,
    else by a request. A child paused already, or asked to pause or stop, is left as it is.
    Returns how many."""
    if not isinstance(store, JoinStoreMixin):
        return 0
    count = 0
    for child in store.live_children(run_id):
        if child.record.status == "paused" or child.control in (*PAUSES, STOP):
            continue
        count += pause_children(store, child.id, now=now, worker=worker, tell=tell)
        count += _control_child(
            store, child, PARENT_PAUSE, now=now, worker=worker, reason=PARENT_PAUSED, tell=tell
        )
    return count


def _control_child(
    store: Store,
    child: StoredRun,
    action: str,
    *,
    now: float,
    worker: str,
    reason: str,
    tell: Tell | None = None,
) -> bool:
    """Stop or pause (``action``: STOP or PARENT_PAUSE) one child as it is now: ask its
    worker (held or running), else write it (fenced on its row as read: claimed, ended or
    asked something meanwhile, look again); ``tell``: of what it wrote (the listeners)."""
    unless = () if action == STOP else (STOP, *PAUSES)
    for _ in range(STOP_ATTEMPTS):
        if child.record.status in FINISHED:
            return False
        if action != STOP and (child.record.status == "paused" or child.control in unless):
            return False  # paused, or asked to, meanwhile: that pause (or stop) stays its own
        if child.owner is not None or child.record.status == "running":
            return store.request_control(child.id, action, unless=unless)
        boundary = _honouring(child, action, {"reason": reason}, now=now, worker=worker)
        if store.write([boundary])[0]:
            if tell is not None:
                tell(boundary)
            return True
        fresh = store.get_run(child.id)
        if fresh is None:
            return False
        child = fresh
    # Still moving: its next claim honours it.
    return store.request_control(child.id, action, unless=unless)


async def claimed(
    executor: Executor, workflow: Workflow, record: RunRecord, fence: Fence
) -> RunRecord | None:
    """A claimed run in a state without a step of its own: a wait past the run's deadline,
    a call or map state, a compensating state, or a final state it sleeps before."""
    now = executor.clock.now()
    compensating = workflow.compensates(record.state)
    if compose.deadline_passed(record, now) and (
        not compensating or slept_past_deadline(record, executor.store.journal(record.id))
    ):
        return await past_deadline(executor, workflow, record, fence)
    if record.state in workflow.waits:
        return await executor._end_wait(workflow, record, fence)
    if record.state in workflow.composites:
        return await drive(executor, workflow, record, fence)
    if compensating:
        from flowloop import sagas

        return await sagas.drive(executor, workflow, record, fence)
    if workflow.is_final(record.state):  # (scheduled there: asleep before it, step.sleep)
        return await executor._end_sleep(workflow, record, fence)
    released = executor._event(record, j.RUN_RELEASED, state=record.state, data={"due": None})
    await executor._finish(record, fence, [released])
    return None


def error_route(
    workflow: Workflow, spec: StepSpec, record: RunRecord, error: BaseException
) -> tuple[str, str] | None:
    """The ``(event, target)`` of the step's ``on_error`` route for ``error``, unless the
    target refuses another visit (then the run fails as it would without a route)."""
    route = compose.route_error(spec.on_error, error, idempotent=spec.idempotent)
    if route is None:
        return None
    try:
        check_visits(workflow, record, route[1])
    except FlowloopError:
        return None
    return route


def interrupted(
    workflow: Workflow,
    record: RunRecord,
    data: dict[str, Any],
    message: str,
    now: float,
    undoing: str | None = None,
) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """Recovery of a run cut off mid-step: a compensation (of the step ``undoing``) runs
    again while its ``compensate_retry`` has attempts left (compensations are idempotent
    by their key); a non-idempotent step goes where ``on_error={Interrupted: ...}`` says,
    an idempotent one with no attempts left where its ``"*"`` says too.
    Returns the event's data, message and ``event``/``next_state`` fields."""
    if workflow.compensates(record.state):
        return (*compose.compensation_cut_off(workflow, undoing, record.attempt, now), {})
    spec = workflow.steps.get(record.state)
    if spec is None or "retry_at" in data:
        return data, message, {}
    route = error_route(workflow, spec, record, Interrupted(message))
    if route is None:
        return data, message, {}
    routed = {**keeping_context(entering(workflow, route[1], now), record), "route": "on_error"}
    return routed, message, {"event": route[0], "next_state": route[1]}


def family(store: Any, run_id: str) -> list[str]:
    """The run and its live descendants (what ``engine.run`` drives to the end). Looked up
    again after each round of that drive: a query per generation, ids and statuses (a
    query per run, of whole rows, made ``engine.run`` of a map of 800 items, 5 at a time,
    each calling a child, take 12.1 s instead of 3.5 on SQLite: quadratic)."""
    if not isinstance(store, JoinStoreMixin):
        return [run_id]
    return [run_id, *store.live_descendants(run_id)]


def paused_children(store: Any, run_id: str) -> list[str]:
    """The run's children its pause paused, or asked to pause at their next boundary
    (unpausing it unpauses them too); not a child an operator paused itself."""
    if not isinstance(store, JoinStoreMixin):
        return []
    return [
        c.id
        for c in store.live_children(run_id)
        if (c.record.status == "paused" and c.record.reason == PARENT_PAUSED)
        or (c.record.status != "paused" and c.control == PARENT_PAUSE)
    ]


def retryable_state(workflow: Workflow, state: str) -> bool:
    """An operator may retry a run from a call, map or compensating state too."""
    return state in workflow.composites or workflow.compensates(state)


def is_held(store: Store, run_id: str) -> bool:
    """A map's child not allowed to run yet (``max_parallel``)."""
    return isinstance(store, JoinStoreMixin) and store.is_held(run_id)
