"""Per-step cost of OpenTelemetry tracing: the same runs with tracing off and on.

Programs, alternated per round, each on a fresh SQLite file (WAL, ``synchronous=NORMAL``):

* ``off``: an engine without ``flowloop.tracing.instrument`` (what every user without the
  ``otel`` extra runs: one ``None`` check per run start, nothing per step);
* ``on, simple``: instrumented, spans handed to a ``SimpleSpanProcessor`` whose exporter
  drops them (span creation and the synchronous processor path, no I/O);
* ``on, batch``: instrumented, a ``BatchSpanProcessor`` with the same exporter (what a
  service exporting over the network would use).

Workload: ``--runs`` sequential runs (``engine.run``) of a workflow of ``--steps`` trivial
``async def`` steps. Each traced run makes one span per step attempt and one run span (the
finishing boundary reads the run's journal back once to build it).

    python bench/tracing.py            # ~1 minute
    python bench/tracing.py --quick    # smoke run, < 10 s
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import common
from common import Results
from pydantic import BaseModel


class Ctx(BaseModel):
    n: int = 0


def workflow(steps: int) -> Any:
    from flowloop import Workflow

    wf = Workflow("traced_bench", context=Ctx)
    names = [f"s{i:02d}" for i in range(steps)]
    for index, name in enumerate(names):
        nxt = names[index + 1] if index + 1 < steps else "done"

        async def step(ctx: Ctx) -> None:
            ctx.n += 1

        wf.step(name=name, initial=index == 0, next=nxt)(step)
    wf.final("done")
    return wf


def program(directory: str, *, runs: int, steps: int, mode: str) -> common.Program:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SimpleSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    from flowloop import Engine, tracing

    class Drop(SpanExporter):
        def __init__(self) -> None:
            self.spans = 0

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

    wf = workflow(steps)

    def run(round_: int) -> Mapping[str, float]:
        exporter = Drop()
        provider = TracerProvider()
        if mode == "simple":
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        elif mode == "batch":
            provider.add_span_processor(BatchSpanProcessor(exporter))
        with common.fresh_url("sqlite", directory, None, f"trace-{mode}-{round_}") as url:
            engine = Engine(url, workflows=[wf])
            try:
                if mode != "off":
                    tracing.instrument(engine, tracer_provider=provider)
                engine.run(wf, {})  # warm-up: prepared statements, the executor
                with common.Timer() as t:
                    for _ in range(runs):
                        engine.run(wf, {})
            finally:
                engine.close()
                provider.shutdown()  # the batch processor exports what it holds
        total = runs * steps
        want = 0 if mode == "off" else (runs + 1) * (steps + 1)
        if exporter.spans != want:
            raise RuntimeError(f"{mode}: {exporter.spans} spans exported, expected {want}")
        return t.per_step(total)

    return run


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=300, help="runs per sample (300)")
    p.add_argument("--steps", type=int, default=10, help="steps per run (10)")
    args = p.parse_args(argv)
    rounds = common.rounds_for(args)
    runs = 30 if args.quick else args.runs
    with common.data_dir(args.dir) as directory:
        info = common.machine(None, directory)
        common.header(
            "tracing: per-step cost, OpenTelemetry off and on",
            info,
            {
                "workload": f"{runs:,} sequential runs x {args.steps} trivial async steps",
                "database": "SQLite WAL, synchronous=NORMAL",
                "rounds": f"{rounds}, programs alternated; fresh database per sample",
            },
        )
        programs = [
            (name, program(directory, runs=runs, steps=args.steps, mode=mode))
            for name, mode in (("off", "off"), ("on, simple", "simple"), ("on, batch", "batch"))
        ]
        results: Results = common.alternate(programs, rounds, show="steps_per_s")
    rows = []
    base = results.median("off", "us_per_step")
    base_cpu = results.median("off", "cpu_us_per_step")
    for name in results.order:
        extra = results.median(name, "us_per_step") - base
        extra_cpu = results.median(name, "cpu_us_per_step") - base_cpu
        rows.append(
            [
                name,
                common.fmt_spread(results, name, "steps_per_s"),
                common.fmt_spread(results, name, "us_per_step", 1),
                common.fmt_spread(results, name, "cpu_us_per_step", 1),
                "" if name == "off" else f"{extra:+.1f} µs ({extra_cpu:+.1f} CPU µs)",
            ]
        )
    common.table(
        ["tracing", "steps/s median (min-max)", "µs/step", "CPU µs/step", "cost vs off"], rows
    )
    common.footer()
    common.write_json(args.json, {"machine": info, "results": results.to_json()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
