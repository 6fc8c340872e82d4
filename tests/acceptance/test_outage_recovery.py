"""A live worker rides out an outage longer than its lease and finishes every run by itself
(issue 20, item 1): no restart, and SIGTERM still ends it within its grace period.

The faults are real: on PostgreSQL the test's own scratch database refuses connections
(``ALLOW_CONNECTIONS false``) and its backends are terminated; on SQLite another process
holds ``BEGIN EXCLUSIVE`` on the file. Either lasts longer than 5/6 of the worker's lease,
so the worker fences its runs off (it cannot renew) while boundary writes are kept for
retry — the state that used to wedge the committer for good.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import faultkit
import mwkit
import pytest
from conftest import pg_base_url, require_pg

RUNS = 8
LEASE_S = 3.0
GRACE_S = 3.0
OUTAGE_S = 4.0
"""Longer than 5/6 of the lease: every run is self-fenced during the outage."""
RECOVERY_BOUND_S = 30.0
"""From the end of the fault to every run finished (leases expire, the sweep settles the
fenced runs, the steps run again): about lease + sweep + the steps' own time."""
EXIT_BOUND_S = GRACE_S + 10.0
"""SIGTERM to exit: the grace plus interpreter start-up slack on a loaded machine."""
ENV = {"MW_LEDGER_DSN": "", "MW_STEP_SLEEP": "0.2"}


@pytest.fixture
def workers() -> Iterator[mwkit.Workers]:
    procs = mwkit.Workers()
    yield procs
    procs.stop_all()


def _steps_done(url: str) -> int:
    return sum(1 for row in mwkit.journal_rows(url) if row.kind == "step_succeeded")


def _ride_out(url: str, tmp_path: Path, workers: mwkit.Workers, fault: object) -> float:
    """Start a worker, inject ``fault`` (begin/end callables) for OUTAGE_S, and return the
    seconds from the fault's end to every run finished."""
    flow = mwkit.write_flow(tmp_path)
    mwkit.enqueue(url, flow, RUNS, lease=LEASE_S)
    worker = workers.add(
        mwkit.spawn_worker(
            flow, url, tmp_path, "w", concurrency=4, lease=LEASE_S, grace=GRACE_S, env=ENV
        )
    )
    mwkit.wait_for(
        "the worker to get going",
        lambda: _steps_done(url) >= RUNS,
        timeout=60,
        describe=workers.logs,
    )
    begin, end = fault  # type: ignore[misc]
    begin()
    try:
        time.sleep(OUTAGE_S)  # the fault's length is the point of the test
    finally:
        end()
    ended = time.monotonic()
    assert _steps_done(url) < RUNS * len(mwkit.STATES), "the outage came too late to matter"
    mwkit.wait_for(
        "every run to finish after the outage, without a restart",
        lambda: mwkit.all_finished(url, RUNS),
        timeout=RECOVERY_BOUND_S,
        describe=lambda: f"{mwkit.statuses(url)}\n{workers.logs()}",
    )
    recovered = time.monotonic() - ended
    assert worker.proc.poll() is None, workers.logs()
    # Said once per part of the worker (each retry logged a warning: 67-203 lines in 40 s),
    # and said when it was over (fault audit).
    output = worker.output()
    for part in ("claims", "writes"):
        assert output.count(f"{part}: database ") <= 1, workers.logs()
    assert "the database answers again" in output, workers.logs()
    assert mwkit.statuses(url) == Counter({"succeeded": RUNS}), workers.logs()
    assert mwkit.succeeded_once_per_visit(mwkit.journal_rows(url)) == []
    output = worker.output()
    assert "self-fencing" in output, workers.logs()  # the outage outlasted the lease
    assert "Traceback" not in output, workers.logs(80)

    asked = time.monotonic()
    worker.terminate()
    worker.proc.wait(EXIT_BOUND_S)
    assert worker.proc.returncode == 0, workers.logs()
    print(
        f"recovered {recovered:.1f}s after a {OUTAGE_S:g}s outage (lease {LEASE_S:g}s); "
        f"SIGTERM to exit {time.monotonic() - asked:.1f}s"
    )
    return recovered


def test_worker_recovers_after_sqlite_locked_longer_than_its_lease(
    tmp_path: Path, workers: mwkit.Workers
) -> None:
    db = tmp_path / "flowloop.db"
    locks: list[faultkit.SqliteLock] = []

    def begin() -> None:
        locks.append(faultkit.SqliteLock(db, tmp_path / "unlock"))

    _ride_out(f"sqlite:///{db}", tmp_path, workers, (begin, lambda: locks[0].release()))


@pytest.mark.postgres
def test_worker_recovers_after_postgres_refused_connections_longer_than_its_lease(
    tmp_path: Path, workers: mwkit.Workers
) -> None:
    require_pg()
    with faultkit.scratch_pg_database(pg_base_url()) as url:
        outage = faultkit.PgOutage(pg_base_url(), url.rsplit("/", 1)[1])
        try:
            _ride_out(url, tmp_path, workers, (outage.begin, outage.end))
        finally:
            workers.stop_all()
            outage.end()
            outage.close()


@pytest.mark.postgres
def test_worker_rides_out_postgres_turning_read_only(
    tmp_path: Path, workers: mwkit.Workers
) -> None:
    """SQLSTATE 25006 (read_only_sql_transaction) arrives as InternalError, not as an
    OperationalError: it is an outage all the same (issue 20, item 5)."""
    require_pg()
    with faultkit.scratch_pg_database(pg_base_url()) as url:
        fault = faultkit.PgReadOnly(pg_base_url(), url.rsplit("/", 1)[1])
        try:
            _ride_out(url, tmp_path, workers, (fault.begin, fault.end))
            assert "read-only transaction" in workers.procs[0].output()
        finally:
            workers.stop_all()
            fault.close()


