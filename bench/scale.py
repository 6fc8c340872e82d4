"""Scale: recovery of many interrupted runs, reads over a large journal, idle waiting runs.

1. **Recovery.** A real crash makes the template: a child process claims a run and is
   SIGKILLed while its step (the 2nd of a 3-step workflow) runs, so the run is left
   ``running`` with a ``step_started`` and no outcome, owned by a dead worker on this host.
   That run is cloned (run row + journal, new ids) to ``--recover`` runs in one bulk insert,
   and each round works on a fresh copy of that database. Programs, alternated:
   ``recover`` (``Executor.recover()`` alone: every run gets its ``step_interrupted`` and
   goes ``retrying``) and ``resume`` (``engine.resume()``: recovery, then every run re-runs
   its step and finishes). Reported: seconds, runs/s, statements and commits issued.
2. **Reads over a large journal.** One finished 10-step run (21 journal rows) is cloned
   until the journal has ``--journal-rows`` rows (bulk insert). Latency (p50, p99) of
   ``engine.get``, ``engine.history``, ``engine.runs(limit=100)`` and ``engine.replay`` for
   random runs, alternated with the same calls on a small database (one template's worth).
3. **Waiting runs.** A run parked in a wait state (with a 1-day timeout, so it is a durable
   timer too) is cloned to ``--waiting`` runs. A worker process (``Worker.run``) idles over
   them for a few seconds, alternated with one idling over none: resident memory and CPU
   seconds per idle second; then ``engine.send`` latency to waiting runs.
4. **Idle loops.** A worker with ``--loops`` hourly loops whose first slot is an hour
   away, alternated with a worker with none: memory and CPU per idle second (the timer
   heap should make waiting loops free).

    python bench/scale.py            # ~2 minutes
    python bench/scale.py --quick    # smoke run, < 10 s
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import common
import sqlalchemy as sa
from common import Ctx, Results, WireCounter

HANG = os.environ.get("FLOWLOOP_BENCH_HANG") == "1"


def recovery_workflow() -> Any:
    """s0 -> s1 -> s2 -> done; s1 hangs in the crash child (so it can be killed mid-step)."""
    from flowloop import Workflow

    workflow = Workflow("scale_recover", context=Ctx)

    @workflow.step(name="s0", initial=True, next="s1")
    async def s0(ctx: Ctx) -> None:
        ctx.n += 1

    @workflow.step(name="s1", next="s2")
    async def s1(ctx: Ctx) -> None:
        if HANG:
            await asyncio.sleep(3600)
        ctx.n += 1

    @workflow.step(name="s2", next="done")
    async def s2(ctx: Ctx) -> None:
        ctx.n += 1

    workflow.final("done")
    return workflow


def waiting_workflow() -> Any:
    """s0 -> (wait: approve | 1-day timeout) -> done."""
    from flowloop import Workflow

    workflow = Workflow("scale_wait", context=Ctx)

    @workflow.step(name="s0", initial=True, next="awaiting")
    async def s0(ctx: Ctx) -> None:
        ctx.n += 1

    workflow.wait("awaiting", on={"approve": "done"}, timeout=timedelta(days=1), on_timeout="done")
    workflow.final("done")
    return workflow


# -- databases: build once, copy per round -----------------------------------------------


@dataclass
class Place:
    """A database: a SQLite file or a PostgreSQL schema."""

    kind: str
    url: str
    path: str | None = None
    schema: str | None = None


@contextlib.contextmanager
def new_place(kind: str, directory: str, pg: str | None, name: str) -> Iterator[Place]:
    if kind == "sqlite":
        with common.sqlite_file(directory, name) as path:
            yield Place(kind, f"sqlite:///{path}", path=path)
    else:
        assert pg is not None
        with common.pg_schema(pg, name) as (url, schema):
            yield Place(kind, url, schema=schema)


def copy_place(src: Place, dst: Place, pg: str | None) -> None:
    """Copy every table of ``src`` into the empty ``dst``."""
    if src.kind == "sqlite":
        assert src.path and dst.path
        engine = sa.create_engine(src.url, poolclass=sa.NullPool)
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        engine.dispose()
        shutil.copyfile(src.path, dst.path)
        return
    assert pg is not None
    admin = sa.create_engine(pg, poolclass=sa.NullPool)
    with admin.begin() as conn:
        tables = (
            conn.execute(
                sa.text("SELECT tablename FROM pg_tables WHERE schemaname = :s"), {"s": src.schema}
            )
            .scalars()
            .all()
        )
        for table in tables:
            conn.execute(
                sa.text(
                    f'CREATE TABLE "{dst.schema}"."{table}" '
                    f'(LIKE "{src.schema}"."{table}" INCLUDING ALL)'
                )
            )
            conn.execute(
                sa.text(
                    f'INSERT INTO "{dst.schema}"."{table}" SELECT * FROM "{src.schema}"."{table}"'
                )
            )
        conn.execute(sa.text("ANALYZE"))
    admin.dispose()


def clone_runs(url: str, template_id: str, copies: int, *, chunk: int = 2000) -> None:
    """Insert ``copies`` clones of run ``template_id`` (row + journal), new ids, one
    transaction. Columns are read from the database, so this follows schema changes."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            md = sa.MetaData()
            runs = sa.Table("flowloop_runs", md, autoload_with=conn)
            journal = sa.Table("flowloop_journal", md, autoload_with=conn)
            run_row = dict(
                conn.execute(sa.select(runs).where(runs.c.id == template_id)).mappings().one()
            )
            events = [
                dict(row)
                for row in conn.execute(
                    sa.select(journal)
                    .where(journal.c.run_id == template_id)
                    .order_by(journal.c.seq)
                ).mappings()
            ]
            for col in ("key", "idempotency_key"):
                if col in run_row:
                    run_row[col] = None
            done = 0
            while done < copies:
                n = min(chunk, copies - done)
                run_rows, event_rows = [], []
                for _ in range(n):
                    rid = uuid.uuid4().hex
                    run_rows.append({**run_row, "id": rid})
                    event_rows.extend({**e, "run_id": rid} for e in events)
                conn.execute(sa.insert(runs), run_rows)
                conn.execute(sa.insert(journal), event_rows)
                done += n
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE")
    finally:
        engine.dispose()


