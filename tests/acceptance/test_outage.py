"""The database goes away under running workers (its connections are killed, again and
again, for about two seconds): workers keep running, retry with backoff, log it, and carry
on when it returns; every run finishes, none is failed because of the outage.

The server is not restarted (other tests share it): the outage is
``pg_terminate_backend`` of every connection the workers (and their steps) hold, found by
the ``application_name`` this test gives them. New connections made meanwhile are killed
at the next sweep, 20 times a second.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import mwkit
import pytest
import sqlalchemy as sa

from flowloop import Engine

pytestmark = pytest.mark.postgres

RUNS = 150
WORKERS = 3
OUTAGE_S = 2.0
SWEEP_EVERY_S = 0.05


@pytest.fixture
def workers() -> Iterator[mwkit.Workers]:
    procs = mwkit.Workers()
    yield procs
    procs.stop_all()


def kill_connections(admin: sa.Connection, application: str) -> int:
    return int(
        admin.execute(
            sa.text(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = :app AND pid <> pg_backend_pid()"
            ),
            {"app": application},
        ).scalar_one()
    )


def test_workers_ride_out_killed_connections(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    application = f"mw_outage_{uuid.uuid4().hex[:8]}"
    url = f"{pg_url}&application_name={application}"
    flow = mwkit.write_flow(tmp_path)
    run_ids = mwkit.enqueue(pg_url, flow, RUNS)
    # Steps of 30 ms: 12 at once make at most 400 steps/s, so the runs are far from done
    # when the outage begins (after a tenth of the steps) and when it ends.
    env = {"MW_LEDGER_MODE": "idempotent", "MW_STEP_SLEEP": "0.03"}
    for i in range(WORKERS):
        workers.add(mwkit.spawn_worker(flow, url, tmp_path, f"w{i}", concurrency=4, env=env))

    def steps_done() -> int:
        return sum(1 for row in mwkit.journal_rows(pg_url) if row.kind == "step_succeeded")

    mwkit.wait_for(
        "the workers to get going", lambda: steps_done() >= RUNS, timeout=60, describe=workers.logs
    )
    before_outage = steps_done()

    killed = sweeps = 0
    with mwkit.db(pg_url) as admin_engine, admin_engine.connect() as admin:
        admin = admin.execution_options(isolation_level="AUTOCOMMIT")
        end = time.monotonic() + OUTAGE_S
        while time.monotonic() < end:
            killed += kill_connections(admin, application)
            sweeps += 1
            time.sleep(SWEEP_EVERY_S)
    assert killed >= WORKERS, f"the outage hit no connection ({sweeps} sweeps)"
    assert steps_done() < RUNS * len(mwkit.STATES), "the outage came too late to matter"

    mwkit.wait_for(
        "every run to finish after the outage",
        lambda: mwkit.all_finished(pg_url, RUNS),
        timeout=90,
        describe=lambda: f"{mwkit.statuses(pg_url)}\n{workers.logs()}",
    )
    for proc in workers.procs:
        assert proc.proc.poll() is None, f"{proc.name} died in the outage:\n{workers.logs()}"
    for proc in workers.procs:
        assert proc.stop() == 0, workers.logs()

    assert mwkit.statuses(pg_url) == Counter({"succeeded": RUNS}), workers.logs()
    journal = mwkit.journal_rows(pg_url)
    assert mwkit.succeeded_once_per_visit(journal) == []
    assert not [row for row in journal if row.kind == "run_failed"]
    with Engine(pg_url, workflows=[mwkit.load_flow(flow)]) as engine:
        for run_id in run_ids:
            assert engine.replay(run_id).matches, run_id
    ledger = mwkit.ledger_rows(pg_url)
    assert len(ledger) == RUNS * len(mwkit.STATES)

    logs = "\n".join(proc.output() for proc in workers.procs)
    assert "database unreachable" in logs or "heartbeat failed" in logs, workers.logs()
    assert "Traceback" not in logs, workers.logs(80)
    print(
        f"outage: {killed} connections killed in {sweeps} sweeps; {before_outage} steps "
        f"before it; retried boundary writes: {logs.count('boundary write(s) kept')}"
    )


def test_partitioned_worker_fences_itself_before_its_lease_ends(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    """Only worker a loses the database (a proxy between them is cut) while a step of it is
    running: a cannot renew, so it abandons the run while the lease still runs — before any
    other worker can take it — and, once reconnected, writes nothing for it."""
    lease = 3.0
    flow = mwkit.write_flow(tmp_path)
    (run_id,) = mwkit.enqueue(pg_url, flow, 1)
    release = tmp_path / "release"
    partition = mwkit.Partition(pg_url)
    try:
        a = workers.add(
            mwkit.spawn_worker(
                flow,
                partition.url,
                tmp_path,
                "a",
                concurrency=2,
                lease=lease,
                env={
                    "MW_BLOCK_STATE": "s3",
                    "MW_BLOCK_FILE": str(release),
                    "MW_LEDGER_MODE": "idempotent",
                },
            )
        )
        mwkit.wait_for(
            "a to block in s3", Path(f"{release}.entered").exists, timeout=30, describe=workers.logs
        )
        a_row = next(r for r in mwkit.run_rows(pg_url) if r.id == run_id)
        # The journal's latest entry (a running run's row is a snapshot behind it).
        a_seq = max(r.seq for r in mwkit.journal_rows(pg_url) if r.run_id == run_id)
        b = workers.add(
            mwkit.spawn_worker(
                flow,
                pg_url,
                tmp_path,
                "b",
                concurrency=2,
                lease=lease,
                env={"MW_LEDGER_MODE": "idempotent"},
            )
        )
        mwkit.wait_for("b to start", b.is_up, timeout=30, describe=workers.logs)

        partition.cut()
        cut_at = time.time()
        # The lease a last renewed (the row no longer changes until b takes the run over).
        last = {"lease": 0.0}

        def taken_over() -> bool:
            row = next(r for r in mwkit.run_rows(pg_url) if r.id == run_id)
            if row.lease_epoch == a_row.lease_epoch:
                last["lease"] = row.lease_expires_at
                return False
            return True

        mwkit.wait_for("b to take the run over", taken_over, timeout=30, describe=workers.logs)
        mwkit.wait_for(
            "b to finish the run",
            lambda: mwkit.all_finished(pg_url, 1),
            timeout=30,
            describe=workers.logs,
        )
        fenced = [line for line in a.output().splitlines() if "self-fencing" in line]
        assert fenced and run_id in fenced[0], workers.logs()
        fenced_at = mwkit.log_time(fenced[0])
        assert cut_at < fenced_at < last["lease"], (cut_at, fenced_at, last["lease"])
        journal = mwkit.journal_rows(pg_url)
        taken = journal[a_seq]
        assert (taken.kind, taken.state) == ("step_interrupted", "s3")
        assert taken.at >= last["lease"] - 0.05  # b waited for the lease to end

        # a comes back and its step finishes: nothing of it reaches the journal.
        before = (journal, mwkit.run_rows(pg_url))
        partition.heal()
        release.write_text("go")
        mwkit.wait_for(
            "a's abandoned step to end",
            lambda: "result discarded" in a.output(),
            timeout=30,
            describe=workers.logs,
        )
        assert a.stop() == 0, workers.logs()
        assert (mwkit.journal_rows(pg_url), mwkit.run_rows(pg_url)) == before
        a_id = a_row.owner
        assert all(row.seq <= a_seq for row in before[0] if row.worker == a_id)
        assert mwkit.statuses(pg_url) == Counter({"succeeded": 1})
        with Engine(pg_url, workflows=[mwkit.load_flow(flow)]) as engine:
            assert engine.replay(run_id).matches
    finally:
        workers.stop_all()
        partition.close()
