"""flowloop against a peer: the same 10-step workload on DBOS Transact.

Both programs run in their own long-lived child process (DBOS is a process-wide singleton
with background threads; neither may disturb the other), and the parent alternates them
round by round: flowloop, DBOS, flowloop, DBOS ... Each round gets a fresh database: a new
SQLite file, or a new PostgreSQL schema (flowloop's tables via search_path, DBOS's via
``dbos_system_schema``). Only the runs are timed; DBOS's launch/destroy and flowloop's
Engine construction are not.

Workload: a workflow of 10 trivial steps, each adding one to a counter in a small context
({"n", "label"}), run to completion one run at a time:

* flowloop: ``engine.run(workflow, ctx)``; async: ``async def`` steps; sync: plain ``def``
  steps (without a timeout, ``engine.run`` calls them in the calling thread)
* DBOS: a ``@DBOS.workflow`` calling a ``@DBOS.step`` 10 times, called directly; async:
  ``async def`` workflow and step awaited in ``asyncio.run``; sync: plain ``def``

SQLite settings are the same for both: journal_mode=WAL, the same synchronous mode,
busy_timeout 30 s, BEGIN IMMEDIATE for writes (DBOS's own choice too); DBOS gets an engine
made so (``system_database_engine``). On PostgreSQL DBOS uses its default engine settings.

    python bench/dbos_peer.py            # ~2-3 minutes
    python bench/dbos_peer.py --quick    # smoke run, < 10 s
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import common
import sqlalchemy as sa
from common import Ctx, Results, WireCounter

TARGETS = {"sqlite": 15.0, "pg": 5.0}
"""Issue 13: flowloop / DBOS steps/s, both step kinds (issue 4 had asked 8x and 3x)."""
MARK = "@@result "


# -- the children ------------------------------------------------------------------------


def sqlite_engine(url: str, synchronous: str) -> sa.Engine:
    """An engine with flowloop's SQLite settings, as DBOS's system database engine."""
    engine = sa.create_engine(url)

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi: Any, _record: Any) -> None:
        dbapi.isolation_level = "IMMEDIATE"  # as DBOS's own SQLite engine does
        dbapi.execute("PRAGMA busy_timeout=30000")
        dbapi.execute("PRAGMA foreign_keys=ON")
        dbapi.execute("PRAGMA journal_mode=WAL")
        dbapi.execute(f"PRAGMA synchronous={synchronous}")

    return engine


class FlowloopChild:
    def __init__(self) -> None:
        self.workflows = {
            kind: common.chain(f"peer_{kind}", 10, kind=kind) for kind in ("async", "sync")
        }

    def round(self, req: Mapping[str, Any]) -> dict[str, float]:
        from flowloop import Engine

        workflow = self.workflows[req["kind"]]
        wire = WireCounter().install()
        engine = Engine(
            req["url"], workflows=[workflow], synchronous=req.get("synchronous") or "NORMAL"
        )
        try:
            engine.run(workflow, Ctx())
            wire.start()
            for _ in range(req["warm"]):
                engine.run(workflow, Ctx())
            wire.stop()
            wire.uninstall()
            counts = wire.per(req["warm"] * 10)
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(req["runs"]):
                info = engine.run(workflow, Ctx())
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            if info.status != "succeeded" or info.context.n != 10:  # type: ignore[union-attr]
                raise RuntimeError(f"flowloop run ended {info.status}")
        finally:
            wire.stop()
            wire.uninstall()
            engine.close()
        steps = req["runs"] * 10
        return {
            "steps_per_s": steps / seconds,
            "us_per_step": seconds / steps * 1e6,
            "cpu_us_per_step": cpu / steps * 1e6,
            **counts,
        }


class DbosChild:
    def __init__(self) -> None:
        from dbos import DBOS

        self.DBOS = DBOS

        @DBOS.step()
        def add_one(ctx: dict[str, Any]) -> dict[str, Any]:
            return {**ctx, "n": ctx["n"] + 1}

        @DBOS.workflow()
        def chain_sync(ctx: dict[str, Any]) -> dict[str, Any]:
            for _ in range(10):
                ctx = add_one(ctx)
            return ctx

        @DBOS.step()
        async def add_one_async(ctx: dict[str, Any]) -> dict[str, Any]:
            return {**ctx, "n": ctx["n"] + 1}

        @DBOS.workflow()
        async def chain_async(ctx: dict[str, Any]) -> dict[str, Any]:
            for _ in range(10):
                ctx = await add_one_async(ctx)
            return ctx

        self.chain_sync = chain_sync
        self.chain_async = chain_async

    def round(self, req: Mapping[str, Any]) -> dict[str, float]:
        DBOS = self.DBOS
        wire = WireCounter().install()
        config: dict[str, Any] = {"name": "flowloop-bench", "log_level": "WARNING"}
        if req["backend"] == "sqlite":
            engine = sqlite_engine(req["url"], req["synchronous"])
            config.update(system_database_url=req["url"], system_database_engine=engine)
        else:
            url = sa.make_url(req["url"]).set(drivername="postgresql+psycopg")
            engine = sa.create_engine(
                url, pool_size=20, max_overflow=0, pool_timeout=30, pool_pre_ping=True
            )
            plain = url.set(drivername="postgresql").render_as_string(hide_password=False)
            config.update(
                system_database_url=plain,
                system_database_engine=engine,
                dbos_system_schema=req["schema"],
            )
        DBOS(config=config)  # type: ignore[arg-type]
        DBOS.launch()
        ctx = {"n": 0, "label": "bench"}
        try:
            if req["kind"] == "sync":

                def many(n: int) -> dict[str, Any]:
                    out = ctx
                    for _ in range(n):
                        out = self.chain_sync(ctx)
                    return out

            else:

                def many(n: int) -> dict[str, Any]:
                    async def go() -> dict[str, Any]:
                        out = ctx
                        for _ in range(n):
                            out = await self.chain_async(ctx)
                        return out

                    return asyncio.run(go())

            many(1)
            wire.start()
            many(req["warm"])
            wire.stop()
            wire.uninstall()
            counts = wire.per(req["warm"] * 10)
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            out = many(req["runs"])
            seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
            if out["n"] != 10:
                raise RuntimeError(f"DBOS workflow returned {out}")
        finally:
            wire.stop()
            wire.uninstall()
            DBOS.destroy()
            engine.dispose()
        steps = req["runs"] * 10
        return {
            "steps_per_s": steps / seconds,
            "us_per_step": seconds / steps * 1e6,
            "cpu_us_per_step": cpu / steps * 1e6,
            **counts,
        }


def serve(program: str) -> int:
    """Child: one JSON request per stdin line, one result line per request."""
    import logging

    logging.getLogger("dbos").setLevel(logging.WARNING)
    child = FlowloopChild() if program == "flowloop" else DbosChild()
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            result: dict[str, Any] = child.round(json.loads(line))
        except Exception as error:
            result = {
                "error": f"{type(error).__name__}: {common.first_line(error)}",
                "trace": traceback.format_exc()[-2000:],
            }
        print(MARK + json.dumps(result), flush=True)
    return 0


class Child:
    def __init__(self, program: str) -> None:
        self.program = program
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve", program],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return dict(json.loads(line[len(MARK) :]))
        raise RuntimeError(f"{self.program} child exited ({self.proc.wait()})")

    def ready(self) -> None:
        self._read()

    def ask(self, req: Mapping[str, Any]) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        result = self._read()
        if "error" in result:
            print(result.get("trace", ""), file=sys.stderr)
            raise RuntimeError(result["error"])
        return result

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- the parent --------------------------------------------------------------------------


@contextlib.contextmanager
def fresh(backend: str, directory: str, pg: str | None) -> Iterator[dict[str, str]]:
    if backend == "sqlite":
        with common.sqlite_file(directory, "peer") as path:
            yield {"url": f"sqlite:///{path}"}
    else:
        assert pg is not None
        with common.pg_schema(pg, "peer") as (url, schema):
            yield {"url": url, "schema": f"{schema}_dbos"}
            admin = sa.create_engine(pg, poolclass=sa.NullPool)
            with admin.begin() as conn:
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}_dbos" CASCADE'))
            admin.dispose()


def program(child: Child, base: dict[str, Any], directory: str, pg: str | None) -> common.Program:
    def run(_round: int) -> Mapping[str, float]:
        with fresh(base["backend"], directory, pg) as where:
            return child.ask({**base, **where})

    return run


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 3 and sys.argv[1] == "--serve":
        return serve(sys.argv[2])
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None, help="runs per sample, SQLite NORMAL (100)")
    p.add_argument("--runs-full", type=int, default=None, help="runs per sample, SQLite FULL (50)")
    p.add_argument("--runs-pg", type=int, default=None, help="runs per sample, PostgreSQL (40)")
    p.add_argument("--warm", type=int, default=2, help="warm-up (counted, untimed) runs")
    p.add_argument("--kinds", default=None, help="step kinds: async,sync (default both)")
    p.add_argument("--no-full", action="store_true", help="skip SQLite synchronous=FULL")
    args = p.parse_args(argv)
    quick = args.quick
    rounds = common.rounds_for(args, default=3, quick=3)
    kinds = (args.kinds or ("async" if quick else "async,sync")).split(",")
    pg = common.pg_for(args)
    warm = 1 if quick else args.warm

    try:
        import dbos  # noqa: F401
    except ImportError as error:
        print(f"DBOS is not installed ({error}); pip install 'flowloop[bench]' or pip install dbos")
        return 0 if quick else 2

    settings: list[tuple[str, str, str | None, int]] = [
        ("sqlite WAL NORMAL", "sqlite", "NORMAL", args.runs or (3 if quick else 100)),
    ]
    if not quick and not args.no_full:
        settings.append(("sqlite WAL FULL", "sqlite", "FULL", args.runs_full or 50))
    if pg:
        settings.append(("postgresql", "pg", None, args.runs_pg or (3 if quick else 40)))

    with common.data_dir(args.dir) as directory:
        info = common.machine(pg, directory)
        import importlib.metadata

        info["dbos"] = importlib.metadata.version("dbos")
        common.header(
            "dbos_peer: flowloop vs DBOS Transact, 10 trivial steps per run, sequential runs",
            info,
            {
                "durability": "SQLite WAL + "
                + ", ".join(s[2] or "" for s in settings if s[1] == "sqlite")
                + " (same settings for both); PostgreSQL server defaults",
                "runs per sample": ", ".join(f"{s[0]}: {s[3]}" for s in settings),
                "rounds": f"{rounds}, flowloop and DBOS alternated; warm-up {warm} runs",
                "step kinds": ", ".join(kinds),
                "processes": "one long-lived child per program; fresh database per round",
            },
        )
        children = {name: Child(name) for name in ("flowloop", "dbos")}
        try:
            for child in children.values():
                child.ready()
            all_results: dict[str, Results] = {}
            for label, backend, synchronous, runs in settings:
                results = Results()
                for kind in kinds:
                    print(f"-- {label}, {kind} steps", file=sys.stderr, flush=True)
                    base = {
                        "backend": backend,
                        "synchronous": synchronous,
                        "runs": runs,
                        "warm": warm,
                        "kind": kind,
                    }
                    common.alternate(
                        [
                            (
                                f"flowloop {kind}",
                                program(children["flowloop"], base, directory, pg),
                            ),
                            (f"DBOS {kind}", program(children["dbos"], base, directory, pg)),
                        ],
                        rounds,
                        results,
                    )
                all_results[label] = results
        finally:
            for child in children.values():
                child.close()

    report(all_results, kinds, settings)
    common.footer()
    common.write_json(
        args.json,
        {
            "machine": info,
            "results": {k: v.to_json() for k, v in all_results.items()},
        },
    )
    return 0


def report(all_results: Mapping[str, Results], kinds: list[str], settings: list[Any]) -> None:
    backend_of = {s[0]: s[1] for s in settings}
    rows = []
    for label, results in all_results.items():
        for name in results.order:
            rows.append(
                [
                    label,
                    name,
                    common.fmt_spread(results, name, "steps_per_s"),
                    common.fmt_spread(results, name, "us_per_step"),
                    common.fmt_spread(results, name, "cpu_us_per_step"),
                    common.fmt_spread(results, name, "commits", 2),
                    common.fmt_spread(results, name, "statements", 2),
                    common.fmt_spread(results, name, "round_trips", 2),
                ]
            )
        for name, note in results.notes.items():
            rows.append([label, name, note, "", "", "", "", ""])
    print(
        "Figures: median (min-max) over rounds. Per step, counted at the driver during "
        "warm-up runs: commits,"
    )
    print(
        "statements (SQL other than BEGIN/COMMIT), PostgreSQL round trips; CPU: the child "
        "process's CPU time"
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
    print("Ratios flowloop / DBOS (medians)")
    ratio_rows = []
    for label, results in all_results.items():
        target = TARGETS[backend_of[label]]
        for kind in kinds:
            ours, theirs = f"flowloop {kind}", f"DBOS {kind}"
            if results.has(ours, "steps_per_s") and results.has(theirs, "steps_per_s"):
                ratio = results.median(ours, "steps_per_s") / results.median(theirs, "steps_per_s")
                cpu = results.median(theirs, "cpu_us_per_step") / results.median(
                    ours, "cpu_us_per_step"
                )
                ratio_rows.append(
                    [label, f"{kind} steps", common.verdict(ratio, target), f"{cpu:.2f}x"]
                )
    common.table(
        ["database", "pairing", "flowloop / DBOS steps/s", "CPU/step DBOS / flowloop"], ratio_rows
    )


if __name__ == "__main__":
    os.environ.setdefault("DBOS__DISABLE_TELEMETRY", "1")
    sys.exit(main())
