"""Shared helpers for the flowloop benchmarks (standalone scripts, not tests).

Every script: alternates the compared programs (A B A B ...), keeps one sample per program
and round, reports the median with min-max, and prints the machine, the settings and the
durability mode first. Importing this module puts the repository root first on
``sys.path``, so ``python bench/x.py`` measures the flowloop tree the script sits in.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import re
import shutil
import sqlite3
import sqlite3.dbapi2
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

PG_URL = os.environ.get("FLOWLOOP_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
"""The PostgreSQL server the benchmarks use (``--pg`` overrides; ``--pg none`` skips it)."""


# -- command line ------------------------------------------------------------------------


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run, < 10 s)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per program (default 5)")
    p.add_argument(
        "--pg",
        default=PG_URL,
        help="PostgreSQL URL (default $FLOWLOOP_BENCH_PG or the local test server; with "
        "--quick only when given); 'none' skips",
    )
    p.add_argument(
        "--dir", default=None, help="directory for the SQLite files (default: a temp dir)"
    )
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    return p


def rounds_for(args: argparse.Namespace, default: int = 5, quick: int = 3) -> int:
    if args.rounds is not None:
        return max(1, args.rounds)
    return quick if args.quick else default


# -- the machine -------------------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _git_rev() -> str:
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "flowloop"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _filesystem(path: str) -> str:
    try:
        return subprocess.run(
            ["stat", "-f", "-c", "%T", path], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def pg_version(url: str | None) -> str:
    if not url:
        return "not used"
    try:
        engine = sa.create_engine(url, poolclass=sa.NullPool)
        try:
            with engine.connect() as conn:
                version = str(conn.execute(sa.text("show server_version")).scalar_one())
                durability = ", ".join(
                    f"{name}={conn.execute(sa.text(f'show {name}')).scalar_one()}"
                    for name in ("synchronous_commit", "fsync", "wal_sync_method")
                )
                return f"{version}; {durability}"
        finally:
            engine.dispose()
    except Exception as error:  # unreachable server, missing driver ...
        return f"unavailable ({first_line(error)})"


def first_line(error: BaseException) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def machine(pg_url: str | None, data_dir: str) -> dict[str, str]:
    import pydantic

    import flowloop

    info = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": str(os.cpu_count()),
        "cpu": cpu_model(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "sqlalchemy": sa.__version__,
        "pydantic": pydantic.VERSION,
        "postgresql": pg_version(pg_url),
        "flowloop": f"{flowloop.__version__} ({_git_rev()}, {Path(flowloop.__file__).parent})",
        "sqlite files": f"{data_dir} ({_filesystem(data_dir)})",
        "load at start": load_text(),
    }
    with contextlib.suppress(ImportError):
        import psycopg

        info["psycopg"] = psycopg.__version__
    return info


def load_text() -> str:
    """The 1/5/15-minute load averages, with a warning when other work competes."""
    one, five, fifteen = os.getloadavg()
    cpus = os.cpu_count() or 1
    busy = (
        "  (BUSY: other processes compete for the CPUs; figures are noisy)"
        if (one > 0.5 * cpus)
        else ""
    )
    return f"{one:.2f} {five:.2f} {fifteen:.2f} on {cpus} CPUs{busy}"


def footer() -> None:
    print(f"load at end: {load_text()}")


def header(title: str, info: Mapping[str, str], settings: Mapping[str, Any]) -> None:
    print(f"== {title}")
    width = max(len(k) for k in [*info, *settings])
    for key, value in info.items():
        print(f"  {key:<{width}}  {value}")
    print("  settings:")
    for key, value in settings.items():
        print(f"  {key:<{width}}  {value}")
    print(flush=True)


def pg_for(args: argparse.Namespace) -> str | None:
    """The PostgreSQL URL to use: ``--pg``, else the default one unless ``--quick``;
    ``None`` when skipped or unreachable."""
    given = any(a == "--pg" or a.startswith("--pg=") for a in sys.argv[1:])
    return pg_usable(None if args.quick and not given else args.pg)


def pg_usable(url: str | None) -> str | None:
    """``url`` if the server answers, else ``None`` (with a note on stderr)."""
    if not url or url.lower() == "none":
        return None
    version = pg_version(url)
    if version.startswith("unavailable"):
        print(f"note: PostgreSQL skipped: {version}", file=sys.stderr)
        return None
    return url


# -- places for data ---------------------------------------------------------------------


@contextlib.contextmanager
def data_dir(path: str | None) -> Iterator[str]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield path
        return
    tmp = tempfile.mkdtemp(prefix="flowloop-bench-")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def sqlite_file(directory: str, name: str = "bench") -> Iterator[str]:
    """A fresh SQLite file path (removed afterwards, with its -wal and -shm)."""
    path = Path(directory) / f"{name}-{uuid.uuid4().hex[:8]}.db"
    try:
        yield str(path)
    finally:
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                Path(str(path) + suffix).unlink()


def with_search_path(url: str, schema: str) -> str:
    made = sa.make_url(url)
    return made.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
        hide_password=False
    )


@contextlib.contextmanager
def pg_schema(url: str, prefix: str = "bench") -> Iterator[tuple[str, str]]:
    """A fresh schema on the server: yields (url whose search_path is it, schema name);
    dropped afterwards."""
    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        yield with_search_path(url, schema), schema
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@contextlib.contextmanager
def fresh_url(backend: str, directory: str, pg: str | None, name: str) -> Iterator[str]:
    """A fresh database URL: a new SQLite file (``backend="sqlite"``) or a new schema on
    ``pg``; removed afterwards."""
    if backend == "sqlite":
        with sqlite_file(directory, name) as path:
            yield f"sqlite:///{path}"
    else:
        assert pg is not None
        with pg_schema(pg, name) as (url, _):
            yield url


# -- the workload ------------------------------------------------------------------------


class Ctx(BaseModel):
    """The context of the benchmark workflows: small, like a typical business context."""

    n: int = 0
    label: str = "bench"


class Line(BaseModel):
    sku: str
    qty: int
    price: float
    note: str


def _lines() -> list[Line]:
    return [
        Line(sku=f"SKU-{i:06d}", qty=i % 7 + 1, price=round(1.5 + i * 0.25, 2), note="n" * 40)
        for i in range(1000)
    ]


class Lines(BaseModel):
    """A large context: 1,000 order lines, ~93 KB of JSON (a context's parse costs in
    proportion to its fields, not only its bytes)."""

    n: int = 0
    lines: list[Line] = Field(default_factory=_lines)


def chain(
    name: str,
    steps: int = 10,
    *,
    kind: str = "async",
    sleep: float = 0.0,
    context: type[BaseModel] = Ctx,
) -> Any:
    """A workflow of ``steps`` trivial states s0 -> s1 -> ... -> done over ``context`` (a
    model with a field ``n``, which each step counts up).

    ``kind``: "async" (``async def`` steps) or "sync" (plain ``def``: ``engine.run`` calls one
    without a timeout in the calling thread, a worker hands it to a thread pool).
    ``sleep``: async steps await ``asyncio.sleep(sleep)`` (I/O-bound work).
    """
    import asyncio

    from flowloop import Workflow

    workflow = Workflow(name, context=context)
    for i in range(steps):
        nxt = f"s{i + 1}" if i < steps - 1 else "done"
        if kind == "sync":

            def fn(ctx: Ctx) -> None:
                ctx.n += 1

        elif sleep > 0:

            async def fn(ctx: Ctx) -> None:
                await asyncio.sleep(sleep)
                ctx.n += 1

        else:

            async def fn(ctx: Ctx) -> None:
                ctx.n += 1

        workflow.step(name=f"s{i}", initial=i == 0, next=nxt)(fn)
    workflow.final("done")
    return workflow


# -- counting database work --------------------------------------------------------------

_TXN = ("BEGIN", "COMMIT", "END", "ROLLBACK", "SAVEPOINT", "RELEASE")


class WireCounter:
    """Counts what reaches the database drivers, below SQLAlchemy (so a hot path that
    talks to the driver directly is counted too):

    * SQLite: every statement SQLite runs, from ``sqlite3``'s trace callback (BEGIN and
      COMMIT included, also those the driver issues itself);
    * PostgreSQL: libpq's protocol trace; a round trip is one ReadyForQuery from the
      server (one simple Query, or one Sync of the extended protocol).

    Connections opened while the counter is installed are instrumented (so create the
    engine under it); counting runs between :meth:`start` and :meth:`stop`.
    """

    def __init__(self) -> None:
        self.sqlite_statements: list[str] = []
        self.pg_lines: list[str] = []
        self._sqlite: list[Any] = []
        self._pg: list[tuple[Any, Any]] = []
        self._counting = False
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> WireCounter:
        counter = self
        orig_sqlite = sqlite3.connect

        def sqlite_connect(*args: Any, **kwargs: Any) -> Any:
            conn = orig_sqlite(*args, **kwargs)
            counter._sqlite.append(conn)
            if counter._counting:
                conn.set_trace_callback(counter._on_sql)
            return conn

        for module in (sqlite3, sqlite3.dbapi2):  # the latter is what SQLAlchemy calls
            self._saved.append((module, "connect", module.connect))
            module.connect = sqlite_connect  # type: ignore[assignment]
        with contextlib.suppress(ImportError):
            import psycopg

            orig_pg = psycopg.connect

            def pg_connect(*args: Any, **kwargs: Any) -> Any:
                conn = orig_pg(*args, **kwargs)
                counter._pg.append((conn, None))
                if counter._counting:
                    counter._trace_pg(len(counter._pg) - 1)
                return conn

            self._saved.append((psycopg, "connect", orig_pg))
            psycopg.connect = pg_connect  # type: ignore[assignment]
        return self

    def uninstall(self) -> None:
        for module, name, value in reversed(self._saved):
            setattr(module, name, value)
        self._saved = []

    def _on_sql(self, sql: str) -> None:
        self.sqlite_statements.append(sql)

    def _trace_pg(self, index: int) -> None:
        import psycopg

        conn, handle = self._pg[index]
        if handle is not None or conn.closed:
            return
        handle = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop()
        conn.pgconn.trace(handle.fileno())
        conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS)
        self._pg[index] = (conn, handle)

    def start(self) -> None:
        self.sqlite_statements = []
        self.pg_lines = []
        self._counting = True
        for conn in self._sqlite:
            with contextlib.suppress(Exception):
                conn.set_trace_callback(self._on_sql)
        for index in range(len(self._pg)):
            with contextlib.suppress(Exception):
                self._trace_pg(index)

    def stop(self) -> None:
        self._counting = False
        for conn in self._sqlite:
            with contextlib.suppress(Exception):
                conn.set_trace_callback(None)
        for index, (conn, handle) in enumerate(self._pg):
            if handle is None:
                continue
            with contextlib.suppress(Exception):
                conn.pgconn.untrace()
            handle.seek(0)
            self.pg_lines.extend(handle.read().splitlines())
            handle.close()
            self._pg[index] = (conn, None)

    def counts(self) -> dict[str, int]:
        """commits (on PostgreSQL also autocommit statements), statements (transaction
        control excluded), round_trips (PostgreSQL)."""
        if self.pg_lines:
            counted = {"commits": 0, "statements": 0, "round_trips": 0}
            in_txn = [False]

            def classify(sql: str) -> None:
                # A statement outside BEGIN ... COMMIT (autocommit) is a commit of its own.
                if sql.startswith("BEGIN"):
                    in_txn[0] = True
                elif sql.startswith(("COMMIT", "ROLLBACK")):
                    counted["commits"] += sql.startswith("COMMIT")
                    in_txn[0] = False
                elif not sql.startswith(_TXN):
                    counted["statements"] += 1
                    counted["commits"] += not in_txn[0]

            # psycopg's extended protocol: Parse names a statement (prepared ones are
            # parsed once), Bind picks one, each Execute runs it.
            prepared: dict[str, str] = {}
            bound = ""
            for line in self.pg_lines:
                parts = line.split("\t")
                if len(parts) < 3:
                    continue
                side, message = parts[0], parts[2]
                quoted = line.split('"')[1::2]
                if side == "B" and message == "ReadyForQuery":
                    counted["round_trips"] += 1
                elif side == "F" and message == "Query" and quoted:
                    classify(quoted[0].strip().upper())
                elif side == "F" and message == "Parse" and len(quoted) >= 2:
                    prepared[quoted[0]] = quoted[1].strip().upper()
                elif side == "F" and message == "Bind" and len(quoted) >= 2:
                    bound = prepared.get(quoted[1], "")
                elif side == "F" and message == "Execute":
                    classify(bound)
            return counted
        commits = statements = 0
        inside = False
        for text in self.sqlite_statements:
            sql = text.lstrip().upper()
            if sql.startswith("BEGIN"):
                inside = True
            elif sql.startswith(("COMMIT", "END", "ROLLBACK")):
                commits += not sql.startswith("ROLLBACK")
                inside = False
            elif not sql.startswith((*_TXN, "PRAGMA")):
                statements += 1
                # A write outside BEGIN ... COMMIT (autocommit: flowloop's usual boundary
                # is one INSERT) is a commit of its own; a read alone commits nothing.
                commits += not inside and sql.startswith(("INSERT", "UPDATE", "DELETE"))
        return {"commits": commits, "statements": statements}

    def per(self, units: int) -> dict[str, float]:
        return {k: v / units for k, v in self.counts().items()}

    def __enter__(self) -> WireCounter:
        return self.install()

    def __exit__(self, *_: object) -> None:
        self.stop()
        self.uninstall()


# -- measuring ---------------------------------------------------------------------------


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Collect first, then keep the cyclic GC out of the timed section (as timeit does)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Timer:
    """Wall seconds (perf_counter) and this process's CPU seconds (all threads)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def __enter__(self) -> Timer:
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.cpu_seconds = time.process_time() - self._c0

    def per_step(self, steps: int) -> dict[str, float]:
        """The figures every script prints of ``steps`` timed steps: steps/s, µs and CPU µs
        per step."""
        return {
            "steps_per_s": steps / self.seconds,
            "us_per_step": self.seconds / steps * 1e6,
            "cpu_us_per_step": self.cpu_seconds / steps * 1e6,
        }


