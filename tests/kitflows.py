"""Small workflows for flowloop.testing's own tests: three steps (one async) recording each
execution, a 2-day wait with a timeout, and a step that sleeps in a cycle."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from pydantic import BaseModel

from flowloop import Step, Workflow
from flowloop.testing import TestEngine


class Ctx(BaseModel):
    name: str = "x"
    trail: list[str] = []
    napped: int = 0


EXECUTED: list[tuple[str, int]] = []
"""(state, attempt) of every execution of the workflows below, in order."""


def three_steps() -> Workflow:
    flow = Workflow("three", context=Ctx, key="name")

    @flow.step(initial=True, next="b")
    def a(ctx: Ctx, step: Step) -> None:
        EXECUTED.append(("a", step.attempt))
        ctx.trail.append("a")

    @flow.step(next="c")
    async def b(ctx: Ctx, step: Step) -> None:
        EXECUTED.append(("b", step.attempt))
        await asyncio.sleep(0)
        ctx.trail.append("b")

    @flow.step(next="done")
    def c(ctx: Ctx, step: Step) -> None:
        EXECUTED.append(("c", step.attempt))
        ctx.trail.append("c")

    flow.final("done")
    return flow


def waiting() -> Workflow:
    flow = Workflow("waiting", context=Ctx)

    @flow.step(initial=True, next="approval")
    def ask(ctx: Ctx) -> None:
        ctx.trail.append("ask")

    flow.wait("approval", on={"ok": "done"}, timeout=timedelta(days=2), on_timeout="expired")
    flow.final("done", "expired")
    return flow


def sleeper(naps: int = 2, *, hours: float = 1.0) -> Workflow:
    flow = Workflow("sleeper", context=Ctx)

    @flow.step(initial=True, on={"again": "nap", "done": "done"})
    def nap(ctx: Ctx, step: Step) -> object:
        if ctx.napped >= naps:
            return "done"
        ctx.napped += 1
        return step.sleep(timedelta(hours=hours), "again")

    flow.final("done")
    return flow


def instants(engine: TestEngine, run_id: str, start: float) -> list[float]:
    """The distinct times (seconds after ``start``) at which ``run_id``'s journal entries
    were written. Time skipping moves the fake clock straight to each due time, so these
    are exactly the run's timers: any other value means time passed some other way."""
    return sorted({event.at - start for event in engine.history(run_id)})
