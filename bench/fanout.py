"""Fan-out and join: one map of N children (one trivial async step each), and the cost of
a call (a child run) against the same work as an inline step.

    python bench/fanout.py --items 10000 --max-parallel 64 [--pg URL | --pg none]
        [--run-items 2000 --run-parallel 5] [--runs 200]

Prints, per backend: the seconds and commits to create the N children (fan-out), to run
them and join (the children's steps, their final transactions with the join counter, the
parent's join), the seconds of ``engine.run`` of a map of ``--run-items`` items (the call
drives its run's family itself), and per-run milliseconds of an order with a call vs one
with an inline step.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from typing import Any

from common import PG_URL, fresh_url  # type: ignore[import-not-found]
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.compose import ChildResult


class Item(BaseModel):
    n: int
    doubled: int = 0


class Batch(BaseModel):
    count: int
    total: int = 0


def workflows(max_parallel: int) -> tuple[Workflow, Workflow]:
    child = Workflow("bench_item", context=Item)

    @child.step(initial=True, next="done")
    async def double(ctx: Item) -> None:
        ctx.doubled = ctx.n * 2

    child.final("done")
    parent = Workflow("bench_map", context=Batch)

    def reduce(ctx: Batch, results: list[ChildResult[Item]]) -> None:
        ctx.total = sum(r.context.doubled for r in results)

    parent.map(
        "fan",
        child=child,
        items=lambda ctx: range(ctx.count),
        context=lambda ctx, i: Item(n=i),
        max_parallel=max_parallel,
        max_items=1_000_000,
        on={"done": "joined"},
        reduce=reduce,
        initial=True,
    )
    parent.final("joined")
    return parent, child


def call_vs_inline() -> tuple[Workflow, Workflow]:
    """prep -> (the work as a child run | the work as an inline step) -> done."""
    child = Workflow("bench_callee", context=Item)

    @child.step(initial=True, next="done")
    async def work(ctx: Item) -> None:
        ctx.doubled = ctx.n * 2

    child.final("done")
    with_call = Workflow("bench_caller", context=Item)

    @with_call.step(initial=True, next="sub")
    async def prep(ctx: Item) -> None: ...

    with_call.call(
        "sub",
        child=child,
        context=lambda ctx: ctx,
        on={"succeeded": "done"},
        result=lambda ctx, c: setattr(ctx, "doubled", c.doubled),
    )
    with_call.final("done")
    inline = Workflow("bench_inline", context=Item)

    @inline.step(initial=True, next="work_inline")
    async def prep_inline(ctx: Item) -> None: ...

    @inline.step(next="done")
    async def work_inline(ctx: Item) -> None:
        ctx.doubled = ctx.n * 2

    inline.final("done")
    return with_call, inline


def count_transactions(store: Any) -> list[int]:
    """Count every transaction the store opens (SQLAlchemy ones and the raw hot path)."""
    counter = [0]
    for name in ("_write", "_driver"):
        original = getattr(store, name)

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            counter[0] += 1
            return _original(*args, **kwargs)

        setattr(store, name, counted)
    return counter


def fan(url: str, items: int, max_parallel: int) -> dict[str, Any]:
    parent, _ = workflows(max_parallel)
    with Engine(url, max_concurrency=64) as engine:
        engine.register(parent)
        started = engine.start(parent, Batch(count=items))
        counter = count_transactions(engine.store)
        executor = engine._new_executor()
        t0 = time.perf_counter()
        asyncio.run(executor.run(until_idle=True, run_ids=[started.id]))  # the fan-out only
        t1 = time.perf_counter()
        fan_commits = counter[0]
        executor.close()
        executor = engine._new_executor()
        asyncio.run(executor.run(until_idle=True))
        t2 = time.perf_counter()
        executor.close()
        join_commits = counter[0] - fan_commits
        info = engine.get(started.id)
        assert info.state == "joined", info
        assert info.context.total == items * (items - 1), info.context  # type: ignore[union-attr]
        return {
            "fan_out_s": t1 - t0,
            "fan_out_commits": fan_commits,
            "run_and_join_s": t2 - t1,
            "run_and_join_commits": join_commits,
        }


def run_map(url: str, items: int, max_parallel: int) -> dict[str, float]:
    """``engine.run`` of the map: the call drives the run and its children itself, each of
    its claims scoped to the run's family (every live child, held ones included)."""
    parent, _ = workflows(max_parallel)
    with Engine(url, max_concurrency=64) as engine:
        t0 = time.perf_counter()
        info = engine.run(parent, Batch(count=items))
        seconds = time.perf_counter() - t0
        assert info.state == "joined", info
        assert info.context.total == items * (items - 1), info.context  # type: ignore[union-attr]
    return {"engine_run_s": seconds}


