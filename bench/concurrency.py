"""Concurrent runs: group commit and I/O overlap.

Programs, alternated per round, each on a fresh database:

* ``concurrent sleep``: 100 runs of 10 steps that ``await asyncio.sleep(0.01)``, started
  with ``engine.start`` then driven by one ``engine.run_until_idle()`` with
  ``max_concurrency=100``. Timed: ``run_until_idle`` (the 100 starts are timed apart).
  Counts from the returned Stats: commits, boundaries, boundaries per commit.
* ``sequential sleep``: the same workflow, ``engine.run`` one run at a time.
* ``concurrent trivial``: as the first with trivial steps (no sleep): the group-commit limit.
* ``sequential trivial``: trivial steps one run at a time (the seq_steps figure).

Ceiling for the sleeping workload: 100 runs x (1 step / 10 ms) = 10,000 steps/s.
Targets: concurrent sleep >= 3x the sequential (trivial-step) figure on SQLite, >= 10x on
PostgreSQL; issue 13: concurrent trivial >= 4x sequential trivial on both.

    python bench/concurrency.py            # ~1-2 minutes
    python bench/concurrency.py --quick    # smoke run, < 10 s
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Mapping
from typing import Any

import common
from common import Ctx, Results

TARGETS = {"sqlite": 3.0, "pg": 10.0}
TRIVIAL_TARGET = 4.0
"""Issue 13: 100 concurrent runs of trivial steps, steps/s against sequential runs."""


def concurrent_program(
    backend: str,
    synchronous: str,
    directory: str,
    pg: str | None,
    *,
    runs: int,
    steps: int,
    sleep: float,
    concurrency: int,
    batches: int,
) -> common.Program:
    from flowloop import Engine

    workflow = common.chain(f"conc_{'sleep' if sleep else 'trivial'}", steps, sleep=sleep)

    def run(_round: int) -> Mapping[str, float]:
        with common.fresh_url(backend, directory, pg, "conc") as url:
            engine = Engine(
                url, workflows=[workflow], synchronous=synchronous, max_concurrency=concurrency
            )
            try:
                engine.run(workflow, Ctx())  # warm-up (statement caches, connections)
                seconds = start_seconds = cpu_seconds = 0.0
                commits = boundaries = 0
                for _ in range(batches):
                    gc.collect()
                    with common.Timer() as started:
                        for _ in range(runs):
                            engine.start(workflow, Ctx())
                    with common.Timer() as t:
                        stats: Any = engine.run_until_idle()
                    seconds += t.seconds
                    cpu_seconds += t.cpu_seconds
                    start_seconds += started.seconds
                    commits += stats.commits
                    boundaries += stats.boundaries
                total = runs * batches + 1
                done = engine.runs(workflow=workflow.name, status="succeeded", limit=total + 10)
                if len(done) != total:
                    raise RuntimeError(f"{len(done) - 1} of {total - 1} runs succeeded")
            finally:
                engine.close()
        n = runs * steps * batches
        return {
            "steps_per_s": n / seconds,
            "seconds": seconds / batches,
            "cpu_us_per_step": cpu_seconds / n * 1e6,
            "start_ms_per_run": start_seconds / (runs * batches) * 1e3,
            "commits": commits / batches,
            "boundaries": boundaries / batches,
            "boundaries_per_commit": boundaries / max(1, commits),
            "commits_per_boundary": commits / max(1, boundaries),
        }

    return run


def sequential_program(
    backend: str,
    synchronous: str,
    directory: str,
    pg: str | None,
    *,
    runs: int,
    steps: int,
    sleep: float,
) -> common.Program:
    from flowloop import Engine

    workflow = common.chain(f"seq_{'sleep' if sleep else 'trivial'}", steps, sleep=sleep)

    def run(_round: int) -> Mapping[str, float]:
        with common.fresh_url(backend, directory, pg, "conc") as url:
            engine = Engine(url, workflows=[workflow], synchronous=synchronous)
            try:
                engine.run(workflow, Ctx())
                gc.collect()
                with common.Timer() as t:
                    for _ in range(runs):
                        info = engine.run(workflow, Ctx())
                if info.status != "succeeded":
                    raise RuntimeError(f"run ended {info.status}")
            finally:
                engine.close()
        return {
            "steps_per_s": runs * steps / t.seconds,
            "seconds": t.seconds,
            "cpu_us_per_step": t.cpu_seconds / (runs * steps) * 1e6,
        }

    return run


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=100, help="concurrent runs (100)")
    p.add_argument("--steps", type=int, default=10, help="steps per run (10)")
    p.add_argument("--sleep", type=float, default=0.01, help="seconds each step sleeps (0.01)")
    p.add_argument("--concurrency", type=int, default=100, help="max_concurrency (100)")
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        help="batches of --runs runs per sample, each started then driven (5)",
    )
    p.add_argument("--seq-runs", type=int, default=None, help="runs, sequential sleep (10)")
    p.add_argument(
        "--seq-trivial-runs",
        type=int,
        default=None,
        help="runs, sequential trivial (200 SQLite, 50 PostgreSQL)",
    )
    p.add_argument("--full", action="store_true", help="also SQLite synchronous=FULL")
    args = p.parse_args(argv)
    quick = args.quick
    rounds = common.rounds_for(args)
    runs = 10 if quick else args.runs
    steps = 3 if quick else args.steps
    seq_runs = args.seq_runs or (2 if quick else 10)
    batches = args.batches or (1 if quick else 5)
    pg = common.pg_for(args)

    settings: list[tuple[str, str, str]] = [("sqlite WAL NORMAL", "sqlite", "NORMAL")]
    if args.full and not quick:
        settings.append(("sqlite WAL FULL", "sqlite", "FULL"))
    if pg:
        settings.append(("postgresql", "pg", "NORMAL"))

    with common.data_dir(args.dir) as directory:
        info = common.machine(pg, directory)
        common.header(
            "concurrency: concurrent runs with group commit",
            info,
            {
                "workload": f"{runs} runs x {steps} steps, each step awaits "
                f"asyncio.sleep({args.sleep:g}); max_concurrency={args.concurrency}",
                "ceiling": f"{min(runs, args.concurrency)} / {args.sleep:g} s = "
                f"{min(runs, args.concurrency) / args.sleep:,.0f} steps/s"
                if args.sleep
                else "none",
                "durability": ", ".join(f"{s[0]}" for s in settings),
                "rounds": f"{rounds}, programs alternated; fresh database per sample",
                "batches": f"{batches} per sample (start {runs} runs, then run_until_idle); "
                "seconds column = one batch",
            },
        )
        all_results: dict[str, Results] = {}
        for label, backend, synchronous in settings:
            print(f"-- {label}", file=sys.stderr, flush=True)
            trivial_runs = args.seq_trivial_runs or (
                5 if quick else (200 if backend == "sqlite" else 50)
            )
            common_kw: dict[str, Any] = {"steps": steps}
            where = (backend, synchronous, directory, pg)
            programs: list[tuple[str, common.Program]] = [
                (
                    "concurrent sleep",
                    concurrent_program(
                        *where,
                        runs=runs,
                        sleep=args.sleep,
                        concurrency=args.concurrency,
                        batches=batches,
                        **common_kw,
                    ),
                ),
                (
                    "sequential sleep",
                    sequential_program(*where, runs=seq_runs, sleep=args.sleep, **common_kw),
                ),
                (
                    "concurrent trivial",
                    concurrent_program(
                        *where,
                        runs=runs,
                        sleep=0.0,
                        concurrency=args.concurrency,
                        batches=batches,
                        **common_kw,
                    ),
                ),
                (
                    "sequential trivial",
                    sequential_program(*where, runs=trivial_runs, sleep=0.0, **common_kw),
                ),
            ]
            all_results[label] = common.alternate(programs, rounds)

    report(all_results, settings, runs, steps)
    common.footer()
    common.write_json(
        args.json,
        {
            "machine": info,
            "results": {k: v.to_json() for k, v in all_results.items()},
        },
    )
    return 0


def report(
    all_results: Mapping[str, Results],
    settings: list[tuple[str, str, str]],
    runs: int,
    steps: int,
) -> None:
    rows = []
    for label, results in all_results.items():
        for name in results.order:
            rows.append(
                [
                    label,
                    name,
                    common.fmt_spread(results, name, "steps_per_s"),
                    common.fmt_spread(results, name, "seconds", 3),
                    common.fmt_spread(results, name, "cpu_us_per_step"),
                    common.fmt_spread(results, name, "commits_per_boundary", 3),
                    common.fmt_spread(results, name, "boundaries_per_commit", 1),
                    common.fmt_spread(results, name, "start_ms_per_run", 2),
                ]
            )
        for name, note in results.notes.items():
            rows.append([label, name, note, "", "", "", "", ""])
    print(f"Figures: median (min-max); {runs} runs x {steps} steps for the concurrent programs")
    common.table(
        [
            "database",
            "program",
            "steps/s",
            "seconds",
            "CPU µs/step",
            "commits/boundary",
            "boundaries/commit",
            "start() ms/run",
        ],
        rows,
    )
    print("Ratios (medians)")
    kinds = {s[0]: s[1] for s in settings}
    ratio_rows = []
    for label, results in all_results.items():

        def med(name: str, r: Results = results) -> float | None:
            return r.median(name, "steps_per_s") if r.has(name, "steps_per_s") else None

        conc, seq_sleep = med("concurrent sleep"), med("sequential sleep")
        conc_trivial, seq_trivial = med("concurrent trivial"), med("sequential trivial")
        if conc and seq_trivial:
            ratio_rows.append(
                [
                    label,
                    "concurrent sleep / sequential trivial",
                    common.verdict(conc / seq_trivial, TARGETS[kinds[label]]),
                ]
            )
        if conc and seq_sleep:
            ratio_rows.append(
                [label, "concurrent sleep / sequential sleep", f"{conc / seq_sleep:.1f}x"]
            )
        if conc_trivial and seq_trivial:
            ratio_rows.append(
                [
                    label,
                    "concurrent trivial / sequential trivial",
                    common.verdict(conc_trivial / seq_trivial, TRIVIAL_TARGET),
                ]
            )
    common.table(["database", "ratio", "value"], ratio_rows)


if __name__ == "__main__":
    sys.exit(main())
