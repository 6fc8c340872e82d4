"""`step_stats` on SQLite and PostgreSQL: counts, success rate, retries, nearest-rank
p50/p95/p99 and the slowest runs, checked against journals with known durations (steps
that move a fake clock, and journal rows written directly)."""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.cli import main
from flowloop.stats import OUTCOME_KINDS, StateStats, loop_stats, run_stats, step_stats
from flowloop.store import SQLStore
from flowloop.store.schema import journal, loop_journal, runs

T0 = 1_800_000_000.0


class Timed(BaseModel):
    seconds: float
    flaky: bool = False


def timed_workflow(clock: FakeClock) -> Workflow:
    """work (takes ``seconds`` of the fake clock) -> check (fails once when flaky) -> done."""
    wf = Workflow("timed", context=Timed)

    @wf.step(initial=True, next="check")
    def work(ctx: Timed) -> None:
        clock.advance(ctx.seconds)

    @wf.step(next="done", retry=Retry(attempts=2, backoff="fixed", base=0, cap=0))
    def check(ctx: Timed, step: Step) -> None:
        clock.advance(0.5)
        if ctx.flaky and step.attempt == 1:
            raise ConnectionError("flaky")

    wf.final("done")
    return wf


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[Engine]:
    with Engine(store_url, clock=clock) as e:
        yield e


def db_of(engine: Engine) -> sa.Engine:
    assert isinstance(engine.store, SQLStore)
    return engine.store.engine


def by_state(found: list[StateStats]) -> dict[tuple[str, str], StateStats]:
    return {(s.workflow, s.state): s for s in found}


def nearest_rank(values: list[float], percentile: int) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(percentile / 100 * len(ordered)) - 1]


def test_step_stats__percentiles_retries_and_slowest_from_real_runs(
    engine: Engine, clock: FakeClock
) -> None:
    wf = timed_workflow(clock)
    ids = {}
    for n in range(1, 21):
        info = engine.run(wf, {"seconds": float(n), "flaky": n % 5 == 0})
        assert info.status == "succeeded"
        ids[n] = info.id

    stats = by_state(step_stats(db_of(engine)))
    assert set(stats) == {("timed", "work"), ("timed", "check")}
    work = stats["timed", "work"]
    assert (work.count, work.succeeded, work.retries, work.failed) == (20, 20, 0, 0)
    assert work.success_rate == 1.0
    # Nearest rank over 1..20 s: ceil(.5*20)=10th, ceil(.95*20)=19th, ceil(.99*20)=20th.
    assert (work.p50, work.p95, work.p99) == (10.0, 19.0, 20.0)
    assert work.slowest == ((ids[20], 20.0), (ids[19], 19.0), (ids[18], 18.0))

    check = stats["timed", "check"]
    assert (check.count, check.succeeded, check.retries) == (24, 20, 4)
    assert check.success_rate == pytest.approx(20 / 24)
    assert (check.p50, check.p99) == (0.5, 0.5)


def insert_history(
    engine: Engine, *, rows: int, seed: int, at: float = T0
) -> dict[tuple[str, str], list[tuple[str, str, float | None, bool]]]:
    """Journal outcome rows written directly: (run, kind, duration, retryable) per state."""
    rng = random.Random(seed)
    expected: dict[tuple[str, str], list[tuple[str, str, float | None, bool]]] = {}
    run_rows, event_rows = [], []
    for i in range(rows):
        workflow = rng.choice(["etl", "order"])
        state = rng.choice(["extract", "load"] if workflow == "etl" else ["charge", "ship"])
        run_id = uuid.uuid4().hex
        roll = rng.random()
        if roll < 0.8:
            kind, duration, retryable = j.STEP_SUCCEEDED, round(rng.lognormvariate(0, 1), 6), False
        elif roll < 0.95:
            kind, duration, retryable = j.STEP_FAILED, round(rng.random(), 6), rng.random() < 0.5
        else:
            kind, duration, retryable = j.STEP_INTERRUPTED, None, True
        expected.setdefault((workflow, state), []).append((run_id, kind, duration, retryable))
        run_rows.append(
            {
                "id": run_id,
                "workflow": workflow,
                "version": 1,
                "fingerprint": "f" * 16,
                "status": "succeeded",
                "state": state,
                "context": "{}",
                "attempt": 0,
                "visits": "{}",
                "last_seq": 3,
                "priority": 0,
                "lease_epoch": 0,
                "created_at": at,
                "updated_at": at,
            }
        )
        for seq, event_kind in ((1, j.RUN_CREATED), (2, j.STEP_STARTED), (3, kind)):
            event_rows.append(
                {
                    "run_id": run_id,
                    "seq": seq,
                    "kind": event_kind,
                    "at": at + i * 0.001,
                    "state": state,
                    "attempt": 1,
                    "duration": duration if seq == 3 else None,
                    "retryable": retryable if seq == 3 and kind != j.STEP_SUCCEEDED else None,
                }
            )
    with db_of(engine).begin() as conn:
        conn.execute(sa.insert(runs), run_rows)
        conn.execute(sa.insert(journal), event_rows)
    return expected


