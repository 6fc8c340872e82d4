"""Compensation (sagas) at run time.

A run that enters a compensating state (``final(..., compensate=True)``) is due at once.
The worker that claims it reads the journal, and for every step that succeeded in the run
and declares ``compensate=`` — newest first, skipping those whose ``compensation_succeeded``
is journaled — runs the compensation exactly like a step:

* ``compensation_started`` is committed before the function is called;
* its outcome is the next commit: ``compensation_succeeded`` (with the context after it)
  together with the next ``compensation_started``, or ``compensation_failed`` with a retry
  time (its own ``compensate_retry``) or, when it gives up, the run parked ``failed`` with
  reason ``compensation_failed: <state>: <error>`` for an operator (``flowloop retry``
  continues with the compensations still owed).

So a compensation whose success is committed never runs again; one cut off by a crash runs
again (it gets ``step.idempotency_key`` ending in ``:undo``) while its ``compensate_retry``
has attempts left — the cut-off attempt counts, as a step's does (compose.compensation_cut_off,
from recovery), else the run parks ``failed``. When none is owed the run ends
in the compensating state, ``succeeded``, reason ``compensated: <states undone>``.

A stop cancels the compensation in progress (the executor's cut-off writes ``run_stopped``
after its ``compensation_started``; a retry calls it again, from attempt 1); a pause (or
a stop that came after the call) is honoured at the next compensation's boundary, with
the success of the one that ran.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import TYPE_CHECKING, Any

from flowloop import compose
from flowloop import journal as j
from flowloop.contexts import context_from
from flowloop.definition import Step, Workflow
from flowloop.errors import StepExited, error_line, error_trace
from flowloop.journal import JournalEvent, RunRecord
from flowloop.outcome_log import (
    COMPENSATED,
    COMPENSATED_UNWRITTEN,
    UNDO_FAILED,
    UNDO_FAILED_UNWRITTEN,
)
from flowloop.owed import CompensationLost, Undo, compensations_due
from flowloop.store import Boundary, Fence
from flowloop.verdicts import DEFINITION_MISMATCH
from flowloop.versions import versions_of

if TYPE_CHECKING:
    from flowloop.executor import Executor


async def drive(
    executor: Executor, workflow: Workflow, record: RunRecord, fence: Fence
) -> RunRecord | None:
    """Run the compensations a claimed compensating run still owes, then end it."""
    events = executor.store.journal(record.id)
    try:
        owed = compensations_due(workflow, events, versions_of(executor.workflows, workflow.name))
    except CompensationLost as lost:
        # Owed the undoing of a step this definition has none for: parked as a definition
        # mismatch (the claim's verdict parks such a run first), never ended without it.
        reason = f"{DEFINITION_MISMATCH}: {lost}"
        parked = executor._event(
            record, j.RUN_PAUSED, state=record.state, error_message=reason, data={"reason": reason}
        )
        await executor._finish(record, fence, [parked])
        return None
    undone = compose.undone(events)
    pending: list[JournalEvent] = []  # a success, committed with what follows it
    for undo in owed:
        spec = workflow.steps[undo.state]
        assert spec.compensate is not None
        # A pause or stop asked during the previous compensation: honoured at this
        # boundary, with that one's success (unpaused or retried, the run goes on with the
        # compensations still owed), unless withdrawn meanwhile.
        if (
            pending
            and record.id in executor._controls
            and await _honoured(executor, record, fence, pending) is not None
        ):
            return None
        after = record
        for event in pending:  # the previous one's success (attempt back to 0)
            after = j.apply(after, event)
        attempt = after.attempt + 1
        started = executor._event(
            after,
            j.COMPENSATION_STARTED,
            state=undo.state,
            attempt=attempt,
            data={"for_seq": undo.seq},
        )
        batch = [*pending, started]
        after = j.apply(after, started)
        boundary = Boundary(events=batch, record=after, fence=fence)
        if not await executor.outcomes.said(record.id, executor._commit(boundary)):
            return None
        record, pending = after, []
        function = spec.compensate
        undo_spec = dataclasses.replace(
            spec,
            fn=function,
            is_async=inspect.iscoroutinefunction(function),
            wants_step=_wants_step(function),
        )
        step = Step(
            run_id=record.id,
            workflow=workflow.name,
            # The key of the step it undoes (its name and visit then), plus ":undo".
            state=undo.ran_as,
            attempt=attempt,
            visit=undo.visit,
            seq=record.last_seq,
            worker=executor.worker_id,
            compensating=True,
        )
        ctx = workflow.load_context(record.context, record.context_version)
        began = executor.clock.monotonic()
        try:
            await executor._call(record, undo_spec, ctx, step)
            context = ctx.model_dump_json()
            context_from(workflow.context, context)
        except (Exception, SystemExit) as caught:
            error = StepExited.instead_of(caught, f"compensation of {undo.state!r}")
            executor.stats.compensations += 1
            await _failed(executor, workflow, record, fence, undo, error, began)
            return None
        executor.stats.compensations += 1
        pending = [
            executor._event(
                record,
                j.COMPENSATION_SUCCEEDED,
                state=undo.state,
                attempt=attempt,
                context=context,
                duration=executor.clock.monotonic() - began,
                # The version of the context written (upcast, when older): see entering().
                data={"for_seq": undo.seq, **workflow.context_stamp()},
            )
        ]
        executor.outcomes.hold(  # said once committed, with what follows it (outcomes.said)
            record.id,
            pending[0].seq,
            logging.INFO,
            COMPENSATED,
            COMPENSATED_UNWRITTEN,
            (record.id, undo.state),
            {"run": record.id, "state": undo.state, "event": "compensation_succeeded"},
        )
        undone.append(undo.state)
    reason = "compensated: " + (", ".join(undone) if undone else "nothing to undo")
    finished = executor._event(
        record,
        j.RUN_COMPENSATED,
        offset=len(pending) + 1,
        state=record.state,
        data={"reason": reason, "undone": undone},
    )
    await executor.outcomes.said(record.id, executor._finish(record, fence, [*pending, finished]))
    return None


async def _honoured(
    executor: Executor, record: RunRecord, fence: Fence, pending: list[JournalEvent]
) -> bool | None:
    """Commit ``pending`` (a compensation's success) with the entry honouring the run's
    request; as ``_commit_honouring`` answers (``None``: withdrawn, nothing written)."""
    action = executor._confirmed_control(record.id)
    if action is None:
        return None

    def entries(honour: str) -> list[JournalEvent]:
        kind, data = j.control_entry(honour)
        offset = len(pending) + 1
        entry = executor._event(record, kind, offset=offset, state=record.state, data=data)
        return [*pending, entry]

    try:
        done = await executor._commit_honouring(record, fence, action, entries)
    except BaseException:
        executor.outcomes.drop(record.id)  # (whether it was written is not known)
        raise
    if done is not None:  # (withdrawn: the success's line waits for its commit)
        executor.outcomes.settle(record.id)
    return done


async def _failed(
    executor: Executor,
    workflow: Workflow,
    record: RunRecord,
    fence: Fence,
    undo: Undo,
    error: Exception,
    began: float,
) -> None:
    retry = compose.compensation_retry(workflow, undo.state)
    retryable = retry.should_retry(error, record.attempt)
    message = error_line(error)
    data: dict[str, Any] = {"for_seq": undo.seq}
    if retryable:
        data["retry_at"] = executor.clock.now() + retry.delay(record.attempt)
    else:
        data["reason"] = (
            f"compensation_failed: {undo.state}: {type(error).__name__}: {message} "
            "(fix it, then `flowloop retry` runs the compensations still owed)"
        )
    failed = executor._event(
        record,
        j.COMPENSATION_FAILED,
        state=undo.state,
        attempt=record.attempt,
        duration=executor.clock.monotonic() - began,
        error_type=type(error).__name__,
        error_message=message,
        traceback=error_trace(error),
        retryable=retryable,
        data=data,
    )
    executor.outcomes.hold(
        record.id,
        failed.seq,
        logging.INFO if retryable else logging.ERROR,
        UNDO_FAILED,
        UNDO_FAILED_UNWRITTEN,
        (record.id, undo.state, record.attempt, message),
        {"run": record.id, "state": undo.state, "event": "compensation_failed"},
    )
    await executor.outcomes.said(record.id, executor._finish(record, fence, [failed]))
    if retryable:
        executor.wake(record.id)


def _wants_step(function: Any) -> bool:
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return any(p.kind == p.VAR_POSITIONAL for p in parameters) or len(positional) >= 2
