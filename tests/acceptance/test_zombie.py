"""Workers that freeze or die while holding leases, on PostgreSQL.

* A zombie: worker A is frozen (SIGSTOP) in the middle of a step past its lease; worker B
  takes the run over and finishes it; A, resumed (SIGCONT), is refused by the fence and
  writes nothing more — the journal stays B's.
* SIGKILL of a worker holding leases: its runs are finished by another worker — at once
  when the dead worker was on this host (its pid is gone), after the lease otherwise (a
  worker id naming another host).
* The fence itself: an owner's write after its lease ran out changes nothing, even when no
  one has taken the run over yet.
"""

from __future__ import annotations

import itertools
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import mwkit
import pytest
import storekit

from flowloop import Engine
from flowloop.store import Fence, SQLStore

pytestmark = pytest.mark.postgres

LEASE_S = 2.0


@pytest.fixture
def workers() -> Iterator[mwkit.Workers]:
    procs = mwkit.Workers()
    yield procs
    procs.stop_all()


def owner_of(url: str, run_id: str) -> tuple[str | None, int]:
    row = next(r for r in mwkit.run_rows(url) if r.id == run_id)
    return row.owner, row.lease_epoch


def test_frozen_worker_is_fenced_off_after_takeover(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    flow = mwkit.write_flow(tmp_path)
    (run_id,) = mwkit.enqueue(pg_url, flow, 1)
    release = tmp_path / "release"
    a = workers.add(
        mwkit.spawn_worker(
            flow,
            pg_url,
            tmp_path,
            "a",
            concurrency=2,
            lease=LEASE_S,
            env={
                "MW_BLOCK_STATE": "s3",
                "MW_BLOCK_FILE": str(release),
                "MW_LEDGER_MODE": "idempotent",
            },
        )
    )
    entered = Path(f"{release}.entered")
    mwkit.wait_for(
        "worker a to block in step s3", entered.exists, timeout=30, describe=workers.logs
    )
    assert entered.read_text() == run_id
    a_id, a_epoch = owner_of(pg_url, run_id)
    assert a_id is not None and a_id.split(":")[1] == str(a.pid)
    a_seq = max(row.seq for row in mwkit.journal_rows(pg_url))  # a's step_started of s3

    # b is up and idle before a freezes: the takeover is b's periodic recovery, not its start-up.
    b = workers.add(
        mwkit.spawn_worker(
            flow,
            pg_url,
            tmp_path,
            "b",
            concurrency=2,
            lease=LEASE_S,
            env={"MW_LEDGER_MODE": "idempotent"},
        )
    )
    mwkit.wait_for("worker b to start", b.is_up, timeout=30, describe=workers.logs)
    assert owner_of(pg_url, run_id) == (a_id, a_epoch), "a's heartbeat keeps its lease"
    a.signal(signal.SIGSTOP)
    frozen_at = time.time()
    mwkit.wait_for(
        "b to finish the run",
        lambda: mwkit.all_finished(pg_url, 1),
        timeout=30,
        describe=workers.logs,
    )
    assert mwkit.statuses(pg_url) == Counter({"succeeded": 1})

    journal = mwkit.journal_rows(pg_url)
    taken = journal[a_seq]  # the event after a's last one
    assert (taken.kind, taken.state, taken.seq) == ("step_interrupted", "s3", a_seq + 1)
    assert taken.worker != a_id and taken.at >= frozen_at + LEASE_S / 3
    assert {row.worker for row in journal[a_seq:]} == {taken.worker}, "b wrote the rest"

    # a wakes up with its step about to finish: the fence refuses it, and it stops there.
    before = (journal, mwkit.run_rows(pg_url))
    release.write_text("go")
    a.signal(signal.SIGCONT)
    mwkit.wait_for(
        "a to notice it lost the run",
        lambda: any(m in a.output() for m in ("lost its lease", "write refused", "self-fencing")),
        timeout=30,
        describe=workers.logs,
    )
    assert a.stop() == 0, workers.logs()
    assert (mwkit.journal_rows(pg_url), mwkit.run_rows(pg_url)) == before
    assert all(row.seq <= a_seq for row in mwkit.journal_rows(pg_url) if row.worker == a_id)

    # What a would have written (s3's outcome, after its own view of the journal), written
    # with a's fence now: refused, zero rows — both as of a's epoch and as of any claim.
    with Engine(pg_url, workflows=[mwkit.load_flow(flow)]) as engine:
        assert engine.replay(run_id).matches
        a_view = engine.replay(run_id, at=a_seq).record
        store = engine.store
        assert isinstance(store, SQLStore)
        late = storekit.succeed_step(a_view, Fence(a_id, a_epoch), next_state="s4", release=False)
        final_row = store.get_run(run_id)
        assert store.write([late]) == [False]
        assert store.get_run(run_id) == final_row
    assert mwkit.succeeded_once_per_visit(mwkit.journal_rows(pg_url)) == []


def test_owner_write_after_its_lease_ran_out_is_refused(pg_url: str) -> None:
    """No takeover needed: the lease is judged on the database's clock at the write."""
    store = SQLStore(pg_url)
    try:
        stored, _ = store.create_run(storekit.new_run())
        (claimed,) = store.claim(
            worker="a", now=time.time(), limit=1, lease_seconds=0.3, run_ids=[stored.id]
        )
        assert claimed.lease_expires_at is not None
        mwkit.wait_for(
            "the lease to run out by the database clock",
            lambda: store.db_now() > claimed.lease_expires_at,
            timeout=10,
        )  # type: ignore[operator]
        assert store.write([storekit.start_step(claimed, "a")]) == [False]
        assert store.renew(worker="a", run_ids=[stored.id], lease_seconds=30) == set()
        after = store.get_run(stored.id)
        assert after is not None and after.record == claimed.record
    finally:
        store.close()


def _kill_while_holding(
    url: str,
    tmp_path: Path,
    workers: mwkit.Workers,
    *,
    lease: float,
    victim_id: str | None,
) -> tuple[set[str], str, float]:
    """Two workers share 24 slow runs; the victim is SIGKILLed while it holds 8 of them
    mid-step, and the survivor (already running: its periodic recovery, not its start-up,
    must notice) finishes everything. Returns the runs the victim left ``running``, its
    worker id and when it died."""
    flow = mwkit.write_flow(tmp_path)
    run_ids = mwkit.enqueue(url, flow, 24)
    env = {"MW_STEP_SLEEP": "0.2", "MW_LEDGER_MODE": "idempotent"}
    victim = workers.add(
        mwkit.spawn_worker(
            flow, url, tmp_path, "victim", concurrency=8, lease=lease, worker_id=victim_id, env=env
        )
    )
    mwkit.wait_for(
        "the victim to take 8 runs",
        lambda: len(held(url, victim, victim_id)) == 8,
        timeout=30,
        describe=workers.logs,
    )
    survivor = workers.add(
        mwkit.spawn_worker(flow, url, tmp_path, "survivor", concurrency=8, lease=lease, env=env)
    )
    mwkit.wait_for("the survivor to start", survivor.is_up, timeout=30, describe=workers.logs)
    mwkit.wait_for(
        "the victim to hold 8 running runs",
        lambda: len(held(url, victim, victim_id, status="running")) == 8,
        timeout=30,
        describe=workers.logs,
    )
    owner = victim_id or f"{socket.gethostname()}:{victim.pid}:"
    owner = next(r.owner for r in mwkit.run_rows(url) if (r.owner or "").startswith(owner))
    victim.kill()
    killed_at = time.time()
    mwkit.wait_for(
        "the survivor to finish every run",
        lambda: mwkit.all_finished(url, 24),
        timeout=60,
        describe=lambda: f"{mwkit.statuses(url)}\n{workers.logs()}",
    )
    assert mwkit.statuses(url) == Counter({"succeeded": 24}), workers.logs()
    journal = mwkit.journal_rows(url)
    assert mwkit.succeeded_once_per_visit(journal) == []
    with Engine(url, workflows=[mwkit.load_flow(flow)]) as engine:
        for run_id in run_ids:
            assert engine.replay(run_id).matches, run_id
    # Each step the victim left without an outcome was settled by the survivor's recovery
    # (step_interrupted, then run again), and nothing else was interrupted.
    left_running: set[str] = set()
    for before, after in itertools.pairwise(journal):
        if before.run_id != after.run_id or before.kind != "step_started":
            continue
        if before.worker == owner and after.worker != owner:
            assert (after.kind, after.state) == ("step_interrupted", before.state), after
            left_running.add(after.run_id)
        else:
            assert after.kind != "step_interrupted", (before, after, owner)
    assert left_running, "the victim died holding no step"
    return left_running, owner, killed_at


def held(
    url: str, victim: mwkit.WorkerProc, victim_id: str | None, status: str | None = None
) -> set[str]:
    """Runs the victim owns (by its worker id, or by the host and pid of its CLI worker id)."""
    prefix = victim_id or f"{socket.gethostname()}:{victim.pid}:"
    return {
        r.id
        for r in mwkit.run_rows(url)
        if (r.owner or "").startswith(prefix) and (status is None or r.status == status)
    }


def test_sigkill_on_this_host_runs_taken_over_without_waiting_for_the_lease(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    lease = 60.0  # far longer than the test: only the dead-pid check can free the runs
    _, victim, killed_at = _kill_while_holding(
        pg_url, tmp_path, workers, lease=lease, victim_id=None
    )
    interrupted = [r for r in mwkit.journal_rows(pg_url) if r.kind == "step_interrupted"]
    assert all(r.worker != victim and r.at >= killed_at for r in interrupted)
    assert time.time() - killed_at < lease / 2


def test_sigkill_on_another_host_runs_taken_over_after_the_lease(
    pg_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    """A worker id naming another host: its pid means nothing here, so the runs wait for
    the lease to run out by the database's clock (renewed every lease/3 until the kill)."""
    lease = 3.0
    _, victim, killed_at = _kill_while_holding(
        pg_url, tmp_path, workers, lease=lease, victim_id="elsewhere.example:4242:feedbeef"
    )
    assert victim == "elsewhere.example:4242:feedbeef"
    interrupted = [r for r in mwkit.journal_rows(pg_url) if r.kind == "step_interrupted"]
    earliest = min(r.at for r in interrupted)
    assert earliest >= killed_at + lease * 2 / 3 - 0.25, earliest - killed_at