def test_step_stats__nearest_rank_matches_a_reference_on_random_history(engine: Engine) -> None:
    expected = insert_history(engine, rows=1500, seed=42)

    stats = by_state(step_stats(db_of(engine), slowest=5))
    assert set(stats) == set(expected)
    for key, rows in expected.items():
        got = stats[key]
        durations = [d for _, _, d, _ in rows if d is not None]
        assert got.count == len(rows), key
        assert got.succeeded == sum(1 for _, kind, _, _ in rows if kind == j.STEP_SUCCEEDED)
        assert got.retries == sum(1 for _, kind, _, r in rows if r and kind != j.STEP_SUCCEEDED)
        assert (got.p50, got.p95, got.p99) == tuple(
            nearest_rank(durations, p) for p in (50, 95, 99)
        ), key
        slowest = sorted((r for r in rows if r[2] is not None), key=lambda r: -(r[2] or 0))[:5]
        assert [run_id for run_id, _ in got.slowest] == [run_id for run_id, *_ in slowest]


def test_step_stats__since_and_workflow_narrow_the_window(engine: Engine) -> None:
    old = insert_history(engine, rows=200, seed=1, at=T0)
    new = insert_history(engine, rows=100, seed=2, at=T0 + 3600)

    recent = by_state(step_stats(db_of(engine), since=T0 + 3600))
    assert sum(s.count for s in recent.values()) == 100
    assert {k: s.count for k, s in recent.items()} == {k: len(v) for k, v in new.items()}

    everything = step_stats(db_of(engine))
    assert sum(s.count for s in everything) == 300

    etl = step_stats(db_of(engine), workflow="etl")
    assert {s.workflow for s in etl} == {"etl"}
    assert sum(s.count for s in etl) == sum(
        len(v) for k, v in (*old.items(), *new.items()) if k[0] == "etl"
    )


def test_step_stats__empty_journal_and_unknown_workflow(engine: Engine) -> None:
    assert step_stats(db_of(engine)) == []
    insert_history(engine, rows=10, seed=3)
    assert step_stats(db_of(engine), workflow="nope") == []


