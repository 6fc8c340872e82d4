"""Real processes, really killed: SIGKILL at random instants, then resume.

Workers are forked from a zygote (tests/crashkit.py) and killed with SIGKILL while they
drive runs of a 20-step workflow whose steps write to a side-effect ledger. After all the
kills one resume finishes everything, and the journal, the rows and the ledger must show
exactly-once progress: every run succeeded, each state succeeded once per visit, the final
context equals an uninterrupted run's, and every execution the ledger saw was preceded by
its committed ``step_started``.

The random seed is printed on failure; set FLOWLOOP_CRASH_SEED to replay a schedule.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crashkit
import pytest
from crashkit import CrashCtx, Zygote

from flowloop import Engine, FakeClock
from flowloop import journal as j

pytestmark = pytest.mark.crash

RUNS_PER_BATCH = 6
MAX_KILL_DELAY_S = 0.06
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    yield from crashkit.zygote_process()


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.db"
    crashkit.create_ledger(path)
    monkeypatch.setattr(crashkit, "LEDGER", path)  # the test's own resume records too
    return path


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("FLOWLOOP_CRASH_SEED") or time.time_ns() % 1_000_000)


def reference_contexts(tmp_path: Path, count: int) -> dict[int, CrashCtx]:
    """Final contexts of uninterrupted runs."""
    wf = crashkit.crash20()
    found: dict[int, CrashCtx] = {}
    with Engine(str(tmp_path / "reference.db"), clock=FakeClock(), workflows=[wf]) as engine:
        for n in range(count):
            info = engine.run(wf, CrashCtx(n=n))
            assert info.status == "succeeded" and isinstance(info.context, CrashCtx)
            found[n] = info.context
    return found


def expected_path() -> list[tuple[str, int]]:
    states = crashkit.STATES
    lap = states[states.index(crashkit.LOOP_TO) : states.index(crashkit.LOOP_FROM) + 1]
    first = states[: states.index(crashkit.LOOP_FROM) + 1]
    rest = states[states.index(crashkit.LOOP_FROM) + 1 :]
    return [(s, 1) for s in first] + [(s, 2) for s in lap] + [(s, 1) for s in rest]


def unfinished(engine: Engine) -> int:
    return len(
        engine.runs(workflow="crash20", status=["scheduled", "running", "retrying"], limit=10_000)
    )


def kill_repeatedly(
    engine: Engine, zygote: Zygote, url: str, ledger: Path, *, kills: int, rng: random.Random
) -> tuple[list[str], int]:
    """Start batches of runs; fork a worker, SIGKILL it at a random instant; repeat until
    ``kills`` workers were killed. Returns the run ids and how many kills there were."""
    wf = engine.workflow("crash20")
    ids: list[str] = []
    killed = 0
    for _ in range(kills * 5):  # bounded: most rounds end in a kill
        if killed >= kills:
            break
        if unfinished(engine) == 0:
            ids += [engine.start(wf, CrashCtx(n=n)).id for n in range(RUNS_PER_BATCH)]
        pid = zygote.fork(url, ledger)
        if rng.random() < 0.8:  # most kills while it works, some while it starts up
            wait_until_working(ledger, pid)
        time.sleep(rng.uniform(0, MAX_KILL_DELAY_S))
        if crashkit.kill(pid):
            killed += 1
        crashkit.wait_gone(pid)
    return ids, killed


def wait_until_working(ledger: Path, pid: int) -> None:
    """Until worker ``pid`` has run a step (or is gone): the random instant comes after."""
    deadline = time.monotonic() + DEADLINE_S
    while not crashkit.has_worked(ledger, pid) and crashkit.alive(pid):
        if time.monotonic() > deadline:
            raise AssertionError(f"worker {pid} ran no step within {DEADLINE_S}s")
        time.sleep(0.002)


def verify_exactly_once(
    engine: Engine, ids: list[str], ledger: Path, reference: dict[int, CrashCtx]
) -> Counter[str]:
    """Everything the suite promises after crashes; returns counts of journal kinds."""
    assert engine.runs(status="running", limit=10_000) == []
    kinds: Counter[str] = Counter()
    started_by_run: dict[str, set[tuple[str, int, int, int]]] = {}
    path = expected_path()
    for run_id in ids:
        info = engine.get(run_id)
        assert (info.status, info.state, info.owner) == ("succeeded", "done", None), run_id
        assert engine.replay(run_id).matches, run_id
        assert isinstance(info.context, CrashCtx)
        assert info.context == reference[info.context.n], run_id
        visits: dict[str, int] = {}
        succeeded: list[tuple[str, int]] = []
        started: set[tuple[str, int, int, int]] = set()
        for event in engine.history(run_id):
            kinds[event.kind] += 1
            assert event.state is not None or event.kind == j.RUN_RELEASED
            if event.kind == j.RUN_CREATED:
                visits[str(event.state)] = 1
            elif event.kind == j.STEP_STARTED:
                started.add((str(event.state), visits[str(event.state)], event.attempt, event.seq))
            elif event.kind == j.STEP_SUCCEEDED:
                succeeded.append((str(event.state), visits[str(event.state)]))
                nxt = str(event.next_state)
                visits[nxt] = visits.get(nxt, 0) + 1
        assert succeeded == path, run_id  # each state succeeded exactly once per visit
        started_by_run[run_id] = started
    executions: Counter[tuple[Any, ...]] = Counter()
    for run_id, state, visit, attempt, seq, key, _pid in crashkit.ledger_rows(ledger):
        if run_id not in started_by_run:
            continue
        # Every execution follows its own committed step_started, once: a step whose
        # success was committed never ran again.
        assert (state, visit, attempt, seq) in started_by_run[run_id], (run_id, state, seq)
        assert key == f"{run_id}:{state}:{visit}"
        executions[(run_id, state, visit, attempt)] += 1
    assert max(executions.values()) == 1
    visited = {(run_id, s, v) for run_id, s, v, _ in executions}
    assert len(visited) == len(ids) * crashkit.VISITS_PER_RUN
    return kinds


def crash_suite(
    url: str, tmp_path: Path, zygote: Zygote, ledger: Path, *, kills: int, seed: int
) -> None:
    rng = random.Random(seed)
    reference = reference_contexts(tmp_path, RUNS_PER_BATCH)
    with Engine(url, workflows=crashkit.all_workflows()) as engine:
        ids, killed = kill_repeatedly(engine, zygote, url, ledger, kills=kills, rng=rng)
        assert killed >= kills, f"seed {seed}: only {killed} kills"
    with Engine(url, workflows=crashkit.all_workflows()) as survivor:
        survivor.resume()
        kinds = verify_exactly_once(survivor, ids, ledger, reference)
    # The kills really cut steps off (else this suite proves little).
    assert kinds[j.STEP_INTERRUPTED] > 0, f"seed {seed}: {kinds}"


def test_crash__sigkill_at_random_instants_then_resume_is_exact(
    tmp_path: Path, zygote: Zygote, ledger: Path, seed: int, request: pytest.FixtureRequest
) -> None:
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    try:
        crash_suite(url, tmp_path, zygote, ledger, kills=50, seed=seed)
    except Exception as error:
        raise AssertionError(f"FLOWLOOP_CRASH_SEED={seed}: {error}") from error


def test_crash__sigkill_on_postgres_then_resume_is_exact(
    tmp_path: Path, zygote: Zygote, ledger: Path, seed: int, pg_url: str
) -> None:
    try:
        crash_suite(pg_url, tmp_path, zygote, ledger, kills=10, seed=seed)
    except Exception as error:
        raise AssertionError(f"FLOWLOOP_CRASH_SEED={seed}: {error}") from error


def _wait_for_ledger(ledger: Path, run_id: str, state: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not any(r[0] == run_id and r[1] == state for r in crashkit.ledger_rows(ledger)):
        if time.monotonic() > deadline:
            raise AssertionError(f"{state} of {run_id} never ran")
        time.sleep(0.01)


def test_crash__non_idempotent_step_interrupted_fails_and_is_not_rerun(
    tmp_path: Path, zygote: Zygote, ledger: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'fragile.db'}"
    with Engine(url, workflows=crashkit.all_workflows()) as engine:
        run_id = engine.start(engine.workflow("fragile"), CrashCtx(n=1)).id
        pid = zygote.fork(url, ledger)
        _wait_for_ledger(ledger, run_id, "charge")  # its effect happened; now it dies
        assert crashkit.kill(pid)
        crashkit.wait_gone(pid)
    with Engine(url, workflows=crashkit.all_workflows()) as survivor:
        survivor.resume()
        info = survivor.get(run_id)
        assert (info.status, info.state, info.reason) == ("failed", "charge", "interrupted")
        charges = [r for r in crashkit.ledger_rows(ledger) if r[0] == run_id and r[1] == "charge"]
        assert len(charges) == 1
        assert survivor.replay(run_id).matches


def test_crash__step_that_exits_its_process_every_time_ends_failed(
    tmp_path: Path, zygote: Zygote, ledger: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'suicide.db'}"
    with Engine(url, workflows=crashkit.all_workflows()) as engine:
        run_id = engine.start(engine.workflow("suicide"), CrashCtx(n=1)).id
        for _ in range(3 * crashkit.SUICIDE_ATTEMPTS):  # bounded
            pid = zygote.fork(url, ledger)
            crashkit.wait_gone(pid, timeout=DEADLINE_S)
            if engine.get(run_id).status == "failed":
                break
        info = engine.get(run_id)
        assert (info.status, info.state, info.reason) == ("failed", "boom", "interrupted")
        booms = [r for r in crashkit.ledger_rows(ledger) if r[0] == run_id and r[1] == "boom"]
        assert sorted(r[3] for r in booms) == list(range(1, crashkit.SUICIDE_ATTEMPTS + 1))
        interrupted = [e for e in engine.history(run_id) if e.kind == j.STEP_INTERRUPTED]
        assert [e.retryable for e in interrupted] == [True, True, False]
        assert engine.replay(run_id).matches
