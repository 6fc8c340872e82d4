"""The engine on a real SQLite file: running, retrying, replaying, operating, versions."""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.errors import (
    DefinitionError,
    FlowloopError,
    InvalidContext,
    InvalidTransition,
    UnknownRun,
)
from flowloop.journal import JournalEvent, RunRecord
from flowloop.store.schema import runs

DEADLINE_S = 10.0
QUICK = Retry(attempts=3, backoff="fixed", base=0, cap=0)


class Order(BaseModel):
    order_id: str
    in_stock: bool = True
    flaky: int = 0
    """How many times charge fails before it works."""
    charge_id: str | None = None
    trail: list[str] = []


def order_workflow(*, version: int = 1, retry: Retry | None = None) -> tuple[Workflow, list[Any]]:
    """reserve -> charge (flaky) -> ship -> delivered | cancelled. Returns the workflow and a
    list every step execution appends (state, attempt, idempotency key) to."""
    calls: list[Any] = []
    wf = Workflow("order", context=Order, version=version, key="order_id")

    @wf.step(initial=True, on={"reserved": "charge", "out_of_stock": "cancelled"})
    def reserve(ctx: Order, step: Step) -> str:
        calls.append(("reserve", step.attempt, step.idempotency_key))
        ctx.trail.append("reserve")
        return "reserved" if ctx.in_stock else "out_of_stock"

    @wf.step(
        on={"charged": "ship"},
        retry=retry
        or Retry(attempts=5, backoff="exponential", base=10, cap=25, on=(ConnectionError,)),
    )
    async def charge(ctx: Order, step: Step) -> str:
        calls.append(("charge", step.attempt, step.idempotency_key))
        if step.attempt <= ctx.flaky:
            raise ConnectionError(f"gateway down (attempt {step.attempt})")
        ctx.charge_id = f"ch-{step.idempotency_key}"
        ctx.trail.append("charge")
        return "charged"

    @wf.step(next="delivered", idempotent=False)
    def ship(ctx: Order) -> None:
        calls.append(("ship", 1, ""))
        ctx.trail.append("ship")

    wf.final("delivered", "cancelled")
    return wf, calls


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine(sqlite_url: str, clock: FakeClock) -> Iterator[Engine]:
    with Engine(sqlite_url, clock=clock, poll_seconds=0.02) as e:
        yield e


def kinds(engine: Engine, run_id: str) -> list[str]:
    return [e.kind for e in engine.history(run_id)]


def assert_replay_matches(engine: Engine, run_ids: Sequence[str]) -> None:
    for run_id in run_ids:
        replay = engine.replay(run_id)
        assert replay.matches, (run_id, replay.differences)


# -- running ------------------------------------------------------------------------------


def test_run__to_success(engine: Engine) -> None:
    wf, calls = order_workflow()
    info = engine.run(wf, Order(order_id="A1"))
    assert (info.status, info.state) == ("succeeded", "delivered")
    assert isinstance(info.context, Order)
    assert info.context.trail == ["reserve", "charge", "ship"]
    assert info.context.charge_id == f"ch-{info.id}:charge:1"
    assert info.owner is None and info.next_run_at is None
    assert kinds(engine, info.id) == [
        j.RUN_CREATED,
        j.STEP_STARTED,
        j.STEP_SUCCEEDED,
        j.STEP_STARTED,
        j.STEP_SUCCEEDED,
        j.STEP_STARTED,
        j.STEP_SUCCEEDED,
    ]
    assert [c[0] for c in calls] == ["reserve", "charge", "ship"]
    assert_replay_matches(engine, [info.id])