@pytest.mark.postgres
def test_sigterm_during_an_outage_ends_the_worker_and_nothing_is_lost(
    tmp_path: Path, workers: mwkit.Workers
) -> None:
    """SIGTERM while the database still refuses connections: the worker exits within its
    grace plus the bounded wait for journaling cut-offs — long before self-fencing would
    end its runs (5/6 of a 30 s lease) — and a worker started after the outage finishes
    every run (the journal holds; the first worker's process is gone, so its leases are
    taken over at once)."""
    from flowloop.executor import CUT_OFF_WRITE_SECONDS

    lease, grace = 30.0, 1.0

    require_pg()
    with faultkit.scratch_pg_database(pg_base_url()) as url:
        outage = faultkit.PgOutage(pg_base_url(), url.rsplit("/", 1)[1])
        try:
            flow = mwkit.write_flow(tmp_path)
            mwkit.enqueue(url, flow, RUNS, lease=lease)
            first = workers.add(
                mwkit.spawn_worker(
                    flow, url, tmp_path, "w1", concurrency=4, lease=lease, grace=grace, env=ENV
                )
            )
            mwkit.wait_for(
                "the worker to get going",
                lambda: _steps_done(url) >= RUNS,
                timeout=60,
                describe=workers.logs,
            )
            outage.begin()
            mwkit.wait_for(
                "the worker to notice the outage",
                lambda: "database unreachable" in first.output(),
                timeout=30,
                describe=workers.logs,
            )
            asked = time.monotonic()
            first.terminate()
            first.proc.wait(grace + CUT_OFF_WRITE_SECONDS + 10)
            took = time.monotonic() - asked
            outage.end()
            second = workers.add(
                mwkit.spawn_worker(
                    flow, url, tmp_path, "w2", concurrency=4, lease=LEASE_S, grace=GRACE_S, env=ENV
                )
            )
            mwkit.wait_for(
                "the second worker to finish every run",
                lambda: mwkit.all_finished(url, RUNS),
                timeout=RECOVERY_BOUND_S,
                describe=lambda: f"{mwkit.statuses(url)}\n{workers.logs()}",
            )
            assert mwkit.statuses(url) == Counter({"succeeded": RUNS}), workers.logs()
            assert mwkit.succeeded_once_per_visit(mwkit.journal_rows(url)) == []
            assert second.stop() == 0, workers.logs()
            assert "self-fencing" not in first.output(), workers.logs()
            print(f"SIGTERM during the outage: exit after {took:.1f}s (grace {grace:g}s)")
        finally:
            workers.stop_all()
            outage.end()
            outage.close()


@pytest.mark.postgres
def test_a_worker_and_resume_started_during_an_outage_wait_for_the_database(
    tmp_path: Path, workers: mwkit.Workers
) -> None:
    """A worker (or `flowloop resume`) started while PostgreSQL refused connections exited 1
    at once ("cannot use database …: unreachable"), though the README says it waits (fault
    audit). Both wait, say so once, and do their work when the database answers."""
    import os
    import subprocess
    import sys

    require_pg()
    with faultkit.scratch_pg_database(pg_base_url()) as url:
        outage = faultkit.PgOutage(pg_base_url(), url.rsplit("/", 1)[1])
        try:
            flow = mwkit.write_flow(tmp_path)
            mwkit.enqueue(url, flow, RUNS, lease=LEASE_S)
            outage.begin()
            worker = workers.add(
                mwkit.spawn_worker(
                    flow, url, tmp_path, "w", concurrency=4, lease=LEASE_S, grace=GRACE_S, env=ENV
                )
            )
            resumed = tmp_path / "resume.log"
            with resumed.open("w") as log:
                resume = subprocess.Popen(
                    [sys.executable, "-m", "flowloop.cli", "resume", "-w", str(flow), "--db", url],
                    cwd=tmp_path,
                    env={**os.environ, "PYTHONPATH": str(mwkit.ROOT), **ENV},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            waiting = "cannot use the database yet"
            # Both have tried and are waiting before the outage ends (a slow start of
            # either found the database back, and had nothing to wait for).
            mwkit.wait_for(
                "the worker and resume to say they wait for the database",
                lambda: waiting in worker.output() and waiting in resumed.read_text(),
                timeout=60,
                describe=lambda: f"{workers.logs()}\nresume: {resumed.read_text()}",
            )
            assert worker.proc.poll() is None and resume.poll() is None, workers.logs()
            outage.end()
            mwkit.wait_for(
                "every run to finish once the database answers",
                lambda: mwkit.all_finished(url, RUNS),
                timeout=RECOVERY_BOUND_S,
                describe=lambda: f"{mwkit.statuses(url)}\n{workers.logs()}",
            )
            resume.wait(timeout=RECOVERY_BOUND_S)
            output = resumed.read_text()
            assert resume.returncode == 0, output
            assert waiting in output and "the database answers again" in output, output
            assert "the database answers again" in worker.output()
            assert mwkit.succeeded_once_per_visit(mwkit.journal_rows(url)) == []
            assert worker.stop() == 0, workers.logs()
        finally:
            workers.stop_all()
            outage.end()
            outage.close()