def flowloop_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """The CLI's entry point in this process (FlowloopError to one line and its exit code):
    the exit code, stdout, stderr."""
    code = 0
    try:
        main(list(args))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_stats_cli__an_unknown_workflow_is_a_mistake_exit_2(
    engine: Engine, store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flowloop stats nosuch` said the database had no such workflow, and exited 0 (ops
    audit): a misspelt name is refused, one line, exit 2, as other usage errors are — with
    --json too."""
    engine.run(timed_workflow(FakeClock(T0)), Timed(seconds=1))
    for extra in ([], ["--json"]):
        code, out, err = flowloop_cli(capsys, "stats", "nosuch", *extra, "--db", store_url)
        assert (code, out) == (2, "")
        assert err.splitlines() == ["error: this database has no workflow 'nosuch' (known: timed)"]
    code, out, _ = flowloop_cli(capsys, "stats", "timed", "--since", "all", "--db", store_url)
    assert code == 0 and "timed" in out


def test_step_stats__json_shape(engine: Engine, clock: FakeClock) -> None:
    info = engine.run(timed_workflow(clock), {"seconds": 2.0})
    work = by_state(step_stats(db_of(engine)))["timed", "work"].as_dict()
    assert work == {
        "workflow": "timed",
        "state": "work",
        "count": 1,
        "succeeded": 1,
        "failed": 0,
        "retries": 0,
        "success_rate": 1.0,
        "p50": 2.0,
        "p95": 2.0,
        "p99": 2.0,
        "slowest": [{"run_id": info.id, "duration": 2.0}],
    }


def test_step_stats__since_reads_the_window_runs_not_the_whole_journal(sqlite_url: str) -> None:
    """What keeps `flowloop stats --since` fast on a long history without a time index on
    the journal (every step would pay for one): SQLite finds the window's runs through the
    runs' indexes and reads their entries by the journal's key, never scanning it."""
    from flowloop.store.windows import journal_since

    with Engine(sqlite_url, clock=FakeClock(T0)) as e:
        insert_history(e, rows=50, seed=4)
        db = db_of(e)
        with db.connect() as conn:
            for table in ("flowloop_journal", "flowloop_runs"):
                conn.exec_driver_sql(f"ANALYZE {table}")
            query = (
                sa.select(sa.func.count())
                .select_from(journal.join(runs, runs.c.id == journal.c.run_id))
                .where(journal.c.kind.in_(OUTCOME_KINDS), journal_since(1_800_000_000.0))
            )
            compiled = query.compile(db, compile_kwargs={"literal_binds": True})
            plan = " ".join(
                str(row[-1]) for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}")
            )
    assert "SCAN flowloop_journal" not in plan, plan
    assert "flowloop_journal USING PRIMARY KEY (run_id=?)" in plan, plan
    assert "ix_flowloop_runs_updated" in plan, plan


def test_run_stats__success_rate_and_whole_run_latency_from_real_runs(
    engine: Engine, clock: FakeClock
) -> None:
    """Every timed run succeeds (some after a retried attempt): the runs' success rate is
    100 % although the step attempts' is not; latency is run_created → final entry."""
    wf = timed_workflow(clock)
    latencies = []
    for n in range(1, 21):
        flaky = n % 5 == 0
        assert engine.run(wf, {"seconds": float(n), "flaky": flaky}).status == "succeeded"
        latencies.append(n + (1.0 if flaky else 0.5))  # work n s, check 0.5 s per attempt
    broken = Workflow("broken", context=Timed)

    @broken.step(initial=True, next="done", retry=Retry(attempts=1))
    def explode(ctx: Timed) -> None:
        raise ValueError("no")

    broken.final("done")
    assert engine.run(broken, {"seconds": 0}).status == "failed"
    engine.stop(engine.start(broken, {"seconds": 0}).id)

    found = {s.workflow: s for s in run_stats(db_of(engine))}
    timed = found["timed"]
    assert (timed.finished, timed.succeeded, timed.failed, timed.stopped) == (20, 20, 0, 0)
    assert timed.success_rate == 1.0
    assert (timed.p50, timed.p95, timed.p99) == tuple(
        pytest.approx(nearest_rank(latencies, p)) for p in (50, 95, 99)
    )
    assert by_state(step_stats(db_of(engine)))["timed", "check"].success_rate < 1.0
    gone = found["broken"]
    assert (gone.finished, gone.succeeded, gone.failed, gone.stopped) == (2, 0, 1, 1)
    assert (gone.success_rate, gone.p50) == (0.0, None)  # latency is of succeeded runs
    assert gone.as_dict()["latency_p99"] is None
    # The window holds runs whose final entry is in it.
    assert run_stats(db_of(engine), since=clock.now() + 1) == []
    assert [s.workflow for s in run_stats(db_of(engine), workflow="broken")] == ["broken"]


def test_loop_stats__iterations_by_outcome_slots_not_run_and_durations(engine: Engine) -> None:
    rows = [("iteration_started", None, 0)] * 12
    rows += [("iteration_succeeded", float(d), 0) for d in range(1, 11)]
    rows += [("iteration_failed", 20.0, 0), ("iteration_failed", 30.0, 0)]
    rows += [("skipped_overlap", None, 3), ("missed", None, 2)]
    with db_of(engine).begin() as conn:
        conn.execute(
            sa.insert(loop_journal),
            [
                {
                    "loop": loop,
                    "seq": seq,
                    "kind": kind,
                    "at": T0 + seq + (0 if loop == "tick" else 3600),
                    "slot": T0 + seq,
                    "attempt": 1,
                    "count": count,
                    "duration": duration,
                }
                for loop in ("tick", "later")
                for seq, (kind, duration, count) in enumerate(rows, start=1)
            ],
        )
    found = {s.loop: s for s in loop_stats(db_of(engine))}
    tick = found["tick"]
    assert tick.outcomes == {"failed": 2, "succeeded": 10} and tick.iterations == 12
    assert tick.slots_not_run == {"missed": 2, "skipped_overlap": 3}
    durations = [float(d) for d in range(1, 11)] + [20.0, 30.0]
    assert (tick.p50, tick.p95) == (nearest_rank(durations, 50), nearest_rank(durations, 95))
    assert tick.as_dict()["iterations"] == 12
    recent = loop_stats(db_of(engine), since=T0 + 3600)
    assert [s.loop for s in recent] == ["later"]
