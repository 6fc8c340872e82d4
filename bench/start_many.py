"""Fan-out: enqueueing many runs with ``engine.start_many`` against ``engine.start`` each.

Programs, alternated per round, each on a fresh database:

* ``start_many``: ``--runs`` contexts (each with its own business key) in one call,
  1,000 runs per transaction.
* ``start each``: the same contexts, ``engine.start`` one by one (a commit per run).

Timed: the enqueueing only (contexts are built beforehand); the runs are not executed.

    python bench/start_many.py            # ~1 minute
    python bench/start_many.py --quick    # smoke run, < 10 s
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import common
from common import Results
from pydantic import BaseModel


class Order(BaseModel):
    order_id: str
    amount: float = 9.5


def workflow() -> Any:
    from flowloop import Workflow

    wf = Workflow("fanout", context=Order, key="order_id")
    wf.step(name="charge", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    return wf


def program(
    backend: str, directory: str, pg: str | None, *, runs: int, many: bool
) -> common.Program:
    from flowloop import Engine

    wf = workflow()

    def run(round_: int) -> Mapping[str, float]:
        contexts = [Order(order_id=f"r{round_}-{n}") for n in range(runs)]
        with common.fresh_url(backend, directory, pg, "fanout") as url:
            engine = Engine(url, workflows=[wf])
            try:
                with common.Timer() as t:
                    if many:
                        engine.start_many(wf, contexts)
                    else:
                        for context in contexts:
                            engine.start(wf, context)
                stored = len(engine.runs(workflow=wf.name, limit=runs + 10))
            finally:
                engine.close()
        if stored != runs:
            raise RuntimeError(f"{stored} of {runs} runs stored")
        return {"runs_per_s": runs / t.seconds, "cpu_us_per_run": t.cpu_seconds / runs * 1e6}

    return run


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10_000, help="runs enqueued per sample (10,000)")
    args = p.parse_args(argv)
    rounds = common.rounds_for(args)
    runs = 500 if args.quick else args.runs
    pg = common.pg_for(args)
    backends = [("sqlite WAL NORMAL", "sqlite")] + ([("postgresql", "pg")] if pg else [])
    with common.data_dir(args.dir) as directory:
        info = common.machine(pg, directory)
        common.header(
            "fan-out: start_many vs start one by one",
            info,
            {
                "workload": f"{runs:,} runs, each with its own business key",
                "rounds": f"{rounds}, programs alternated; fresh database per sample",
            },
        )
        all_results: dict[str, Results] = {}
        for label, backend in backends:
            print(f"-- {label}", file=sys.stderr, flush=True)
            where = (backend, directory, pg)
            programs = [
                ("start_many", program(*where, runs=runs, many=True)),
                ("start each", program(*where, runs=runs, many=False)),
            ]
            all_results[label] = common.alternate(programs, rounds, show="runs_per_s")
    rows = []
    for label, results in all_results.items():
        for name in results.order:
            rows.append(
                [
                    label,
                    name,
                    common.fmt_spread(results, name, "runs_per_s"),
                    common.fmt_spread(results, name, "cpu_us_per_run"),
                    results.notes.get(name, ""),
                ]
            )
        if results.has("start_many", "runs_per_s") and results.has("start each", "runs_per_s"):
            ratio = results.median("start_many", "runs_per_s") / results.median(
                "start each", "runs_per_s"
            )
            rows.append([label, "ratio start_many / start each", f"{ratio:.1f}x", "", ""])
    common.table(["database", "program", "runs/s median (min-max)", "CPU µs/run", "note"], rows)
    common.footer()
    common.write_json(
        args.json,
        {"machine": info, "results": {k: v.to_json() for k, v in all_results.items()}},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
