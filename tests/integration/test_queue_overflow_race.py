"""``max_queued`` under starts and claims at once: a drop stops only a run still queued.

A worker's claim takes the oldest queued run, the one ``queue_overflow="drop_oldest"``
picks, and claims do not take the starts' turn (the ``queue:<workflow>`` lock). A start
read the oldest, a claim of it committed, and the start's fenced UPDATE changed nothing,
yet it journaled ``run_stopped`` at seq 2: the claimed run's row said scheduled while its
journal said stopped, every worker's ``step_started`` was refused (claimed again and again,
for ever), and starters got the journal's IntegrityError or a DeadlockDetected (audit).

The race is made on PostgreSQL by a claim held open in a connection of the test's own
(SQLite takes writes one at a time: a start and a claim cannot interleave); the processes
test runs on both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mwkit
import pytest
import sqlalchemy as sa
from polling import wait_until_blocked_by
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow
from flowloop.loader import import_file
from flowloop.store.schema import runs


class Job(BaseModel):
    n: int = 0


def bounded(name: str, limit: int) -> Workflow:
    wf = Workflow(name, context=Job, max_queued=limit, queue_overflow="drop_oldest")

    @wf.step(initial=True, next="done")
    def work(ctx: Job) -> None:
        return None

    wf.final("done")
    return wf


@pytest.fixture
def engine(pg_url: str) -> Iterator[Engine]:
    with Engine(pg_url, clock=FakeClock(), poll_seconds=0.02) as e:
        yield e


def queued(engine: Engine, wf: Workflow, count: int) -> list[str]:
    ids = []
    for n in range(count):
        ids.append(engine.start(wf, Job(n=n)).id)
        engine.clock.advance(1)  # type: ignore[attr-defined]
    return ids


def kinds(engine: Engine, run_id: str) -> list[str]:
    return [event.kind for event in engine.history(run_id)]


def claim_sql(run_ids: list[str]) -> Any:
    """A worker's claim of ``run_ids`` (what claims.claim_statement sets)."""
    return (
        sa.update(runs)
        .where(runs.c.id.in_(run_ids))
        .values(
            owner="claimer",
            lease_epoch=runs.c.lease_epoch + 1,
            lease_expires_at=sa.literal_column("extract(epoch from clock_timestamp())") + 60,
        )
    )


