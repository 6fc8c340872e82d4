"""Dashboard page times at scale: 100k runs and 1.1M journal rows on SQLite and PostgreSQL.

The rows are inserted straight into the tables (what 100k real runs of a four-step workflow
leave behind: created, each step started and succeeded, one retried failure per run),
spread over the last 7 days; then a real uvicorn server answers each page a few times over
HTTP and the median is printed. Run: ``python bench/ui_pages.py [--quick] [--pg URL|none]``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel
from sqlalchemy import insert

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import fresh_url, parser, rounds_for
from uikit import serve

from flowloop import Step, Workflow
from flowloop import journal as j
from flowloop.store.schema import journal, runs
from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app

DAY = 86_400.0
BATCH = 2_000
ANALYZE_SQLITE = False


class Ctx(BaseModel):
    n: int = 0


def _noop(ctx: Ctx, step: Step) -> None:
    return None


wf = Workflow("shipment", context=Ctx)
for _name, _next in (("a", "b"), ("b", "c"), ("c", "d"), ("d", "done")):
    wf.step(name=_name, initial=_name == "a", next=_next)(_noop)
wf.final("done")


def fill(url: str, n: int) -> int:
    """``n`` runs with 11 journal rows each; returns the journal rows written."""
    store = SQLStore(url)
    store.save_definition(wf.fingerprint, wf.name, wf.version, json.dumps(wf.structure()))
    now = store.db_now()
    rows = 0
    run_rows: list[dict[str, Any]] = []
    journal_rows: list[dict[str, Any]] = []
    with store.engine.begin() as conn:
        for i in range(n):
            run_id = f"{i:08x}" + "0" * 24
            created = now - 7 * DAY * (n - i) / n
            live = i % 20 == 0
            failed = i % 20 == 1
            status = "running" if live else "failed" if failed else "succeeded"
            state = "c" if live else "b" if failed else "done"
            run_rows.append(
                {
                    "id": run_id,
                    "workflow": wf.name,
                    "version": wf.version,
                    "fingerprint": wf.fingerprint,
                    "key": f"K{i}",
                    "idempotency_key": None,
                    "status": status,
                    "state": state,
                    "context": '{"n":1}',
                    "attempt": 1,
                    "visits": '{"a":1,"b":1}',
                    "next_run_at": None,
                    "last_seq": 11,
                    "reason": None,
                    "error": "ValueError: bad" if failed else None,
                    "priority": 0,
                    "owner": "bench-worker" if live else None,
                    "lease_expires_at": now + 30 if live else None,
                    "lease_epoch": 1,
                    "control": None,
                    "created_at": created,
                    "updated_at": created + 1,
                }
            )
            created_data = json.dumps(
                {
                    "workflow": wf.name,
                    "version": wf.version,
                    "fingerprint": wf.fingerprint,
                    "key": f"K{i}",
                    "due": created,
                }
            )
            kinds = [(j.RUN_CREATED, "a", None)]
            for state_name, nxt in (("a", "b"), ("b", None), ("b", "c"), ("c", "d"), ("d", "done")):
                kinds.append((j.STEP_STARTED, state_name, None))
                outcome = j.STEP_FAILED if nxt is None else j.STEP_SUCCEEDED
                kinds.append((outcome, state_name, nxt))
            for seq, (kind, state_name, nxt) in enumerate(kinds[:11], start=1):
                journal_rows.append(
                    {
                        "run_id": run_id,
                        "seq": seq,
                        "kind": kind,
                        "at": created + seq * 0.05,
                        "state": state_name,
                        "attempt": 1,
                        "event": "next" if nxt else None,
                        "next_state": nxt,
                        "context": '{"n":1}' if kind != j.STEP_STARTED else None,
                        "duration": 0.01 * (1 + (i * seq) % 7) if kind != j.STEP_STARTED else None,
                        "error_type": "ValueError" if kind == j.STEP_FAILED else None,
                        "error_message": "bad" if kind == j.STEP_FAILED else None,
                        "traceback": None,
                        "retryable": True if kind == j.STEP_FAILED else None,
                        "worker": "bench",
                        "data": created_data
                        if kind == j.RUN_CREATED
                        else json.dumps({"retry_at": created + seq * 0.05})
                        if kind == j.STEP_FAILED
                        else json.dumps({"final": True})
                        if nxt == "done"
                        else None,
                    }
                )
            if len(run_rows) >= BATCH:
                conn.execute(insert(runs), run_rows)
                conn.execute(insert(journal), journal_rows)
                rows += len(journal_rows)
                run_rows, journal_rows = [], []
        if run_rows:
            conn.execute(insert(runs), run_rows)
            conn.execute(insert(journal), journal_rows)
            rows += len(journal_rows)
    # PostgreSQL: statistics and the visibility map, as autovacuum keeps them. SQLite: as a
    # flowloop database is in use, without ANALYZE (nothing runs it), unless --analyze.
    with store.engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        if conn.dialect.name != "sqlite":
            conn.exec_driver_sql("VACUUM ANALYZE")
        elif ANALYZE_SQLITE:
            conn.exec_driver_sql("ANALYZE")
    store.close()
    return rows


def timed(client: httpx.Client, path: str, rounds: int) -> tuple[float, int]:
    client.get(path)  # warm: the SVG cache and the database's own caches
    samples = []
    status = 0
    for _ in range(rounds):
        started = time.perf_counter()
        response = client.get(path)
        samples.append(time.perf_counter() - started)
        status = response.status_code
    return statistics.median(samples), status


def measure(url: str, n: int, rounds: int) -> list[tuple[str, float, int]]:
    store = SQLStore(url, create=False)
    results = []
    try:
        with (
            serve(create_app(store, workflows={wf.name: wf})) as base,
            httpx.Client(base_url=base, timeout=120) as client,
        ):
            deep = client.get("/api/runs", params={"limit": 50}).json()["next"]
            for _ in range(n // 100):  # walk far down: keyset paging costs the same there
                page = client.get("/api/runs", params={"limit": 50, "after": deep}).json()
                deep = page["next"] or deep
            middle = f"{n // 2:08x}" + "0" * 24
            paths = [
                "/runs",
                "/api/runs",
                "/api/runs?status=failed",
                f"/api/runs?workflow={wf.name}&status=running",
                f"/api/runs?after={deep}",
                f"/api/runs?key=K{n // 3}",
                f"/api/runs?id={middle[:6]}",
                f"/runs/{middle}",
                f"/api/runs/{middle}/progress",
                f"/api/runs/{middle}/journal",
                "/workflows",
                f"/workflows/{wf.name}?since=1h",
                f"/workflows/{wf.name}?since=24h",
                f"/api/workflows/{wf.name}?since=7d",
                "/workers",
            ]
            for path in paths:
                seconds, status = timed(client, path, rounds)
                results.append((path, seconds, status))
    finally:
        store.close()
    return results


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--runs", type=int, default=100_000)
    p.add_argument("--analyze", action="store_true", help="run ANALYZE on the SQLite file")
    args = p.parse_args()
    global ANALYZE_SQLITE
    ANALYZE_SQLITE = args.analyze
    n = 2_000 if args.quick else args.runs
    rounds = rounds_for(args)
    backends = ["sqlite"] + (
        [] if args.pg in (None, "none") or (args.quick and not args.pg) else ["postgres"]
    )
    import tempfile

    directory = args.dir or tempfile.mkdtemp(prefix="flowloop-ui-bench-")
    for backend in backends:
        with fresh_url(backend, directory, args.pg, "ui_pages") as url:
            started = time.perf_counter()
            rows = fill(url, n)
            print(
                f"\n{backend}: {n:,} runs, {rows:,} journal rows (filled in "
                f"{time.perf_counter() - started:.0f} s); median of {rounds} over HTTP"
            )
            for path, seconds, status in measure(url, n, rounds):
                print(f"  {seconds * 1000:8.1f} ms  {status}  {path[:90]}")


if __name__ == "__main__":
    main()
