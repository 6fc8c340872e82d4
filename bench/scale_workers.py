"""Many workers: steps/s of 1, 2 and 4 worker processes sharing one PostgreSQL database.

Programs ``1 worker``, ``2 workers``, ``4 workers``, alternated per round (the order rotates
from round to round); each round has its own fresh PostgreSQL schema and its own 4 worker
processes (``python -m flowloop.cli worker FLOW --db URL --concurrency C``, the command users
run). FLOW defines one 10-step workflow of trivial ``async def`` steps per program, so the
samples of a round never mix runs.

A sample: all 4 workers are up and frozen (SIGSTOP, idle: they hold no lease); the runs are
enqueued (``engine.start``, due now); N workers are resumed at once (SIGCONT) — time zero.
Timed: until every run succeeded (the latest ``updated_at`` of its run rows, written by
the workers); then the N workers are frozen again. Start-up and enqueueing are not timed.

steps/s = runs x steps / seconds. Also shown: each worker's share of the steps (the work
spreads across workers through ``FOR UPDATE SKIP LOCKED`` claims) and the scaling ratios.
Every sample checks that every run succeeded and that no step succeeded twice.

Note: the workers, the benchmark and the database share this machine's CPUs (see nproc):
where they are few, more workers mostly compete for the same cores.

    python bench/scale_workers.py            # 2,000 runs, 3 rounds: a few minutes
    python bench/scale_workers.py --quick    # 60 runs, 1 round: smoke run, < 15 s
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import common
import sqlalchemy as sa
from common import Results

WORKER_COUNTS = (1, 2, 4)
ENQUEUE_THREADS = 4

FLOW_SOURCE = """\
# The workflows of bench/scale_workers.py: trivial async steps (bench/common.py:chain).
import sys

sys.path.insert(0, {bench!r})
import common  # noqa: E402

{workflows}
"""


def workflow_name(count: int) -> str:
    return f"scale_{count}"


def write_flow(directory: str, steps: int) -> Path:
    path = Path(directory) / f"scale_flow_{steps}.py"
    defs = "\n".join(
        f"{workflow_name(n)} = common.chain({workflow_name(n)!r}, {steps})" for n in WORKER_COUNTS
    )
    path.write_text(FLOW_SOURCE.format(bench=str(Path(__file__).resolve().parent), workflows=defs))
    return path


@contextlib.contextmanager
def frozen_workers(
    flow: Path, url: str, count: int, concurrency: int, directory: str
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` worker processes, started and up (their first log line), then frozen."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(common.ROOT), os.environ.get("PYTHONPATH")])),
    )
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for i in range(count):
            log = Path(directory) / f"worker-{i}.log"
            logs.append(log)
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "flowloop.cli",
                            "worker",
                            str(flow),
                            "--db",
                            url,
                            "--concurrency",
                            str(concurrency),
                            "--grace",
                            "5",
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=directory,
                    )
                )
        deadline = time.monotonic() + 60
        while not all("workflow(s)" in log.read_text(errors="replace") for log in logs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                tails = "\n".join(log.read_text(errors="replace")[-2000:] for log in logs)
                raise RuntimeError(f"workers did not start:\n{tails}")
            time.sleep(0.05)
        for proc in procs:
            os.kill(proc.pid, signal.SIGSTOP)
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            with contextlib.suppress(OSError):
                log.unlink()


def enqueue(url: str, workflow: Any, runs: int) -> None:
    from flowloop import Engine

    def part(count: int) -> None:
        with Engine(url, workflows=[workflow]) as engine:
            ctx = common.Ctx()
            for _ in range(count):
                engine.start(workflow, ctx)

    shares = [
        runs // ENQUEUE_THREADS + (i < runs % ENQUEUE_THREADS) for i in range(ENQUEUE_THREADS)
    ]
    with ThreadPoolExecutor(ENQUEUE_THREADS) as pool:
        list(pool.map(part, [s for s in shares if s]))


def one_round(
    pg: str,
    directory: str,
    flow: Path,
    order: Sequence[int],
    *,
    runs: int,
    steps: int,
    concurrency: int,
) -> dict[int, dict[str, float]]:
    from flowloop import Engine
    from flowloop.loader import import_file

    module = import_file(flow)
    out: dict[int, dict[str, float]] = {}
    with common.pg_schema(pg, "scale") as (url, _schema):
        with Engine(url, workflows=[getattr(module, workflow_name(n)) for n in order]):
            pass  # the schema, before the workers look at it
        db = sa.create_engine(url, poolclass=sa.NullPool)
        try:
            with frozen_workers(flow, url, max(order), concurrency, directory) as procs:
                for count in order:
                    name = workflow_name(count)
                    enqueue(url, getattr(module, name), runs)
                    go = time.time()
                    for proc in procs[:count]:
                        os.kill(proc.pid, signal.SIGCONT)
                    try:
                        end = wait_all_succeeded(db, name, runs, procs)
                    finally:
                        for proc in procs[:count]:
                            os.kill(proc.pid, signal.SIGSTOP)
                    shares = check(db, name, runs, steps)
                    seconds = end - go
                    total = runs * steps
                    metrics = {"steps_per_s": total / seconds, "seconds": seconds}
                    for i, share in enumerate(sorted(shares.values(), reverse=True)):
                        metrics[f"share_{i + 1}"] = share / total * 100
                    out[count] = metrics
        finally:
            db.dispose()
    return out


def wait_all_succeeded(
    db: sa.Engine, workflow: str, runs: int, procs: Sequence[subprocess.Popen[bytes]]
) -> float:
    """Poll until every run succeeded; the time the last one did (its row's updated_at)."""
    deadline = time.monotonic() + 600
    query = sa.text(
        "SELECT count(*) FILTER (WHERE status = 'succeeded'), max(updated_at)"
        " FROM flowloop_runs WHERE workflow = :w"
    )
    with db.connect() as conn:
        while True:
            done, last = conn.execute(query, {"w": workflow}).one()
            conn.commit()
            if done == runs:
                return float(last)
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"only {done} of {runs} runs succeeded")
            time.sleep(0.02)


