"""ETL fan-out: one child run of workflows/etl.py per file (a map state, max_parallel=2)
against the same files loaded one after the other, on 2 cores.

The parent lists the input folder and maps each file to a child ``etl`` run (its context:
the same folder, ``pattern`` the file's name). Steps run in threads and the GIL keeps one
process to one core, so the parallel program runs **two worker processes** on the same
SQLite store; the sequential one is the same parent with ``max_parallel=1`` and one
worker. Both load into a SQLite target (WAL; two writers take turns on its lock).

    python bench/etl_parallel.py                 # 2 files x 250,000 rows, 3 rounds
    python bench/etl_parallel.py --quick         # 2 x 5,000 rows, one round
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import common
import gen_etl_data
from pydantic import BaseModel

from flowloop import Engine, Step, Workflow
from flowloop.compose import ChildResult
from flowloop.loader import import_file
from flowloop.worker import Worker

etl_module = import_file(common.ROOT / "workflows" / "etl.py")
POLL_S = 0.05


class Fanout(BaseModel):
    input_dir: str
    target_url: str
    batch_size: int = 1_000
    files: list[str] = []
    rows_done: int = 0
    rejects: int = 0


def fanout(max_parallel: int) -> Workflow:
    workflow = Workflow(f"etl_fanout_bench_{max_parallel}", context=Fanout)

    @workflow.step(initial=True, next="load_files")
    def list_files(ctx: Fanout, step: Step) -> None:
        ctx.files = sorted(p.name for p in Path(ctx.input_dir).glob("*.csv"))

    def collect(ctx: Fanout, results: list[ChildResult[Any]]) -> None:
        ctx.rows_done = sum(r.context.rows_done for r in results if r.ok)
        ctx.rejects = sum(r.context.rejects for r in results if r.ok)

    workflow.map(
        "load_files",
        child=etl_module.etl,
        items=lambda ctx: ctx.files,
        context=lambda ctx, name: {
            "input_dir": ctx.input_dir,
            "pattern": name,
            "target_url": ctx.target_url,
            "batch_size": ctx.batch_size,
        },
        max_parallel=max_parallel,
        on={"done": "done", "failed": "failed"},
        reduce=collect,
    )
    workflow.final("done", "failed")
    return workflow


WORKFLOWS = {n: fanout(n) for n in (1, 2)}


def worker_process(store: str, run_id: str, max_parallel: int) -> None:
    """One worker on ``store`` until the parent run has ended."""

    async def main() -> None:
        with Engine(store, poll_seconds=POLL_S) as engine:
            engine.register(WORKFLOWS[max_parallel])
            engine.register(etl_module.etl)
            stop = asyncio.Event()
            # One run at a time: with two, one process takes both children and the GIL
            # keeps them to one core.
            task = asyncio.create_task(Worker(engine, [], concurrency=1).run(stop))
            while engine.get(run_id).status not in ("succeeded", "failed", "stopped"):
                await asyncio.sleep(POLL_S)
            stop.set()
            await task

    asyncio.run(main())


def load(
    dbs: Path, inbox: Path, name: str, processes: int, max_parallel: int
) -> Mapping[str, float]:
    with (
        common.sqlite_file(dbs, f"store-{name}") as store_path,
        common.sqlite_file(dbs, f"target-{name}") as target,
    ):
        store = f"sqlite:///{store_path}"
        with Engine(store) as engine:
            context = {"input_dir": str(inbox), "target_url": f"sqlite:///{target}"}
            run_id = engine.start(WORKFLOWS[max_parallel], context).id
        t0 = time.perf_counter()
        fork = multiprocessing.get_context("fork")
        children = [
            fork.Process(target=worker_process, args=(store, run_id, max_parallel))
            for _ in range(processes)
        ]
        for child in children:
            child.start()
        for child in children:
            child.join()
        wall = time.perf_counter() - t0
        with Engine(store) as engine:
            engine.register(WORKFLOWS[max_parallel])
            info = engine.get(run_id)
        if info.status != "succeeded":
            raise RuntimeError(f"run {info.status}: {info.error}")
        rows = info.context.rows_done
        return {"seconds": wall, "rows_per_s": rows / wall, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rows", type=int, default=None, help="rows per file (default 250,000)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--data", default=None, help="folder for the generated input (kept)")
    p.add_argument("--dir", default=None, help="folder for the databases")
    args = p.parse_args(argv)
    rows = args.rows or (5_000 if args.quick else 250_000)
    rounds = args.rounds or (1 if args.quick else 3)
    with common.data_dir(args.data) as data, common.data_dir(args.dir) as dbs_text:
        inbox = Path(data) / f"fanout-2x{rows}"
        if not (inbox / ".complete").exists():
            gen_etl_data.generate(inbox, rows * 2, files=2, seed=gen_etl_data.DEFAULT_SEED)
            (inbox / ".complete").touch()
        dbs = Path(dbs_text)
        common.header(
            "ETL fan-out: a map of one etl child per file, 2 worker processes, vs one by one",
            common.machine(None, dbs_text),
            {"rows": f"2 files x {rows:,}", "rounds": rounds, "load": common.load_text()},
        )
        programs: list[tuple[str, common.Program]] = [
            ("sequential", lambda r: load(dbs, inbox, f"seq-{r}", 1, 1)),
            ("parallel", lambda r: load(dbs, inbox, f"par-{r}", 2, 2)),
        ]
        results = common.alternate(programs, rounds, common.Results(), show="rows_per_s")
        print(f"== rows/s loading 2 x {rows:,} rows (median, min-max)")
        for name in ("sequential", "parallel"):
            print(f"  {name:<10} {common.fmt_spread(results, name, 'rows_per_s')} rows/s")
        if results.has("sequential", "seconds") and results.has("parallel", "seconds"):
            pairs = zip(
                results.samples["sequential"]["seconds"],
                results.samples["parallel"]["seconds"],
                strict=False,
            )
            speedup = statistics.median(s / q for s, q in pairs)
            print(f"  speed-up (median of per-round ratios): {speedup:.2f}x on 2 cores")
        if results.notes:
            print(f"  notes: {results.notes}")
        common.footer()


if __name__ == "__main__":
    sys.exit(main())
