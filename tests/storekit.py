"""Building blocks for store tests: runs and boundaries made by hand, as the executor would."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import sqlalchemy as sa

from flowloop import journal as j
from flowloop.journal import JournalEvent, RunRecord
from flowloop.store import Boundary, Fence, NewRun, SQLStore, StoredRun, migrate
from flowloop.store.schema import runs
from flowloop.workerids import host_tag

WORKFLOW = "w"
FINGERPRINT = "f" * 16
CONTEXT = '{"n":0}'


def past() -> float:
    """A due time surely behind every database clock and every test's now."""
    return time.time() - 60.0


def new_run(
    run_id: str | None = None,
    *,
    workflow: str = WORKFLOW,
    key: str | None = None,
    idempotency_key: str | None = None,
    due: float | None = None,
    priority: int = 0,
    owner: str | None = None,
    state: str = "a",
    context: str = CONTEXT,
    lease_seconds: float = 30.0,
) -> NewRun:
    """A ``run_created`` (and, with ``owner``, its first ``step_started``)."""
    at = past()
    created = JournalEvent(
        run_id=run_id or uuid.uuid4().hex,
        seq=1,
        kind=j.RUN_CREATED,
        at=at,
        state=state,
        context=context,
        data={
            "workflow": workflow,
            "version": 1,
            "fingerprint": FINGERPRINT,
            "key": key,
            "due": at if due is None else due,
        },
    )
    events = [created]
    record = j.create(created)
    if owner is not None:
        started = JournalEvent(
            run_id=created.run_id,
            seq=2,
            kind=j.STEP_STARTED,
            at=at,
            state=state,
            attempt=1,
            worker=owner,
        )
        events.append(started)
        record = j.apply(record, started)
    return NewRun(
        record=record,
        events=events,
        idempotency_key=idempotency_key,
        priority=priority,
        owner=owner,
        lease_seconds=lease_seconds,
    )


def event(record: RunRecord, kind: str, offset: int = 1, **fields: object) -> JournalEvent:
    return JournalEvent(
        run_id=record.id,
        seq=record.last_seq + offset,
        kind=kind,
        at=time.time(),
        **fields,  # type: ignore[arg-type]
    )


def start_step(stored: StoredRun, worker: str, *, epoch: int | None = None) -> Boundary:
    """The ``step_started`` boundary a claimer writes after claiming ``stored``."""
    record = stored.record
    started = event(record, j.STEP_STARTED, state=record.state, attempt=record.attempt + 1)
    return Boundary(
        events=[started],
        record=j.apply(record, started),
        fence=Fence(worker, stored.lease_epoch if epoch is None else epoch),
    )


def succeed_step(
    record: RunRecord,
    fence: Fence,
    *,
    next_state: str = "b",
    final: bool = False,
    release: bool = True,
) -> Boundary:
    """A ``step_succeeded`` boundary for a run whose step is running."""
    done = event(
        record,
        j.STEP_SUCCEEDED,
        state=record.state,
        attempt=record.attempt,
        event="next",
        next_state=next_state,
        context='{"n":1}',
        data={"final": True} if final else {},
    )
    return Boundary(events=[done], record=j.apply(record, done), fence=fence, release=release)


def succeed_and_start(record: RunRecord, fence: Fence, context: str) -> Boundary:
    """A step's success with ``context`` and the next step's start, in the same state: a
    boundary that keeps the run running (one joined journal row)."""
    done = event(
        record,
        j.STEP_SUCCEEDED,
        state=record.state,
        event="next",
        next_state=record.state,
        context=context,
        attempt=record.attempt,
        worker=fence.owner,
    )
    after = j.apply(record, done)
    start = event(after, j.STEP_STARTED, state=record.state, attempt=1, worker=fence.owner)
    return Boundary(events=[done, start], record=j.apply(after, start), fence=fence)


def pause(stored: StoredRun) -> Boundary:
    """An operator's pause of a queued run (a write by nobody)."""
    record = stored.record
    paused = event(record, j.RUN_PAUSED, state=record.state)
    return Boundary(
        events=[paused], record=j.apply(record, paused), fence=Fence(None, stored.lease_epoch)
    )


def dead_owner() -> str:
    """A worker id on this host whose process has exited (its leases are taken over at once)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return f"{socket.gethostname()}:{done.stdout.strip()}:dead:{host_tag()}"


def to_revision(url: str, revision: str) -> None:
    """Take the database at ``url`` to schema ``revision`` (Alembic, up or down)."""
    store = SQLStore(url, check_schema=False)
    try:
        with store._schema_write() as conn:
            migrate.to_revision(conn, revision)
    finally:
        store.close()


def copy_run_pg(store: SQLStore, run_id: str, copies: int, changed: dict[str, str]) -> None:
    """Copy the run ``run_id`` ``copies`` times on PostgreSQL, in one statement: each copy's
    columns as the run's, but those in ``changed`` (SQL over ``g``, the copy's number from
    1), then analyze the runs table (as autovacuum keeps it)."""
    columns = [c.name for c in runs.c]
    copied = ", ".join(changed.get(name, name) for name in columns)
    with store.engine.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO flowloop_runs ({', '.join(columns)}) SELECT {copied} "
            f"FROM flowloop_runs, generate_series(1, {copies}) AS g WHERE id = %(id)s",
            {"id": run_id},
        )
        conn.exec_driver_sql("ANALYZE flowloop_runs")


def batch_sizes(monkeypatch: Any) -> tuple[list[int], list[int]]:
    """From now on, the sizes of the batches a store sends by ``executemany`` and as JSON
    (PostgreSQL, flowloop/store/recordsets.py: one array, or parts of a long one), as they
    are encoded."""
    from flowloop.store import appends, recordsets

    by_executemany: list[int] = []
    as_json: list[int] = []
    executemany, rows_json = appends._executemany, recordsets.rows_json

    def counted_executemany(cursor: Any, stmt: Any, params: Any, **given: Any) -> bool:
        by_executemany.append(len(params))
        return executemany(cursor, stmt, params, **given)

    def counted_rows_json(params: Any) -> str | None:
        as_json.append(len(params))
        return rows_json(params)

    monkeypatch.setattr(appends, "_executemany", counted_executemany)
    monkeypatch.setattr(recordsets, "rows_json", counted_rows_json)
    return by_executemany, as_json


def pg_rows_read(store: SQLStore, statement: Any, params: dict[str, Any]) -> int:
    """The rows of the runs table PostgreSQL reads to run ``statement`` (each scan's rows
    out and rows its filter removed, over all its loops), in a transaction rolled back."""
    with store.engine.connect() as conn:
        explained = sa.text(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement.text}")
        plan = conn.execute(explained, params).scalar_one()
        conn.rollback()

    def read(node: dict[str, Any]) -> int:
        rows = 0
        if node.get("Relation Name") == "flowloop_runs" and "Scan" in node["Node Type"]:
            per_loop = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
            rows = round(per_loop * node["Actual Loops"])
        return rows + sum(read(child) for child in node.get("Plans", []))

    return read(plan[0]["Plan"])