def journal_count(url: str) -> int:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql("SELECT count(*) FROM flowloop_journal").scalar_one())
    finally:
        engine.dispose()


# -- 1. recovery -------------------------------------------------------------------------


def crash_child(url: str) -> int:
    """Child: start one run and drive it; its step s1 hangs until we are SIGKILLed."""
    from flowloop import Engine

    workflow = recovery_workflow()
    engine = Engine(url, workflows=[workflow])
    run = engine.start(workflow, Ctx())
    print(run.id, flush=True)
    engine.run_until_idle()
    return 0


def make_interrupted(place: Place) -> str:
    env = {**os.environ, "FLOWLOOP_BENCH_HANG": "1"}
    child = subprocess.Popen(
        [sys.executable, __file__, "--crash-child", place.url],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    from flowloop import Engine

    try:
        assert child.stdout is not None
        run_id = child.stdout.readline().strip()
        engine = Engine(place.url, workflows=[recovery_workflow()])
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                info = engine.get(run_id)
                if info.status == "running" and info.state == "s1":
                    break
                time.sleep(0.02)
            else:
                raise RuntimeError("the crash child never reached step s1")
        finally:
            engine.close()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    return run_id


def recovery_program(
    master: Place, directory: str, pg: str | None, mode: str, n: int
) -> common.Program:
    from flowloop import Engine

    def run(_round: int) -> Mapping[str, float]:
        with new_place(master.kind, directory, pg, "rec") as place:
            copy_place(master, place, pg)
            wire = WireCounter().install()
            engine = Engine(place.url, workflows=[recovery_workflow()], max_concurrency=100)
            try:
                gc.collect()
                wire.start()
                with common.Timer() as t:
                    if mode == "recover":
                        executor = engine._executor()
                        try:
                            recovered = asyncio.run(executor.recover())
                        finally:
                            executor.close()
                    else:
                        recovered = engine.resume().recovered
                wire.stop()
                counted = wire.counts()
                wanted = "retrying" if mode == "recover" else "succeeded"
                settled = len(engine.runs(status=wanted, limit=n + 10))
                if recovered != n or settled != n:
                    raise RuntimeError(f"recovered {recovered}, {settled} {wanted}, of {n}")
            finally:
                wire.stop()
                wire.uninstall()
                engine.close()
        return {"seconds": t.seconds, "runs_per_s": n / t.seconds, **counted}

    return run


# -- 2. reads over a large journal -------------------------------------------------------


def latency_program(place: Place, ids: list[str], op: str, samples: int) -> common.Program:
    from flowloop import Engine

    workflow = common.chain("scale_read", 10)

    def run(round_: int) -> Mapping[str, float]:
        engine = Engine(place.url, workflows=[workflow])
        try:
            rng = random.Random(round_)
            calls: dict[str, Callable[[str], Any]] = {
                "get": engine.get,
                "history": engine.history,
                "runs(limit=100)": lambda _id: engine.runs(workflow=workflow.name, limit=100),
                "replay": engine.replay,
            }
            call = calls[op]
            for rid in ids[:5]:
                call(rid)
            gc.collect()
            times = []
            for _ in range(samples):
                rid = rng.choice(ids)
                t0 = time.perf_counter()
                call(rid)
                times.append((time.perf_counter() - t0) * 1e3)
        finally:
            engine.close()
        times.sort()
        return {
            "p50_ms": statistics.median(times),
            "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))],
        }

    return run


def sample_ids(url: str, k: int) -> list[str]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return list(
                conn.exec_driver_sql(
                    f"SELECT id FROM flowloop_runs ORDER BY random() LIMIT {int(k)}"
                ).scalars()
            )
    finally:
        engine.dispose()


# -- 3./4. idle workers ------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def idle_child(url: str, loops: int, seconds: float) -> int:
    """Child: a Worker over ``url`` (and ``loops`` hourly loops) idling for ``seconds``;
    prints its memory and CPU use as JSON."""
    from flowloop import Engine
    from flowloop.loops import Loop
    from flowloop.worker import Worker

    engine = Engine(url, workflows=[waiting_workflow()])

    async def nothing(_: Any) -> None:
        return None

    # First slot an hour ahead: nothing is due while we measure (a new loop's first slot is
    # otherwise "now", and registering 1,000 of them fires 1,000 iterations at once).
    first = time.time() + 3600
    defined = [Loop(f"idle{i}", nothing, every=3600, start_at=first) for i in range(loops)]
    gc.collect()
    before = rss_mb()

    async def main() -> dict[str, float]:
        stop = asyncio.Event()
        worker = Worker(engine, defined)
        task = asyncio.create_task(worker.run(stop))
        await asyncio.sleep(min(2.0, seconds))  # registration, first claim/recovery pass
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        stop.set()
        await task
        return {"cpu_per_s": cpu / wall}

    out = asyncio.run(main())
    out["rss_mb"] = rss_mb()
    out["rss_growth_mb"] = out["rss_mb"] - before
    out["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    engine.close()
    print(json.dumps(out), flush=True)
    return 0


def idle_program(url: str, loops: int, seconds: float) -> common.Program:
    def run(_round: int) -> Mapping[str, float]:
        out = subprocess.run(
            [sys.executable, __file__, "--idle-child", url, str(loops), str(seconds)],
            capture_output=True,
            text=True,
            timeout=120 + seconds,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr else "failed")
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    return run


def send_program(place: Place, ids: list[str], samples: int) -> common.Program:
    from flowloop import Engine

    def run(round_: int) -> Mapping[str, float]:
        engine = Engine(place.url, workflows=[waiting_workflow()])
        try:
            chosen = ids[round_ * samples : (round_ + 1) * samples]
            times = []
            for rid in chosen:
                t0 = time.perf_counter()
                engine.send(rid, "approve", None)
                times.append((time.perf_counter() - t0) * 1e3)
        finally:
            engine.close()
        times.sort()
        return {
            "p50_ms": statistics.median(times),
            "p99_ms": times[min(len(times) - 1, int(len(times) * 0.99))],
        }

    return run


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "--crash-child":
        return crash_child(sys.argv[2])
    if len(sys.argv) >= 5 and sys.argv[1] == "--idle-child":
        return idle_child(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--recover", type=int, default=None, help="interrupted runs (10,000)")
    p.add_argument("--journal-rows", type=int, default=None, help="journal rows (1,000,000)")
    p.add_argument("--waiting", type=int, default=None, help="waiting runs (10,000)")
    p.add_argument("--loops", type=int, default=None, help="idle loops (1,000)")
    p.add_argument("--idle-seconds", type=float, default=None, help="idle time measured (3)")
    p.add_argument("--samples", type=int, default=None, help="calls per latency sample (200)")
    p.add_argument(
        "--pieces",
        default="recovery,reads,waiting,loops",
        help="which pieces to run (comma-separated)",
    )
    args = p.parse_args(argv)
    quick = args.quick
    rounds = common.rounds_for(args, default=3, quick=3)
    n_recover = args.recover or (200 if quick else 10_000)
    n_rows = args.journal_rows or (3_000 if quick else 1_000_000)
    n_waiting = args.waiting or (200 if quick else 10_000)
    n_loops = args.loops or (20 if quick else 1_000)
    idle_seconds = args.idle_seconds or (0.3 if quick else 3.0)
    samples = args.samples or (15 if quick else 200)
    pieces = set(args.pieces.split(","))
    if quick:
        pieces &= {"recovery", "reads"}
    pg = common.pg_for(args)
    kinds = [("sqlite WAL NORMAL", "sqlite")] + ([("postgresql", "pg")] if pg else [])

    with common.data_dir(args.dir) as directory:
        info = common.machine(pg, directory)
        common.header(
            "scale: recovery, reads over a large journal, idle waiting runs",
            info,
            {
                "recovery": f"{n_recover:,} interrupted runs (cloned from a real SIGKILL)",
                "reads": f"{n_rows:,} journal rows; {samples} calls per sample",
                "waiting": f"{n_waiting:,} runs in a wait state with a 1-day timeout",
                "loops": f"{n_loops:,} loops every 3600 s; idle {idle_seconds:g} s per sample",
                "rounds": f"{rounds}, programs alternated",
                "durability": "SQLite WAL synchronous=NORMAL; PostgreSQL server defaults",
                "pieces": ", ".join(sorted(pieces)) + (" (quick: SQLite only)" if quick else ""),
            },
        )
        sections: dict[str, dict[str, Results]] = {}
        notes: list[str] = []
        from flowloop import Engine

        for label, kind in kinds:
            if "recovery" in pieces:
                print(f"-- recovery, {label}", file=sys.stderr, flush=True)
                with new_place(kind, directory, pg, "recmaster") as master:
                    template = make_interrupted(master)
                    with common.Timer() as built:
                        clone_runs(master.url, template, n_recover - 1)
                    notes.append(
                        f"{label}: {n_recover:,} interrupted runs built in {built.seconds:.1f} s"
                    )
                    sections.setdefault("recovery", {})[label] = common.alternate(
                        [
                            (
                                "recover()",
                                recovery_program(master, directory, pg, "recover", n_recover),
                            ),
                            (
                                "resume() to the end",
                                recovery_program(master, directory, pg, "resume", n_recover),
                            ),
                        ],
                        rounds,
                        show="seconds",
                    )

            if "reads" in pieces:
                print(f"-- reads, {label}", file=sys.stderr, flush=True)
                workflow = common.chain("scale_read", 10)
                with (
                    new_place(kind, directory, pg, "big") as big,
                    new_place(kind, directory, pg, "small") as small,
                ):
                    per_run = 0
                    for place in (big, small):
                        engine = Engine(place.url, workflows=[workflow])
                        template = engine.run(workflow, Ctx()).id
                        per_run = len(engine.history(template))
                        engine.close()
                        if place is big:
                            with common.Timer() as built:
                                clone_runs(big.url, template, max(0, -(-n_rows // per_run) - 1))
                        else:  # 100 runs: runs(limit=100) returns as many rows on both
                            clone_runs(small.url, template, 99)
                    rows_big, rows_small = journal_count(big.url), journal_count(small.url)
                    notes.append(
                        f"{label}: large journal {rows_big:,} rows "
                        f"({per_run} per run) built in {built.seconds:.1f} s; "
                        f"small journal {rows_small:,} rows (100 runs)"
                    )
                    ids_big, ids_small = sample_ids(big.url, 5000), sample_ids(small.url, 100)
                    programs: list[tuple[str, common.Program]] = []
                    for op in ("get", "history", "runs(limit=100)", "replay"):
                        programs.append(
                            (
                                f"{op} @ {rows_big:,} rows",
                                latency_program(big, ids_big, op, samples),
                            )
                        )
                        programs.append(
                            (
                                f"{op} @ {rows_small:,} rows",
                                latency_program(small, ids_small, op, samples),
                            )
                        )
                    sections.setdefault("reads", {})[label] = common.alternate(
                        programs, rounds, show="p50_ms"
                    )

            if "waiting" in pieces or "loops" in pieces:
                print(f"-- waiting runs and loops, {label}", file=sys.stderr, flush=True)
                workflow = waiting_workflow()
                with (
                    new_place(kind, directory, pg, "waiting") as place,
                    new_place(kind, directory, pg, "empty") as empty,
                ):
                    engine = Engine(place.url, workflows=[workflow])
                    template = engine.run(workflow, Ctx())
                    engine.close()
                    if template.state != "awaiting":
                        raise RuntimeError(f"template run is {template.status} in {template.state}")
                    clone_runs(place.url, template.id, n_waiting - 1)
                    Engine(empty.url, workflows=[workflow]).close()
                    programs = []
                    if "waiting" in pieces:
                        programs += [
                            (
                                f"worker, {n_waiting:,} waiting runs",
                                idle_program(place.url, 0, idle_seconds),
                            ),
                            ("worker, no runs", idle_program(empty.url, 0, idle_seconds)),
                        ]
                    if "loops" in pieces:
                        programs.append(
                            (
                                f"worker, {n_loops:,} idle loops",
                                idle_program(empty.url, n_loops, idle_seconds),
                            )
                        )
                    sections.setdefault("idle", {})[label] = common.alternate(
                        programs, rounds, show="rss_mb"
                    )
                    if "waiting" in pieces:
                        ids = sample_ids(place.url, samples * rounds)
                        sections.setdefault("send", {})[label] = common.alternate(
                            [("engine.send to a waiting run", send_program(place, ids, samples))],
                            rounds,
                            show="p50_ms",
                        )

    report(sections, notes)
    common.footer()
    common.write_json(
        args.json,
        {
            "machine": info,
            "notes": notes,
            "results": {s: {k: v.to_json() for k, v in r.items()} for s, r in sections.items()},
        },
    )
    return 0


def report(sections: Mapping[str, Mapping[str, Results]], notes: list[str]) -> None:
    for note in notes:
        print(f"  {note}")
    print()
    if "recovery" in sections:
        print("Recovery of interrupted runs: median (min-max)")
        rows = []
        for label, results in sections["recovery"].items():
            for name in results.order:
                rows.append(
                    [
                        label,
                        name,
                        common.fmt_spread(results, name, "seconds", 2),
                        common.fmt_spread(results, name, "runs_per_s"),
                        common.fmt_spread(results, name, "statements"),
                        common.fmt_spread(results, name, "commits"),
                        common.fmt_spread(results, name, "round_trips"),
                    ]
                )
            rows += [[label, k, v, "", "", "", ""] for k, v in results.notes.items()]
        common.table(
            ["database", "program", "seconds", "runs/s", "statements", "commits", "PG round trips"],
            rows,
        )
    if "reads" in sections:
        print("Read latency, ms: median over rounds of p50 and p99 (min-max)")
        rows = []
        for label, results in sections["reads"].items():
            for name in results.order:
                rows.append(
                    [
                        label,
                        name,
                        common.fmt_spread(results, name, "p50_ms", 2),
                        common.fmt_spread(results, name, "p99_ms", 2),
                    ]
                )
            rows += [[label, k, v, ""] for k, v in results.notes.items()]
        common.table(["database", "call", "p50 ms", "p99 ms"], rows)
    if "idle" in sections:
        print("Idle worker (separate process): median (min-max)")
        rows = []
        for label, results in sections["idle"].items():
            for name in results.order:
                rows.append(
                    [
                        label,
                        name,
                        common.fmt_spread(results, name, "rss_mb", 1),
                        common.fmt_spread(results, name, "rss_growth_mb", 1),
                        common.fmt_spread(results, name, "cpu_per_s", 3),
                    ]
                )
            rows += [[label, k, v, "", ""] for k, v in results.notes.items()]
        common.table(
            ["database", "program", "RSS MB", "RSS growth MB (worker)", "CPU s per idle s"], rows
        )
    if "send" in sections:
        rows = []
        for label, results in sections["send"].items():
            for name in results.order:
                rows.append(
                    [
                        label,
                        name,
                        common.fmt_spread(results, name, "p50_ms", 2),
                        common.fmt_spread(results, name, "p99_ms", 2),
                    ]
                )
            rows += [[label, k, v, ""] for k, v in results.notes.items()]
        common.table(["database", "call", "p50 ms", "p99 ms"], rows)


if __name__ == "__main__":
    sys.exit(main())
