"""Workflows for the composition crash suite (tests/acceptance/test_compose_crash.py): a
saga with 3 compensations, a call, and a map of 200 children with max_parallel=8.

Every step and every compensation records its execution in crashkit's ledger (kind "step"
or "undo") before it returns; workers are forked by crashkit's zygote
(``crashkit.Zygote("composekit")``) and resume with these workflows.
"""

from __future__ import annotations

import asyncio
import sys

import crashkit
from crashkit import CRASH_RETRY, record
from pydantic import BaseModel

from flowloop import ChildResult, Engine, Retry, Step, Workflow
from flowloop.errors import Interrupted

CHILDREN = 200
MAX_PARALLEL = 8


async def pause() -> None:
    await asyncio.sleep(crashkit.pause_s())


class SagaCtx(BaseModel):
    n: int
    done: list[str] = []
    undone: list[str] = []


def saga() -> Workflow:
    wf = Workflow("crash_saga", context=SagaCtx)
    names = ["book_a", "book_b", "book_c"]
    for index, name in enumerate(names):
        nxt = names[index + 1] if index + 1 < len(names) else "fail"

        async def book(ctx: SagaCtx, step: Step, name: str = name) -> None:
            await pause()
            record(step)
            ctx.done.append(name)

        async def undo(ctx: SagaCtx, step: Step, name: str = name) -> None:
            await pause()
            record(step, kind="undo")
            ctx.undone.append(name)

        wf.step(
            name=name,
            initial=index == 0,
            next=nxt,
            retry=CRASH_RETRY,
            compensate=undo,
            compensate_retry=CRASH_RETRY,
        )(book)

    # One attempt: cut off by a kill, it has none left, so Interrupted routes it too.
    @wf.step(
        next="ok", retry=Retry(attempts=1), on_error={"*": "cancelled", Interrupted: "cancelled"}
    )
    async def fail(ctx: SagaCtx, step: Step) -> None:
        await pause()
        record(step)
        raise RuntimeError(f"saga {ctx.n}: the last step fails")

    wf.final("ok")
    wf.final("cancelled", compensate=True)
    return wf


class Work(BaseModel):
    n: int
    out: int = 0
    trail: list[str] = []


def callee() -> Workflow:
    wf = Workflow("crash_callee", context=Work)

    @wf.step(initial=True, next="second", retry=CRASH_RETRY)
    async def first(ctx: Work, step: Step) -> None:
        await pause()
        record(step)
        ctx.trail.append("first")

    @wf.step(next="done", retry=CRASH_RETRY)
    async def second(ctx: Work, step: Step) -> None:
        await pause()
        record(step)
        ctx.out = ctx.n * 3

    wf.final("done")
    return wf


def caller(child: Workflow) -> Workflow:
    wf = Workflow("crash_caller", context=Work)
    wf.call(
        "sub",
        child=child,
        context=lambda ctx: Work(n=ctx.n),
        on={"succeeded": "after"},
        result=lambda ctx, sub: setattr(ctx, "out", sub.out),
        initial=True,
    )

    @wf.step(next="done", retry=CRASH_RETRY)
    async def after(ctx: Work, step: Step) -> None:
        await pause()
        record(step)
        ctx.trail.append(f"got {ctx.out}")

    wf.final("done")
    return wf


class Item(BaseModel):
    i: int
    sq: int = 0


class Fan(BaseModel):
    count: int
    total: int = 0
    seen: int = 0


def item() -> Workflow:
    wf = Workflow("crash_item", context=Item)

    @wf.step(initial=True, next="done", retry=CRASH_RETRY)
    async def square(ctx: Item, step: Step) -> None:
        await pause()
        record(step)
        ctx.sq = ctx.i * ctx.i

    wf.final("done")
    return wf


def mapper(child: Workflow) -> Workflow:
    wf = Workflow("crash_map", context=Fan)

    def reduce(ctx: Fan, results: list[ChildResult[Item]]) -> None:
        ctx.seen = len(results)
        ctx.total = sum(r.context.sq for r in results)

    wf.map(
        "fan",
        child=child,
        items=lambda ctx: range(ctx.count),
        context=lambda ctx, i: Item(i=i),
        max_parallel=MAX_PARALLEL,
        on={"done": "done"},
        reduce=reduce,
        initial=True,
    )
    wf.final("done")
    return wf


def all_workflows() -> list[Workflow]:
    return [saga(), caller(callee()), mapper(item())]


if __name__ == "__main__":
    if sys.argv[1:] != ["zygote"]:
        raise SystemExit("usage: composekit.py zygote")
    crashkit.serve(
        lambda command: crashkit.resume(command, all_workflows()),
        warm=lambda: Engine("sqlite://", workflows=all_workflows()).close(),
    )
