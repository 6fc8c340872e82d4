"""An outcome is logged once the journal holds it (flowloop/outcome_log.py). A step (or a
compensation) whose run is fenced off, or taken over by another worker, while it runs has
its outcome discarded — README: "that outcome is not written" — and the log no longer
says it succeeded or failed: it says the outcome was not journaled. Found by the fault
audit (fence.py): "seq 6: second attempt 1 succeeded in 8390.5 ms" for an attempt the
journal shows interrupted and run again elsewhere (359 "succeeded in" lines for 350
successes). On SQLite files and PostgreSQL; the loss is staged, no timing involved."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from pydantic import BaseModel
from storekit import dead_owner, start_step

from flowloop import Engine, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.executor import Executor
from flowloop.store import Boundary

LEASE_S = 30.0
OTHER = "elsewhere:1:other"
"""Another worker (on another host: alive as far as this one can tell)."""
STEP_FIELDS = {"workflow", "run", "seq", "state", "attempt", "event", "outcome", "duration"}


class Ctx(BaseModel):
    n: int = 0


Lose = Callable[[str], None]


def lose(engine: Engine, executor: Executor, how: str) -> Lose:
    """What happens to the run while its step runs: ``fenced``, its lease deadline passed
    unrenewed (what the fence thread does, before the loop hears of it); ``taken``, its
    lease ran out and another worker claimed it (this worker's write is then refused)."""

    def lost(run_id: str) -> None:
        if how == "fenced":
            executor.leases.guard.give_up(run_id)
            assert executor.leases.fenced(run_id)
        else:
            engine.store.expire_leases([engine.worker_id])
            (taken,) = engine.store.claim_interrupted(worker=OTHER, limit=1, lease_seconds=LEASE_S)
            assert taken.id == run_id

    return lost


def stepping(hook: dict[str, Lose], *, fails: bool) -> Workflow:
    wf = Workflow("discarded", context=Ctx)

    @wf.step(initial=True, next="end", retry=Retry(attempts=3, backoff="fixed", base=0))
    async def work(ctx: Ctx, step: Step) -> None:
        hook["lose"](step.run_id)
        if fails:
            raise ConnectionError("down")
        ctx.n = 1

    wf.final("end")
    return wf


def compensating(hook: dict[str, Lose], *, fails: bool) -> Workflow:
    wf = Workflow("undone", context=Ctx)

    def undo(ctx: Ctx, step: Step) -> None:
        hook["lose"](step.run_id)
        if fails:
            raise ConnectionError("down")

    @wf.step(initial=True, next="boom", compensate=undo)
    def reserve(ctx: Ctx) -> None:
        ctx.n = 1

    @wf.step(next="end", retry=Retry(attempts=1), on_error={"*": "cancelled"})
    def boom(ctx: Ctx) -> None:
        raise RuntimeError("refused")

    wf.final("end")
    wf.final("cancelled", compensate=True)
    return wf


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO, logger="flowloop")
    yield caplog


def drive(url: str, build: Callable[[dict[str, Lose]], Workflow], how: str) -> list[str]:
    """Drive one run of ``build``'s workflow to where this worker loses it; its journal."""
    hook: dict[str, Lose] = {}
    wf = build(hook)
    with Engine(url, workflows=[wf], lease_seconds=LEASE_S) as engine:
        run_id = engine.start(wf, Ctx()).id
        executor = engine._new_executor()
        hook["lose"] = lose(engine, executor, how)
        try:
            asyncio.run(executor.run(until_idle=True, run_ids=[run_id]))
        finally:
            executor.close()
        return [event.kind for event in engine.history(run_id)]


