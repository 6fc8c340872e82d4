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

import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crashkit
import pytest
from crashkit import CrashCtx, Zygote

from flowloop import Engine
from flowloop import journal as j

pytestmark = pytest.mark.crash

RUNS_PER_BATCH = 6
MAX_KILL_DELAY_S = 0.06
WAIT_SHARE = 0.8
"""Most kills while a worker works, some while it starts up."""


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    yield from crashkit.zygote_process()


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "ledger.db"
    crashkit.create_ledger(path)
    monkeypatch.setattr(crashkit, "LEDGER", path)  # the test's own resume records too
    return path


def reference_contexts(tmp_path: Path, count: int) -> list[Any]:
    """Final contexts of uninterrupted runs, by ``n``."""
    wf = crashkit.crash20()
    return crashkit.final_contexts(
        tmp_path / "reference.db",
        [wf],
        lambda engine: [engine.start(wf, CrashCtx(n=n)).id for n in range(count)],
    )


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

    def more() -> bool:
        if unfinished(engine) == 0:
            ids.extend(engine.start(wf, CrashCtx(n=n)).id for n in range(RUNS_PER_BATCH))
        return True

    killed = crashkit.kill_repeatedly(
        zygote,
        {"db": url, "ledger": str(ledger)},
        kills=kills,
        rng=rng,
        max_delay=MAX_KILL_DELAY_S,
        working=lambda pid: crashkit.has_worked(ledger, pid),
        more=more,
        wait_share=WAIT_SHARE,
    )
    return ids, killed


def verify_exactly_once(
    engine: Engine, ids: list[str], ledger: Path, reference: list[Any]
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
    for done in crashkit.ledger_rows(ledger):
        run_id, state, visit = done.run_id, done.state, done.visit
        if run_id not in started_by_run:
            continue
        # Every execution follows its own committed step_started, once: a step whose
        # success was committed never ran again.
        point = (state, visit, done.attempt, done.seq)
        assert point in started_by_run[run_id], (run_id, state, done.seq)
        assert done.idempotency_key == f"{run_id}:{state}:{visit}"
        executions[(run_id, state, visit, done.attempt)] += 1
    assert max(executions.values()) == 1
    visited = {(run_id, s, v) for run_id, s, v, _ in executions}
    assert len(visited) == len(ids) * crashkit.VISITS_PER_RUN
    return kinds


def crash_suite(url: str, tmp_path: Path, zygote: Zygote, ledger: Path, *, kills: int) -> None:
    seed = crashkit.seed()
    with crashkit.replayable(seed):
        reference = reference_contexts(tmp_path, RUNS_PER_BATCH)
        with Engine(url, workflows=crashkit.all_workflows()) as engine:
            ids, killed = kill_repeatedly(
                engine, zygote, url, ledger, kills=kills, rng=random.Random(seed)
            )
            assert killed >= kills, f"only {killed} kills"
        with Engine(url, workflows=crashkit.all_workflows()) as survivor:
            survivor.resume()
            kinds = verify_exactly_once(survivor, ids, ledger, reference)
        # The kills really cut steps off (else this suite proves little).
        assert kinds[j.STEP_INTERRUPTED] > 0, kinds


def test_crash__sigkill_at_random_instants_then_resume_is_exact(
    tmp_path: Path, zygote: Zygote, ledger: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    crash_suite(url, tmp_path, zygote, ledger, kills=50)


def test_crash__sigkill_on_postgres_then_resume_is_exact(
    tmp_path: Path, zygote: Zygote, ledger: Path, pg_url: str
) -> None:
    crash_suite(pg_url, tmp_path, zygote, ledger, kills=10)


def test_crash__non_idempotent_step_interrupted_fails_and_is_not_rerun(
    tmp_path: Path, zygote: Zygote, ledger: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'fragile.db'}"
    with Engine(url, workflows=crashkit.all_workflows()) as engine:
        run_id = engine.start(engine.workflow("fragile"), CrashCtx(n=1)).id
        pid = zygote.fork(db=url, ledger=str(ledger))
        # Its effect happened; now it dies.
        charged = crashkit.kill_when(
            pid, lambda: bool(crashkit.executions(ledger, run_id, "charge")), what="charge ran"
        )
        assert charged
    with Engine(url, workflows=crashkit.all_workflows()) as survivor:
        survivor.resume()
        info = survivor.get(run_id)
        assert (info.status, info.state, info.reason) == ("failed", "charge", "interrupted")
        assert len(crashkit.executions(ledger, run_id, "charge")) == 1
        assert survivor.replay(run_id).matches


def test_crash__step_that_exits_its_process_every_time_ends_failed(
    tmp_path: Path, zygote: Zygote, ledger: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'suicide.db'}"
    with Engine(url, workflows=crashkit.all_workflows()) as engine:
        run_id = engine.start(engine.workflow("suicide"), CrashCtx(n=1)).id
        for _ in range(3 * crashkit.SUICIDE_ATTEMPTS):  # bounded
            zygote.exit_code(zygote.fork(db=url, ledger=str(ledger)))
            if engine.get(run_id).status == "failed":
                break
        info = engine.get(run_id)
        assert (info.status, info.state, info.reason) == ("failed", "boom", "interrupted")
        booms = [
            e for e in crashkit.ledger_rows(ledger) if e.run_id == run_id and e.state == "boom"
        ]
        assert sorted(e.attempt for e in booms) == list(range(1, crashkit.SUICIDE_ATTEMPTS + 1))
        interrupted = [e for e in engine.history(run_id) if e.kind == j.STEP_INTERRUPTED]
        assert [e.retryable for e in interrupted] == [True, True, False]
        assert engine.replay(run_id).matches


def test_crash__compensation_that_exits_its_process_counts_against_compensate_retry(
    store_url: str, zygote: Zygote, ledger: Path
) -> None:
    """Each worker finds the last one's compensation cut off (its process gone), runs it
    again and dies: an attempt of ``compensate_retry`` each time, as for a step's
    ``retry``; out of attempts the run parks ``failed`` (not 25 runs of it, as before)."""
    attempts = crashkit.UNDO_SUICIDE_ATTEMPTS
    with Engine(store_url, workflows=crashkit.all_workflows()) as engine:
        run_id = engine.start(engine.workflow("undo_suicide"), CrashCtx(n=1)).id
        for _ in range(3 * attempts):  # bounded
            zygote.exit_code(zygote.fork(db=store_url, ledger=str(ledger)))
            if engine.get(run_id).status == "failed":
                break
        info = engine.get(run_id)
        assert (info.status, info.state) == ("failed", "cancelled"), info
        assert info.reason == f"compensation_failed: charge: interrupted {attempts} time(s)"
        undos = [e for e in crashkit.ledger_rows(ledger) if e.kind == "undo"]
        assert [(e.state, e.attempt) for e in undos] == [("charge", a) for a in (1, 2)]
        interrupted = [e for e in engine.history(run_id) if e.kind == j.STEP_INTERRUPTED]
        assert [e.retryable for e in interrupted] == [True, False]
        assert engine.replay(run_id).matches
        # Fixed (it no longer exits), an operator's retry runs it again, budget renewed.
        engine.retry(run_id, set_fields={"n": 0})
        engine.run_until_idle()
        info = engine.get(run_id)
        assert (info.status, info.reason) == ("succeeded", "compensated: charge")
        assert info.context.trail == ["refunded"]
        undos = [e for e in crashkit.ledger_rows(ledger) if e.kind == "undo"]
        assert [e.attempt for e in undos] == [1, 2, 1]
