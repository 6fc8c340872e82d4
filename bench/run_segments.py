"""Where one ``engine.run()`` spends its time: the segments between the engine's calls to its
store, for a sequential workflow of ``--steps`` trivial steps (SQLite WAL NORMAL, and
PostgreSQL when it answers).

The store's ``create_run`` and ``write`` (the whole of a run's database work under
``engine.run``: one creation, one write per boundary) and each step note the time they
start and end (``time.perf_counter``); the gaps between those notes are the engine's own
Python. Per run, in order:

* ``call -> create``: ``engine.run`` up to the store (the context parsed and checked, the
  run's first entries and record built, the event loop entered);
* ``create``: the store's ``create_run`` (its statements, its commit, its Python);
* ``create -> 1st step``: the run's task spawned, the lease threads and the watchdog told,
  an event-loop turn;
* ``step -> write``: from a step's start to its boundary's write (the step itself, the
  context dumped and parsed back, the entries and record built), every step;
* ``write``: the store's ``write`` of every boundary (the last one ends the run);
* ``write -> step``: from a write back to the next step, every step but the first;
* ``last write -> return``: the run's task ended, the caller woken, its RunInfo built,
  the loop left.

Each note is a call, a clock read and an append (4 + 3 per step in a run): a few tenths of
a µs each, counted in the segments. Figures: µs per run, the median (min-max) of the
rounds; the fixed part (the three per-run segments), the engine's Python per step (its two
per-step segments, each averaged over the steps it occurs in) and the store per step.

    python bench/run_segments.py              # ~30 s
    python bench/run_segments.py --quick      # smoke run
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import common
from common import Ctx, Results

from flowloop import Engine, Workflow

SEGMENTS = (
    "call -> create",
    "create",
    "create -> 1st step",
    "step -> write",
    "write",
    "write -> step",
    "last write -> return",
)
FIXED = ("call -> create", "create -> 1st step", "last write -> return")
"""The engine's Python that a run pays once, whatever its steps."""
MARKS = {
    ("start", "create"): "call -> create",
    ("create", "created"): "create",
    ("created", "step"): "create -> 1st step",
    ("step", "write"): "step -> write",
    ("write", "written"): "write",
    ("written", "step"): "write -> step",
    ("written", "end"): "last write -> return",
}


def marked_chain(name: str, steps: int, kind: str, note: Callable[[str], None]) -> Workflow:
    """common.chain's workflow, each step noting its start first."""
    workflow = Workflow(name, context=Ctx)
    for i in range(steps):
        nxt = f"s{i + 1}" if i < steps - 1 else "done"
        if kind == "sync":

            def fn(ctx: Ctx) -> None:
                note("step")
                ctx.n += 1

        else:

            async def fn(ctx: Ctx) -> None:
                note("step")
                ctx.n += 1

        workflow.step(name=f"s{i}", initial=i == 0, next=nxt)(fn)
    workflow.final("done")
    return workflow


@contextmanager
def store_marks(store: Any, note: Callable[[str], None]) -> Iterator[None]:
    """``store``'s ``create_run`` and ``write`` noting their start and end (on the
    instance: the class is left as it is)."""
    create, write = store.create_run, store.write

    def create_run(*args: Any, **kwargs: Any) -> Any:
        note("create")
        try:
            return create(*args, **kwargs)
        finally:
            note("created")

    def write_marked(boundaries: Any) -> Any:
        note("write")
        try:
            return write(boundaries)
        finally:
            note("written")

    store.create_run, store.write = create_run, write_marked
    try:
        yield
    finally:
        del store.create_run, store.write


def program(
    backend: str, directory: str, pg: str | None, kind: str, runs: int, steps: int
) -> common.Program:
    def run(_round: int) -> Mapping[str, float]:
        marks: list[tuple[str, float]] = []
        clock = time.perf_counter

        def note(what: str) -> None:
            marks.append((what, clock()))

        workflow = marked_chain(f"segments_{kind}", steps, kind, note)
        totals = dict.fromkeys(SEGMENTS, 0.0)
        with (
            common.fresh_url(backend, directory, pg, "segments") as url,
            Engine(url, workflows=[workflow]) as engine,
            store_marks(engine.store, note),
        ):
            for _ in range(max(runs // 10, 5)):  # warm: caches, connections
                engine.run(workflow, Ctx())
            gc.collect()
            for _ in range(runs):
                marks.clear()
                note("start")
                info = engine.run(workflow, Ctx())
                note("end")
                if info.status != "succeeded":
                    raise RuntimeError(f"run ended {info.status}: {info.error}")
                for (a, at), (b, bt) in itertools.pairwise(marks):
                    segment = MARKS.get((a, b))
                    if segment is None:  # (a write retried, say): not the usual run
                        raise RuntimeError(f"unexpected calls to the store: {a} then {b}")
                    totals[segment] += bt - at
        per_run = {name: seconds / runs * 1e6 for name, seconds in totals.items()}
        per_run["total"] = sum(per_run.values())
        per_run["fixed"] = sum(per_run[name] for name in FIXED)
        per_run["python per step"] = per_run["step -> write"] / steps + (
            per_run["write -> step"] / (steps - 1) if steps > 1 else 0.0
        )
        per_run["store per step"] = per_run["write"] / steps
        return per_run

    return run


def main() -> None:
    parser = common.parser(__doc__ or "")
    parser.add_argument("--runs", type=int, default=None, help="runs per sample (2000)")
    parser.add_argument("--steps", type=int, default=10, help="steps per run (10)")
    args = parser.parse_args()
    runs = args.runs or (50 if args.quick else 2000)
    rounds = common.rounds_for(args)
    pg = common.pg_for(args)
    with common.data_dir(args.dir) as directory:
        info = common.machine(pg, directory)
        common.header(
            "Where an engine.run() spends its time", info, {"runs": runs, "steps": args.steps}
        )
        backends = [("sqlite", "sqlite WAL NORMAL")] + ([("pg", "postgresql")] if pg else [])
        everything: dict[str, Results] = {}
        for backend, label in backends:
            print(f"-- {label}")
            programs = [
                (kind, program(backend, directory, pg, kind, runs, args.steps))
                for kind in ("async", "sync")
            ]
            results = everything[label] = common.alternate(programs, rounds, show="total")
            for name, failure in results.notes.items():
                print(f"  {name}: {failure}")
            rows = [
                [name, *[common.fmt_spread(results, kind, name, 1) for kind, _ in programs]]
                for name in (*SEGMENTS, "total", "fixed", "python per step", "store per step")
            ]
            print(f"\nµs per run of {args.steps} steps, {label}: median (min-max), {rounds} rounds")
            common.table(["segment", "async def steps", "def steps"], rows)
            print()
        common.write_json(args.json, {name: r.to_json() for name, r in everything.items()})
        common.footer()


if __name__ == "__main__":
    main()
