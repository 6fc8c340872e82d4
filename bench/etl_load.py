"""ETL load rate: the flowloop.etl kit (workflows/etl.py) through flowloop against the same
step functions in a plain loop.

One generated file (bench/gen_etl_data.py: 1,000,000 order rows, ~0.1 % bad) is loaded into
a fresh SQLite target per program and round, at each batch size:

* ``flowloop``  ``Engine.run(etl, ctx)`` on a fresh SQLite store (WAL, synchronous NORMAL):
  every batch is a step boundary, its context (file, byte offset, counters) committed to
  the journal, so a killed load resumes at the last batch;
* ``plain``     ``etl.run_plain(ctx)``: the same step functions called in a loop, no journal
  (a crash starts over).

* ``reader``      the kit's CSV reader alone (``CsvFormat.read`` batch after batch, no
  validation, no writes): how much of a load parsing is, i.e. what a faster CSV parser
  could save at most;
* ``boundaries``  the batch loop alone: a workflow whose self-looping step only moves the
  offset of an ETL-sized context, as many times as the load has batches: the cost of the
  checkpoints themselves, which contention on a busy machine blurs less than the loads'.

rows/s = data rows read (loaded + rejected) / wall seconds, the scan and hashing of the
file by ``discover`` included. The overhead of checkpointing is
``flowloop seconds / plain seconds - 1``, also shown per batch (ms per boundary), in wall
time and in CPU time (the process's, step threads included: unlike wall time it does not
grow when other processes compete for the CPUs). Programs alternate per round.

    python bench/etl_load.py                # 1,000,000 rows, batch 1,000 and 10,000, 3 rounds
    python bench/etl_load.py --quick        # 10,000 rows, one round, < 10 s
    python bench/etl_load.py --data /tmp/etl-1m   # keep the generated input between runs
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import common
import gen_etl_data
from common import Results

from flowloop import Engine, Workflow
from flowloop.etl import FileInfo, writers
from flowloop.loader import import_file

ETL_FILE = common.ROOT / "workflows" / "etl.py"
QUICK_ROWS = 10_000


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{QUICK_ROWS:,} rows, one round (< 10 s)")
    p.add_argument("--rows", type=int, default=None, help="rows to load (default 1,000,000)")
    p.add_argument(
        "--batch-sizes", default="1000,10000", help="comma-separated (default 1000,10000)"
    )
    p.add_argument("--rounds", type=int, default=None, help="rounds per program (default 3)")
    p.add_argument(
        "--data",
        default=None,
        help="folder for the generated input, kept and reused (default: a temp dir)",
    )
    p.add_argument("--dir", default=None, help="folder for the databases (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    return p.parse_args(argv)


@contextlib.contextmanager
def input_folder(path: str | None, rows: int) -> Iterator[Path]:
    """A folder with one generated file of ``rows`` rows (made once; reused if it matches)."""
    with common.data_dir(path) as folder_text:
        folder = Path(folder_text) / f"rows-{rows}"
        done = folder / ".complete"
        if not done.exists():
            t0 = time.perf_counter()
            gen_etl_data.generate(folder, rows, files=1, seed=gen_etl_data.DEFAULT_SEED)
            done.touch()
            print(f"generated {rows:,} rows in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        yield folder


def close_target(etl: ModuleType, url: str) -> None:
    writers.close_engine(url)


def measure(etl: ModuleType, run: Any, context: Mapping[str, Any], target: str) -> dict[str, float]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    ctx = run({**context, "target_url": target})
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    close_target(etl, target)
    return {
        "seconds": wall,
        "cpu_s": cpu,
        "rows_per_s": ctx.rows_done / wall,
        "rows": ctx.rows_done,
        "batches": ctx.batches_done,
        "rejects": ctx.rejects,
    }


def probe_workflow(etl: ModuleType, batches: int) -> Workflow:
    """The ETL's batch loop with the work taken out: a step that only moves the offset and
    the counters of an ETL context. What is left per step is flowloop's boundary."""
    workflow = Workflow(f"etl_probe_{batches}", context=etl.EtlContext)

    @workflow.step(initial=True, on={"more": "batch", "eof": "done"}, max_visits=batches + 1)
    def batch(ctx: Any) -> str:
        ctx.batches_done += 1
        ctx.rows_done += ctx.batch_size
        ctx.offset += 100 * ctx.batch_size
        return "more" if ctx.batches_done < batches else "eof"

    workflow.final("done")
    return workflow


