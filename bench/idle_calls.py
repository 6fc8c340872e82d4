"""What a call that finds nothing to do costs: ``engine.run_until_idle()`` on a database
with no run due (issue 13: "run_until_idle() with nothing due costs ≈ 0.9 ms per call"),
SQLite WAL NORMAL and PostgreSQL.

Programs, alternated per round, each on a fresh database holding one finished run:

* ``kept loop``       ``engine.run_until_idle()``: the calling thread's kept event loop
  (flowloop.mainloop.ThreadLoops), as ``engine.run`` uses;
* ``loop per call``   ``asyncio.run(engine.arun_until_idle())``: a new event loop built and
  closed at every call — what ``run_until_idle`` did before it kept the loop.

Both make the same database calls (recovery's sweep, the park of stranded waits, two
claims, the next due time): the difference between them is the loop alone. Figures: µs
and CPU µs per call, the median (min-max) of the rounds, and statements per call counted
at the driver outside the timed section.

    python bench/idle_calls.py            # ~20 s
    python bench/idle_calls.py --quick    # smoke run, < 10 s
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable, Mapping

import common
from common import Ctx, Results, WireCounter

from flowloop import Engine

CallIdle = Callable[[Engine], object]

PROGRAMS: dict[str, CallIdle] = {
    "kept loop": lambda engine: engine.run_until_idle(),
    "loop per call": lambda engine: asyncio.run(engine.arun_until_idle()),
}


def program(
    backend: str, directory: str, pg: str | None, call: CallIdle, calls: int
) -> common.Program:
    workflow = common.chain("idle", 3)

    def run(_round: int) -> Mapping[str, float]:
        with (
            common.fresh_url(backend, directory, pg, "idle") as url,
            WireCounter() as wire,
            Engine(url, workflows=[workflow]) as engine,
        ):
            engine.run(workflow, Ctx())  # one finished run: nothing is due
            for _ in range(20):  # warm: statement caches, connections
                call(engine)
            wire.start()
            for _ in range(20):
                call(engine)
            wire.stop()
            counts = wire.per(20)
            gc.collect()
            with common.Timer() as t:
                for _ in range(calls):
                    call(engine)
        return {
            "us_per_call": t.seconds / calls * 1e6,
            "cpu_us_per_call": t.cpu_seconds / calls * 1e6,
            "statements": counts.get("statements", 0.0),
        }

    return run


def main() -> None:
    args = common.parser(__doc__ or "").parse_args()
    rounds = common.rounds_for(args)
    calls = 50 if args.quick else 500
    pg = common.pg_for(args)
    with common.data_dir(args.dir) as directory:
        common.header(
            "run_until_idle() with nothing due",
            common.machine(pg, directory),
            {"rounds": rounds, "calls per sample": calls},
        )
        backends = ["sqlite"] + (["pg"] if pg else [])
        rows: list[list[str]] = []
        payload: dict[str, object] = {}
        for backend in backends:
            label = "sqlite WAL NORMAL" if backend == "sqlite" else "postgresql"
            print(f"-- {label}", flush=True)
            results = common.alternate(
                [
                    (name, program(backend, directory, pg, call, calls))
                    for name, call in PROGRAMS.items()
                ],
                rounds,
                Results(),
                show="us_per_call",
            )
            for name in PROGRAMS:
                rows.append(
                    [
                        label,
                        name,
                        common.fmt_spread(results, name, "us_per_call"),
                        common.fmt_spread(results, name, "cpu_us_per_call"),
                        common.fmt_spread(results, name, "statements"),
                        results.notes.get(name, ""),
                    ]
                )
            if results.has("kept loop", "cpu_us_per_call"):
                saved = results.median("loop per call", "cpu_us_per_call") - results.median(
                    "kept loop", "cpu_us_per_call"
                )
                rows.append(
                    [label, "saved by the kept loop (CPU µs)", "", common.fmt(saved), "", ""]
                )
            payload[backend] = results.to_json()
    common.table(["database", "program", "µs/call", "CPU µs/call", "statements/call", "note"], rows)
    common.write_json(args.json, payload)
    common.footer()


if __name__ == "__main__":
    main()
