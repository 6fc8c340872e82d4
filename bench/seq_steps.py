"""Sequential steps/s: flowloop against the raw limit of its databases.

Programs, alternated per round, each on a fresh database (SQLite file / PostgreSQL schema):

* ``floor``  stdlib sqlite3: per boundary BEGIN; UPDATE run; INSERT journal row; COMMIT
* ``core``   the same with SQLAlchemy Core on one held connection (the baseline)
* ``core_apart``  (SQLite) the Core loop with its WAL checkpoints on a thread, as flowloop's
  store does them: the same remedy given to the baseline, so its share reads apart
* ``async``  flowloop: ``engine.run(workflow, ctx)`` per run, 10 ``async def`` steps
* ``sync``   the same with plain ``def`` steps (``engine.run`` calls one without a timeout
  in the calling thread; a worker and ``run_until_idle`` hand it to a thread pool: the
  hop timed below)

A run is its creation plus one boundary per step: 11 commits per 10 steps for the
baselines (the floor flowloop's protocol also has: one commit per boundary). steps/s =
runs x steps / seconds. Counts (commits, statements, PostgreSQL round trips) come from
SQLAlchemy events during a warm-up pass, outside the timed section.

A micro-benchmark also times the hop of a plain ``def`` step into a thread and back
against awaiting an ``async def`` step, as flowloop's executor calls them.

    python bench/seq_steps.py            # ~1-2 minutes
    python bench/seq_steps.py --quick    # smoke run, < 10 s
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sqlite3
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import common
import sqlalchemy as sa
from common import Ctx, Results, WireCounter


def target_vs_core(label: str, program: str) -> float:
    """Issue 13's targets against the Core loop: on SQLite ``async def`` steps 1.5x and
    ``def`` steps 1.0x, on PostgreSQL 1.5x for both."""
    return 1.0 if label.startswith("sqlite") and program == "sync" else 1.5


@dataclass(frozen=True)
class Backend:
    label: str
    kind: str  # "sqlite" | "pg"
    synchronous: str | None
    runs: int
    pg_url: str | None = None
    directory: str = "."

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A fresh database: a SQLite file URL or a PostgreSQL URL on a fresh schema."""
        if self.kind == "sqlite":
            with common.sqlite_file(self.directory) as path:
                yield f"sqlite:///{path}"
        else:
            assert self.pg_url is not None
            with common.pg_schema(self.pg_url) as (url, _):
                yield url


# -- the baselines -----------------------------------------------------------------------

RUN_DDL = (
    "CREATE TABLE runs (id VARCHAR(40) PRIMARY KEY, status VARCHAR(16) NOT NULL, "
    "state VARCHAR(200) NOT NULL, context TEXT NOT NULL, last_seq INTEGER NOT NULL, "
    "updated_at FLOAT NOT NULL)"
)
JOURNAL_DDL = (
    "CREATE TABLE journal (run_id VARCHAR(40) NOT NULL, seq INTEGER NOT NULL, "
    "kind VARCHAR(32) NOT NULL, at FLOAT NOT NULL, state VARCHAR(200), context TEXT, "
    "worker VARCHAR(200), PRIMARY KEY (run_id, seq))"
)


