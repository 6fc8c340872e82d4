"""Composition under SIGKILL: a saga with 3 compensations, a call, and a map of 200
children with max_parallel=8, driven by forked workers killed at random instants, then
resumed by one survivor. Promised: no child created twice, the join counts exact, no
compensation run again after its success was committed, every parent's final context
equal to an uninterrupted run's.

The random seed is printed on failure; set FLOWLOOP_CRASH_SEED to replay a schedule.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import composekit
import crashkit
import pytest
from composekit import Fan, SagaCtx, Work
from crashkit import Zygote

from flowloop import Engine
from flowloop import journal as j
from flowloop.store.joins import JoinStoreMixin

pytestmark = pytest.mark.crash

SAGAS = 3
MAX_KILL_DELAY_S = 0.08
UNFINISHED = ["scheduled", "running", "retrying"]


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    yield from crashkit.zygote_process("composekit")


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.db"
    crashkit.create_ledger(path)
    monkeypatch.setattr(crashkit, "LEDGER", path)  # the survivor's resume records too
    return path


def start_all(engine: Engine) -> dict[str, list[str]]:
    saga, caller, mapper = composekit.all_workflows()
    return {
        "saga": [engine.start(saga, SagaCtx(n=n)).id for n in range(SAGAS)],
        "call": [engine.start(caller, Work(n=7)).id],
        "map": [engine.start(mapper, Fan(count=composekit.CHILDREN)).id],
    }


def flat(ids: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(kind, run id) of every run ``start_all`` started, in its order."""
    return [(kind, run_id) for kind, run_ids in ids.items() for run_id in run_ids]


def reference(tmp_path: Path) -> list[object]:
    """The final contexts of uninterrupted runs, in ``flat`` order."""
    return list(
        crashkit.final_contexts(
            tmp_path / "reference.db",
            composekit.all_workflows(),
            lambda engine: [run_id for _, run_id in flat(start_all(engine))],
        )
    )


def verify(
    engine: Engine, ids: dict[str, list[str]], ledger: Path, want: list[object]
) -> Counter[str]:
    store = engine.store
    assert isinstance(store, JoinStoreMixin)
    assert engine.runs(status=UNFINISHED, limit=10) == []
    kinds: Counter[str] = Counter()
    for (kind, run_id), context in zip(flat(ids), want, strict=True):
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
    for done in crashkit.ledger_rows(ledger):
        if done.kind == "undo":
            executions[(done.run_id, done.state, done.attempt)] += 1
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


def crash_suite(url: str, tmp_path: Path, zygote: Zygote, ledger: Path, *, kills: int) -> None:
    seed = crashkit.seed()
    with crashkit.replayable(seed):
        want = reference(tmp_path)
        with Engine(url, workflows=composekit.all_workflows()) as engine:
            ids = start_all(engine)
            killed = crashkit.kill_repeatedly(
                zygote,
                {"db": url, "ledger": str(ledger)},
                kills=kills,
                rng=random.Random(seed),
                max_delay=MAX_KILL_DELAY_S,
                working=lambda pid: crashkit.has_worked(ledger, pid),
                more=lambda: bool(
                    engine.runs(status=["scheduled", "running", "retrying"], limit=1)
                ),
            )
            assert killed >= 1, "no kill landed"
        with Engine(url, workflows=composekit.all_workflows()) as survivor:
            survivor.resume()
            kinds = verify(survivor, ids, ledger, want)
        print(f"seed {seed}: {killed} kills; {dict(kinds)}")
        assert kinds[j.STEP_INTERRUPTED] > 0, f"no step was cut off: {kinds}"


def test_compose_crash__sigkill_at_random_instants_then_resume_is_exact(
    tmp_path: Path, zygote: Zygote, ledger: Path, sqlite_url: str
) -> None:
    crash_suite(sqlite_url, tmp_path, zygote, ledger, kills=8)


