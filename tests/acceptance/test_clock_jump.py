"""A worker whose wall clock jumps (an operator's `date -s`, a VM resumed from a snapshot,
NTP stepping a clock far off) keeps judging due times by the database's clock, on
PostgreSQL: before, it added its last measured offset to its own wall clock, so between a
jump of an hour and its next measurement (a recovery sweep, up to 10 s later) it claimed
and ran a run due in 30 minutes. The jump is real: the worker process runs under
libfaketime with its offset read from a file at every call (``FAKETIME_NO_CACHE``), the
monotonic clock left alone; the PostgreSQL server keeps the true time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mwkit
import pytest
import sqlalchemy as sa

from flowloop import Engine

pytestmark = [pytest.mark.postgres, pytest.mark.crash]

JUMP_S = 3600.0
DUE_IN_S = 1800.0


def jumping_clock_env(stamp: Path) -> dict[str, str]:
    try:
        import libfaketime
    except ImportError as error:
        pytest.skip(f"libfaketime is not installed ({error}): pip install -e '.[dev]'")
    _, env = libfaketime.get_reload_information()
    stamp.write_text("+0s\n")
    return {
        **env,
        "FAKETIME_TIMESTAMP_FILE": str(stamp),
        "FAKETIME_NO_CACHE": "1",
        "DONT_FAKE_MONOTONIC": "1",
    }


@pytest.fixture
def workers() -> Iterator[mwkit.Workers]:
    procs = mwkit.Workers()
    yield procs
    procs.stop_all()


def db_now(url: str) -> float:
    with mwkit.db(url) as engine, engine.connect() as conn:
        now = conn.execute(sa.text("SELECT extract(epoch from clock_timestamp())"))
        return float(now.scalar_one())


def test_a_worker_whose_clock_jumps_ahead_runs_nothing_early(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    flow = mwkit.write_flow(tmp_path)
    mwkit.enqueue(pg_url, flow, 0)
    with Engine(pg_url, workflows=[mwkit.load_flow(flow)]) as engine:
        later = engine.start(mwkit.load_flow(flow), {"n": 0}, run_at=db_now(pg_url) + DUE_IN_S)
    stamp = tmp_path / "faketime"
    env = {**jumping_clock_env(stamp), "MW_LEDGER_MODE": "idempotent"}
    worker = workers.add(mwkit.spawn_worker(flow, pg_url, tmp_path, "jumps", env=env))
    mwkit.wait_for("the worker to start", worker.is_up, timeout=60, describe=workers.logs)
    assert "off the database's" not in worker.output()

    stamp.write_text(f"+{JUMP_S:g}s\n")  # the worker's wall clock jumps an hour ahead
    # Its next measurement of the offset (a recovery sweep, at most 10 s away) sees the jump
    # and says so; every claim before it ran with the jumped clock.
    mwkit.wait_for(
        "the worker to measure its clock against the database's again",
        lambda: "off the database's" in worker.output(),
        timeout=60,
        describe=workers.logs,
    )
    started = [e for e in mwkit.journal_rows(pg_url) if e.kind == "step_started"]
    assert started == [], f"a run due in 30 minutes ran: {started}\n{workers.logs()}"
    assert mwkit.statuses(pg_url)["scheduled"] == 1
    assert later.id in {row.id for row in mwkit.run_rows(pg_url)}