def _sqlite_pragmas(dbapi: Any, synchronous: str) -> None:
    cursor = dbapi.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute(f"PRAGMA synchronous={synchronous}")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def floor_program(backend: Backend, steps: int, warm: int) -> common.Program:
    """stdlib sqlite3, explicit BEGIN/COMMIT, statements cached by the driver."""

    def run(_round: int) -> Mapping[str, float]:
        with backend.database() as url:
            path = url.removeprefix("sqlite:///")
            con = sqlite3.connect(path, isolation_level=None)
            _sqlite_pragmas(con, backend.synchronous or "NORMAL")
            con.execute(RUN_DDL)
            con.execute(JOURNAL_DDL)
            insert_run = "INSERT INTO runs VALUES (?, ?, ?, ?, ?, ?)"
            update_run = (
                "UPDATE runs SET status=?, state=?, context=?, last_seq=?, updated_at=? WHERE id=?"
            )
            insert_event = "INSERT INTO journal VALUES (?, ?, ?, ?, ?, ?, ?)"

            def one() -> None:
                rid = uuid.uuid4().hex
                now = time.time()
                con.execute("BEGIN")
                con.execute(insert_run, (rid, "running", "s0", '{"n":0}', 1, now))
                con.execute(insert_event, (rid, 1, "run_created", now, "s0", '{"n":0}', "w"))
                con.execute("COMMIT")
                for i in range(steps):
                    now = time.time()
                    ctx = f'{{"n":{i + 1}}}'
                    status = "succeeded" if i == steps - 1 else "running"
                    con.execute("BEGIN")
                    con.execute(update_run, (status, f"s{i + 1}", ctx, i + 2, now, rid))
                    con.execute(insert_event, (rid, i + 2, "step", now, f"s{i}", ctx, "w"))
                    con.execute("COMMIT")

            for _ in range(warm):
                one()
            gc.collect()
            with common.Timer() as t:
                for _ in range(backend.runs):
                    one()
            con.close()
        n = backend.runs * steps
        return {
            **t.per_step(n),
            "commits": (steps + 1) / steps,
            "statements": 2 * (steps + 1) / steps,
        }

    return run


def core_engine(url: str, backend: Backend, *, checkpoint_pages: int | None = None) -> sa.Engine:
    if backend.kind == "sqlite":
        engine = sa.create_engine(url)
        mode = backend.synchronous or "NORMAL"

        def pragmas(dbapi: Any, _record: Any) -> None:
            _sqlite_pragmas(dbapi, mode)
            if checkpoint_pages is not None:
                dbapi.execute(f"PRAGMA wal_autocheckpoint={checkpoint_pages}")

        sa.event.listen(engine, "connect", pragmas)
        return engine
    return sa.create_engine(url)


@contextlib.contextmanager
def checkpoints_apart(path: str, synchronous: str, every: float = 0.25) -> Iterator[None]:
    """A thread checkpointing the WAL of ``path`` every ``every`` seconds (PASSIVE), as
    flowloop's store does (flowloop/store/checkpointer.py) and SQLite's WAL page advises:
    the same remedy given to the baseline, so its effect on flowloop reads apart."""
    import threading

    stop = threading.Event()
    failed: list[BaseException] = []

    def loop() -> None:
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            try:
                conn.execute(f"PRAGMA synchronous={synchronous}")
                while not stop.wait(every):
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            finally:
                conn.close()
        except BaseException as error:  # the sample must not quietly become another program
            failed.append(error)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    if failed:
        raise RuntimeError(f"the Core loop's checkpoint thread failed: {failed[0]!r}")