def extra(record: logging.LogRecord, key: str) -> Any:
    return getattr(record, key, None)


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
@pytest.mark.parametrize("how", ["fenced", "taken"])
def test_a_step_outcome_not_written_is_not_logged_as_one(
    store_url: str, logs: pytest.LogCaptureFixture, how: str, fails: bool
) -> None:
    kinds = drive(store_url, lambda hook: stepping(hook, fails=fails), how)
    records = logs.records
    assert kinds == [j.RUN_CREATED, j.STEP_STARTED], kinds  # the outcome is not written
    messages = [r.getMessage() for r in records]
    assert not [r for r in records if extra(r, "event") == "step_finished"], messages
    outcome = "retried" if fails else "succeeded"
    assert not [m for m in messages if f"attempt 1 {outcome} in" in m], messages
    (line,) = [r for r in records if extra(r, "event") == "outcome_not_written"]
    assert extra(line, "outcome") == outcome
    assert (extra(line, "state"), extra(line, "attempt"), extra(line, "seq")) == ("work", 1, 2)
    assert "work attempt 1 ended" in line.getMessage() and "not journaled" in line.getMessage()


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
@pytest.mark.parametrize("how", ["fenced", "taken"])
def test_a_compensation_outcome_not_written_is_not_logged_as_one(
    store_url: str, logs: pytest.LogCaptureFixture, how: str, fails: bool
) -> None:
    kinds = drive(store_url, lambda hook: compensating(hook, fails=fails), how)
    records = logs.records
    assert kinds[-1] == j.COMPENSATION_STARTED, kinds  # its outcome is not written
    messages = [r.getMessage() for r in records]
    said = {"compensation_succeeded", "compensation_failed"}
    assert not [r for r in records if extra(r, "event") in said], messages
    (line,) = [r for r in records if extra(r, "event") == "outcome_not_written"]
    expected = "compensation_failed" if fails else "compensation_succeeded"
    assert extra(line, "outcome") == expected
    assert "compensation of reserve" in line.getMessage(), line.getMessage()
    assert "not journaled" in line.getMessage()


def test_outcomes_written_are_logged_once_each_after_their_entry(store_url: str) -> None:
    """A step that fails once, then succeeds: one line per outcome, each said once the
    journal holds its entry, its JSON fields as before."""
    wf = Workflow("twice", context=Ctx)

    @wf.step(initial=True, next="end", retry=Retry(attempts=2, backoff="fixed", base=0))
    def work(ctx: Ctx, step: Step) -> None:
        if step.attempt == 1:
            raise ConnectionError("down")
        ctx.n = 1

    wf.final("end")
    seen: list[tuple[str, bool, logging.LogRecord]] = []

    with Engine(store_url, workflows=[wf], lease_seconds=LEASE_S) as engine:

        class Journaled(logging.Handler):
            """Whether the journal holds a step outcome's entry when its line is said."""

            def emit(self, record: logging.LogRecord) -> None:
                if extra(record, "event") != "step_finished":
                    return
                entries = engine.store.journal(record.run)  # type: ignore[attr-defined]
                held = any(e.seq == record.seq + 1 for e in entries)  # type: ignore[attr-defined]
                seen.append((record.outcome, held, record))  # type: ignore[attr-defined]

        handler = Journaled(logging.INFO)
        logger = logging.getLogger("flowloop")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            info = engine.run(wf, Ctx())
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
        kinds = [event.kind for event in engine.history(info.id)]
    assert info.status == "succeeded", kinds
    assert [(outcome, held) for outcome, held, _ in seen] == [
        ("retried", True),
        ("succeeded", True),
    ]
    retried, succeeded = (record for _, _, record in seen)
    assert STEP_FIELDS | {"error_type", "retryable"} <= set(vars(retried))
    assert STEP_FIELDS | {"next_state"} <= set(vars(succeeded))
    assert (extra(succeeded, "state"), extra(succeeded, "attempt")) == ("work", 2)
    assert extra(succeeded, "next_state") == "end"
    assert isinstance(extra(succeeded, "duration"), float)
    assert "work attempt 2 succeeded in" in succeeded.getMessage()


