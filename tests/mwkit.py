"""Building blocks for the many-workers tests on PostgreSQL (tests/acceptance/test_multiworker.py,
test_zombie.py, test_outage.py) and bench/scale_workers.py.

* :data:`LEDGER_FLOW` — the source of a 10-step workflow file (``ledger``: s0 → … → s9 →
  done). Each step appends one row to the ``mw_ledger`` table, keyed by the step's
  idempotency key, through its own connection to the same PostgreSQL schema: who ran it
  (``worker``, ``pid``), when it started and ended, how many times it was executed.
  Environment of the worker process:

  - ``MW_LEDGER_DSN``: the libpq URL of the ledger (unset: steps write nothing);
  - ``MW_LEDGER_MODE``: ``strict`` (a plain INSERT: a second execution of a key fails with a
    unique violation, so a double execution shows up as a failed step) or ``idempotent``
    (``ON CONFLICT`` counts ``executions``; database errors are retried inside the step,
    as a step talking to an external system with an idempotency key would);
  - ``MW_BLOCK_STATE`` + ``MW_BLOCK_FILE``: the step of that state writes
    ``MW_BLOCK_FILE.entered`` (the run id) and blocks until ``MW_BLOCK_FILE`` exists;
  - ``MW_STEP_SLEEP``: seconds each step sleeps (so SIGKILLs land mid-step).

* Processes: :func:`spawn_worker` starts ``python -m flowloop.cli worker`` (or, with a
  ``worker_id``, this module as a script, which runs the same Worker under a given id — a
  worker "on another host"); output goes to a log file.

* Waiting: :func:`wait_for` polls a condition with a deadline (no sleep-and-hope).

Everything here talks to the database directly with SQLAlchemy, so it works while workers
run in other processes.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from polling import poll
from sqlalchemy import select

from flowloop.journal import JournalEvent
from flowloop.store.entries import decode
from flowloop.store.schema import journal

ROOT = Path(__file__).resolve().parent.parent
STATES = [f"s{i}" for i in range(10)]
WORKFLOW = "ledger"

LEDGER_FLOW = '''\
"""mwkit's ledger workflow: 10 steps, each appending one row to mw_ledger (see tests/mwkit.py)."""

from __future__ import annotations

import os
import threading
import time

from pydantic import BaseModel

from flowloop import Retry, Step, Workflow

STATES = [f"s{i}" for i in range(10)]
RETRY = Retry(attempts=50, backoff="fixed", base=0.05, cap=0.05)
"""Interruptions (SIGKILL, a zombie's takeover) count as attempts: allow many."""


class LedgerCtx(BaseModel):
    n: int = 0


_local = threading.local()


def _conn():  # type: ignore[no-untyped-def]
    import psycopg

    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = psycopg.connect(os.environ["MW_LEDGER_DSN"], autocommit=True, connect_timeout=5)
        _local.conn = conn
    return conn


def _drop_conn() -> None:
    conn = getattr(_local, "conn", None)
    _local.conn = None
    if conn is not None:
        try:
            conn.close()
        except Exception:
            pass


def _block(step: Step) -> None:
    flag = os.environ.get("MW_BLOCK_FILE")
    if not flag or step.state != os.environ.get("MW_BLOCK_STATE"):
        return
    # One temporary file per run: several runs reach the blocking state at once, and a
    # shared one made a run's rename fail (FileNotFoundError) and its step retry.
    tmp = f"{flag}.entered.{step.run_id}.tmp"
    with open(tmp, "w") as handle:
        handle.write(step.run_id)
    os.replace(tmp, flag + ".entered")
    while not os.path.exists(flag):
        time.sleep(0.02)


STRICT = """INSERT INTO mw_ledger
(key, run_id, state, seq, attempt, worker, pid, started_at, ended_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s, extract(epoch from clock_timestamp()))"""
IDEMPOTENT = STRICT + """
ON CONFLICT (key) DO UPDATE SET executions = mw_ledger.executions + 1"""


def record(ctx: LedgerCtx, step: Step) -> None:
    started = time.time()
    _block(step)
    pause = float(os.environ.get("MW_STEP_SLEEP") or 0)
    if pause:
        time.sleep(pause)
    if os.environ.get("MW_LEDGER_DSN"):
        strict = os.environ.get("MW_LEDGER_MODE", "strict") == "strict"
        params = (step.idempotency_key, step.run_id, step.state, step.seq, step.attempt,
                  step.worker, os.getpid(), started)
        deadline = time.monotonic() + 60.0
        while True:
            try:
                _conn().execute(STRICT if strict else IDEMPOTENT, params)
                break
            except Exception as error:
                import psycopg

                _drop_conn()
                if strict or not isinstance(error, psycopg.OperationalError):
                    raise
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    ctx.n += 1