def check(db: sa.Engine, workflow: str, runs: int, steps: int) -> Counter[str]:
    """Every step succeeded once per run; the steps each worker ran."""
    with db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT j.worker, count(*), count(DISTINCT (j.run_id, j.state))"
                " FROM flowloop_journal j JOIN flowloop_runs r ON r.id = j.run_id"
                " WHERE j.kind = 'step_succeeded' AND r.workflow = :w GROUP BY j.worker"
            ),
            {"w": workflow},
        ).all()
        statuses: dict[str, int] = dict(
            conn.execute(
                sa.text(
                    "SELECT status, count(*) FROM flowloop_runs WHERE workflow = :w GROUP BY status"
                ),
                {"w": workflow},
            ).all()
        )
    total = sum(int(r[1]) for r in rows)
    distinct = sum(int(r[2]) for r in rows)
    if statuses != {"succeeded": runs} or total != runs * steps or distinct != total:
        raise RuntimeError(f"runs {statuses}, {total} steps succeeded (expected {runs * steps})")
    return Counter({str(r[0]): int(r[1]) for r in rows})


def label(count: int) -> str:
    return f"{count} worker{'s' if count > 1 else ''}"


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None, help="runs per sample (2000; quick 60)")
    p.add_argument("--steps", type=int, default=10, help="steps per run (10)")
    p.add_argument("--concurrency", type=int, default=16, help="--concurrency of each worker")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    runs = args.runs or (60 if args.quick else 2000)
    pg = common.pg_usable(args.pg)
    if pg is None:
        print("scale_workers needs PostgreSQL (--pg URL)", file=sys.stderr)
        return 2

    with common.data_dir(args.dir) as directory:
        info = common.machine(pg, directory)
        common.header(
            "scale_workers: steps/s of 1, 2 and 4 worker processes on one PostgreSQL database",
            info,
            {
                "workload": f"{runs} runs x {args.steps} trivial async steps per sample,"
                " enqueued due now",
                "workers": f"python -m flowloop.cli worker --concurrency {args.concurrency}"
                " (lease 30 s); frozen while the runs are enqueued, then N resumed: time zero",
                "timed": "from resuming the workers until the last run succeeded",
                "rounds": f"{rounds}; order rotates per round; fresh schema and 4 fresh worker"
                " processes per round",
            },
        )
        flow = write_flow(directory, args.steps)
        results = Results()
        for r in range(rounds):
            order = [WORKER_COUNTS[(i + r) % len(WORKER_COUNTS)] for i in range(len(WORKER_COUNTS))]
            try:
                samples = one_round(
                    pg,
                    directory,
                    flow,
                    order,
                    runs=runs,
                    steps=args.steps,
                    concurrency=args.concurrency,
                )
            except Exception as error:
                results.notes[f"round {r + 1}"] = f"failed: {common.first_line(error)}"
                print(f"  round {r + 1}/{rounds}: FAILED {error}", file=sys.stderr, flush=True)
                continue
            for count in WORKER_COUNTS:
                results.add(label(count), samples[count])
            line = "  ".join(f"{label(n)}={common.fmt(samples[n]['steps_per_s'])}" for n in order)
            print(f"  round {r + 1}/{rounds}: {line}", file=sys.stderr, flush=True)

    report(results, runs, args.steps)
    common.write_json(args.json, {"machine": info, "results": results.to_json()})
    return 0


def report(results: Results, runs: int, steps: int) -> None:
    print(f"Figures: median (min-max) of the rounds; {runs} runs x {steps} steps per sample")
    rows: list[list[Any]] = []
    for name in results.order:
        shares = [
            f"{results.median(name, f'share_{i}'):.0f}%"
            for i in range(1, 5)
            if results.has(name, f"share_{i}")
        ]
        rows.append(
            [
                name,
                common.fmt_spread(results, name, "steps_per_s"),
                common.fmt_spread(results, name, "seconds", 2),
                " / ".join(shares),
            ]
        )
    for name, note in results.notes.items():
        rows.append([name, note, "", ""])
    common.table(["program", "steps/s", "seconds", "share of steps per worker"], rows)
    base = "1 worker"
    if results.has(base, "steps_per_s"):
        ratio_rows = []
        one = results.median(base, "steps_per_s")
        for name in results.order[1:]:
            if results.has(name, "steps_per_s"):
                ratio_rows.append(
                    [f"{name} / {base}", f"{results.median(name, 'steps_per_s') / one:.2f}x"]
                )
        print("Scaling (medians)")
        common.table(["ratio", "value"], ratio_rows)
    print(f"note: {os.cpu_count()} CPUs shared by the workers, PostgreSQL and this script")


if __name__ == "__main__":
    sys.exit(main())