def probe_context(etl: ModuleType, size: int) -> dict[str, Any]:
    """An ETL context as it is in the middle of a big file (same fields, same size)."""
    info = FileInfo(
        name="orders_gen_0001.csv", size=123_456_789, mtime_ns=1, sha256="0" * 64, rows=1_000_000
    )
    return {
        "pending": [info.model_dump()],
        "file": info.name,
        "columns": list(etl.loader.columns),
        "batch_size": size,
        "file_status": "loading",
        "rows_total": 1_000_000,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    rows = args.rows or (QUICK_ROWS if args.quick else gen_etl_data.DEFAULT_ROWS)
    rounds = max(1, args.rounds or (1 if args.quick else 3))
    sizes = [int(size) for size in args.batch_sizes.split(",") if size.strip()]
    etl = import_file(ETL_FILE)
    with input_folder(args.data, rows) as inbox, common.data_dir(args.dir) as dbs:
        common.header(
            "ETL load: flowloop (a journaled step per batch) vs the same steps in a plain loop",
            common.machine(None, dbs),
            {
                "rows": f"{rows:,} in one file, {_size(inbox)}",
                "batch sizes": ", ".join(f"{s:,}" for s in sizes),
                "rounds": rounds,
                "store": "SQLite, WAL, synchronous NORMAL",
                "target": "SQLite, WAL, NORMAL",
                "load": common.load_text(),
            },
        )
        programs: list[tuple[str, common.Program]] = []
        for size in sizes:
            context = {"input_dir": str(inbox), "batch_size": size}

            def flowloop(
                r: int, context: dict[str, Any] = context, size: int = size
            ) -> Mapping[str, float]:
                with (
                    common.sqlite_file(dbs, f"store-{size}") as store,
                    common.sqlite_file(dbs, f"target-{size}") as target,
                    Engine(f"sqlite:///{store}") as engine,
                ):

                    def run(ctx: Mapping[str, Any]) -> Any:
                        info = engine.run(etl.etl, ctx)
                        if info.status != "succeeded":
                            raise RuntimeError(f"run {info.status}: {info.error}")
                        return info.context

                    return measure(etl, run, context, f"sqlite:///{target}")

            def plain(
                r: int, context: dict[str, Any] = context, size: int = size
            ) -> Mapping[str, float]:
                with common.sqlite_file(dbs, f"plain-{size}") as target:
                    return measure(etl, etl.run_plain, context, f"sqlite:///{target}")

            def probe(r: int, size: int = size) -> Mapping[str, float]:
                batches = -(-rows // size)
                workflow = probe_workflow(etl, batches)
                with (
                    common.sqlite_file(dbs, f"probe-{size}") as store,
                    Engine(f"sqlite:///{store}") as engine,
                ):
                    engine.register(workflow)
                    wall0, cpu0 = time.perf_counter(), time.process_time()
                    info = engine.run(workflow, probe_context(etl, size))
                    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                assert info.status == "succeeded", info.error
                return {
                    "ms_per_boundary": wall / batches * 1000,
                    "cpu_ms_per_boundary": cpu / batches * 1000,
                    "seconds": wall,
                    "cpu_s": cpu,
                    "batches": batches,
                }

            def reader(r: int, size: int = size) -> Mapping[str, float]:
                return read_only(etl, inbox, size)

            programs += [
                (f"flowloop/{size}", flowloop),
                (f"plain/{size}", plain),
                (f"reader/{size}", reader),
                (f"boundaries/{size}", probe),
            ]
        results = common.alternate(programs, rounds, Results(), show="rows_per_s")
        report(results, sizes, rows)
        common.footer()
        common.write_json(
            args.json,
            {"rows": rows, "rounds": rounds, "results": results.to_json(), "notes": results.notes},
        )


def read_only(etl: ModuleType, inbox: Path, size: int) -> dict[str, float]:
    """The kit's reader over the input, ``size`` records a read from each returned offset."""
    fmt = etl.loader.fmt
    wall0, cpu0 = time.perf_counter(), time.process_time()
    records = 0
    for path in sorted(inbox.glob("*.csv")):
        header, problem = fmt.header(path)
        assert header is not None, problem
        end, offset, line = path.stat().st_size, header.data_offset, header.data_line
        while offset < end:
            batch = fmt.read(path, header=header, offset=offset, end=end, line=line, limit=size)
            records += len(batch.records)
            offset, line = batch.offset, batch.line
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return {"seconds": wall, "cpu_s": cpu, "rows_per_s": records / wall, "rows": records}


def _size(folder: Path) -> str:
    size = sum(path.stat().st_size for path in folder.glob("*.csv"))
    return f"{size / 1e6:,.1f} MB"


def report(results: Results, sizes: list[int], rows: int) -> None:
    table_rows = []
    for size in sizes:
        for kind in ("flowloop", "plain"):
            name = f"{kind}/{size}"
            table_rows.append(
                [
                    name,
                    common.fmt_spread(results, name, "rows_per_s"),
                    common.fmt_spread(results, name, "seconds"),
                    common.fmt_spread(results, name, "cpu_s"),
                    common.fmt(results.median(name, "batches"), 0)
                    if results.has(name, "batches")
                    else "-",
                ]
            )
    print(f"== rows/s loading {rows:,} rows (median, min-max)")
    common.table(["program", "rows/s", "seconds", "cpu s", "batches"], table_rows)
    print("== overhead of checkpointing (flowloop vs plain, median of per-round ratios)")
    for size in sizes:
        flow, plain = f"flowloop/{size}", f"plain/{size}"
        if not (results.has(flow, "seconds") and results.has(plain, "seconds")):
            print(f"  batch {size:,}: not measured ({results.notes})")
            continue
        batches = results.median(flow, "batches")
        for metric, what in (("seconds", "wall"), ("cpu_s", "CPU")):
            pairs = list(
                zip(results.samples[flow][metric], results.samples[plain][metric], strict=False)
            )
            ratio = statistics.median(f / p for f, p in pairs)
            per_batch = statistics.median((f - p) / batches for f, p in pairs) * 1000
            print(
                f"  batch {size:>6,} {what:>4}: flowloop {ratio:.3f}x the plain loop "
                f"({(ratio - 1) * 100:+.1f} %), {per_batch:+.2f} ms per batch boundary"
            )
    print("== the CSV reader alone (stdlib csv at byte offsets; no validation, no writes)")
    for size in sizes:
        name, plain = f"reader/{size}", f"plain/{size}"
        if not (results.has(name, "cpu_s") and results.has(plain, "cpu_s")):
            continue
        share = results.median(name, "cpu_s") / results.median(plain, "cpu_s") * 100
        print(
            f"  batch {size:>6,}: {common.fmt_spread(results, name, 'rows_per_s')} rows/s, "
            f"{results.median(name, 'cpu_s'):.2f} s CPU = {share:.1f} % of the plain load's CPU"
        )
    print("== the boundaries alone (the batch loop with a step that does no work, same context)")
    for size in sizes:
        name, plain = f"boundaries/{size}", f"plain/{size}"
        if not results.has(name, "seconds"):
            continue
        share = results.median(name, "cpu_s") / results.median(plain, "cpu_s") * 100
        print(
            f"  batch {size:>6,}: {results.median(name, 'batches'):,.0f} boundaries, "
            f"{common.fmt_spread(results, name, 'ms_per_boundary', 3)} ms each "
            f"({common.fmt_spread(results, name, 'cpu_ms_per_boundary', 3)} ms CPU); "
            f"in all {results.median(name, 'cpu_s'):.2f} s CPU = {share:.1f} % of the plain "
            f"load's CPU"
        )
    if results.notes:
        print(f"  notes: {results.notes}")
    print()


if __name__ == "__main__":
    main()