def test_run__one_write_transaction_per_step_boundary(tmp_path: Path) -> None:
    # Counted at the driver (SQLite's trace callback sees every statement, whichever
    # layer sends it): every connection the store opens is traced from its start.
    statements: list[str] = []
    url = f"sqlite:///{tmp_path / 'count.db'}"

    with Engine(url) as engine:

        def trace(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.set_trace_callback(statements.append)

        engine.store.engine.dispose()  # type: ignore[attr-defined]
        sa.event.listen(engine.store.engine, "connect", trace)  # type: ignore[attr-defined]
        engine.store._writer = None  # type: ignore[attr-defined]
        wf, _ = order_workflow()
        engine.register(wf)
        statements.clear()
        info = engine.run(wf, Order(order_id="C1"))
    assert info.status == "succeeded"
    # Write transactions: BEGIN IMMEDIATE … COMMIT, or one write statement in autocommit
    # (its own transaction: the usual boundary is one fenced INSERT).
    transactions, alone, inside = 0, 0, False
    for statement in statements:
        if statement.startswith("BEGIN IMMEDIATE"):
            transactions, inside = transactions + 1, True
        elif statement in ("COMMIT", "ROLLBACK"):
            inside = False
        elif not inside and statement.split(None, 1)[0] in ("INSERT", "UPDATE", "DELETE"):
            transactions, alone = transactions + 1, alone + 1
    # The run created with its first step_started, then one per step's outcome (carrying
    # the next step_started): the two that go on are one statement each.
    assert (transactions, alone) == (1 + 3, 2)


def test_run__where_sync_steps_run(engine: Engine) -> None:
    """Engine.run calls a plain ``def`` step without a timeout on its own thread (its loop
    drives that run only: no thread hop); a step with a timeout, and every sync step of
    runs driven by run_until_idle or awaited with arun, runs in the step threads."""
    threads: dict[str, str] = {}
    wf = Workflow("w", context=Order)

    @wf.step(initial=True, next="b")
    def a(ctx: Order) -> None:
        threads.setdefault("sync", threading.current_thread().name)

    @wf.step(next="c", timeout=30)
    def b(ctx: Order) -> None:
        threads.setdefault("sync with timeout", threading.current_thread().name)

    @wf.step(next="done")
    async def c(ctx: Order) -> None:
        threads.setdefault("async", threading.current_thread().name)

    wf.final("done")
    here = threading.current_thread().name
    engine.run(wf, Order(order_id="t"))
    assert threads == {
        "sync": here,
        "sync with timeout": threads["sync with timeout"],
        "async": here,
    }
    assert threads["sync with timeout"].startswith("flowloop-step")
    threads.clear()
    engine.start(wf, Order(order_id="u"))
    engine.run_until_idle()
    assert threads["sync"].startswith("flowloop-step")
    threads.clear()
    asyncio.run(engine.arun(wf, Order(order_id="v")))
    assert threads["sync"].startswith("flowloop-step")


def test_run__queued_runs_executed_by_run_until_idle(engine: Engine) -> None:
    wf, _ = order_workflow()
    ids = [engine.start(wf, Order(order_id=f"Q{n}")).id for n in range(5)]
    assert {engine.get(i).status for i in ids} == {"scheduled"}
    stats = engine.run_until_idle()
    assert stats.steps == 15
    assert stats.commits < stats.boundaries  # group commit shares transactions
    assert {engine.get(i).status for i in ids} == {"succeeded"}


def test_run__while_other_runs_are_due_drives_only_its_own(engine: Engine) -> None:
    wf, _ = order_workflow()
    queued = engine.start(wf, Order(order_id="queued"))
    info = engine.run(wf, Order(order_id="mine"))
    assert info.status == "succeeded"
    assert engine.get(queued.id).status == "scheduled"


def test_run__retries_with_backoff_then_takes_the_branch(engine: Engine, clock: FakeClock) -> None:
    wf, calls = order_workflow()
    t0 = clock.now()
    info = engine.run(wf, Order(order_id="R1", flaky=3))
    assert info.status == "succeeded"
    assert [c[1] for c in calls if c[0] == "charge"] == [1, 2, 3, 4]
    assert len({c[2] for c in calls if c[0] == "charge"}) == 1  # one key for every attempt
    history = engine.history(info.id)
    failures = [e for e in history if e.kind == j.STEP_FAILED]
    assert [e.attempt for e in failures] == [1, 2, 3]
    assert all(e.error_type == "ConnectionError" and e.retryable for e in failures)
    assert [e.data["retry_at"] - e.at for e in failures] == [10.0, 20.0, 25.0]  # capped
    for failure in failures:  # the next attempt starts no earlier than its retry time
        nxt = next(e for e in history if e.seq == failure.seq + 1)
        assert nxt.kind == j.STEP_STARTED and nxt.at >= failure.data["retry_at"]
    assert clock.now() - t0 >= 55.0  # the fake clock moved; nobody slept
    cancelled = engine.run(wf, Order(order_id="R2", in_stock=False))
    assert (cancelled.status, cancelled.state) == ("succeeded", "cancelled")
    assert_replay_matches(engine, [info.id, cancelled.id])


def test_run__retries_exhausted_ends_failed(engine: Engine) -> None:
    wf, calls = order_workflow(retry=Retry(attempts=3, base=0, on=(ConnectionError,)))
    info = engine.run(wf, Order(order_id="F1", flaky=99))
    assert (info.status, info.state, info.reason) == ("failed", "charge", "error")
    assert info.error == "ConnectionError: gateway down (attempt 3)"
    assert [c[1] for c in calls if c[0] == "charge"] == [1, 2, 3]
    last = engine.history(info.id)[-1]
    assert last.kind == j.STEP_FAILED and last.retryable is False
    assert last.traceback is not None and "ConnectionError" in last.traceback
    assert_replay_matches(engine, [info.id])


def test_run__non_retryable_error_fails_at_once(engine: Engine) -> None:
    wf = Workflow("w", context=Order)

    @wf.step(
        initial=True,
        next="done",
        retry=Retry(attempts=5, base=0, on=(OSError,), giving_up_on=(PermissionError,)),
    )
    def a(ctx: Order) -> None:
        raise PermissionError("card blocked")

    wf.final("done")
    info = engine.run(wf, Order(order_id="x"))
    assert info.status == "failed" and info.error == "PermissionError: card blocked"
    assert kinds(engine, info.id).count(j.STEP_STARTED) == 1


def test_run__undeclared_event_fails_with_that_message(engine: Engine) -> None:
    wf = Workflow("w", context=Order)
    attempts: list[int] = []

    @wf.step(initial=True, on={"yes": "done", "no": "done"}, retry=QUICK)
    def decide(ctx: Order, step: Step) -> str:
        attempts.append(step.attempt)
        return "maybe"

    wf.final("done")
    info = engine.run(wf, Order(order_id="x"))
    assert (info.status, info.state) == ("failed", "decide")
    assert info.error == (
        "InvalidEvent: state 'decide' does not accept event 'maybe' (it accepts: no, yes)"
    )
    assert attempts == [1]  # a wrong event is a bug, not bad luck: never retried


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_run__step_breaking_its_context_fails(engine: Engine) -> None:
    wf = Workflow("w", context=Order)

    @wf.step(initial=True, next="done", retry=QUICK)
    def a(ctx: Order) -> None:
        ctx.flaky = "lots"  # type: ignore[assignment]

    wf.final("done")
    info = engine.run(wf, Order(order_id="x"))
    assert info.status == "failed" and info.error is not None
    assert info.error.startswith("ValidationError: flaky:")
    assert kinds(engine, info.id).count(j.STEP_STARTED) == 1


def test_run__unserializable_context_field_fails_at_once_naming_the_field(
    engine: Engine,
) -> None:
    class Holder(BaseModel):
        order_id: str
        extras: dict[str, Any] = {}

    wf = Workflow("holds", context=Holder)
    attempts: list[int] = []

    @wf.step(initial=True, next="done", retry=Retry(attempts=3, base=0, on=(Exception,)))
    def grab(ctx: Holder, step: Step) -> None:
        attempts.append(step.attempt)
        ctx.extras = {"ok": 1, "guard": [threading.Lock()]}

    wf.final("done")
    info = engine.run(wf, Holder(order_id="x"))
    assert info.status == "failed" and info.error is not None
    assert info.error.startswith("ContextNotSerializable: ")
    assert "field 'extras.guard[0]'" in info.error and "step 'grab'" in info.error
    assert attempts == [1]  # the journal cannot hold it: no retry can help
    (failed,) = [e for e in engine.history(info.id) if e.kind == j.STEP_FAILED]
    assert failed.retryable is False


def test_run__steps_get_their_own_copy_of_the_context(engine: Engine) -> None:
    wf = Workflow("w", context=Order)
    seen: list[list[str]] = []

    @wf.step(initial=True, next="done", retry=QUICK)
    def a(ctx: Order, step: Step) -> None:
        seen.append(list(ctx.trail))
        ctx.trail.append(f"attempt {step.attempt}")
        if step.attempt == 1:
            raise RuntimeError("changes of a failed attempt are not kept")

    wf.final("done")
    info = engine.run(wf, Order(order_id="x"))
    assert seen == [[], []]
    assert isinstance(info.context, Order) and info.context.trail == ["attempt 2"]


# -- timeouts -----------------------------------------------------------------------------


def test_timeout__async_step_cancelled_and_retried(engine: Engine) -> None:
    wf = Workflow("w", context=Order)
    cancelled = threading.Event()

    @wf.step(initial=True, next="done", timeout=0.05, retry=QUICK)
    async def slow(ctx: Order, step: Step) -> None:
        if step.attempt == 1:
            try:
                await asyncio.sleep(DEADLINE_S)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        ctx.charge_id = f"attempt {step.attempt}"

    wf.final("done")
    started = time.monotonic()
    info = engine.run(wf, Order(order_id="x"))
    assert time.monotonic() - started < DEADLINE_S / 2
    assert cancelled.is_set()
    assert info.status == "succeeded"
    assert isinstance(info.context, Order) and info.context.charge_id == "attempt 2"
    failed = [e for e in engine.history(info.id) if e.kind == j.STEP_FAILED]
    assert [(e.error_type, e.error_message) for e in failed] == [
        ("StepTimeout", "step 'slow' took longer than 0.05s")
    ]


def test_timeout__async_step_without_retry_fails(engine: Engine) -> None:
    wf = Workflow("w", context=Order)

    @wf.step(initial=True, next="done", timeout=0.05, retry=Retry(attempts=1))
    async def slow(ctx: Order) -> None:
        await asyncio.sleep(DEADLINE_S)

    wf.final("done")
    info = engine.run(wf, Order(order_id="x"))
    assert info.status == "failed" and info.error is not None
    assert info.error.startswith("StepTimeout")


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_timeout__sync_step_late_result_discarded(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread cannot be killed: attempt 1 finishes after attempt 2 has committed. Its
    result must not reach the journal or the row."""
    caplog.set_level(logging.WARNING, logger="flowloop")
    wf = Workflow("w", context=Order)
    release, late_done = threading.Event(), threading.Event()

    @wf.step(initial=True, next="done", timeout=0.1, retry=QUICK)
    def slow(ctx: Order, step: Step) -> None:
        if step.attempt == 1:
            release.wait(DEADLINE_S)
            ctx.charge_id = "LATE attempt 1"
            late_done.set()
            return
        ctx.charge_id = f"attempt {step.attempt}"
        release.set()  # attempt 1 wakes up now, while this attempt commits

    wf.final("done")
    info = engine.run(wf, Order(order_id="x"))
    assert late_done.wait(DEADLINE_S)
    _wait_for(lambda: "result discarded" in caplog.text, "the late-result warning")
    assert info.status == "succeeded"
    after = engine.get(info.id)
    assert isinstance(after.context, Order) and after.context.charge_id == "attempt 2"
    assert after.last_seq == info.last_seq
    history = engine.history(info.id)
    assert all("LATE" not in (e.context or "") for e in history)
    assert [(e.kind, e.attempt) for e in history[1:]] == [
        (j.STEP_STARTED, 1),
        (j.STEP_FAILED, 1),
        (j.STEP_STARTED, 2),
        (j.STEP_SUCCEEDED, 2),
    ]
    assert_replay_matches(engine, [info.id])


def test_timeout__sync_step_without_retry_fails_and_late_result_is_ignored(
    engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flowloop")
    wf = Workflow("w", context=Order)
    release, late_done = threading.Event(), threading.Event()

    @wf.step(initial=True, next="done", timeout=0.05, retry=Retry(attempts=1))
    def slow(ctx: Order) -> None:
        release.wait(DEADLINE_S)
        ctx.charge_id = "LATE"
        late_done.set()

    wf.final("done")
    info = engine.run(wf, Order(order_id="x"))
    assert info.status == "failed" and info.error is not None
    assert info.error.startswith("StepTimeout")
    release.set()
    assert late_done.wait(DEADLINE_S)
    _wait_for(lambda: "result discarded" in caplog.text, "the late-result warning")
    after = engine.get(info.id)
    assert after.status == "failed" and after.last_seq == info.last_seq
    assert isinstance(after.context, Order) and after.context.charge_id is None


# -- cycles -------------------------------------------------------------------------------


class Poll(BaseModel):
    asks: int = 0
    ready_after: int = 99


def poll_workflow(max_visits: int) -> Workflow:
    wf = Workflow("poll", context=Poll)

    @wf.step(initial=True, on={"wait": "pause", "ready": "done"}, max_visits=max_visits)
    def ask(ctx: Poll) -> str:
        ctx.asks += 1
        return "ready" if ctx.asks >= ctx.ready_after else "wait"

    @wf.step(next="ask")
    def pause(ctx: Poll) -> None: ...

    wf.final("done")
    return wf


def test_max_visits__endless_cycle_ends_failed(engine: Engine) -> None:
    info = engine.run(poll_workflow(max_visits=3), Poll())
    assert (info.status, info.state) == ("failed", "pause")
    assert info.error == ("MaxVisitsExceeded: state 'ask' would be visited 4 times (max_visits=3)")
    assert isinstance(info.context, Poll) and info.context.asks == 3
    assert info.visits == {"ask": 3, "pause": 3}
    assert_replay_matches(engine, [info.id])


def test_max_visits__cycle_within_limit_succeeds(engine: Engine) -> None:
    info = engine.run(poll_workflow(max_visits=3), Poll(ready_after=3))
    assert info.status == "succeeded" and info.visits == {"ask": 3, "pause": 2, "done": 1}


def test_step__idempotency_key_per_visit(engine: Engine) -> None:
    wf = Workflow("w", context=Poll)
    keys: list[tuple[int, int, str]] = []

    @wf.step(initial=True, on={"again": "a", "done": "done"}, retry=QUICK)
    def a(ctx: Poll, step: Step) -> str:
        keys.append((step.visit, step.attempt, step.idempotency_key))
        if step.attempt == 1:
            raise RuntimeError("first attempt of every visit fails")
        ctx.asks += 1
        return "again" if ctx.asks < 2 else "done"

    wf.final("done")
    info = engine.run(wf, Poll())
    assert keys == [
        (1, 1, f"{info.id}:a:1"),
        (1, 2, f"{info.id}:a:1"),
        (2, 1, f"{info.id}:a:2"),
        (2, 2, f"{info.id}:a:2"),
    ]


# -- concurrency --------------------------------------------------------------------------


class Slot(BaseModel):
    n: int


def gauge_workflow(
    name: str, gauge: dict[str, int], max_concurrency: int | None = None
) -> Workflow:
    wf = Workflow(name, context=Slot, max_concurrency=max_concurrency)

    @wf.step(initial=True, next="done")
    async def work(ctx: Slot) -> None:
        gauge["now"] += 1
        gauge["peak"] = max(gauge["peak"], gauge["now"])
        await asyncio.sleep(0.02)
        gauge["now"] -= 1

    wf.final("done")
    return wf


def test_concurrency__bounded_globally(sqlite_url: str) -> None:
    gauge = {"now": 0, "peak": 0}
    wf = gauge_workflow("g", gauge)
    with Engine(sqlite_url, clock=FakeClock(), max_concurrency=3, workflows=[wf]) as engine:
        for n in range(10):
            engine.start(wf, Slot(n=n))
        engine.run_until_idle()
        assert gauge["peak"] == 3
        assert {r.status for r in engine.runs()} == {"succeeded"}


def test_concurrency__bounded_per_workflow(sqlite_url: str) -> None:
    gauge = {"now": 0, "peak": 0}
    wf = gauge_workflow("g", gauge, max_concurrency=1)
    with Engine(sqlite_url, clock=FakeClock(), max_concurrency=8, workflows=[wf]) as engine:
        for n in range(4):
            engine.start(wf, Slot(n=n))
        engine.run_until_idle()
        assert gauge["peak"] == 1
        assert len(engine.runs(status="succeeded")) == 4


# -- starting twice -----------------------------------------------------------------------


def test_start__same_business_key_returns_the_same_run(engine: Engine) -> None:
    wf, calls = order_workflow()
    first = engine.start(wf, Order(order_id="K1"))
    again = engine.start(wf, Order(order_id="K1", in_stock=False))
    assert again.id == first.id
    assert isinstance(again.context, Order) and again.context.in_stock
    done = engine.run(wf, Order(order_id="K1"))
    assert done.id == first.id and done.status == "succeeded"
    rerun = engine.run(wf, Order(order_id="K1"))
    assert rerun.id == first.id and len(calls) == 3  # nothing executed twice
    assert engine.find(wf, key="K1") is not None
    assert len(engine.runs(workflow="order")) == 1


def test_start__same_idempotency_key_returns_the_same_run(engine: Engine) -> None:
    wf = Workflow("nokey", context=Slot)
    wf.step(name="a", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    first = engine.start(wf, Slot(n=1), idempotency_key="req-1")
    again = engine.start(wf, Slot(n=2), idempotency_key="req-1")
    other = engine.start(wf, Slot(n=3), idempotency_key="req-2")
    assert again.id == first.id and other.id != first.id


def test_start__invalid_context_refused(engine: Engine) -> None:
    wf, _ = order_workflow()
    with pytest.raises(InvalidContext, match="order_id"):
        engine.start(wf, {"in_stock": True})
    assert engine.runs() == []


def test_start_many__batches_then_runs_each_once_and_a_second_start_adds_only_the_missing(
    engine: Engine,
) -> None:
    wf, calls = order_workflow()
    batches: list[tuple[int, int]] = []
    first_five = [{"order_id": f"M{n}"} for n in range(5)]
    started = engine.start_many(
        wf, first_five, batch_size=2, progress=lambda done, total: batches.append((done, total))
    )
    assert batches == [(2, 5), (4, 5), (5, 5)]  # three transactions
    assert [info.key for info in started] == [f"M{n}" for n in range(5)]  # in order
    assert {info.status for info in started} == {"scheduled"} and started.created == 5
    # After a crash, the whole list again (plus a duplicate within it): only M5 is new.
    again = engine.start_many(wf, [*first_five, {"order_id": "M5"}, {"order_id": "M5"}])
    assert [info.id for info in again[:5]] == [info.id for info in started]
    assert again[5].id == again[6].id and again[5].id not in {info.id for info in started}
    assert again.created == 1 and len(again) == 7
    assert len(engine.runs(workflow="order")) == 6
    engine.run_until_idle()
    assert {info.status for info in engine.runs(workflow="order")} == {"succeeded"}
    assert sorted(call[0] for call in calls).count("ship") == 6  # each run once
    assert_replay_matches(engine, [info.id for info in again])


def test_start_many__an_invalid_context_writes_nothing_and_names_its_position(
    engine: Engine,
) -> None:
    wf, _ = order_workflow()
    contexts = [{"order_id": "V1"}, {"order_id": "V2"}, {"in_stock": False}]
    with pytest.raises(InvalidContext, match=r"context #3 for workflow 'order'.*order_id"):
        engine.start_many(wf, contexts, batch_size=1)
    assert engine.runs() == []
    with pytest.raises(FlowloopError, match="batch_size"):
        engine.start_many(wf, contexts[:1], batch_size=0)


def test_start__run_at_in_the_future_waits(engine: Engine, clock: FakeClock) -> None:
    wf, calls = order_workflow()
    later = engine.start(wf, Order(order_id="L"), run_at=clock.now() + 3600)
    engine.run_until_idle(idle_horizon=60)
    assert engine.get(later.id).status == "scheduled" and calls == []
    clock.advance(3600)
    engine.run_until_idle()
    assert engine.get(later.id).status == "succeeded"


# -- replay -------------------------------------------------------------------------------


def test_replay__fold_equals_row_for_retries_and_branches(engine: Engine) -> None:
    wf, _ = order_workflow(retry=Retry(attempts=3, base=1, on=(ConnectionError,)))
    contexts = [
        Order(order_id="ok"),
        Order(order_id="flaky", flaky=2),
        Order(order_id="dead", flaky=9),
        Order(order_id="none", in_stock=False),
    ]
    ids = [engine.start(wf, c).id for c in contexts]
    engine.run_until_idle()
    assert [engine.get(i).status for i in ids] == ["succeeded", "succeeded", "failed", "succeeded"]
    assert_replay_matches(engine, ids)


def test_replay__at_a_seq_shows_the_context_then(engine: Engine) -> None:
    wf, _ = order_workflow()
    info = engine.run(wf, Order(order_id="S1"))
    history = engine.history(info.id)
    after_reserve = next(e for e in history if e.kind == j.STEP_SUCCEEDED)
    replay = engine.replay(info.id, at=after_reserve.seq)
    assert replay.seq == after_reserve.seq
    assert replay.record.state == "charge" and replay.record.status == "scheduled"
    assert json.loads(replay.record.context)["trail"] == ["reserve"]
    assert engine.replay(info.id, at=1).record.state == "reserve"
    assert replay.matches  # the comparison is always of the full fold
    # (It named the CLI's --at to a Python caller: API audit.)
    with pytest.raises(FlowloopError, match=f"has seq 1..{len(history)}; seq 99 is outside$"):
        engine.replay(info.id, at=99)
    with pytest.raises(UnknownRun):
        engine.replay("nope")
    with pytest.raises(TypeError, match="a run id is a string"):  # an AttributeError before
        engine.get(None)  # type: ignore[arg-type]


def test_replay__tampered_row_is_reported(engine: Engine) -> None:
    wf, _ = order_workflow()
    info = engine.run(wf, Order(order_id="T"))
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(sa.update(runs).where(runs.c.id == info.id).values(state="charge"))
    assert engine.replay(info.id).differences == [
        "state: journal says 'delivered', row says 'charge'"
    ]


# -- operator actions ---------------------------------------------------------------------


class Three(BaseModel):
    n: int = 0
    fail_at_c: bool = True
    seen: list[str] = []


def three_workflow(calls: list[str]) -> Workflow:
    wf = Workflow("three", context=Three)

    @wf.step(initial=True, next="b")
    def a(ctx: Three) -> None:
        calls.append("a")
        ctx.n += 1
        ctx.seen.append(f"a:{ctx.n}")

    @wf.step(next="c")
    def b(ctx: Three) -> None:
        calls.append("b")
        ctx.n += 10
        ctx.seen.append(f"b:{ctx.n}")

    @wf.step(next="done", retry=Retry(attempts=1))
    def c(ctx: Three) -> None:
        calls.append("c")
        if ctx.fail_at_c:
            raise RuntimeError("c refuses")
        ctx.seen.append(f"c:{ctx.n}")

    wf.final("done")
    return wf


def test_retry__from_a_past_state_with_edited_context(engine: Engine) -> None:
    calls: list[str] = []
    wf = three_workflow(calls)
    failed = engine.run(wf, Three())
    assert (failed.status, failed.state) == ("failed", "c")
    retried = engine.retry(failed.id, from_state="b", set_fields={"fail_at_c": False}, by="alice")
    assert (retried.status, retried.state) == ("scheduled", "b")
    # b's context as recorded when the run entered b, plus the edit.
    assert isinstance(retried.context, Three)
    assert retried.context.seen == ["a:1"] and retried.context.n == 1
    assert not retried.context.fail_at_c
    last = engine.history(failed.id)[-1]
    assert last.kind == j.RUN_RETRIED
    assert dict(last.data) == {"by": "alice", "from": "b", "set": {"fail_at_c": False}}
    assert last.worker is not None and last.worker.startswith("operator:")
    engine.run_until_idle()
    done = engine.get(failed.id)
    assert done.status == "succeeded"
    assert isinstance(done.context, Three) and done.context.seen == ["a:1", "b:11", "c:11"]
    assert calls == ["a", "b", "c", "b", "c"]
    assert done.visits == {"a": 1, "b": 2, "c": 2, "done": 1}
    assert_replay_matches(engine, [failed.id])


def test_retry__invalid_edit_refused_and_nothing_changes(engine: Engine) -> None:
    wf = three_workflow([])
    failed = engine.run(wf, Three())
    with pytest.raises(InvalidContext, match="n: "):
        engine.retry(failed.id, from_state="a", set_fields={"n": "ten"})
    after = engine.get(failed.id)
    assert after.status == "failed" and after.last_seq == failed.last_seq


def test_retry__edit_of_an_unknown_field_refused(engine: Engine) -> None:
    wf = three_workflow([])
    failed = engine.run(wf, Three())
    with pytest.raises(InvalidContext, match=r"no field\(s\) 'fail_at_see' in Three"):
        engine.retry(failed.id, set_fields={"fail_at_see": False})  # misspelt
    assert engine.get(failed.id).last_seq == failed.last_seq


class Dated(BaseModel):
    when: datetime.datetime | None = None
    ok: bool = False


def test_retry__edit_recorded_as_json_whatever_its_type(engine: Engine) -> None:
    wf = Workflow("dated", context=Dated)

    @wf.step(initial=True, next="done", retry=Retry(attempts=1))
    def a(ctx: Dated) -> None:
        if not ctx.ok:
            raise RuntimeError("not ok")

    wf.final("done")
    failed = engine.run(wf, Dated())
    when = datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
    engine.retry(failed.id, set_fields={"when": when, "ok": True}, by="bob")
    last = engine.history(failed.id)[-1]
    assert last.data["set"] == {"when": "2030-01-02T03:04:05Z", "ok": True}
    engine.run_until_idle()
    done = engine.get(failed.id)
    assert done.status == "succeeded"
    assert isinstance(done.context, Dated) and done.context.when == when


def test_retry__refusals(engine: Engine) -> None:
    wf = three_workflow([])
    failed = engine.run(wf, Three())
    with pytest.raises(DefinitionError, match="cannot retry from 'done'"):
        engine.retry(failed.id, from_state="done")
    with pytest.raises(UnknownRun):
        engine.retry("missing")
    ok = engine.run(wf, Three(fail_at_c=False))
    with pytest.raises(InvalidTransition, match="is succeeded: cannot retry"):
        engine.retry(ok.id)


def test_retry__never_visited_state_refused(engine: Engine) -> None:
    wf = Workflow("branch", context=Three)
    wf.step(name="a", initial=True, on={"left": "l", "right": "r"}, retry=Retry(attempts=1))(
        lambda ctx: "left"
    )

    @wf.step(name="l", next="done", retry=Retry(attempts=1))
    def left(ctx: Three) -> None:
        raise RuntimeError("no")

    wf.step(name="r", next="done")(lambda ctx: None)
    wf.final("done")
    failed = engine.run(wf, Three())
    with pytest.raises(FlowloopError, match="never reached state 'r'"):
        engine.retry(failed.id, from_state="r")
    assert engine.retry(failed.id).state == "l"  # from where it failed, by default


def test_pause__queued_run_paused_then_unpaused(engine: Engine) -> None:
    calls: list[str] = []
    wf = three_workflow(calls)
    info = engine.start(wf, Three(fail_at_c=False))
    paused = engine.pause(info.id)
    assert paused.status == "paused" and paused.reason == "paused"
    assert engine.pause(info.id).last_seq == paused.last_seq  # pausing twice is a no-op
    engine.run_until_idle()
    assert calls == [] and engine.get(info.id).status == "paused"
    with pytest.raises(InvalidTransition):
        engine.unpause(engine.start(wf, Three(n=5)).id)
    assert engine.unpause(info.id).status == "scheduled"
    engine.run_until_idle()
    assert engine.get(info.id).status == "succeeded"
    assert kinds(engine, info.id)[:3] == [j.RUN_CREATED, j.RUN_PAUSED, j.RUN_UNPAUSED]
    assert_replay_matches(engine, [info.id])


def test_stop__queued_and_paused_runs(engine: Engine) -> None:
    calls: list[str] = []
    wf = three_workflow(calls)
    queued = engine.start(wf, Three())
    paused = engine.start(wf, Three(n=1))
    engine.pause(paused.id)
    assert engine.stop(queued.id).status == "stopped"
    assert engine.stop(paused.id).status == "stopped"
    # Stopping a stopped run is done already (as pausing a paused one): nothing written.
    seq = engine.history(queued.id)[-1].seq
    assert engine.stop(queued.id).status == "stopped"
    assert engine.history(queued.id)[-1].seq == seq
    engine.run_until_idle()
    assert calls == []
    assert engine.retry(queued.id).status == "scheduled"  # an operator may run it again
    ended = engine.run(wf, Three())  # (it fails: n=0)
    with pytest.raises(InvalidTransition, match="is failed: cannot stop"):
        engine.stop(ended.id)
    assert_replay_matches(engine, [queued.id, paused.id])


class ControlSeen:
    """Wraps ``store.pending_controls`` to tell when the worker has picked a request up."""

    def __init__(self, engine: Engine) -> None:
        self.seen = threading.Event()
        self._inner = engine.store.pending_controls

        def pending(*, worker: str) -> dict[str, str]:
            found = self._inner(worker=worker)
            if found:
                self.seen.set()
            return found

        engine.store.pending_controls = pending  # type: ignore[method-assign]


def _on_step_started(engine: Engine, state: str, action: Callable[[RunRecord], object]) -> None:
    def listener(record: RunRecord, events: Sequence[JournalEvent]) -> None:
        if any(e.kind == j.STEP_STARTED and e.state == state for e in events):
            action(record)

    engine.listeners.append(listener)


def test_pause__running_run_pauses_at_its_next_boundary(engine: Engine) -> None:
    control = ControlSeen(engine)
    calls: list[str] = []
    wf = Workflow("w", context=Three)
    wf.step(name="begin", initial=True, next="a")(lambda ctx: None)

    @wf.step(next="b")
    async def a(ctx: Three) -> None:
        calls.append("a")
        deadline = time.monotonic() + DEADLINE_S
        while not control.seen.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)  # the worker notices the request meanwhile

    @wf.step(next="done")
    def b(ctx: Three) -> None:
        calls.append("b")

    wf.final("done")
    _on_step_started(engine, "a", lambda r: engine.pause(r.id))
    info = engine.run(wf, Three())
    assert control.seen.is_set()
    assert (info.status, info.state) == ("paused", "b") and calls == ["a"]
    assert engine.store.get_run(info.id).control is None  # type: ignore[union-attr]
    engine.listeners.clear()
    engine.unpause(info.id)
    engine.run_until_idle()
    assert engine.get(info.id).status == "succeeded" and calls == ["a", "b"]
    assert_replay_matches(engine, [info.id])


def test_stop__cancels_a_running_step(engine: Engine) -> None:
    cancelled = threading.Event()
    wf = Workflow("w", context=Three)
    wf.step(name="begin", initial=True, next="forever")(lambda ctx: None)

    @wf.step(next="done")
    async def forever(ctx: Three) -> None:
        try:
            await asyncio.sleep(DEADLINE_S)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    wf.final("done")
    _on_step_started(engine, "forever", lambda r: engine.stop(r.id))
    started = time.monotonic()
    info = engine.run(wf, Three())
    assert time.monotonic() - started < DEADLINE_S / 2
    assert cancelled.is_set()
    assert (info.status, info.reason) == ("stopped", "stopped during step")
    assert kinds(engine, info.id)[-2:] == [j.STEP_STARTED, j.RUN_STOPPED]
    assert_replay_matches(engine, [info.id])


# -- definitions that change --------------------------------------------------------------


class Ver(BaseModel):
    trail: list[str] = []


def versioned(version: int, *, keep_b: bool = True, b_to: str = "c") -> Workflow:
    """v1: a -> b -> c -> done; b fails once with a long backoff, so a run waits in b."""
    wf = Workflow("ver", context=Ver, version=version)

    @wf.step(initial=True, next="b" if keep_b else "c")
    def a(ctx: Ver) -> None:
        ctx.trail.append(f"a{version}")

    if keep_b:

        @wf.step(next=b_to, retry=Retry(attempts=2, backoff="fixed", base=1000, cap=1000))
        def b(ctx: Ver, step: Step) -> None:
            if step.attempt == 1:
                raise ConnectionError("later")
            ctx.trail.append(f"b{version}")

    @wf.step(on={"next": "done", "extra": "x"} if version > 1 else {"next": "done"})
    def c(ctx: Ver) -> str:
        ctx.trail.append(f"c{version}")
        return "next"

    if version > 1:
        wf.step(name="x", next="c" if b_to == "x" else "done")(lambda ctx: None)
    wf.final("done")
    return wf


def _run_waiting_in_b(url: str) -> tuple[str, float]:
    clock = FakeClock()
    with Engine(url, clock=clock, workflows=[versioned(1)]) as first:
        run_id = first.start(first.workflow("ver"), Ver()).id
        first.run_until_idle(idle_horizon=10)
        info = first.get(run_id)
        assert (info.status, info.state) == ("retrying", "b")
        return run_id, clock.now() + 2000


def test_definition_change__compatible_change_continues(sqlite_url: str) -> None:
    run_id, later = _run_waiting_in_b(sqlite_url)
    with Engine(sqlite_url, clock=FakeClock(later), workflows=[versioned(2)]) as second:
        assert second.check(second.workflow("ver")) == []
        second.run_until_idle()
        info = second.get(run_id)
        assert info.status == "succeeded"
        assert isinstance(info.context, Ver) and info.context.trail == ["a1", "b2", "c2"]
        assert info.version == 1  # the run remembers what it started under
        assert second.replay(run_id).matches


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"keep_b": False}, "state 'b' no longer exists in ver v2"),
        ({"b_to": "x"}, "transitions of state 'b' changed (next->c no longer exist)"),
    ],
    ids=["state-removed", "transition-changed"],
)
def test_definition_change__incompatible_change_parks_the_run(
    sqlite_url: str, change: dict[str, Any], why: str
) -> None:
    run_id, later = _run_waiting_in_b(sqlite_url)
    new = versioned(2, **change)
    with Engine(sqlite_url, clock=FakeClock(later), workflows=[new]) as second:
        stranded = second.check(new)
        assert [(s.run_id, s.state, s.status, s.reason) for s in stranded] == [
            (run_id, "b", "retrying", f"definition_mismatch: {why}")
        ]
        before = second.get(run_id)
        second.run_until_idle()
        info = second.get(run_id)
        assert info.status == "paused"
        assert info.reason is not None and info.reason.startswith("definition_mismatch")
        assert info.reason == f"definition_mismatch: {why}"
        assert info.context == before.context and info.state == "b"  # nothing is lost
        assert [s.status for s in second.check(new)] == ["paused"]
        assert second.replay(run_id).matches
    # The old definition can still finish it.
    with Engine(sqlite_url, clock=FakeClock(later), workflows=[versioned(1)]) as old:
        old.unpause(run_id)
        old.run_until_idle()
        assert old.get(run_id).status == "succeeded"


# -- a broken row -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("stored", "outcome"),
    [
        ("{not json", ("failed", "invalid_context")),
        ("[1, 2]", ("failed", "invalid_context")),
        # A JSON object its unchanged definition refuses: a validator changed (the
        # fingerprint does not see it) as well as a hand edit — parked, not failed.
        ('{"order_id": 5}', ("paused", "context_mismatch")),
    ],
    ids=["unparseable", "not-an-object", "invalid"],
)
def test_invalid_context__run_failed_or_parked_others_unaffected(
    engine: Engine, stored: str, outcome: tuple[str, str]
) -> None:
    wf, _ = order_workflow()
    ids = [engine.start(wf, Order(order_id=f"I{n}")).id for n in range(4)]
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(sa.update(runs).where(runs.c.id == ids[1]).values(context=stored))
    engine.run_until_idle()
    broken = engine.get(ids[1])  # still readable
    assert broken.reason is not None
    assert (broken.status, broken.reason.split(":")[0]) == outcome
    if broken.status == "failed":
        assert broken.error is not None and "invalid" in broken.error.lower()
    else:  # what the context lacks, said in the reason (a pause has no error)
        assert "order_id" in broken.reason and "a validator may have changed" in broken.reason
    assert [engine.get(i).status for i in ids if i != ids[1]] == ["succeeded"] * 3
    seq = broken.last_seq
    engine.run_until_idle()  # never retried in a loop
    assert engine.get(ids[1]).last_seq == seq
    assert len(engine.runs()) == 4  # listing is not broken either


@pytest.mark.parametrize("stored", ["{oops", "[1]"], ids=["unparseable", "not-an-object"])
def test_invalid_row__corrupt_visits_fail_that_run_only(engine: Engine, stored: str) -> None:
    wf, _ = order_workflow()
    ids = [engine.start(wf, Order(order_id=f"V{n}")).id for n in range(3)]
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(sa.update(runs).where(runs.c.id == ids[0]).values(visits=stored))
    engine.run_until_idle()
    broken = engine.get(ids[0])
    assert (broken.status, broken.reason) == ("failed", "invalid_row")
    assert broken.error is not None and "stored visits are not" in broken.error
    assert [engine.get(i).status for i in ids[1:]] == ["succeeded"] * 2
    seq = broken.last_seq
    engine.run_until_idle()
    assert engine.get(ids[0]).last_seq == seq


# -- listeners ----------------------------------------------------------------------------


def test_listeners__called_after_each_committed_boundary(engine: Engine) -> None:
    wf, _ = order_workflow()
    seen: list[tuple[str, ...]] = []
    engine.listeners.append(lambda record, events: seen.append(tuple(e.kind for e in events)))

    def broken(record: RunRecord, events: Sequence[JournalEvent]) -> None:
        raise RuntimeError("a listener must not break the run")

    engine.listeners.append(broken)
    info = engine.run(wf, Order(order_id="L1"))
    assert info.status == "succeeded"
    assert seen == [
        (j.STEP_SUCCEEDED, j.STEP_STARTED),
        (j.STEP_SUCCEEDED, j.STEP_STARTED),
        (j.STEP_SUCCEEDED,),
    ]


def test_engine__bare_path_is_a_sqlite_file(tmp_path: Path) -> None:
    with Engine(str(tmp_path / "plain.db")) as engine:
        assert engine.url.startswith("sqlite:///")
    assert (tmp_path / "plain.db").exists()