def per_run(url: str, runs: int) -> dict[str, float]:
    with_call, inline = call_vs_inline()
    out = {}
    with Engine(url) as engine:
        for name, wf in (("inline_ms", inline), ("call_ms", with_call)):
            engine.run(wf, Item(n=1))  # warm up
            t0 = time.perf_counter()
            for i in range(runs):
                info = engine.run(wf, Item(n=i))
                assert info.state == "done"
            out[name] = (time.perf_counter() - t0) / runs * 1000
    return out


def per_run_batch(url: str, runs: int) -> dict[str, float]:
    """Per-run cost when a worker drives many (start them all, then run until idle)."""
    with_call, inline = call_vs_inline()
    out = {}
    with Engine(url, max_concurrency=64) as engine:
        for name, wf in (("inline_batch_ms", inline), ("call_batch_ms", with_call)):
            engine.start_many(wf, [Item(n=i) for i in range(runs)])
            t0 = time.perf_counter()
            engine.run_until_idle()
            out[name] = (time.perf_counter() - t0) / runs * 1000
            assert len(engine.runs(workflow=wf.name, status="succeeded", limit=runs)) == runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=10_000)
    parser.add_argument("--max-parallel", type=int, default=64)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument(
        "--run-items", type=int, default=2_000, help="items of the map engine.run drives"
    )
    parser.add_argument("--run-parallel", type=int, default=5, help="its max_parallel")
    parser.add_argument("--pg", default=PG_URL)
    args = parser.parse_args()
    backends = ["sqlite"] + ([] if args.pg == "none" else ["postgres"])
    with tempfile.TemporaryDirectory() as directory:
        for backend in backends:
            pg = None if backend == "sqlite" else args.pg
            with fresh_url(backend, directory, pg, "fanout") as url:
                figures = fan(url, args.items, args.max_parallel)
            with fresh_url(backend, directory, pg, "engine_run") as url:
                figures.update(run_map(url, args.run_items, args.run_parallel))
            with fresh_url(backend, directory, pg, "call") as url:
                figures.update(per_run(url, args.runs))
            with fresh_url(backend, directory, pg, "batch") as url:
                figures.update(per_run_batch(url, args.runs * 5))
            print(
                f"{backend:8s} items={args.items} max_parallel={args.max_parallel}: "
                f"fan-out {figures['fan_out_s']:.2f}s / {figures['fan_out_commits']} commits; "
                f"run+join {figures['run_and_join_s']:.2f}s / "
                f"{figures['run_and_join_commits']} commits; "
                f"engine.run of a map of {args.run_items} items, {args.run_parallel} at a time: "
                f"{figures['engine_run_s']:.2f}s; "
                f"per run: inline step {figures['inline_ms']:.2f} ms, "
                f"call {figures['call_ms']:.2f} ms "
                f"({figures['call_ms'] / figures['inline_ms']:.1f}x); "
                f"{args.runs * 5} runs by one worker: inline {figures['inline_batch_ms']:.2f} ms, "
                f"call {figures['call_batch_ms']:.2f} ms per run "
                f"({figures['call_batch_ms'] / figures['inline_batch_ms']:.1f}x)"
            )


if __name__ == "__main__":
    main()
