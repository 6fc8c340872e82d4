"""A host lost in the middle of a boundary write (issue 20, item 14): its session is left
"idle in transaction" holding the run's row lock, and every other worker's claim skips the
row (SKIP LOCKED). flowloop's connections set ``idle_in_transaction_session_timeout`` (a
third of the lease, at least 2 s) and server-side keepalives, so the server ends such a
session and another worker takes the run over within lease + sweep + that timeout.

The lost host is a real process on flowloop's own engine (its connection settings): it
claims a run under another host's worker id (so no same-host shortcut applies), begins the
write — UPDATE sent, COMMIT not — and freezes (SIGSTOP): to the server, exactly a client
that vanished between two round trips."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import mwkit
import pytest
from polling import poll

pytestmark = pytest.mark.postgres

LEASE_S = 3.0
IDLE_S = 2.0  # flowloop.store.dialect.pg_idle_in_transaction_ms(3.0) / 1000
SWEEP_S = LEASE_S / 2
TAKEOVER_BOUND_S = LEASE_S + SWEEP_S + IDLE_S + 20.0
"""Slack for a loaded 2-core machine; without the timeout the run is never taken over."""

LOST_HOST = """
import os, signal, sys
import sqlalchemy as sa
sys.path.insert(0, os.path.dirname(sys.argv[2]))
from flowloop import Engine
from pathlib import Path
from flowloop.loader import import_file

flow = import_file(Path(sys.argv[2])).ledger
with Engine(sys.argv[1], workflows=[flow], lease_seconds=float(sys.argv[4])) as engine:
    run_id = engine.start(flow, {"n": 0}).id
    store = engine.store
    (claimed,) = store.claim(
        worker="elsewhere:4242:lost", now=store.db_now(), limit=1,
        lease_seconds=float(sys.argv[4]), workflows=["ledger"], run_ids=[run_id],
    )
    conn = store.engine.connect()
    conn.begin()
    conn.execute(sa.text("UPDATE flowloop_runs SET updated_at = updated_at WHERE id = :id"),
                 {"id": run_id})
    with open(sys.argv[3], "w") as handle:
        handle.write(run_id)
    os.kill(os.getpid(), signal.SIGSTOP)  # gone, between the UPDATE and the COMMIT
"""


@pytest.fixture
def workers() -> Iterator[mwkit.Workers]:
    procs = mwkit.Workers()
    yield procs
    procs.stop_all()


def test_a_run_locked_by_a_vanished_session_is_taken_over(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    flow = mwkit.write_flow(tmp_path)
    mwkit.enqueue(pg_url, flow, 0)  # the schema and the ledger table
    ready = tmp_path / "locked"
    lost = subprocess.Popen(
        [sys.executable, "-c", LOST_HOST, pg_url, str(flow), str(ready), str(LEASE_S)],
        env={**os.environ, "PYTHONPATH": str(mwkit.ROOT)},
    )
    try:

        def locked() -> str | None:
            assert lost.poll() is None, "the lost host's process ended early"
            return ready.read_text() if ready.exists() else None

        run_id = poll(
            locked,
            timeout=60,
            every=0.05,
            what="the lost host to lock its run",
        )
        locked_at = time.monotonic()
        env = {"MW_LEDGER_DSN": ""}
        workers.add(
            mwkit.spawn_worker(flow, pg_url, tmp_path, "b", concurrency=2, lease=LEASE_S, env=env)
        )
        mwkit.wait_for(
            "another worker to take the locked run over and finish it",
            lambda: mwkit.all_finished(pg_url, 1),
            timeout=TAKEOVER_BOUND_S,
            describe=workers.logs,
        )
        took = time.monotonic() - locked_at
        assert mwkit.statuses(pg_url) == Counter({"succeeded": 1}), workers.logs()
        kinds = [row.kind for row in mwkit.journal_rows(pg_url) if row.run_id == run_id]
        assert kinds.count("step_succeeded") == len(mwkit.STATES), kinds
        print(f"run held by a vanished session finished {took:.1f}s after it was locked")
    finally:
        lost.send_signal(signal.SIGKILL)
        lost.wait(10)
