"""Helpers for the ETL tests: the example module, data files, target dumps, and the ETL
workers the crash tests kill.

Workers are real processes forked by crashkit's zygote (``crashkit.Zygote("etlkit", FILE,
WORKFLOW)``, see :func:`zygote`), one per command ``{"db": ..., "mode": ..., "n": ...}``.
Modes:

* ``run``: resume the runs in ``db`` to the end (the test SIGKILLs it once the run has
  committed a given batch: :func:`kill_at_batch`);
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import crashkit
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
    running run's row is a snapshot, its journal after the snapshot's seq has the rest (a
    long context is the journal's only: then all of it, from seq 1)."""
    from flowloop.store.entries import JOURNALED, context_after

    conn = sqlite3.connect(db_path, timeout=5, isolation_level=None)
    try:
        conn.execute("BEGIN")  # one snapshot for both reads
        row = conn.execute(
            "SELECT context, last_seq FROM flowloop_runs WHERE id = ?", (run_id,)
        ).fetchone()
        if row is None:
            return None
        context, after = (None, 0) if row[0] == JOURNALED else row
        for stored, data in conn.execute(
            "SELECT context, data FROM flowloop_journal WHERE run_id = ? AND seq > ?"
            " AND context IS NOT NULL ORDER BY seq",
            (run_id, after),
        ):
            context = context_after(context, stored, data)
        conn.execute("COMMIT")
    finally:
        conn.close()
    return dict(json.loads(context))


# -- workers killed at a batch -------------------------------------------------------------

MODES: Final = ("run", "after_commit", "mid_transaction")


def zygote(file: Path = ETL_FILE, workflow: str = "etl") -> crashkit.Zygote:
    """crashkit's zygote, forking workers that load with ``workflow`` of ``file``."""
    return crashkit.Zygote("etlkit", str(file), workflow)


def batches_done(db: Path, run_id: str) -> int:
    ctx = run_context(db, run_id)
    assert ctx is not None, f"no run {run_id} in {db}"
    return int(ctx["batches_done"])


def kill_at_batch(zygote: crashkit.Zygote, db: Path, run_id: str, mode: str, batch: int) -> None:
    """One worker, SIGKILLed once the run has committed ``batch`` batches: by the test as
    soon as it sees them committed (``run``), or by itself at its precise point of the
    next batch (the other modes)."""
    if mode == "run":
        pid = zygote.fork(db=str(db), mode=mode, n=0)
        crashkit.kill_when(
            pid, lambda: batches_done(db, run_id) >= batch, what=f"batch {batch} committed"
        )
    else:
        # The worker's n-th batch: its first re-runs the interrupted one.
        pid = zygote.fork(db=str(db), mode=mode, n=batch - batches_done(db, run_id) + 1)
    code = zygote.exit_code(pid)
    assert code == -signal.SIGKILL, f"worker {mode} (batch {batch}) exited {code}"


def kill_at_batches(
    zygote: crashkit.Zygote,
    db: Path,
    run_id: str,
    modes: Sequence[str],
    *,
    batch_after: Callable[[int], int],
    last: int,
) -> int:
    """For each of ``modes`` in turn, a worker killed at the batch ``batch_after(committed
    batches)`` names, until that would be past batch ``last``. Returns how many."""
    kills = 0
    for mode in modes:
        batch = batch_after(batches_done(db, run_id))
        if batch > last:
            break
        kill_at_batch(zygote, db, run_id, mode, batch)
        kills += 1
    return kills


def finished(db: Path, workflow: Any, run_id: str) -> tuple[Any, list[Any]]:
    """After the last resume: the run's info and its journal (to compare with a plain load)."""
    from flowloop import Engine

    with Engine(f"sqlite:///{db}") as engine:
        engine.register(workflow)
        return engine.get(run_id), engine.history(run_id)


def _worker(module: ModuleType, workflow: str, command: Mapping[str, Any]) -> int:
    from flowloop import Engine
    from flowloop.etl import writers

    mode, n = str(command.get("mode", "run")), int(command.get("n", 0))
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
    with Engine(command["db"]) as engine:
        engine.register(getattr(module, workflow))
        engine.resume()
    return 0


def _serve(file: Path, workflow: str) -> None:
    from flowloop.loader import import_file

    module = import_file(file)
    import flowloop.engine  # noqa: F401 - imported once here, not in each worker

    crashkit.serve(lambda command: _worker(module, workflow, command))


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
    _serve(Path(sys.argv[2]), sys.argv[3])
