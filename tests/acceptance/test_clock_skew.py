"""Due times are judged by the database's clock, not each worker's (issue 20, item 15): a
worker whose host clock is 90 s behind claims a new run at once (it used to wait 90 s), and
one 90 s ahead does not run a run due in 15 s early. The skewed clocks are real: each
worker process runs under libfaketime (``FAKETIME=±90s``, the monotonic clock left alone),
the PostgreSQL server keeps the true time."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import mwkit
import pytest
import sqlalchemy as sa

pytestmark = pytest.mark.postgres

SKEW_S = 90.0
DUE_IN_S = 15.0


def faketime_env(offset: float) -> dict[str, str]:
    try:
        import libfaketime
    except ImportError as error:
        pytest.skip(f"libfaketime is not installed ({error}): pip install -e '.[dev]'")
    _, env = libfaketime.get_reload_information()
    return {**env, "FAKETIME": f"{offset:+g}s", "DONT_FAKE_MONOTONIC": "1"}


@pytest.fixture
def workers() -> Iterator[mwkit.Workers]:
    procs = mwkit.Workers()
    yield procs
    procs.stop_all()


def db_now(url: str) -> float:
    with mwkit.db(url) as engine, engine.connect() as conn:
        now = conn.execute(sa.text("SELECT extract(epoch from clock_timestamp())"))
        return float(now.scalar_one())


def test_a_worker_behind_claims_new_runs_at_once(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    flow = mwkit.write_flow(tmp_path)
    mwkit.enqueue(pg_url, flow, 3)  # due now, by the true clock
    env = {**faketime_env(-SKEW_S), "MW_LEDGER_MODE": "idempotent"}
    started = time.monotonic()
    worker = workers.add(mwkit.spawn_worker(flow, pg_url, tmp_path, "behind", env=env))
    mwkit.wait_for(
        "the worker 90 s behind to finish the runs due now",
        lambda: mwkit.all_finished(pg_url, 3),
        timeout=SKEW_S / 2,
        describe=workers.logs,
    )
    assert mwkit.statuses(pg_url) == Counter({"succeeded": 3})
    assert "off the database's" in worker.output()
    print(
        f"worker 90 s behind: 3 runs due now finished {time.monotonic() - started:.1f}s"
        " after its start"
    )


def test_a_worker_ahead_does_not_run_runs_early(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    from flowloop import Engine

    flow = mwkit.write_flow(tmp_path)
    mwkit.enqueue(pg_url, flow, 0)
    due = db_now(pg_url) + DUE_IN_S
    with Engine(pg_url, workflows=[mwkit.load_flow(flow)]) as engine:
        run_id = engine.start(mwkit.load_flow(flow), {"n": 0}, run_at=due).id
    env = {**faketime_env(+SKEW_S), "MW_LEDGER_MODE": "idempotent"}
    workers.add(mwkit.spawn_worker(flow, pg_url, tmp_path, "ahead", env=env))
    mwkit.wait_for(
        "the worker 90 s ahead to finish the run when it is due",
        lambda: mwkit.all_finished(pg_url, 1),
        timeout=DUE_IN_S + 45,
        describe=workers.logs,
    )
    first = min(row.ended_at for row in mwkit.ledger_rows(pg_url) if row.run_id == run_id)
    assert first >= due, f"the first step ended {due - first:.1f}s before the run was due"
    print(f"worker 90 s ahead: first step ended {first - due:.1f}s after the run was due")
