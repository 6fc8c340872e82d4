"""A live worker on another machine that happens to have this machine's hostname (cloned
VMs, containers given one ``hostname:``) keeps its runs, on PostgreSQL. Before, a worker's
recovery sweep took "this hostname, a pid not running here" for a worker killed on this
host and expired its leases at once: the other machine's run was taken over in the
middle of its step, run a second time beside it (a step declared ``idempotent=False``
would have failed as interrupted), and every later sweep did it again (fault audit).
"Here" is now this machine's boot and pid namespace, named in the worker id."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import mwkit
import pytest

pytestmark = [pytest.mark.postgres, pytest.mark.crash]

LEASE_S = 60.0
"""Far longer than the test: only a wrong "dead here" verdict can free the run."""


@pytest.fixture
def workers() -> Iterator[mwkit.Workers]:
    procs = mwkit.Workers()
    yield procs
    procs.stop_all()


def pid_not_running_here() -> int:
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            pass
        pid += 1


@pytest.mark.parametrize("form", ["tagged", "untagged"])
def test_a_worker_of_a_same_named_host_keeps_its_runs(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers, form: str
) -> None:
    flow = mwkit.write_flow(tmp_path)
    mwkit.enqueue(pg_url, flow, 2, lease=LEASE_S)
    block = tmp_path / "block"
    base = f"{socket.gethostname()}:{pid_not_running_here()}:feedbe"
    other = f"{base}:00000000" if form == "tagged" else base  # (its machine's tag; pre-tag ids)
    env = {"MW_BLOCK_STATE": "s2", "MW_BLOCK_FILE": str(block), "MW_LEDGER_MODE": "idempotent"}
    workers.add(
        mwkit.spawn_worker(
            flow, pg_url, tmp_path, "twin", concurrency=1, lease=LEASE_S, worker_id=other, env=env
        )
    )
    entered = Path(f"{block}.entered")
    mwkit.wait_for("the twin to enter s2", entered.exists, timeout=60, describe=workers.logs)
    held = entered.read_text()

    # A worker here: its first recovery sweep comes before its first claim, so once it has
    # finished the other run, it has judged the twin.
    workers.add(mwkit.spawn_worker(flow, pg_url, tmp_path, "here", lease=LEASE_S))
    mwkit.wait_for(
        "the worker here to finish the run the twin does not hold",
        lambda: mwkit.statuses(pg_url)["succeeded"] >= 1,
        timeout=60,
        describe=workers.logs,
    )
    row = next(r for r in mwkit.run_rows(pg_url) if r.id == held)
    interrupted = [e for e in mwkit.journal_rows(pg_url) if e.kind == "step_interrupted"]
    block.write_text("go")
    assert (row.owner, row.status) == (other, "running"), workers.logs()
    assert interrupted == [], workers.logs()