def racing_start(
    engine: Engine,
    pg_url: str,
    wf: Workflow,
    claimed: list[str],
) -> tuple[int, list[object]]:
    """Start a run of ``wf`` while a claim of ``claimed`` is held open, then commit the
    claim; (how many waited on the claim, outcomes)."""
    outcome: list[object] = []

    def starting() -> None:
        try:
            outcome.append(engine.start(wf, Job(n=99)).id)
        except BaseException as error:  # reported by the test's thread
            outcome.append(error)

    others = sa.create_engine(pg_url, poolclass=sa.NullPool)
    try:
        with others.connect() as claiming:
            pid = int(claiming.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
            claiming.execute(claim_sql(claimed))
            thread = threading.Thread(target=starting)
            thread.start()
            # Until the start waits on the claim, or ends without waiting.
            waited = wait_until_blocked_by(pg_url, pid, still_going=thread.is_alive, timeout=10)
            claiming.commit()
            thread.join(timeout=30)
            assert not thread.is_alive()
    finally:
        others.dispose()
    return waited, outcome


def finish_all(engine: Engine, wf: Workflow, claimed: list[str]) -> None:
    """The claimer lets its runs go; every run ends, and its row is its journal's fold."""
    engine.store.release(worker="claimer", run_ids=claimed)
    engine.run_until_idle(idle_horizon=0)
    for run in engine.runs(workflow=wf.name):
        assert run.status in ("succeeded", "stopped"), (run.id, kinds(engine, run.id))
        replay = engine.replay(run.id)
        assert replay.matches, (run.id, replay.differences)


def test_drop_oldest__a_run_claimed_meanwhile_is_passed_by_and_the_next_one_dropped(
    engine: Engine, pg_url: str
) -> None:
    wf = bounded("q-claimed", 2)
    first, second = queued(engine, wf, 2)
    waited, outcome = racing_start(engine, pg_url, wf, [first])
    # The claimed run is the claimer's, and its journal says nothing more.
    assert kinds(engine, first) == ["run_created"]
    assert engine.get(first).status == "scheduled"
    assert waited == 0  # the start passed the claimed run by: it never waited on the claim
    [started] = outcome
    assert isinstance(started, str), started
    assert kinds(engine, second) == ["run_created", "run_stopped"]
    assert engine.get(second).reason == "dropped: max_queued=2"
    assert engine.get(started).status == "scheduled"
    finish_all(engine, wf, [first])
    assert engine.get(first).status == "succeeded"


def test_drop_oldest__with_every_queued_run_being_claimed_waits_and_drops_none(
    engine: Engine, pg_url: str
) -> None:
    """No run to drop but ones being claimed: the start waits for those claims (in a
    transaction of its own, holding no run), finds room once they commit, stops nothing."""
    wf = bounded("q-all-claimed", 2)
    ids = queued(engine, wf, 2)
    waited, outcome = racing_start(engine, pg_url, wf, ids)
    assert [kinds(engine, i) for i in ids] == [["run_created"]] * 2
    assert waited == 1
    [started] = outcome
    assert isinstance(started, str), started
    assert [run.status for run in engine.runs(workflow=wf.name)] == ["scheduled"] * 3
    finish_all(engine, wf, ids)


# -- processes: starters and a worker at once, on both databases --------------------------

FLOW = """\
from pydantic import BaseModel

from flowloop import Workflow


class Job(BaseModel):
    n: int = 0


bounded = Workflow("bounded", context=Job, max_queued=3, queue_overflow="drop_oldest")


@bounded.step(initial=True, next="done")
def work(ctx: Job) -> None:
    return None


bounded.final("done")
"""

STARTER = """\
import json, os, sys, time
from pathlib import Path
from collections import Counter

from flowloop import Engine
from flowloop.loader import import_file

flow, url, go, count = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
wf = import_file(Path(flow)).bounded
outcomes = Counter()
with Engine(url, workflows=[wf]) as engine:
    open(go + f".ready-{os.getpid()}", "w").close()
    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.005)
    for n in range(count):
        try:
            engine.start(wf, {"n": n})
            outcomes["started"] += 1
        except Exception as error:
            outcomes[f"{type(error).__name__}: {str(error)[:200]}"] += 1
print(json.dumps(outcomes))
"""

STARTERS = 4
STARTS = 40


def test_drop_oldest__starter_processes_and_a_worker_end_every_run_as_journaled(
    store_url: str, tmp_path: Path
) -> None:
    flow = tmp_path / "bounded_flow.py"
    flow.write_text(FLOW)
    starter = tmp_path / "starter.py"
    starter.write_text(STARTER)
    go = tmp_path / "go"
    with Engine(store_url) as engine:  # the schema, before any process opens it
        engine.runs()
    workers = mwkit.Workers()
    path = os.pathsep.join(filter(None, [str(mwkit.ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    starters: list[subprocess.Popen[str]] = []
    try:
        worker = workers.add(
            mwkit.spawn_worker(flow, store_url, tmp_path, "w", concurrency=4, grace=5)
        )
        starters = [
            subprocess.Popen(
                [sys.executable, str(starter), str(flow), store_url, str(go), str(STARTS)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
            )
            for _ in range(STARTERS)
        ]
        mwkit.wait_for(
            "the starters to be ready",
            lambda: (
                len(list(tmp_path.glob("go.ready-*"))) == STARTERS
                or any(p.poll() is not None for p in starters)
            ),
            timeout=30,
        )
        mwkit.wait_for("the worker to start", worker.is_up, timeout=30, describe=workers.logs)
        go.touch()  # all at once, the worker claiming
        outcomes: Counter[str] = Counter()
        for proc in starters:
            out, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, out
            outcomes.update(json.loads(out.strip().splitlines()[-1]))
        # Every start made a run (dropping another when the queue was full): no raw
        # database error, no QueueFull (there is always a run of its own to drop).
        assert outcomes == Counter({"started": STARTERS * STARTS}), outcomes
        total = STARTERS * STARTS
        mwkit.wait_for(
            "every run to end",
            lambda: mwkit.all_finished(store_url, total),
            timeout=30,
            describe=lambda: f"{mwkit.statuses(store_url)}\n{workers.logs()}",
        )
        assert worker.stop() == 0, workers.logs()
    finally:
        for proc in starters:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        workers.stop_all()
    counts = mwkit.statuses(store_url)
    assert sum(counts.values()) == total and set(counts) <= {"succeeded", "stopped"}, counts
    # (How many were dropped depends on how fast the worker claims against the starters:
    # the deterministic tests above drop one; this one holds the invariants whatever.)
    with Engine(store_url, workflows=[import_file(flow).bounded]) as engine:
        for run in engine.runs(workflow="bounded", limit=total):
            history = kinds(engine, run.id)
            if run.status == "stopped":  # dropped before it began, and nothing after
                assert history == ["run_created", "run_stopped"], (run.id, history)
            else:
                assert "run_stopped" not in history, (run.id, history)
            replay = engine.replay(run.id)
            assert replay.matches, (run.id, replay.differences)
