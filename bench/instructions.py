"""Instructions per step, counted by callgrind: the figure a noisy VM does not move.

Timings on a shared 2-vCPU VM move ±10-30 % between samples (neighbours, CPU frequency);
``valgrind --tool=callgrind`` counts the instructions this process executes, the same to
0.2 % from run to run whatever else the machine does (the database file's writes are the
kernel's work and are not counted, nor is PostgreSQL's). Each program runs in a child
process under callgrind, which counts only its measured batch: the batch runs inside
``functools.reduce``, the C function ``--toggle-collect`` names (set-up, imports and warm-up
runs are not counted).

Programs, each a fresh SQLite file (WAL, ``synchronous=NORMAL``), sequential runs of a
workflow of ``--steps`` trivial steps:

* ``async`` / ``sync``: flowloop, ``engine.run()`` per run, ``async def`` / plain ``def`` steps
* ``core``: seq_steps.py's hand-written SQLAlchemy Core loop (one transaction per boundary)
* ``floor``: the same SQL on the stdlib sqlite3 driver
* ``concurrent``: flowloop, ``--runs`` runs of ``async def`` steps started, then one
  ``engine.run_until_idle()`` with ``max_concurrency`` as many (their boundaries share
  commits): the counted batch is the ``run_until_idle`` alone
* ``pg_async`` / ``pg_core`` / ``pg_concurrent``: ``async``, ``core`` and ``concurrent`` on
  PostgreSQL (a fresh schema; the URL is ``--pg`` or $FLOWLOOP_BENCH_PG): the client's
  instructions only, the server's are another process's

``--context lines`` runs flowloop's programs over a ~93 KB context of 1,000 order lines
(common.Lines) instead of the usual two fields (the baselines keep theirs): what a large
context costs a run.

    python bench/instructions.py                     # ~3 minutes (valgrind is ~50x slower)
    python bench/instructions.py --programs async --steps 1,10,50
    python bench/instructions.py --programs pg_async,pg_core
    python bench/instructions.py --programs async --steps 1,10 --context lines
    python bench/instructions.py --quick             # smoke run

Needs valgrind (Debian: ``apt-get install valgrind``).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from typing import Any

import common

PROGRAMS = ("async", "sync", "core", "floor", "concurrent", "pg_async", "pg_core", "pg_concurrent")
DEFAULT_PROGRAMS = ("async", "sync", "core", "floor")


CONTEXTS = {"small": "Ctx", "lines": "Lines"}
"""``--context``: the model of flowloop's programs' context, in bench/common.py."""


def _child(program: str, runs: int, steps: int, directory: str, pg_url: str, context: str) -> None:
    """In the child, under callgrind: set up, warm up, then one counted batch of runs."""
    import seq_steps

    if program.startswith("pg_"):
        program = program.removeprefix("pg_")
        backend = seq_steps.Backend("pg", "pg", None, runs, pg_url=pg_url)
    else:
        backend = seq_steps.Backend("sqlite", "sqlite", "NORMAL", runs, directory=directory)
    if program == "concurrent":
        _concurrent(backend, runs, steps, getattr(common, CONTEXTS[context]))
        return
    if program in ("async", "sync"):
        from flowloop import Engine

        model = getattr(common, CONTEXTS[context])
        workflow = common.chain(f"i_{program}", steps, kind=program, context=model)
        # A small context is made per run, as the figures of earlier passes were counted;
        # the large one once (making 1,000 lines is not the engine's work).
        lines = model()
        fresh = model if context == "small" else lambda: lines
        with backend.database() as url:
            engine = Engine(url, workflows=[workflow])
            for _ in range(max(3, runs // 5)):
                engine.run(workflow, fresh())

            def batch(_a: Any, _b: Any) -> None:
                for _ in range(runs):
                    engine.run(workflow, fresh())

            functools.reduce(batch, [0, 1])
            engine.close()
        return
    # A baseline program is one call: its database and table made, ``runs`` warm-up runs,
    # ``runs`` timed runs. Counted whole; _count subtracts a count at half the runs.
    make = seq_steps.floor_program if program == "floor" else seq_steps.core_program
    run = make(backend, steps, runs)
    functools.reduce(lambda _a, _b: run(0), [0, 1])


def _concurrent(backend: Any, runs: int, steps: int, model: Any) -> None:
    """``runs`` runs of context ``model`` started, then driven together by one counted
    ``run_until_idle`` (a batch of them first, uncounted: caches, connections)."""
    from flowloop import Engine

    workflow = common.chain("i_concurrent", steps, kind="async", context=model)
    with backend.database() as url:
        engine = Engine(url, workflows=[workflow], max_concurrency=runs)
        for warming in (True, False):
            for _ in range(runs):
                engine.start(workflow, model())
            if warming:
                engine.run_until_idle()
        stats: list[Any] = []
        functools.reduce(lambda _a, _b: stats.append(engine.run_until_idle()), [0, 1])
        assert stats[0].steps == runs * steps, stats
        engine.close()


def _count(program: str, runs: int, steps: int, directory: str, pg_url: str, context: str) -> float:
    """Instructions per step of one program. flowloop's batch is counted alone; a
    baseline's call also makes its database (2 x ``runs`` runs): the difference of two
    counts, at ``runs`` and twice that, is ``2 x runs`` runs."""
    if program in ("core", "floor", "pg_core"):
        once = _collected(program, runs, steps, directory, pg_url, context)
        twice = _collected(program, 2 * runs, steps, directory, pg_url, context)
        return (twice - once) / (2 * runs * steps)
    return _collected(program, runs, steps, directory, pg_url, context) / (runs * steps)


def _collected(
    program: str, runs: int, steps: int, directory: str, pg_url: str, context: str
) -> int:
    """The instructions callgrind counted in one child process."""
    out = os.path.join(directory, f"callgrind.{program}.{steps}.{runs}.out")
    child = [sys.executable, __file__, "--child", program, str(runs), str(steps), directory]
    return common.callgrind(
        [*child, pg_url, context],
        options=[
            "--collect-atstart=no",
            "--toggle-collect=functools_reduce",
            f"--callgrind-out-file={out}",
        ],
        env={**os.environ, "PYTHONHASHSEED": "0"},
        what=program,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        program, runs, steps, directory = argv[1], int(argv[2]), int(argv[3]), argv[4]
        _child(program, runs, steps, directory, argv[5], argv[6])
        return 0
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None, help="runs per program (default 20)")
    p.add_argument("--steps", default="10", help="steps per run, comma-separated (default 10)")
    p.add_argument(
        "--context",
        choices=sorted(CONTEXTS),
        default="small",
        help="flowloop's context: two fields (small, the default) or ~93 KB of lines",
    )
    p.add_argument(
        "--programs",
        default=",".join(DEFAULT_PROGRAMS),
        help=f"which programs, of {', '.join(PROGRAMS)}",
    )
    args = p.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    runs = args.runs or (2 if args.quick else 20)
    step_counts = [int(s) for s in args.steps.split(",")]
    programs = [p for p in args.programs.split(",") if p]
    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        print(f"unknown program(s) {', '.join(unknown)}: choose from {', '.join(PROGRAMS)}")
        return 2
    pg_url = args.pg
    if pg_url == "none" and any(p.startswith("pg_") for p in programs):
        print("the pg_* programs need a PostgreSQL server: --pg URL")
        return 2
    with common.data_dir(args.dir) as directory:
        uses_pg = any(p.startswith("pg_") for p in programs)
        info = common.machine(pg_url if uses_pg else None, directory)
        common.header(
            "instructions: callgrind's count per step (this process; not the kernel's work)",
            info,
            {
                "workflow": f"{args.steps} trivial steps per run, sequential runs",
                "context": "two fields"
                if args.context == "small"
                else "~93 KB: 1,000 order lines (flowloop's programs)",
                "runs": f"{runs} counted per program (after uncounted warm-up runs)",
                "database": "SQLite WAL, synchronous=NORMAL, a fresh file per program; "
                "pg_*: PostgreSQL, a fresh schema per program",
            },
        )
        rows = []
        figures: dict[tuple[str, int], float] = {}
        for steps in step_counts:
            for program in programs:
                print(f"-- {program}, {steps} steps", file=sys.stderr, flush=True)
                with tempfile.TemporaryDirectory(dir=directory) as own:
                    figures[program, steps] = _count(
                        program, runs, steps, own, pg_url, args.context
                    )
                rows.append([program, str(steps), f"{figures[program, steps] / 1000:,.1f} k"])
        common.table(["program", "steps per run", "instructions per step"], rows)
        for steps in step_counts:
            for prefix in ("", "pg_"):
                core = figures.get((f"{prefix}core", steps))
                for program in (f"{prefix}async", f"{prefix}sync"):
                    ours = figures.get((program, steps))
                    if core and ours:
                        print(f"{prefix}core / {program} ({steps} steps): {core / ours:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