def take_over(engine: Engine, run_id: str) -> None:
    """Another worker claims the run (its lease ran out): this worker's write is refused."""
    engine.store.expire_leases([engine.worker_id])
    (taken,) = engine.store.claim_interrupted(worker=OTHER, limit=1, lease_seconds=LEASE_S)
    assert taken.id == run_id


def test_a_cut_off_not_written_is_not_logged_as_one(
    store_url: str, logs: pytest.LogCaptureFixture
) -> None:
    """A step cut off by a shutdown (its task cancelled) after another worker took its run
    over: the interruption's write is refused, and not logged as written."""
    entered = asyncio.Event()
    wf = Workflow("cut", context=Ctx)

    @wf.step(initial=True, next="end")
    async def block(ctx: Ctx, step: Step) -> None:
        take_over(engine, step.run_id)
        entered.set()
        await asyncio.Event().wait()  # until cut off

    wf.final("end")

    async def scenario(run_id: str) -> None:
        executor = engine._new_executor()
        try:
            (claimed,) = engine.store.claim(
                worker=engine.worker_id,
                now=time.time(),
                limit=1,
                lease_seconds=LEASE_S,
                run_ids=[run_id],
            )
            task = executor.spawn(claimed, starting=True)
            await asyncio.wait_for(entered.wait(), 30)
            task.cancel()  # a shutdown's grace ran out
            await asyncio.gather(task, return_exceptions=True)
        finally:
            executor.close()

    with Engine(store_url, workflows=[wf], lease_seconds=LEASE_S) as engine:
        run_id = engine.start(wf, Ctx()).id
        asyncio.run(scenario(run_id))
        kinds = [event.kind for event in engine.history(run_id)]
    assert kinds == [j.RUN_CREATED, j.STEP_STARTED], kinds
    records = logs.records
    messages = [r.getMessage() for r in records]
    assert not [r for r in records if extra(r, "event") == "step_finished"], messages
    (line,) = [r for r in records if extra(r, "event") == "outcome_not_written"]
    assert extra(line, "outcome") == "interrupted"
    assert "block attempt 1 found cut off (cut off by shutdown" in line.getMessage()
    assert "not journaled" in line.getMessage()


def test_a_recovery_not_written_is_not_logged_as_one(
    store_url: str, logs: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery claims a run a worker left cut off; before its entry is written, another
    worker takes the run (this one's claim ended early: a frozen sweep, say). The write is
    refused, and the interruption is not logged as written."""
    wf = Workflow("found", context=Ctx)

    @wf.step(initial=True, next="end")
    def work(ctx: Ctx) -> None:
        ctx.n = 1

    wf.final("end")
    with Engine(store_url, workflows=[wf], lease_seconds=LEASE_S) as engine:
        run_id = engine.start(wf, Ctx()).id
        gone = dead_owner()
        (claimed,) = engine.store.claim(
            worker=gone, now=time.time(), limit=1, lease_seconds=LEASE_S, run_ids=[run_id]
        )
        assert engine.store.write([start_step(claimed, gone)]) == [True]
        real_write = engine.store.write
        raced: list[str] = []

        def taken_first(boundaries: Sequence[Boundary]) -> list[bool]:
            if not raced:  # (the recovery's write)
                raced.append(boundaries[0].run_id)
                take_over(engine, run_id)
            return real_write(boundaries)

        monkeypatch.setattr(engine.store, "write", taken_first)
        executor = engine._new_executor()
        try:
            assert asyncio.run(executor.recover()) == 0
        finally:
            executor.close()
        kinds = [event.kind for event in engine.history(run_id)]
    assert raced == [run_id]
    assert kinds == [j.RUN_CREATED, j.STEP_STARTED], kinds
    records = logs.records
    messages = [r.getMessage() for r in records]
    assert not [r for r in records if extra(r, "event") == "step_finished"], messages
    (line,) = [r for r in records if extra(r, "event") == "outcome_not_written"]
    assert extra(line, "outcome") == "interrupted"
    assert "work attempt 1 found cut off (its worker went away" in line.getMessage()
