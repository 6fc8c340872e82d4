"""Helpers for the ETL tests: the example module, data files, target dumps, and a process
harness that kills ETL workers.

Workers are real processes. Importing flowloop and the workflow takes most of a second, so a
*zygote* (``python etlkit.py zygote``) imports everything once and forks a fresh worker per
command line ``<db> <mode> <n>``; it answers ``started <pid>`` and, when that worker is gone,
``exit <pid> <code>`` (a negative code is the signal that ended it). Modes:

* ``run``: resume the runs in ``<db>`` to the end (the parent may SIGKILL it at any instant);
* ``after_commit``: SIGKILL itself right after the target commit of its ``n``-th batch,
  before flowloop records the step: the batch runs again on resume;
* ``mid_transaction``: SIGKILL itself inside the ``n``-th batch's target transaction (the
  orders are written, the rejects not, nothing committed).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import sqlite3
import subprocess
import sys
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import IO, Any

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
ETL_FILE = ROOT / "workflows" / "etl.py"
GEN_FILE = ROOT / "bench" / "gen_etl_data.py"
SAMPLE_DIR = ROOT / "workflows" / "data"
READINGS_FILE = ROOT / "workflows" / "etl_readings.py"


def load_etl() -> ModuleType:
    """workflows/etl.py, imported the way the CLI imports it (one module per process)."""
    from flowloop.loader import import_file

    return import_file(ETL_FILE)


def load_generator() -> ModuleType:
    name = "gen_etl_data"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, GEN_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def write_csv(
    path: Path, rows: Iterable[Sequence[str]], header: Sequence[str] | None = None
) -> Path:
    """A CSV file written atomically (``.part`` then rename), as a well-behaved producer."""
    part = path.with_name(path.name + ".part")
    with part.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(header if header is not None else load_generator().HEADER)
        writer.writerows(rows)
    part.replace(path)
    return path


def order(n: int, **changes: str) -> list[str]:
    """A valid order row (``changes`` override fields by name)."""
    fields = {
        "order_id": f"SO-{n:05d}",
        "ordered_at": "2024-03-01T10:00:00Z",
        "customer_id": f"C{1000 + n}",
        "email": f"c{n}@example.com",
        "country": "DE",
        "sku": "BK-1001",
        "product": "Book",
        "quantity": "1",
        "unit_price": "10.00",
        "currency": "EUR",
        "status": "paid",
    }
    fields.update(changes)
    return list(fields.values())


def sqlite_target(folder: Path, name: str = "target.db") -> str:
    return f"sqlite:///{folder / name}"


def dump(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """What a load left in a target, in a comparable form (no load times, run ids, mtimes)."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return {
                "orders": [
                    tuple(r)
                    for r in conn.execute(sa.text("SELECT * FROM orders ORDER BY order_id"))
                ],
                "rejects": [
                    tuple(r)
                    for r in conn.execute(
                        sa.text(
                            "SELECT file, row_no, reason, raw, file_sha256 FROM rejects "
                            "ORDER BY file, row_no"
                        )
                    )
                ],
                "loaded_files": [
                    tuple(r)
                    for r in conn.execute(
                        sa.text(
                            "SELECT file, sha256, size, status, rows_loaded, rows_rejected "
                            "FROM loaded_files ORDER BY file, sha256"
                        )
                    )
                ],
            }
    finally:
        engine.dispose()


def run_context(db_path: Path, run_id: str) -> dict[str, Any] | None:
    """The committed context of a run, read with the stdlib (no pool, no threads): a
    running run's row is a snapshot, its journal after the snapshot's seq has the rest."""
    from flowloop.store.entries import context_after

    conn = sqlite3.connect(db_path, timeout=5, isolation_level=None)
    try:
        conn.execute("BEGIN")  # one snapshot for both reads
        row = conn.execute(
            "SELECT context, last_seq FROM flowloop_runs WHERE id = ?", (run_id,)
        ).fetchone()
        if row is None:
            return None
        context = row[0]
        for stored, data in conn.execute(
            "SELECT context, data FROM flowloop_journal WHERE run_id = ? AND seq > ?"
            " AND context IS NOT NULL ORDER BY seq",
            (run_id, row[1]),
        ):
            context = context_after(context, stored, data)
        conn.execute("COMMIT")
    finally:
        conn.close()
    return dict(json.loads(context))


# -- the zygote --------------------------------------------------------------------------------


class Zygote:
    """The parent's handle on ``python etlkit.py zygote FILE WORKFLOW`` (default: the
    ``etl`` workflow of workflows/etl.py)."""

    def __init__(self, file: Path = ETL_FILE, workflow: str = "etl") -> None:
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "zygote", str(file), workflow],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
            env=env,
            cwd=ROOT,
        )
        assert self._read() == "ready"

    def _read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote died (exit {self.process.poll()})")
        return line.strip()

    def start(self, db: Path, mode: str = "run", n: int = 0) -> int:
        """Fork a worker; its pid."""
        assert self.process.stdin is not None
        self.process.stdin.write(f"{db} {mode} {n}\n")
        kind, pid = self._read().split()
        assert kind == "started", kind
        return int(pid)

    def wait(self, pid: int) -> int:
        """The worker's exit code once it is gone (negative: killed by that signal)."""
        kind, got, code = self._read().split()
        assert kind == "exit" and int(got) == pid, (kind, got, pid)
        return int(code)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _worker(module: ModuleType, workflow: str, db: str, mode: str, n: int) -> None:
    from flowloop import Engine
    from flowloop.etl import writers

    if mode in ("after_commit", "mid_transaction"):
        loader = module.loader
        original_write, original_upsert = loader.write, writers.upsert
        batches = [0]

        def write(url: str, rows: Any, bad: Any) -> None:
            batches[0] += 1
            original_write(url, rows, bad)
            if mode == "after_commit" and batches[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)

        def upsert(conn: Any, table: Any, rows: Any) -> None:
            original_upsert(conn, table, rows)
            if mode == "mid_transaction" and batches[0] == n and table is loader.table:
                os.kill(os.getpid(), signal.SIGKILL)

        # The loader calls its write method and writers.upsert by name at each batch (this
        # is a forked worker: the patches die with it).
        loader.write = write
        writers.upsert = upsert
    with Engine(db) as engine:
        engine.register(getattr(module, workflow))
        engine.resume()


def zygote(stdin: IO[str], stdout: IO[str], file: Path, workflow: str) -> None:
    from flowloop.loader import import_file

    module = import_file(file)
    import flowloop.engine  # noqa: F401 - imported once here, not in each worker

    stdout.write("ready\n")
    stdout.flush()
    for line in stdin:
        db, mode, n = line.split()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _worker(module, workflow, db, mode, int(n))
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        stdout.write(f"started {pid}\n")
        stdout.flush()
        _, status = os.waitpid(pid, 0)
        stdout.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
        stdout.flush()


def cli(
    args: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``flowloop ARGS`` in a subprocess, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "flowloop.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


if __name__ == "__main__" and sys.argv[1:2] == ["zygote"]:
    zygote(sys.stdin, sys.stdout, Path(sys.argv[2]), sys.argv[3])
