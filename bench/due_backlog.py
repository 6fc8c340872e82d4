"""What a claim costs beside runs due later and runs queued (SQLite WAL NORMAL, PostgreSQL).

A run asleep (``step.sleep``), waiting with a timeout, backing off before a retry or
started for later is a claimable run with a due time ahead: before migration 0017, both
databases read every such run of a worker's workflows at every poll, and every queued run
at every claim (flowloop/store/claims.py). One round, on a fresh database:

* ``later`` runs of workflow ``asleep`` due tomorrow (started for later: the same row as
  a durable sleep's);
* ``empty poll``: the claim a worker polls with (limit 10), nothing due; ``limited empty
  poll`` the same for workflows with a cluster-wide ``max_concurrency``;
* ``run_until_idle, nothing due``: ``engine.run_until_idle()`` (its claims, its look at
  the next due time and its look for waits the loaded definitions cannot take);
* ``drain``: ``drain`` one-step runs queued, then run by ``engine.run_until_idle()``;
* ``due`` more queued runs, then ``claim of 10`` and ``limited claim of 10`` from them
  (taken with a long lease, one claim after another); ``keyed claim of 10`` the same
  from ``due`` queued runs of workflow ``fair``, whose ``concurrency_key`` spreads them
  over 100 keys (a key limit never reached: migration 0018);
* ``poll beside another's queue``: the empty poll of a worker of ``asleep`` alone, the
  queue of another workflow due (a worker that runs some workflows of a database).

On PostgreSQL the runs table is analyzed after each batch of starts, as autovacuum keeps
it (until it does, after a burst into a small table, PostgreSQL plans without statistics
and walks the workflow's index: see bench/README.md).

Figures: the median of 50 calls (20 for ``run_until_idle``) per round, then the median
(min-max) of the rounds. With ``--before TREE`` each round runs in TREE's flowloop and in
this one, alternated, each in its own process, and the table gives both and their ratio.

    python bench/due_backlog.py                                   # ~2 min
    python bench/due_backlog.py --before /tmp/flowloop-before     # ~4 min
    python bench/due_backlog.py --quick                           # smoke run
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import common
from common import Ctx, Results

from flowloop import Engine, Workflow
from flowloop.store.limits import ClaimLimits

HERE = Path(__file__).resolve()
TOMORROW = 86_400.0
LONG_LEASE = 3_600.0
METRICS = (
    "empty poll",
    "limited empty poll",
    "run_until_idle, nothing due",
    "drain",
    "claim of 10",
    "limited claim of 10",
    "keyed claim of 10",
    "poll beside another's queue",
)
KEYS = 100
UNITS = {"drain": "runs/s"}


def _median_ms(call: Callable[[], object], times: int) -> float:
    call()  # warm: statement caches, connections
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1000


def one_round(url: str, *, later: int, due: int, drain: int) -> dict[str, float]:
    asleep, queued, fair = common.chain("asleep", 1), common.chain("queued", 1), _fair()
    both = [asleep.name, queued.name]
    found: dict[str, float] = {}
    with Engine(url, workflows=[asleep, queued, fair]) as engine:
        store = engine.store

        def start(workflow: Workflow, runs: int | list[Ctx], **when: float) -> None:
            contexts = [Ctx()] * runs if isinstance(runs, int) else runs
            engine.start_many(workflow, contexts, **when)
            if url.startswith("postgresql"):
                with store.engine.begin() as conn:  # (an SQLStore)
                    conn.exec_driver_sql("ANALYZE flowloop_runs")

        def claim(workflows: list[str]) -> Callable[[], object]:
            return lambda: store.claim(
                worker="poller",
                now=time.time(),
                limit=10,
                lease_seconds=LONG_LEASE,
                workflows=workflows,
            )

        def limited(call: Callable[[], object]) -> Callable[[], float]:
            """``call`` with both workflows counted against a (never reached) limit."""

            def measured() -> float:
                store.set_claim_limits(dict.fromkeys(both, ClaimLimits(max_concurrency=10**6)))
                try:
                    return _median_ms(call, 50)
                finally:
                    store.set_claim_limits({})

            return measured

        start(asleep, later, run_at=time.time() + TOMORROW)
        found["empty poll"] = _median_ms(claim(both), 50)
        found["limited empty poll"] = limited(claim(both))()
        found["run_until_idle, nothing due"] = _median_ms(engine.run_until_idle, 20)
        start(queued, drain)
        with common.Timer() as timer:
            engine.run_until_idle()
        found["drain"] = drain / timer.seconds
        start(queued, due)
        found["claim of 10"] = _median_ms(claim(both), 50)
        found["limited claim of 10"] = limited(claim(both))()
        found["poll beside another's queue"] = _median_ms(claim([asleep.name]), 50)
        start(fair, [Ctx(n=n) for n in range(due)])
        store.set_claim_limits({fair.name: ClaimLimits(key_limit=10**6, keyed=True)})
        found["keyed claim of 10"] = _median_ms(claim([fair.name]), 50)
    return found


def _fair() -> Workflow:
    """One step, its runs spread over :data:`KEYS` keys by their context's ``n``."""
    fair = Workflow("fair", context=Ctx, concurrency_key=lambda ctx: f"k{ctx.n % KEYS}")

    @fair.step(initial=True, next="done")
    async def only(ctx: Ctx) -> None:
        ctx.n += 1

    fair.final("done")
    return fair