def test_compose_crash__sigkill_on_postgres_then_resume_is_exact(
    tmp_path: Path, zygote: Zygote, ledger: Path, pg_url: str
) -> None:
    crash_suite(pg_url, tmp_path, zygote, ledger, kills=4)


WORKLOADS = {
    "saga": lambda: SagaCtx(n=1),
    "call": lambda: Work(n=4),
    "map": lambda: Fan(count=6),
}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_compose_crash__killed_at_every_commit_then_resume_is_exact(
    tmp_path: Path, zygote: Zygote, ledger: Path, workload: str
) -> None:
    """For N = 1, 2, ...: a worker dies right after its N-th commit (claims, fan-out,
    children, join, compensations), a survivor resumes; until a worker finishes alone."""
    saga, caller, mapper = composekit.all_workflows()
    wf = {"saga": saga, "call": caller, "map": mapper}[workload]
    [reference_context] = crashkit.final_contexts(
        tmp_path / "reference.db", [wf], lambda ref: [ref.start(wf, WORKLOADS[workload]()).id]
    )
    cut = 0
    for n in range(1, 200):
        url = f"sqlite:///{tmp_path / f'every_{n}.db'}"
        with Engine(url, workflows=composekit.all_workflows()) as engine:
            run_id = engine.start(wf, WORKLOADS[workload]()).id
        crashkit.create_ledger(ledger)
        pid = zygote.fork(db=url, ledger=str(ledger), exit_after=n)
        code = zygote.exit_code(pid)
        assert code in (0, crashkit.EXITED_AFTER_COMMITS), (workload, n, code)
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
        if code == 0:  # finished without reaching its N-th commit
            break
        cut += 1
    assert cut >= 3, f"{workload}: only {cut} commit boundaries cut"
    print(f"{workload}: killed at each of {cut} commits, then finished uninterrupted")


DEADLINE_SCRIPT = """
import os
import sys
from datetime import timedelta

from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow
from flowloop import journal as j


class One(BaseModel):
    n: int = 0


child = Workflow("late_child", context=One)
child.wait("w", on={"go": "done"}, initial=True)
child.final("done")
parent = Workflow("late_parent", context=One, deadline=timedelta(hours=1), on_deadline="late")
parent.call("call", child=child, context=lambda ctx: One(), on={"succeeded": "done"}, initial=True)
parent.final("done", "late")

url, mode = sys.argv[1], sys.argv[2]
clock = FakeClock(1_800_000_000.0, auto_advance=False)
with Engine(url, clock=clock, workflows=[child, parent]) as engine:
    if mode == "start":
        engine.start(parent, One())
        engine.run_until_idle(idle_horizon=0)
    elif mode == "die after the deadline's entry":
        clock.advance(3605)
        write = engine.store.write

        def then_die(boundaries):
            applied = write(boundaries)
            if any(e.kind == j.DEADLINE_PASSED for b in boundaries for e in b.events):
                os._exit(9)  # as a SIGKILL the instant the parent's move is committed
            return applied

        engine.store.write = then_die
        engine.run_until_idle(idle_horizon=0)
    else:
        clock.advance(3610)
        engine.resume()
    for run in engine.runs():
        print(run.workflow, run.status, run.state)
"""


def test_a_crash_after_a_deadline_moved_the_parent_leaves_no_child_waiting(
    tmp_path: Path,
) -> None:
    """A call parent whose deadline passed journaled its move, then stopped its children
    in a separate step: a worker killed in between left the child waiting for ever (its
    parent ended, nothing recovers a finished parent's children). The children are
    stopped first now; the parent's move after them (a crash between: its next claim
    moves it)."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(DEADLINE_SCRIPT)
    url = f"sqlite:///{tmp_path / 'late.db'}"

    def step(mode: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), url, mode],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    assert step("start").returncode == 0
    assert step("die after the deadline's entry").returncode == 9
    resumed = step("resume")
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(resumed.stdout.splitlines()) == [
        "late_child stopped w",
        "late_parent succeeded late",
    ]
