"""The engine keeps one executor for ``engine.run``: a run that waited out a retry backoff
(which drives the executor's queue loop to idle and drains it) must not leave it draining,
or every later ``engine.run`` would hand its run back after each step (a release and a
claim per step instead of going straight on)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

from flowloop import Engine, Retry, Step, Workflow
from flowloop import journal as j


class Ctx(BaseModel):
    n: int = 0


def flaky_then_chain() -> tuple[Workflow, Workflow]:
    flaky = Workflow("flaky", context=Ctx)

    @flaky.step(initial=True, next="done", retry=Retry(attempts=2, backoff="fixed", base=0.01))
    def once(ctx: Ctx, step: Step) -> None:
        if step.attempt == 1:
            raise ConnectionError("first attempt fails")

    flaky.final("done")
    chain = Workflow("chain", context=Ctx)

    @chain.step(initial=True, next="b")
    def a(ctx: Ctx) -> None:
        ctx.n += 1

    @chain.step(next="c")
    def b(ctx: Ctx) -> None:
        ctx.n += 1

    @chain.step(next="done")
    def c(ctx: Ctx) -> None:
        ctx.n += 1

    chain.final("done")
    return flaky, chain


def test_engine_run__after_a_backoff_later_runs_go_straight_on(sqlite_url: str) -> None:
    flaky, chain = flaky_then_chain()
    with Engine(sqlite_url, workflows=[flaky, chain]) as engine:
        assert engine.run(flaky, Ctx()).status == "succeeded"  # waited out its backoff
        info = engine.run(chain, Ctx())
        assert info.status == "succeeded" and engine.get(info.id).context.n == 3  # type: ignore[union-attr]
        kinds = [event.kind for event in engine.history(info.id)]
    assert j.RUN_RELEASED not in kinds, kinds
    assert kinds == [j.RUN_CREATED] + [j.STEP_STARTED, j.STEP_SUCCEEDED] * 3, kinds


def test_engine_run__a_cancelled_run_is_not_kept_by_the_engines_executor(sqlite_url: str) -> None:
    """The executor outlives each call: a run cancelled mid-step (a Ctrl-C) must leave
    neither its id among the tracked runs nor its last committed record behind (both
    were dropped only on the way out of a call that ended normally)."""
    wf = Workflow("cut", context=Ctx)
    entered = asyncio.Event()

    @wf.step(initial=True, next="b")
    def a(ctx: Ctx) -> None:
        ctx.n += 1

    @wf.step(next="done")
    async def b(ctx: Ctx) -> None:
        entered.set()
        await asyncio.Event().wait()  # until cancelled

    wf.final("done")
    with Engine(sqlite_url, workflows=[wf]) as engine:

        async def cut_off() -> None:
            task = asyncio.create_task(engine.arun(wf, Ctx()))
            await asyncio.wait_for(entered.wait(), 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cut_off())
        executor = engine._executor()
        assert executor.tracked == set()
        assert executor.committed == {}
        (run,) = engine.runs()
        assert [event.kind for event in engine.history(run.id)][-1] == j.STEP_INTERRUPTED