Program = Callable[[int], Mapping[str, float]]
"""One compared program: called with the round number, returns its metrics."""


@dataclass
class Results:
    """Samples per (program, metric) across rounds."""

    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)

    def add(self, program: str, metrics: Mapping[str, float]) -> None:
        if program not in self.samples:
            self.samples[program] = {}
            self.order.append(program)
        for key, value in metrics.items():
            self.samples[program].setdefault(key, []).append(float(value))

    def has(self, program: str, metric: str) -> bool:
        return bool(self.samples.get(program, {}).get(metric))

    def median(self, program: str, metric: str) -> float:
        return statistics.median(self.samples[program][metric])

    def spread(self, program: str, metric: str) -> tuple[float, float, float]:
        values = self.samples[program][metric]
        return statistics.median(values), min(values), max(values)

    def to_json(self) -> dict[str, Any]:
        return {
            program: {
                metric: {
                    "median": statistics.median(v),
                    "min": min(v),
                    "max": max(v),
                    "samples": v,
                }
                for metric, v in metrics.items()
            }
            for program, metrics in self.samples.items()
        }


def alternate(
    programs: Sequence[tuple[str, Program]],
    rounds: int,
    results: Results | None = None,
    *,
    show: str = "steps_per_s",
) -> Results:
    """Run the programs in turn, A B C A B C ..., ``rounds`` times."""
    results = results or Results()
    for r in range(rounds):
        line = []
        for name, program in programs:
            try:
                metrics = program(r)
            except Exception as error:
                results.notes[name] = f"failed: {type(error).__name__}: {first_line(error)}"
                line.append(f"{name}=FAILED")
                continue
            results.add(name, metrics)
            if show in metrics:
                line.append(f"{name}={fmt(metrics[show])}")
        print(f"  round {r + 1}/{rounds}: " + "  ".join(line), file=sys.stderr, flush=True)
    return results