def _in_tree(tree: Path) -> Path:
    """This script and common.py in ``tree``'s bench folder (common.py puts the tree's root
    first on sys.path: the copy measures that tree's flowloop)."""
    bench = tree / "bench"
    if bench.resolve() != HERE.parent:
        bench.mkdir(exist_ok=True)
        for name in (HERE.name, "common.py"):
            shutil.copyfile(HERE.parent / name, bench / name)
    return bench / HERE.name


def _round_in(script: Path, backend: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, str(script), "--one", backend, "--pg", args.pg]
    command += ["--later", str(args.later), "--due", str(args.due), "--drain", str(args.drain)]
    if args.dir:
        command += ["--dir", args.dir]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "failed")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def _program(script: Path, backend: str, args: argparse.Namespace) -> common.Program:
    return lambda _round: _round_in(script, backend, args)


def _row(label: str, metric: str, results: Results, versions: list[str]) -> list[str]:
    row = [label, f"{metric} ({UNITS.get(metric, 'ms')})"]
    row += [common.fmt_spread(results, version, metric) for version in versions]
    if len(versions) == 2 and all(results.has(v, metric) for v in versions):
        before, after = (results.median(v, metric) for v in versions)
        faster = after / before if metric in UNITS else before / after
        row.append(f"{common.fmt(faster)}x")
    return row


def main() -> None:
    p = common.parser(__doc__ or "")
    p.add_argument("--before", default=None, metavar="TREE", help="another flowloop tree")
    p.add_argument("--later", type=int, default=None, help="runs due tomorrow (50,000)")
    p.add_argument("--due", type=int, default=None, help="runs queued for the claims (20,000)")
    p.add_argument("--drain", type=int, default=None, help="runs queued and run (5,000)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.later = args.later or (2_000 if args.quick else 50_000)
    args.due = args.due or (1_000 if args.quick else 20_000)
    args.drain = args.drain or (200 if args.quick else 5_000)
    pg = common.pg_for(args)
    with common.data_dir(args.dir) as directory:
        if args.one:  # one round in this tree, for a --before run: figures as JSON
            with common.fresh_url(args.one, directory, pg, "due") as url:
                print(json.dumps(one_round(url, later=args.later, due=args.due, drain=args.drain)))
            return
        rounds = common.rounds_for(args, default=3, quick=1)
        common.header(
            "claims beside runs due later and runs queued",
            common.machine(pg, directory),
            {"rounds": rounds, "due later": args.later, "queued": args.due, "drained": args.drain},
        )
        trees: Mapping[str, Path] = (
            {"before": _in_tree(Path(args.before).resolve()), "after": HERE}
            if args.before
            else {"this tree": HERE}
        )
        args.pg = pg or "none"
        rows: list[list[str]] = []
        payload: dict[str, object] = {}
        for backend in ["sqlite"] + (["pg"] if pg else []):
            label = "sqlite WAL NORMAL" if backend == "sqlite" else "postgresql"
            print(f"-- {label}", flush=True)
            results = common.alternate(
                [(version, _program(script, backend, args)) for version, script in trees.items()],
                rounds,
                Results(),
                show="empty poll",
            )
            rows += [_row(label, metric, results, list(trees)) for metric in METRICS]
            payload[backend] = results.to_json()
    headers = ["database", "figure", *trees] + (["after vs before"] if len(trees) == 2 else [])
    common.table(headers, rows)
    common.write_json(args.json, payload)
    common.footer()


if __name__ == "__main__":
    main()
