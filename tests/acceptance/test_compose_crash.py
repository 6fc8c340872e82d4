"""Composition under SIGKILL: a saga with 3 compensations, a call, and a map of 200
children with max_parallel=8, driven by forked workers killed at random instants, then
resumed by one survivor. Promised: no child created twice, the join counts exact, no
compensation run again after its success was committed, every parent's final context
equal to an uninterrupted run's.

The random seed is printed on failure; set FLOWLOOP_CRASH_SEED to replay a schedule.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import composekit
import crashkit
import pytest
from composekit import Fan, SagaCtx, Work

from flowloop import Engine, FakeClock
from flowloop import journal as j
from flowloop.store.joins import JoinStoreMixin

pytestmark = pytest.mark.crash

SAGAS = 3
MAX_KILL_DELAY_S = 0.08
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def zygote() -> Iterator[composekit.Zygote]:
    z = composekit.Zygote()
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.db"
    composekit.create_ledger(path)
    monkeypatch.setattr(composekit, "LEDGER", path)
    return path


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("FLOWLOOP_CRASH_SEED") or time.time_ns() % 1_000_000)


def start_all(engine: Engine) -> dict[str, list[str]]:
    saga, caller, mapper = composekit.all_workflows()
    return {
        "saga": [engine.start(saga, SagaCtx(n=n)).id for n in range(SAGAS)],
        "call": [engine.start(caller, Work(n=7)).id],
        "map": [engine.start(mapper, Fan(count=composekit.CHILDREN)).id],
    }


def reference(tmp_path: Path) -> dict[str, list[object]]:
    with Engine(str(tmp_path / "reference.db"), clock=FakeClock()) as engine:
        for wf in composekit.all_workflows():
            engine.register(wf)
        ids = start_all(engine)
        engine.run_until_idle()
        return {kind: [engine.get(i).context for i in run_ids] for kind, run_ids in ids.items()}


def kill_repeatedly(
    zygote: composekit.Zygote,
    url: str,
    ledger: Path,
    engine: Engine,
    *,
    kills: int,
    rng: random.Random,
) -> int:
    killed = 0
    for _ in range(kills * 3):
        if killed >= kills or not engine.runs(status=["scheduled", "running", "retrying"], limit=1):
            break
        pid = zygote.fork(url, ledger)
        deadline = time.monotonic() + DEADLINE_S
        while not composekit.has_worked(ledger, pid) and crashkit.alive(pid):
            assert time.monotonic() < deadline, f"worker {pid} did nothing in {DEADLINE_S}s"
            time.sleep(0.002)
        time.sleep(rng.uniform(0, MAX_KILL_DELAY_S))
        if crashkit.kill(pid):
            killed += 1
        crashkit.wait_gone(pid)
    return killed


def verify(
    engine: Engine, ids: dict[str, list[str]], ledger: Path, want: dict[str, list[object]]
) -> Counter[str]:
    store = engine.store
    assert isinstance(store, JoinStoreMixin)
    assert engine.runs(status=["running", "scheduled", "retrying"], limit=10) == []
    kinds: Counter[str] = Counter()
    for kind, run_ids in ids.items():
        for run_id, context in zip(run_ids, want[kind], strict=True):
            info = engine.get(run_id)
            assert info.status == "succeeded", (kind, run_id, info.status, info.reason, info.error)
            assert info.context == context, (kind, run_id)
            assert engine.replay(run_id).matches, run_id
            for event in engine.history(run_id):
                kinds[event.kind] += 1
    # The call: one child. The map: 200 children, one per index, the join exact.
    [call_child] = store.children_of(ids["call"][0])
    assert call_child.record.status == "succeeded"
    children = store.children_of(ids["map"][0])
    indexes = sorted(row.index for row in store.join_results(children[0].record.join or ""))
    assert indexes == list(range(composekit.CHILDREN))
    assert len({c.id for c in children}) == composekit.CHILDREN
    assert len(engine.runs(workflow="crash_item", limit=10_000)) == composekit.CHILDREN
    assert len(engine.runs(workflow="crash_callee", limit=10_000)) == 1
    join = store.get_join(children[0].record.join or "")
    assert join is not None
    assert (join.total, join.created, join.succeeded, join.failed, join.stopped) == (
        composekit.CHILDREN,
        composekit.CHILDREN,
        composekit.CHILDREN,
        0,
        0,
    )
    for child in children:
        for event in engine.history(child.id):
            kinds[event.kind] += 1
    # Compensations: never started again once their success is committed; every ledger
    # execution follows its own committed compensation_started (one per attempt).
    executions: Counter[tuple[str, str, int]] = Counter()
    for kind, run_id, state, attempt, _pid in composekit.ledger_rows(ledger):
        if kind == "undo":
            executions[(run_id, state, attempt)] += 1
    assert executions and max(executions.values()) == 1
    for run_id in ids["saga"]:
        succeeded: dict[str, int] = {}
        started: set[tuple[str, int]] = set()
        for event in engine.history(run_id):
            if event.kind == j.COMPENSATION_STARTED:
                assert event.state not in succeeded, (run_id, event.seq)
                started.add((str(event.state), event.attempt))
            elif event.kind == j.COMPENSATION_SUCCEEDED:
                succeeded[str(event.state)] = event.attempt
        assert sorted(succeeded) == ["book_a", "book_b", "book_c"]
        for (rid, state, attempt), _ in executions.items():
            if rid == run_id:
                assert (state, attempt) in started, (run_id, state, attempt)
                assert attempt <= succeeded[state], (run_id, state, attempt)
    return kinds


def crash_suite(
    url: str, tmp_path: Path, zygote: composekit.Zygote, ledger: Path, *, kills: int, seed: int
) -> None:
    rng = random.Random(seed)
    want = reference(tmp_path)
    with Engine(url, workflows=composekit.all_workflows()) as engine:
        ids = start_all(engine)
        killed = kill_repeatedly(zygote, url, ledger, engine, kills=kills, rng=rng)
        assert killed >= 1, f"seed {seed}: no kill landed"
    with Engine(url, workflows=composekit.all_workflows()) as survivor:
        survivor.resume()
        kinds = verify(survivor, ids, ledger, want)
    print(f"seed {seed}: {killed} kills; {dict(kinds)}")
    assert kinds[j.STEP_INTERRUPTED] > 0, f"seed {seed}: no step was cut off: {kinds}"


def test_compose_crash__sigkill_at_random_instants_then_resume_is_exact(
    tmp_path: Path, zygote: composekit.Zygote, ledger: Path, seed: int, sqlite_url: str
) -> None:
    try:
        crash_suite(sqlite_url, tmp_path, zygote, ledger, kills=8, seed=seed)
    except BaseException:
        print(f"FLOWLOOP_CRASH_SEED={seed}")
        raise


def test_compose_crash__sigkill_on_postgres_then_resume_is_exact(
    tmp_path: Path, zygote: composekit.Zygote, ledger: Path, seed: int, pg_url: str
) -> None:
    try:
        crash_suite(pg_url, tmp_path, zygote, ledger, kills=4, seed=seed)
    except BaseException:
        print(f"FLOWLOOP_CRASH_SEED={seed}")
        raise


WORKLOADS = {
    "saga": lambda: SagaCtx(n=1),
    "call": lambda: Work(n=4),
    "map": lambda: Fan(count=6),
}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_compose_crash__killed_at_every_commit_then_resume_is_exact(
    tmp_path: Path, zygote: composekit.Zygote, ledger: Path, workload: str
) -> None:
    """For N = 1, 2, ...: a worker dies right after its N-th commit (claims, fan-out,
    children, join, compensations), a survivor resumes; until a worker finishes alone."""
    saga, caller, mapper = composekit.all_workflows()
    wf = {"saga": saga, "call": caller, "map": mapper}[workload]
    with Engine(str(tmp_path / "reference.db"), clock=FakeClock(), workflows=[wf]) as ref:
        want = ref.get(ref.start(wf, WORKLOADS[workload]()).id).id
        ref.run_until_idle()
        reference_context = ref.get(want).context
    cut = 0
    for n in range(1, 200):
        url = f"sqlite:///{tmp_path / f'every_{n}.db'}"
        with Engine(url, workflows=composekit.all_workflows()) as engine:
            run_id = engine.start(wf, WORKLOADS[workload]()).id
        composekit.create_ledger(ledger)
        pid = zygote.fork_exiting(url, ledger, n)
        line = zygote.expect("", timeout=30, pid=None)
        while not (line.startswith(f"exiting {pid}") or line.startswith(f"finished {pid}")):
            line = zygote.expect("", timeout=30)
        crashkit.wait_gone(pid)
        with Engine(url, workflows=composekit.all_workflows()) as survivor:
            survivor.resume()
            info = survivor.get(run_id)
            assert info.status == "succeeded", (workload, n, info.status, info.reason)
            assert info.context == reference_context, (workload, n)
            assert survivor.replay(run_id).matches, (workload, n)
            store = survivor.store
            assert isinstance(store, JoinStoreMixin)
            kids = store.children_of(run_id)
            assert len(kids) == {"saga": 0, "call": 1, "map": 6}[workload], (workload, n)
            if kids:
                join = store.get_join(kids[0].record.join or "")
                assert join is not None and join.succeeded == join.total == len(kids)
            succeeded: set[str] = set()
            for event in survivor.history(run_id):
                if event.kind == j.COMPENSATION_STARTED:
                    assert event.state not in succeeded, (workload, n, event.seq)
                elif event.kind == j.COMPENSATION_SUCCEEDED:
                    succeeded.add(str(event.state))
        if line.startswith(f"finished {pid}"):
            break
        cut += 1
    assert cut >= 3, f"{workload}: only {cut} commit boundaries cut"
    print(f"{workload}: killed at each of {cut} commits, then finished uninterrupted")