def callgrind(
    command: Sequence[str],
    *,
    options: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    what: str,
) -> int:
    """The instructions ``valgrind --tool=callgrind`` counted running ``command`` (with
    callgrind's ``options``); a failure stops the script, naming ``what``."""
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", *options, *command],
        cwd=cwd,
        env=dict(env) if env is not None else None,
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{what}: callgrind failed:\n{done.stderr[-2000:]}")
    return int(found.group(1))


# -- printing ----------------------------------------------------------------------------


def fmt(value: float, digits: int | None = None) -> str:
    if digits is not None:
        return f"{value:,.{digits}f}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:,.1f}"
    return f"{value:,.2f}"


def fmt_spread(results: Results, program: str, metric: str, digits: int | None = None) -> str:
    if not results.has(program, metric):
        return "-"
    med, lo, hi = results.spread(program, metric)
    return f"{fmt(med, digits)} ({fmt(lo, digits)}-{fmt(hi, digits)})"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    print("  " + "  ".join(f"{h:<{w}}" for h, w in zip(headers, widths, strict=True)))
    print("  " + "  ".join("-" * w for w in widths))
    for row in rows:
        print("  " + "  ".join(f"{c!s:<{w}}" for c, w in zip(row, widths, strict=True)))
    print(flush=True)


def verdict(ratio: float, target: float) -> str:
    return f"{ratio:.2f}x (target ≥ {target:g}x: {'met' if ratio >= target else 'NOT met'})"


def write_json(path: str | None, payload: Mapping[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
        print(f"results written to {path}")
