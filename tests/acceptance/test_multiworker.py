"""Many worker processes on one PostgreSQL database: they share the queue, never run one step
twice or at once, and every run succeeds (GitHub issue "Many workers on PostgreSQL").

Real processes (``python -m flowloop.cli worker``) on a real server, each test in its own
schema (conftest's ``pg_url``). Every step of the 10-step ledger workflow (tests/mwkit.py)
inserts a row keyed by its idempotency key into a ledger table through its own connection:
a second execution of a key would fail on the primary key and show up as a failed step.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mwkit
import pytest

from flowloop import Engine

pytestmark = pytest.mark.postgres

RUNS = 1_000
WORKERS = 4
CONCURRENCY = 4
DEADLINE_S = 120.0


@pytest.fixture
def workers() -> Iterator[mwkit.Workers]:
    procs = mwkit.Workers()
    yield procs
    procs.stop_all()


def test_four_workers_share_a_thousand_runs(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    flow = mwkit.write_flow(tmp_path)
    mwkit.enqueue(pg_url, flow, 0)  # the schema and the ledger
    for i in range(WORKERS):
        workers.add(mwkit.spawn_worker(flow, pg_url, tmp_path, f"w{i}", concurrency=CONCURRENCY))
    for proc in workers.procs:  # all up before any work exists: they compete from the start
        mwkit.wait_for(f"{proc.name} to start", proc.is_up, timeout=60, describe=workers.logs)
    started = time.monotonic()
    run_ids = mwkit.enqueue(pg_url, flow, RUNS)

    mwkit.wait_for(
        f"{RUNS} runs to finish",
        lambda: mwkit.all_finished(pg_url, RUNS),
        timeout=DEADLINE_S,
        describe=lambda: f"{mwkit.statuses(pg_url)}\n{workers.logs()}",
    )
    elapsed = time.monotonic() - started
    for proc in workers.procs:
        assert proc.stop() == 0, workers.logs()

    # Every run succeeded, and its row is what its journal folds to.
    assert mwkit.statuses(pg_url) == Counter({"succeeded": RUNS})
    with Engine(pg_url, workflows=[mwkit.load_flow(flow)]) as engine:
        for run_id in random.Random(7).sample(run_ids, 100):
            replay = engine.replay(run_id)
            assert replay.matches, (run_id, replay.differences)

    # The journal: each step started and succeeded exactly once; nothing failed or was cut off.
    journal = mwkit.journal_rows(pg_url)
    assert mwkit.succeeded_once_per_visit(journal) == []
    kinds = Counter(row.kind for row in journal)
    assert kinds["step_started"] == kinds["step_succeeded"] == RUNS * len(mwkit.STATES)
    assert kinds["step_failed"] == kinds["step_interrupted"] == 0, kinds

    # The ledger: each key executed once, by the worker that journaled that step, and the
    # steps of a run one after another (never two at once, whoever ran them).
    ledger = mwkit.ledger_rows(pg_url)
    assert len(ledger) == RUNS * len(mwkit.STATES)
    assert all(row.executions == 1 and row.attempt == 1 for row in ledger)
    started_by = {
        (row.run_id, row.seq): row.worker for row in journal if row.kind == "step_started"
    }
    by_run: dict[str, list[Any]] = defaultdict(list)
    for row in ledger:
        assert started_by[(row.run_id, row.seq)] == row.worker, row
        by_run[row.run_id].append(row)
    for rows in by_run.values():
        for before, after in itertools.pairwise(rows):
            assert after.started_at >= before.ended_at - 0.005, (before, after)

    # The work was spread: every worker ran a fair share of the steps.
    per_worker = Counter(row.worker for row in ledger)
    assert len(per_worker) == WORKERS, per_worker
    fair = len(ledger) / WORKERS
    assert min(per_worker.values()) > fair / 4, per_worker
    # Runs changed hands between workers at step boundaries only when a worker let go
    # (here: never, no one did), so each run was driven by one worker.
    assert all(len({row.worker for row in rows}) == 1 for rows in by_run.values())

    logs = "\n".join(proc.output() for proc in workers.procs)
    for problem in ("Traceback", "lost its lease", "write refused", "self-fencing"):
        assert problem not in logs, workers.logs()
    print(
        f"{RUNS} runs x {len(mwkit.STATES)} steps on {WORKERS} workers in {elapsed:.1f}s "
        f"({len(ledger) / elapsed:.0f} steps/s); per worker {dict(per_worker)}"
    )


def test_claims_follow_priority_then_due_time(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    """One worker taking one run at a time starts them highest priority first, then oldest
    due first (the claim's ORDER BY under FOR UPDATE SKIP LOCKED)."""
    flow = mwkit.write_flow(tmp_path)
    workflow = mwkit.load_flow(flow)
    now = time.time()
    plan = [(priority, now - 100 + i) for priority in (0, 5, 1) for i in range(6)]
    random.Random(3).shuffle(plan)
    with Engine(pg_url, workflows=[workflow]) as engine:
        mwkit.create_ledger(pg_url)
        ids = {
            engine.start(workflow, {"n": 0}, priority=priority, run_at=due).id: (priority, due)
            for priority, due in plan
        }
    workers.add(mwkit.spawn_worker(flow, pg_url, tmp_path, "only", concurrency=1))
    mwkit.wait_for(
        "the runs to finish",
        lambda: mwkit.all_finished(pg_url, len(ids)),
        timeout=60,
        describe=workers.logs,
    )
    journal = mwkit.journal_rows(pg_url)
    first_steps = sorted(
        (row for row in journal if row.kind == "step_started" and row.state == "s0"),
        key=lambda row: row.at,
    )
    expected = sorted(ids, key=lambda run_id: (-ids[run_id][0], ids[run_id][1]))
    assert [row.run_id for row in first_steps] == expected