ledger = Workflow("ledger", context=LedgerCtx)
for _i, _state in enumerate(STATES):
    ledger.step(name=_state, initial=_i == 0,
                next=STATES[_i + 1] if _i + 1 < len(STATES) else "done", retry=RETRY)(record)
ledger.final("done")
'''

LEDGER_DDL = """
CREATE TABLE IF NOT EXISTS mw_ledger (
    key text PRIMARY KEY,
    run_id text NOT NULL,
    state text NOT NULL,
    seq integer NOT NULL,
    attempt integer NOT NULL,
    worker text NOT NULL,
    pid integer NOT NULL,
    started_at double precision NOT NULL,
    ended_at double precision NOT NULL,
    executions integer NOT NULL DEFAULT 1
)
"""

T = TypeVar("T")


# -- the workflow file and the ledger ----------------------------------------------------


def write_flow(directory: Path) -> Path:
    path = directory / "ledger_flow.py"
    path.write_text(LEDGER_FLOW)
    return path


def libpq_url(url: str) -> str:
    """The SQLAlchemy URL as libpq takes it (``postgresql://…``, options kept)."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def create_ledger(url: str) -> None:
    with db(url) as engine, engine.begin() as conn:
        conn.execute(sa.text(LEDGER_DDL))


class db:
    """``with db(url) as engine``: a throwaway SQLAlchemy engine (no pooling)."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url, poolclass=sa.NullPool)

    def __enter__(self) -> sa.Engine:
        return self.engine

    def __exit__(self, *_: object) -> None:
        self.engine.dispose()


def load_flow(path: Path) -> Any:
    from flowloop.loader import import_file

    return import_file(path).ledger


def enqueue(url: str, flow: Path, count: int, *, lease: float = 30.0) -> list[str]:
    """Create ``count`` runs of the ledger workflow (scheduled, due now) and the ledger
    table (after flowloop's schema: flowloop refuses a schema with foreign tables only
    when it is new); their ids."""
    from flowloop import Engine

    workflow = load_flow(flow)
    with Engine(url, workflows=[workflow], lease_seconds=lease) as engine:
        create_ledger(url)
        return [engine.start(workflow, {"n": 0}).id for _ in range(count)]


# -- processes --------------------------------------------------------------------------


@dataclass
class WorkerProc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    stopped: bool = field(default=False)
    terminated: bool = field(default=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def is_up(self) -> bool:
        """The worker logged its start-up line (workflows loaded, database open)."""
        return "workflow(s)" in self.output()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def terminate(self) -> None:
        """SIGCONT (it may be frozen) and one SIGTERM (a second one means "exit at once")."""
        if self.proc.poll() is None and not self.terminated:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float = 15.0) -> int | None:
        """:meth:`terminate`, wait; SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.stopped = True
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(5)
        self.stopped = True


def spawn_worker(
    flow: Path,
    url: str,
    log_dir: Path,
    name: str,
    *,
    concurrency: int = 8,
    lease: float = 30.0,
    grace: float = 5.0,
    worker_id: str | None = None,
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
) -> WorkerProc:
    """A worker process on ``flow``: the CLI, or (with ``worker_id``) this module as a
    script running the same Worker under that id; ``prefix`` goes before the command
    (``ip netns exec NAME``: a worker on another host, tests/netkit.py)."""
    log = log_dir / f"{name}.log"
    environment = dict(os.environ)
    environment.update(
        MW_LEDGER_DSN=libpq_url(url),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    environment.update(env or {})
    options = [
        "--db",
        url,
        "--concurrency",
        str(concurrency),
        "--lease",
        str(lease),
        "--grace",
        str(grace),
    ]
    if worker_id is None:
        cmd = [sys.executable, "-m", "flowloop.cli", "worker", str(flow), *options]
    else:
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "worker",
            str(flow),
            *options,
            "--worker-id",
            worker_id,
        ]
    cmd = [*prefix, *cmd]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=environment, cwd=str(log_dir)
        )
    return WorkerProc(name, proc, log)


@dataclass
class Workers:
    """Worker processes started by a test; all stopped (and their logs shown) at the end."""

    procs: list[WorkerProc] = field(default_factory=list)

    def add(self, proc: WorkerProc) -> WorkerProc:
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.stop()

    def logs(self, tail: int = 40) -> str:
        parts = []
        for proc in self.procs:
            lines = proc.output().splitlines()[-tail:]
            parts.append(
                f"--- {proc.name} (pid {proc.pid}, rc {proc.proc.returncode})\n" + "\n".join(lines)
            )
        return "\n".join(parts)


# -- waiting and looking ----------------------------------------------------------------


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    *,
    timeout: float,
    every: float = 0.1,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll ``probe`` until it returns something truthy; fail with ``what`` at the deadline."""
    return poll(probe, timeout=timeout, what=what, every=every, describe=describe)


def statuses(url: str) -> Counter[str]:
    with db(url) as engine, engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT status, count(*) FROM flowloop_runs GROUP BY status"))
        return Counter({row[0]: int(row[1]) for row in rows})


def all_finished(url: str, total: int) -> bool:
    counts = statuses(url)
    return sum(counts[s] for s in ("succeeded", "failed", "stopped")) >= total


def journal_rows(url: str) -> list[JournalEvent]:
    """Every journal entry, by run and seq, read with the store's own decoder (a row that
    holds a step's success and the next start is two entries, as for every reader)."""
    with db(url) as engine, engine.connect() as conn:
        rows = conn.execute(select(journal).order_by(journal.c.run_id, journal.c.seq)).all()
    entries: list[JournalEvent] = []
    for _, of_run in itertools.groupby(rows, key=lambda row: row.run_id):
        entries += decode(of_run, strict=False)
    return entries


def ledger_rows(url: str) -> list[Any]:
    with db(url) as engine, engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT key, run_id, state, seq, attempt, worker, pid, started_at, ended_at,"
                    " executions FROM mw_ledger ORDER BY run_id, seq"
                )
            )
        )


def run_rows(url: str) -> list[Any]:
    with db(url) as engine, engine.connect() as conn:
        return list(
            conn.execute(
                sa.text(
                    "SELECT id, status, state, owner, lease_epoch, lease_expires_at, last_seq"
                    " FROM flowloop_runs ORDER BY id"
                )
            )
        )


def succeeded_once_per_visit(rows: Sequence[Any]) -> list[str]:
    """Problems with "each state succeeded once per visit" (the ledger flow visits each
    state once): a state with no or several ``step_succeeded`` in a run."""
    seen: dict[str, Counter[str]] = {}
    for row in rows:
        counts = seen.setdefault(row.run_id, Counter())
        if row.kind == "step_succeeded":
            counts[row.state] += 1
    problems = []
    for run_id, counts in seen.items():
        for state in STATES:
            if counts[state] != 1:
                problems.append(f"run {run_id}: {state} succeeded {counts[state]} time(s)")
    return problems


# -- a network partition for one worker ---------------------------------------------------


class Partition:
    """A TCP proxy to the database for one worker: :meth:`cut` closes every connection through
    it and turns new ones away at once (the database is unreachable for that worker only,
    and its calls fail fast instead of hanging); :meth:`heal` lets them through again."""

    def __init__(self, url: str) -> None:
        made = sa.make_url(url)
        self.upstream = (made.host or "127.0.0.1", made.port or 5432)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = made.set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)
        self.is_cut = False
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self.is_cut = True
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            _close(sock)

    def heal(self) -> None:
        with self._lock:
            self.is_cut = False

    def close(self) -> None:
        self._closed = True
        self.cut()
        _close(self.listener)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.is_cut:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                self._sockets.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                chunk = source.recv(65536)
                if not chunk or self.is_cut:
                    break
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            _close(source)
            _close(sink)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def log_time(line: str) -> float:
    """The epoch seconds of a worker log line (``%(asctime)s``: local time, milliseconds)."""
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


# -- a worker under a chosen id (another "host") -----------------------------------------


def _main(argv: Sequence[str]) -> None:
    import argparse
    import logging

    from flowloop import Engine
    from flowloop.loader import load_paths
    from flowloop.worker import Worker

    parser = argparse.ArgumentParser(description="a flowloop worker under a given worker id")
    parser.add_argument("command", choices=["worker"])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--db", required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--worker-id", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    loaded = load_paths(args.paths)
    with Engine(
        args.db,
        max_concurrency=args.concurrency,
        lease_seconds=args.lease,
        worker_id=args.worker_id,
    ) as engine:
        engine.register(*loaded.workflows.values())
        Worker(engine, concurrency=args.concurrency, grace=args.grace).run_forever()


if __name__ == "__main__":
    _main(sys.argv[1:])