def core_program(backend: Backend, steps: int, warm: int, *, apart: bool = False) -> common.Program:
    """SQLAlchemy Core, one held connection, one transaction per boundary. ``apart``: its
    commits checkpoint only past 10,000 pages; a thread checkpoints the WAL meanwhile."""
    md = sa.MetaData()
    runs = sa.Table(
        "runs",
        md,
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("state", sa.String(200), nullable=False),
        sa.Column("context", sa.Text, nullable=False),
        sa.Column("last_seq", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    journal = sa.Table(
        "journal",
        md,
        sa.Column("run_id", sa.String(40), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.Column("state", sa.String(200)),
        sa.Column("context", sa.Text),
        sa.Column("worker", sa.String(200)),
    )
    insert_run = sa.insert(runs)
    insert_event = sa.insert(journal)
    update_run = (
        sa.update(runs)
        .where(runs.c.id == sa.bindparam("b_id"))
        .values(
            status=sa.bindparam("status"),
            state=sa.bindparam("state"),
            context=sa.bindparam("context"),
            last_seq=sa.bindparam("last_seq"),
            updated_at=sa.bindparam("updated_at"),
        )
    )

    def run(_round: int) -> Mapping[str, float]:
        with contextlib.ExitStack() as stack:
            url = stack.enter_context(backend.database())
            wire = stack.enter_context(WireCounter())
            engine = core_engine(url, backend, checkpoint_pages=10_000 if apart else None)
            md.create_all(engine)
            if apart:
                mode = backend.synchronous or "NORMAL"
                stack.enter_context(checkpoints_apart(url.removeprefix("sqlite:///"), mode))
            with engine.connect() as conn:

                def one() -> None:
                    rid = uuid.uuid4().hex
                    now = time.time()
                    with conn.begin():
                        conn.execute(
                            insert_run,
                            {
                                "id": rid,
                                "status": "running",
                                "state": "s0",
                                "context": '{"n":0}',
                                "last_seq": 1,
                                "updated_at": now,
                            },
                        )
                        conn.execute(
                            insert_event,
                            {
                                "run_id": rid,
                                "seq": 1,
                                "kind": "run_created",
                                "at": now,
                                "state": "s0",
                                "context": '{"n":0}',
                                "worker": "w",
                            },
                        )
                    for i in range(steps):
                        now = time.time()
                        ctx = f'{{"n":{i + 1}}}'
                        with conn.begin():
                            conn.execute(
                                update_run,
                                {
                                    "b_id": rid,
                                    "status": "succeeded" if i == steps - 1 else "running",
                                    "state": f"s{i + 1}",
                                    "context": ctx,
                                    "last_seq": i + 2,
                                    "updated_at": now,
                                },
                            )
                            conn.execute(
                                insert_event,
                                {
                                    "run_id": rid,
                                    "seq": i + 2,
                                    "kind": "step",
                                    "at": now,
                                    "state": f"s{i}",
                                    "context": ctx,
                                    "worker": "w",
                                },
                            )

                wire.start()
                for _ in range(warm):
                    one()
                wire.stop()
                counts = wire.per(warm * steps)
                gc.collect()
                with common.Timer() as t:
                    for _ in range(backend.runs):
                        one()
            engine.dispose()
        n = backend.runs * steps
        return {
            **t.per_step(n),
            **counts,
        }

    return run


# -- flowloop ----------------------------------------------------------------------------


def flowloop_program(backend: Backend, steps: int, warm: int, kind: str) -> common.Program:
    from flowloop import Engine

    workflow = common.chain(f"seq_{kind}", steps, kind=kind)

    def run(_round: int) -> Mapping[str, float]:
        with backend.database() as url, WireCounter() as wire:
            engine = Engine(url, workflows=[workflow], synchronous=backend.synchronous or "NORMAL")
            try:
                engine.run(workflow, Ctx())  # first use: statement caches, connections
                wire.start()
                for _ in range(warm):
                    info = engine.run(workflow, Ctx())
                wire.stop()
                counts = wire.per(warm * steps)
                gc.collect()
                with common.Timer() as t:
                    for _ in range(backend.runs):
                        info = engine.run(workflow, Ctx())
                if info.status != "succeeded":
                    raise RuntimeError(f"run ended {info.status}: {info.error}")
            finally:
                engine.close()
        n = backend.runs * steps
        return {
            **t.per_step(n),
            **counts,
        }

    return run


# -- the thread hop ----------------------------------------------------------------------


def hop_program(mode: str, calls: int) -> common.Program:
    """Per call: awaiting an async function as a task (``async``) or submitting a plain
    function to a thread pool and awaiting its future (``thread``), as the executor does."""

    def plain(x: int) -> int:
        return x + 1

    async def coro(x: int) -> int:
        return x + 1

    async def main() -> float:
        pool = ThreadPoolExecutor(max_workers=16)
        try:
            for i in range(200):  # start the worker threads
                await asyncio.wrap_future(pool.submit(plain, i))
            t0 = time.perf_counter()
            if mode == "thread":
                for i in range(calls):
                    await asyncio.wrap_future(pool.submit(plain, i))
            else:
                for i in range(calls):
                    await asyncio.ensure_future(coro(i))
            return time.perf_counter() - t0
        finally:
            pool.shutdown()

    def run(_round: int) -> Mapping[str, float]:
        gc.collect()
        seconds = asyncio.run(main())
        return {"us_per_call": seconds / calls * 1e6}

    return run


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="steps per workflow (default 10)")
    p.add_argument("--runs", type=int, default=None, help="runs per sample, SQLite NORMAL (300)")
    p.add_argument("--runs-full", type=int, default=None, help="runs per sample, SQLite FULL (150)")
    p.add_argument("--runs-pg", type=int, default=None, help="runs per sample, PostgreSQL (60)")
    p.add_argument("--warm", type=int, default=3, help="warm-up (counted, untimed) runs")
    p.add_argument("--no-full", action="store_true", help="skip SQLite synchronous=FULL")
    p.add_argument(
        "--no-apart",
        action="store_true",
        help="skip the Core loop with its WAL checkpoints on a thread (SQLite)",
    )
    p.add_argument("--hop-calls", type=int, default=None, help="calls per thread-hop sample")
    args = p.parse_args(argv)
    rounds = common.rounds_for(args)
    quick = args.quick
    runs = args.runs or (5 if quick else 300)
    runs_full = args.runs_full or (3 if quick else 150)
    runs_pg = args.runs_pg or (3 if quick else 60)
    warm = 1 if quick else args.warm
    hop_calls = args.hop_calls or (2_000 if quick else 20_000)
    pg = common.pg_for(args)

    with common.data_dir(args.dir) as directory:
        info = common.machine(pg, directory)
        backends = [Backend("sqlite WAL NORMAL", "sqlite", "NORMAL", runs, directory=directory)]
        if not args.no_full and not quick:
            backends.append(
                Backend("sqlite WAL FULL", "sqlite", "FULL", runs_full, directory=directory)
            )
        if pg:
            backends.append(Backend("postgresql", "pg", None, runs_pg, pg_url=pg))
        common.header(
            "seq_steps: sequential steps/s, flowloop vs one commit per boundary",
            info,
            {
                "workflow": f"{args.steps} trivial steps (ctx.n += 1), engine.run() per run",
                "durability": "SQLite journal_mode=WAL with synchronous NORMAL"
                + ("" if quick or args.no_full else " and FULL")
                + "; PostgreSQL server defaults (synchronous_commit as configured)",
                "runs per sample": ", ".join(f"{b.label}: {b.runs}" for b in backends),
                "rounds": f"{rounds} (programs alternated in each round), warm-up {warm} runs",
                "baseline": "per run 1 commit to create + 1 per step (UPDATE run + INSERT journal)",
            },
        )
        all_results: dict[str, Results] = {}
        for backend in backends:
            print(f"-- {backend.label}", file=sys.stderr, flush=True)
            programs: list[tuple[str, common.Program]] = []
            if backend.kind == "sqlite":
                programs.append(("floor", floor_program(backend, args.steps, warm)))
            programs += [
                ("core", core_program(backend, args.steps, warm)),
            ]
            if backend.kind == "sqlite" and not args.no_apart:
                programs.append(("core_apart", core_program(backend, args.steps, warm, apart=True)))
            programs += [
                ("async", flowloop_program(backend, args.steps, warm, "async")),
                ("sync", flowloop_program(backend, args.steps, warm, "sync")),
            ]
            all_results[backend.label] = common.alternate(programs, rounds)

        print("-- thread hop", file=sys.stderr, flush=True)
        hop = common.alternate(
            [
                ("await task", hop_program("async", hop_calls)),
                ("thread hop", hop_program("thread", hop_calls)),
            ],
            rounds,
            show="us_per_call",
        )

    report(all_results, hop, args.steps)
    common.footer()
    common.write_json(
        args.json,
        {
            "machine": info,
            "steps": args.steps,
            "results": {k: v.to_json() for k, v in all_results.items()},
            "hop": hop.to_json(),
        },
    )
    return 0


def report(all_results: Mapping[str, Results], hop: Results, steps: int) -> None:
    names = {
        "floor": "stdlib sqlite3 (floor)",
        "core": "SQLAlchemy Core (baseline)",
        "core_apart": "Core, WAL checkpoints on a thread",
        "async": "flowloop, async def steps",
        "sync": "flowloop, def steps",
    }
    rows = []
    for label, results in all_results.items():
        for program in results.order:
            rows.append(
                [
                    label,
                    names.get(program, program),
                    common.fmt_spread(results, program, "steps_per_s"),
                    common.fmt_spread(results, program, "us_per_step"),
                    common.fmt_spread(results, program, "cpu_us_per_step"),
                    common.fmt_spread(results, program, "commits", 2),
                    common.fmt_spread(results, program, "statements", 2),
                    common.fmt_spread(results, program, "round_trips", 2),
                ]
            )
            if program in results.notes:
                rows.append(
                    [label, names.get(program, program), results.notes[program], "", "", "", "", ""]
                )
    print(
        "Figures: median (min-max) over rounds. Per step, counted at the driver during "
        "warm-up runs:"
    )
    print(
        "commits; statements (SQL other than BEGIN/COMMIT); PostgreSQL round trips "
        "(server ReadyForQuery messages)"
    )
    common.table(
        [
            "database",
            "program",
            "steps/s",
            "µs/step",
            "CPU µs/step",
            "commits",
            "statements",
            "PG round trips",
        ],
        rows,
    )

    print("Ratios (medians) against the Core baseline; targets: SQLite async 1.5x, def 1.0x;")
    print("PostgreSQL 1.5x")
    ratio_rows = []
    for label, results in all_results.items():
        if not results.has("core", "steps_per_s"):
            continue
        core = results.median("core", "steps_per_s")
        for program in ("async", "sync"):
            if not results.has(program, "steps_per_s"):
                continue
            ours = results.median(program, "steps_per_s")
            floor = (
                f"{ours / results.median('floor', 'steps_per_s'):.2f}x"
                if results.has("floor", "steps_per_s")
                else "-"
            )
            apart = (
                f"{ours / results.median('core_apart', 'steps_per_s'):.2f}x"
                if results.has("core_apart", "steps_per_s")
                else "-"
            )
            cpu = "-"
            if results.has(program, "cpu_us_per_step"):
                core_cpu = results.median("core", "cpu_us_per_step")
                cpu = f"{core_cpu / results.median(program, 'cpu_us_per_step'):.2f}x"
            ratio_rows.append(
                [
                    label,
                    names[program],
                    common.verdict(ours / core, target_vs_core(label, program)),
                    apart,
                    floor,
                    cpu,
                ]
            )
    common.table(
        [
            "database",
            "program",
            "vs Core baseline",
            "vs Core apart",
            "vs floor",
            "CPU/step vs Core",
        ],
        ratio_rows,
    )
    print("vs Core apart: against the Core loop given WAL checkpoints on a thread, as flowloop's")
    print("SQLite store has them (flowloop/store/checkpointer.py)")
    print("CPU/step vs Core: the Core baseline's CPU time per step over flowloop's (this process;")
    print("on SQLite it includes the database work; robust when other processes load the CPUs)")

    print("Thread hop (µs per call, median (min-max))")
    hop_rows = [[name, common.fmt_spread(hop, name, "us_per_call")] for name in hop.order]
    if hop.has("thread hop", "us_per_call") and hop.has("await task", "us_per_call"):
        extra = hop.median("thread hop", "us_per_call") - hop.median("await task", "us_per_call")
        hop_rows.append(["hop cost (thread - task)", f"{extra:.1f}"])
    for label, results in all_results.items():
        if results.has("sync", "us_per_step") and results.has("async", "us_per_step"):
            d = results.median("sync", "us_per_step") - results.median("async", "us_per_step")
            hop_rows.append([f"in flowloop on {label} (sync - async µs/step)", f"{d:.1f}"])
    common.table(["measure", "µs"], hop_rows)


if __name__ == "__main__":
    sys.exit(main())
