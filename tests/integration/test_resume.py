"""Resume after a crash, simulated in-process.

A "crashing" engine runs with the worker id of a process that is already gone (so the next
engine knows at once that its leases are dead, as after a real SIGKILL on this host), and
its step raises :class:`Crash` — a BaseException the executor does not handle — so the run
is left exactly as a killed process leaves it: ``step_started`` committed, no outcome.
Real SIGKILLs are in tests/acceptance/test_crash.py.
"""

from __future__ import annotations

import asyncio
import math
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.executor import RECOVERY_BATCH, Executor, new_worker_id
from flowloop.store import SQLStore
from flowloop.workerids import host_tag


class Crash(BaseException):
    """The process dies here (the executor only handles Exception)."""


class Ctx(BaseModel):
    n: int = 0
    trail: list[str] = []


def dead_worker_id() -> str:
    """A worker id on this host whose process has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return f"{socket.gethostname()}:{proc.pid}:crashed:{host_tag()}"


Plan = Callable[[Step], None]


def three_steps(
    calls: list[tuple[str, int, str]],
    *,
    crash_in: dict[str, Plan] | None = None,
    idempotent_b: bool = True,
    retry_b: Retry | None = None,
) -> Workflow:
    """a -> b -> c -> done; ``crash_in[state](step)`` may raise Crash."""
    crash_in = crash_in or {}
    wf = Workflow("three", context=Ctx)

    def body(state: str) -> Callable[[Ctx, Step], None]:
        def run(ctx: Ctx, step: Step) -> None:
            calls.append((state, step.attempt, step.idempotency_key))
            if state in crash_in:
                crash_in[state](step)
            ctx.n += 1
            ctx.trail.append(state)

        return run

    wf.step(name="a", initial=True, next="b")(body("a"))
    wf.step(
        name="b", next="c", idempotent=idempotent_b, retry=retry_b or Retry(attempts=3, base=0)
    )(body("b"))
    wf.step(name="c", next="done")(body("c"))
    wf.final("done")
    return wf


def crash_on_attempts(*attempts: int) -> Plan:
    def plan(step: Step) -> None:
        if step.attempt in attempts:
            raise Crash(f"killed during {step.state} attempt {step.attempt}")

    return plan


def always_crash(step: Step) -> None:
    raise Crash("killed again")


@pytest.fixture
def url(sqlite_url: str) -> str:
    return sqlite_url


def crash_engine(url: str, wf: Workflow) -> Engine:
    return Engine(url, clock=FakeClock(), workflows=[wf], worker_id=dead_worker_id())


def run_until_crash(engine: Engine, wf: Workflow, ctx: Ctx) -> str:
    """Start a run and drive it until its step crashes the (pretend) process."""
    run_id = engine.start(wf, ctx).id
    engine.run_until_idle()
    info = engine.get(run_id)
    assert info.status == "running" and info.owner == engine.worker_id
    return run_id


@pytest.fixture
def fresh(url: str) -> Iterator[Callable[[Workflow], Engine]]:
    opened: list[Engine] = []

    def make(wf: Workflow) -> Engine:
        engine = Engine(url, clock=FakeClock(), workflows=[wf])
        opened.append(engine)
        return engine

    yield make
    for engine in opened:
        engine.close()


def test_resume__idempotent_step_runs_again_and_the_attempt_counts(
    url: str, fresh: Callable[[Workflow], Engine]
) -> None:
    calls: list[tuple[str, int, str]] = []
    crashing = crash_engine(url, three_steps(calls, crash_in={"b": crash_on_attempts(1)}))
    run_id = run_until_crash(crashing, crashing.workflow("three"), Ctx())
    crashing.close()
    engine = fresh(three_steps(calls))
    stats = engine.resume()
    assert stats.recovered == 1
    info = engine.get(run_id)
    assert info.status == "succeeded"
    assert isinstance(info.context, Ctx) and info.context.trail == ["a", "b", "c"]
    # a's success was committed before the crash: it never runs again.
    assert [(s, n) for s, n, _ in calls] == [("a", 1), ("b", 1), ("b", 2), ("c", 1)]
    assert len({key for s, _, key in calls if s == "b"}) == 1  # same key across the crash
    history = engine.history(run_id)
    interrupted = [e for e in history if e.kind == j.STEP_INTERRUPTED]
    assert [(e.state, e.attempt, e.retryable) for e in interrupted] == [("b", 1, True)]
    assert engine.replay(run_id).matches


def test_resume__non_idempotent_step_fails_interrupted_and_is_not_rerun(
    url: str, fresh: Callable[[Workflow], Engine]
) -> None:
    calls: list[tuple[str, int, str]] = []
    crashing = crash_engine(
        url, three_steps(calls, crash_in={"b": crash_on_attempts(1)}, idempotent_b=False)
    )
    run_id = run_until_crash(crashing, crashing.workflow("three"), Ctx())
    crashing.close()
    engine = fresh(three_steps(calls, idempotent_b=False))
    engine.resume()
    info = engine.get(run_id)
    assert (info.status, info.state, info.reason) == ("failed", "b", "interrupted")
    assert info.error is not None and "not idempotent" in info.error
    assert [s for s, _, _ in calls] == ["a", "b"]  # b ran once
    engine.resume()
    assert [s for s, _, _ in calls] == ["a", "b"]  # and stays failed
    # An operator checked b's effect and decides to run it again.
    engine.retry(run_id)
    engine.run_until_idle()
    assert engine.get(run_id).status == "succeeded"
    assert [s for s, _, _ in calls] == ["a", "b", "b", "c"]
    assert engine.replay(run_id).matches


def test_resume__step_that_always_kills_its_process_ends_failed(url: str) -> None:
    calls: list[tuple[str, int, str]] = []
    wf = three_steps(calls, crash_in={"b": always_crash}, retry_b=Retry(attempts=3, base=0))
    first = crash_engine(url, wf)
    run_id = run_until_crash(first, wf, Ctx())
    first.close()
    for _ in range(10):  # bounded: each round is one process life
        with crash_engine(url, wf) as engine:
            engine.resume()
            if engine.get(run_id).status != "running":
                break
    with Engine(url, workflows=[wf]) as engine:
        info = engine.get(run_id)
        assert (info.status, info.reason) == ("failed", "interrupted")
        assert info.error is not None and "interrupted 3 time(s)" in info.error
        assert [(s, n) for s, n, _ in calls if s == "b"] == [("b", 1), ("b", 2), ("b", 3)]
        assert engine.replay(run_id).matches


def test_resume__live_owner_left_alone_until_its_lease_expires(
    url: str, fresh: Callable[[Workflow], Engine]
) -> None:
    calls: list[tuple[str, int, str]] = []
    wf = three_steps(calls)
    # Owned by a worker of this very process (alive): only an expired lease frees the run.
    holder = Engine(url, workflows=[wf], lease_seconds=30)
    new = holder._new_run(
        wf, Ctx(), key=None, idempotency_key=None, priority=0, run_at=None, owner=holder.worker_id
    )
    held, _ = holder.store.create_run(new)
    engine = fresh(wf)
    engine.resume()
    assert engine.get(held.id).status == "running" and calls == []
    holder.store.expire_leases([holder.worker_id])
    engine.resume()
    assert engine.get(held.id).status == "succeeded"
    holder.close()


def test_resume__runs_of_unknown_workflows_left_alone(
    url: str, fresh: Callable[[Workflow], Engine]
) -> None:
    calls: list[tuple[str, int, str]] = []
    wf = three_steps(calls, crash_in={"b": crash_on_attempts(1)})
    ghost = Workflow("ghost", context=Ctx)
    ghost.step(name="g", initial=True, next="done")(
        lambda ctx, step: (_ for _ in ()).throw(Crash("ghost dies"))
    )
    ghost.final("done")
    with crash_engine(url, wf) as crashing:
        crashing.register(ghost)
        ours = run_until_crash(crashing, wf, Ctx())
        theirs = run_until_crash(crashing, ghost, Ctx())
    engine = fresh(three_steps(calls))
    engine.resume()
    assert engine.get(ours).status == "succeeded"
    other = engine.store.get_run(theirs)
    assert other is not None and other.record.status == "running"
    assert other.record.last_seq == 2  # untouched: no journal entry by us


def test_resume__bulk_recovery_costs_statements_per_batch_not_per_run(
    url: str, fresh: Callable[[Workflow], Engine]
) -> None:
    runs = 2_000
    calls: list[str] = []
    wf = Workflow("one", context=Ctx)
    wf.step(name="only", initial=True, next="done")(lambda ctx: calls.append("only"))
    wf.final("done")
    engine = fresh(wf)
    dead = dead_worker_id()
    for n in range(runs):
        new = engine._new_run(
            wf, Ctx(n=n), key=None, idempotency_key=None, priority=0, run_at=None, owner=dead
        )
        engine.store.create_run(new)
    assert isinstance(engine.store, SQLStore)
    statements = 0

    def count(*_: Any) -> None:
        nonlocal statements
        statements += 1

    executor = Executor(
        engine.store, engine.workflows, clock=engine.clock, worker_id=new_worker_id()
    )
    sa.event.listen(engine.store.engine, "before_cursor_execute", count)
    try:
        recovered = asyncio.run(executor.recover())
    finally:
        sa.event.remove(engine.store.engine, "before_cursor_execute", count)
        executor.close()
    assert recovered == runs and executor.stats.recovered == runs
    batches = math.ceil(runs / RECOVERY_BATCH) + 1  # the last claim finds nothing
    assert statements <= 10 * batches, f"{statements} statements for {batches} batches"
    assert {r.status for r in engine.runs(limit=runs)} == {"retrying"}
    engine.run_until_idle()
    assert {r.status for r in engine.runs(limit=runs)} == {"succeeded"}
    assert len(calls) == runs


def test_resume__start_with_the_same_key_after_a_crash_returns_the_run(
    url: str, fresh: Callable[[Workflow], Engine]
) -> None:
    calls: list[tuple[str, int, str]] = []
    wf = three_steps(calls, crash_in={"b": crash_on_attempts(1)})
    with crash_engine(url, wf) as crashing:
        run_id = crashing.start(wf, Ctx(), idempotency_key="order-9").id
        crashing.run_until_idle()
    engine = fresh(three_steps(calls))
    again = engine.run(engine.workflow("three"), Ctx(), idempotency_key="order-9")
    assert again.id == run_id
    engine.resume()
    assert engine.get(run_id).status == "succeeded"
    assert [s for s, _, _ in calls].count("a") == 1
