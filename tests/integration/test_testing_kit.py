"""flowloop.testing, the kit users test their workflows with: time skipping on a FakeClock,
in-process crash injection and the crash sweep, journal assertions, step overrides and the
pytest fixtures. Real SQLite files throughout (the kit's own guarantee)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from kitflows import EXECUTED, Ctx, instants, sleeper, three_steps, waiting

from flowloop import FakeClock, Iteration, Loop, Retry, Step, Workflow, loop
from flowloop import journal as j
from flowloop.errors import DefinitionError, FlowloopError
from flowloop.store import SQLStore
from flowloop.testing import (
    PathMismatch,
    SimulatedCrash,
    TestEngine,
    assert_crash_safe,
    assert_events,
    assert_path,
    attempts,
    check_crash_points,
    context_at,
    describe,
    kinds,
)

DAY = 86_400.0


@pytest.fixture(autouse=True)
def _fresh_ledger() -> None:
    EXECUTED.clear()


@pytest.fixture
def engine(tmp_path: Path) -> TestEngine:
    with TestEngine(tmp_path / "kit.db") as engine:
        yield engine  # type: ignore[misc]


def journal_in_db(url: str, run_id: str) -> list[j.JournalEvent]:
    """The journal as the database has it, read without the engine."""
    store = SQLStore(url, create=False)
    try:
        return store.journal(run_id)
    finally:
        store.close()


# -- time skipping ----------------------------------------------------------------------


def test_run_until_idle__jumps_to_a_two_day_wait_timeout(engine: TestEngine) -> None:
    flow = waiting()
    start, ticks = engine.clock.now(), engine.clock.monotonic()
    run = engine.start(flow, {})
    engine.run_until_idle()
    info = engine.get(run.id)
    assert (info.status, info.state) == ("succeeded", "expired")
    timeout = next(e for e in engine.history(run.id) if e.kind == j.EVENT_RECEIVED)
    assert (timeout.event, timeout.at) == ("timeout", start + 2 * DAY)
    # Skipped, not waited: one jump of the fake clock (both its clocks, exactly two days)
    # from the wait's entry to its timeout, every journal entry at one of those instants.
    assert engine.clock.now() == start + 2 * DAY
    assert engine.clock.monotonic() - ticks == 2 * DAY
    assert instants(engine, run.id, start) == [0.0, 2 * DAY]


def test_run_until_idle__without_skip_time_leaves_timers_alone(engine: TestEngine) -> None:
    flow = waiting()
    start = engine.clock.now()
    run = engine.start(flow, {})
    engine.run_until_idle(skip_time=False)
    info = engine.get(run.id)
    assert (info.status, info.state) == ("scheduled", "approval")
    assert engine.clock.now() == start
    engine.send(run.id, "ok")
    assert engine.get(run.id).state == "done"


def test_run_until_idle__idle_horizon_bounds_the_jump(engine: TestEngine) -> None:
    flow = waiting()
    start = engine.clock.now()
    run = engine.start(flow, {})
    engine.run_until_idle(idle_horizon=DAY)
    assert engine.get(run.id).state == "approval"
    assert engine.clock.now() == start
    engine.run_until_idle(idle_horizon=2 * DAY)
    assert engine.get(run.id).state == "expired"


def test_advance__fires_what_falls_due_in_order_and_lands_on_the_target(
    engine: TestEngine,
) -> None:
    flow = sleeper(naps=2, hours=1)
    start = engine.clock.now()
    run = engine.start(flow, {})
    engine.advance(timedelta(minutes=90))
    assert engine.clock.now() == start + 90 * 60
    info = engine.get(run.id)
    assert info.context.napped == 2  # type: ignore[union-attr]
    assert info.next_run_at == pytest.approx(start + 2 * 3600)  # the second nap ends at 2 h
    engine.advance(timedelta(minutes=30))
    assert engine.get(run.id).status == "succeeded"
    starts = [a.started_at - start for a in attempts(engine, run, "nap")]
    assert starts == pytest.approx([0.0, 3600.0, 7200.0])


def test_advance__refuses_going_back(engine: TestEngine) -> None:
    with pytest.raises(FlowloopError, match="forward"):
        engine.advance(-1)


def test_run_until_idle__a_workflow_that_never_idles_is_reported(engine: TestEngine) -> None:
    flow = sleeper(naps=1_000_000, hours=1)
    engine.start(flow, {})
    with pytest.raises(FlowloopError, match="never goes idle"):
        engine.run_until_idle(max_jumps=5)


def test_retry_backoff_of_minutes__skipped_on_the_fake_clock(engine: TestEngine) -> None:
    flow = Workflow("flaky", context=Ctx)

    ten_minutes = Retry(attempts=3, backoff="fixed", base=600, cap=600)

    @flow.step(initial=True, next="done", retry=ten_minutes)
    def call(ctx: Ctx, step: Step) -> None:
        if step.attempt < 3:
            raise ConnectionError("provider down")

    flow.final("done")
    start = engine.clock.now()
    run = engine.start(flow, {})
    engine.run_until_idle()
    tries = attempts(engine, run, "call")
    assert [a.outcome for a in tries] == [j.STEP_FAILED, j.STEP_FAILED, j.STEP_SUCCEEDED]
    gaps = [later.started_at - earlier.started_at for earlier, later in itertools.pairwise(tries)]
    assert gaps == [600.0, 600.0]
    # The backoffs were jumps of the fake clock to each retry's due time, nothing else.
    assert engine.clock.now() == start + 1200.0
    assert instants(engine, run.id, start) == [0.0, 600.0, 1200.0]


def test_leases__judged_by_the_database_clock_however_far_the_fake_clock_jumps(
    engine: TestEngine,
) -> None:
    flow = Workflow("leased", context=Ctx)
    seen: list[tuple[float | None, str | None]] = []

    @flow.step(initial=True, on={"later": "check"})
    def wait_a_week(ctx: Ctx, step: Step) -> object:
        return step.sleep(timedelta(days=7), "later")

    @flow.step(next="done")
    def check(ctx: Ctx, step: Step) -> None:
        stored = engine.store.get_run(step.run_id)
        assert stored is not None
        seen.append((stored.lease_expires_at, stored.owner))

    flow.final("done")
    run = engine.start(flow, {})
    engine.run_until_idle()
    assert engine.get(run.id).status == "succeeded"
    (lease_end, owner), db_now = seen[0], engine.store.db_now()
    assert owner == engine.worker_id
    # The lease was set by the database's clock (now + 30 s), not the fake one (a week on).
    assert lease_end is not None
    assert db_now - 60 < lease_end <= db_now + engine.lease_seconds + 1
    assert engine.clock.now() - db_now > 6 * DAY


def test_fake_clock__advance_and_set_take_timedelta_and_datetime() -> None:
    clock = FakeClock(1_000.0)
    clock.advance(timedelta(minutes=2))
    assert (clock.now(), clock.monotonic()) == (1_120.0, 120.0)
    clock.set(clock.utcnow() + timedelta(seconds=30))
    assert clock.now() == 1_150.0
    clock.set(0.0)  # the past: stays
    assert clock.now() == 1_150.0
    with pytest.raises(ValueError, match="back"):
        clock.advance(-1)


def test_fake_clock__starts_at_an_aware_datetime_and_refuses_naive_ones() -> None:
    # FakeClock(datetime) failed later, deep in the engine ("datetime is not JSON
    # serializable"); a naive datetime was read in the machine's local zone, so a test
    # passed in UTC CI and failed on a laptop (or the other way round).
    start = datetime(2027, 3, 1, 9, 30, tzinfo=UTC)
    clock = FakeClock(start)
    assert (clock.now(), clock.utcnow()) == (start.timestamp(), start)
    with pytest.raises(ValueError, match=r"naive datetime.*tzinfo=UTC"):
        FakeClock(datetime(2027, 3, 1))
    with pytest.raises(ValueError, match=r"naive datetime.*tzinfo=UTC"):
        clock.set(datetime(2027, 3, 2))
    assert clock.utcnow() == start


# -- crash injection --------------------------------------------------------------------


def test_crash_at_inside__dead_engine_journals_nothing_and_resume_reruns_the_step(
    engine: TestEngine,
) -> None:
    flow = three_steps()
    engine.register(flow)
    run = engine.start(flow, {"name": "r1"})
    engine.crash_at("b", "inside")
    with pytest.raises(SimulatedCrash, match="inside 'b'"):
        engine.run_until_idle()
    assert engine.crashed == "inside 'b'"
    dead = engine.worker_id
    # SIGKILL semantics: the cut-off a live worker journals when cancelled is not there.
    on_disk = journal_in_db(engine.url, run.id)
    assert [(e.kind, e.state) for e in on_disk][-1] == (j.STEP_STARTED, "b")
    assert EXECUTED == [("a", 1), ("b", 1)]
    with pytest.raises(SimulatedCrash):
        engine.get(run.id)  # a dead process answers nothing
    engine.resume()
    assert engine.worker_id != dead
    info = engine.get(run.id)
    assert (info.status, info.context.trail) == ("succeeded", ["a", "b", "c"])  # type: ignore[union-attr]
    assert EXECUTED == [("a", 1), ("b", 1), ("b", 2), ("c", 1)]
    interrupted = [e for e in engine.history(run.id) if e.kind == j.STEP_INTERRUPTED]
    assert [(e.state, e.worker) for e in interrupted] == [("b", engine.worker_id)]


def test_crash_at_before__the_step_never_ran(engine: TestEngine) -> None:
    flow = three_steps()
    engine.register(flow)
    run = engine.start(flow, {"name": "r1"})
    engine.crash_at("c", "before")
    with pytest.raises(SimulatedCrash):
        engine.run_until_idle()
    assert EXECUTED == [("a", 1), ("b", 1)]  # b's outcome and c's start were one commit
    assert [e.kind for e in journal_in_db(engine.url, run.id)][-1] == j.STEP_STARTED
    engine.resume()
    assert EXECUTED == [("a", 1), ("b", 1), ("b", 2), ("c", 1)]
    assert engine.get(run.id).status == "succeeded"


def test_crash_at_after__a_committed_outcome_never_runs_again(engine: TestEngine) -> None:
    flow = three_steps()
    engine.register(flow)
    run = engine.start(flow, {"name": "r1"})
    seen: list[str] = []
    engine.listeners.append(lambda record, events: seen.extend(e.kind for e in events))
    engine.crash_at("b", "after")
    with pytest.raises(SimulatedCrash):
        engine.run_until_idle()
    engine.resume()
    assert EXECUTED == [("a", 1), ("b", 1), ("c", 2)]  # c was started, then cut off
    assert engine.path(run) == ["a", "b", "c", "done"]
    assert seen[-3:] == [j.STEP_INTERRUPTED, j.STEP_STARTED, j.STEP_SUCCEEDED]  # kept hooks


def test_crash_at__inside_engine_run_and_at_start(engine: TestEngine) -> None:
    flow = three_steps()
    engine.crash_at_commit(1, "before")
    engine.register(flow)
    with pytest.raises(SimulatedCrash, match="before journal commit #1"):
        engine.run(flow, {"name": "r1"})
    engine.resume()
    assert engine.runs() == []  # the run was never created
    engine.crash_at("a", "inside")
    with pytest.raises(SimulatedCrash):
        engine.run(flow, {"name": "r1"})  # created claimed, then died in its first step
    engine.resume()
    info = engine.find(flow, key="r1")
    assert info is not None and info.status == "succeeded"
    assert EXECUTED == [("a", 1), ("a", 2), ("b", 1), ("c", 1)]


def test_crash_at_commit__commits_are_numbered_and_described(engine: TestEngine) -> None:
    flow = three_steps()
    engine.register(flow)
    engine.start(flow, {"name": "r1"})
    engine.run_until_idle()
    lines = [commit.describe() for commit in engine.commits]
    assert lines == [
        "#1 create_run: run_created a",
        "#2 write: step_started a",
        "#3 write: step_succeeded a->b, step_started b",
        "#4 write: step_succeeded b->c, step_started c",
        "#5 write: step_succeeded c->done",
    ]
    assert all(commit.applied for commit in engine.commits)


def test_crash__nothing_registered_a_final_state_inside_and_loops_of_workflows_refused(
    engine: TestEngine,
) -> None:
    """Each was taken and never happened (a crash inside a final state), or said
    "(none registered)" as a workflow's name, or failed with an AttributeError."""
    with pytest.raises(FlowloopError, match="no workflow is registered yet"):
        engine.crash_at("a")
    flow = three_steps()
    engine.register(flow)
    for when in ("inside", "after"):
        with pytest.raises(FlowloopError, match="'done' is a final state"):
            engine.crash_at("done", when)  # type: ignore[arg-type]
    engine.crash_at("done", "before")  # its entry: a commit
    engine.disarm()
    with pytest.raises(FlowloopError, match="run_loops takes loops"):
        engine.run_loops([flow], timedelta(hours=1))  # type: ignore[list-item]
    run = engine.start(flow, {"name": "s"})
    engine.run_until_idle()
    with pytest.raises(FlowloopError, match="has no state 'nosuch'"):
        attempts(engine, run, "nosuch")
    assert [a.state for a in attempts(engine, run, "b")] == ["b"]


def test_crash__unknown_state_and_bad_when_refused(engine: TestEngine) -> None:
    engine.register(three_steps())
    with pytest.raises(DefinitionError, match="no state 'nope'"):
        engine.crash_at("nope")
    with pytest.raises(FlowloopError, match="when must be"):
        engine.crash_at("a", "during")  # type: ignore[arg-type]
    with pytest.raises(FlowloopError, match="when must be"):
        engine.crash_at_commit(2, "inside")


def test_crash_sweep__every_point_of_a_sound_workflow_ends_as_uninterrupted(
    tmp_path: Path,
) -> None:
    flow = three_steps()
    sweep = assert_crash_safe(flow, {"name": "s"}, directory=tmp_path)
    assert len(sweep.commits) == 5
    assert len(sweep.outcomes) == 10
    assert sweep.baseline.context["trail"] == ["a", "b", "c"]
    assert "crash after #5 write: step_succeeded c->done: succeeded in done: ok" in describe(sweep)


COUNTER = [0]


def test_crash_sweep__catches_a_step_that_is_not_crash_safe(tmp_path: Path) -> None:
    flow = Workflow("unsafe", context=Ctx)

    @flow.step(initial=True, next="stamp")
    def first(ctx: Ctx) -> None:
        ctx.trail.append("first")

    @flow.step(next="done")
    def stamp(ctx: Ctx) -> None:
        COUNTER[0] += 1  # process memory: a rerun after a crash stamps another number
        ctx.name = f"stamp-{COUNTER[0]}"

    flow.final("done")

    def reset(engine: TestEngine, run_id: str) -> None:
        COUNTER[0] = 0

    sweep = check_crash_points(flow, {}, actions=[reset], directory=tmp_path)
    assert sweep.failures, describe(sweep)
    with pytest.raises(AssertionError, match=r"context name: 'stamp-2', uninterrupted 'stamp-1'"):
        sweep.assert_ok()


def test_crash_sweep__non_idempotent_step_fails_interrupted_then_operator_retry(
    tmp_path: Path,
) -> None:
    flow = Workflow("once", context=Ctx)

    @flow.step(initial=True, next="done", idempotent=False)
    def ship(ctx: Ctx, step: Step) -> None:
        ctx.name = step.idempotency_key

    flow.final("done")
    sweep = assert_crash_safe(flow, {}, directory=tmp_path)
    retried = [o.label for o in sweep.outcomes if o.operator_retried]
    assert retried == [
        "after #2 write: step_started ship",
        "before #3 write: step_succeeded ship->done",
    ]
    without = check_crash_points(flow, {}, directory=tmp_path, operator_retry=False)
    assert [o.label for o in without.failures] == retried


# -- overrides --------------------------------------------------------------------------


def test_override__swaps_the_function_keeps_the_definition_and_restores(
    engine: TestEngine,
) -> None:
    flow = three_steps()
    fingerprint = flow.fingerprint

    async def fake_b(ctx: Ctx) -> None:
        ctx.trail.append("fake-b")

    with engine.override(flow, "b", fake_b) as same:
        assert same is flow and flow.fingerprint == fingerprint
        run = engine.start(flow, {"name": "o1"})
        engine.run_until_idle()
    assert engine.get(run.id).context.trail == ["a", "fake-b", "c"]  # type: ignore[union-attr]
    assert flow.fingerprint == fingerprint
    again = engine.start(flow, {"name": "o2"})
    engine.run_until_idle()
    assert engine.get(again.id).context.trail == ["a", "b", "c"]  # type: ignore[union-attr]


def test_override__restored_after_an_error_and_unknown_step_refused(engine: TestEngine) -> None:
    flow = three_steps()
    original = flow.steps["a"]
    with pytest.raises(RuntimeError), engine.override(flow, "a", lambda ctx: None):
        raise RuntimeError("test body failed")
    assert flow.steps["a"] is original
    with (
        pytest.raises(DefinitionError, match="no step 'done'"),
        engine.override(flow, "done", lambda ctx: None),
    ):
        pass


def test_override__refuses_what_the_definition_would_refuse(engine: TestEngine) -> None:
    # retry=3 took the engine down mid-run (AttributeError: no should_retry), timeout=-1
    # timed every attempt out at once, a non-callable failed each attempt with a TypeError.
    flow = three_steps()
    original = flow.steps["a"]
    for options, refusal in (
        ({"retry": 3}, "retry=3 must be a flowloop Retry"),
        ({"timeout": -1}, "timeout must be positive"),
        ({"timeout": 0}, "timeout must be positive"),
        ({"function": "not a function"}, "must be a function"),
    ):
        with pytest.raises(DefinitionError, match=refusal), engine.override(flow, "a", **options):
            pass  # pragma: no cover - refused on entry
        assert flow.steps["a"] is original


def test_override__retry_policy_for_one_test(engine: TestEngine) -> None:
    flow = Workflow("flaky2", context=Ctx)

    @flow.step(initial=True, next="done")
    def call(ctx: Ctx, step: Step) -> None:
        if step.attempt == 1:
            raise ConnectionError("once")

    flow.final("done")
    original = flow.steps["call"]
    with engine.override(flow, "call", retry=Retry(attempts=2, backoff="fixed", base=120)):
        run = engine.start(flow, {})
        engine.run_until_idle()
    first, second = attempts(engine, run)
    assert (first.outcome, second.outcome) == (j.STEP_FAILED, j.STEP_SUCCEEDED)
    assert second.started_at - first.started_at == pytest.approx(120.0)
    assert flow.steps["call"] is original


# -- assertions -------------------------------------------------------------------------


def test_assert_path__passes_and_fails_with_a_diff(engine: TestEngine) -> None:
    flow = three_steps()
    run = engine.start(flow, {"name": "p"})
    engine.run_until_idle()
    assert_path(engine, run, ["a", "b", "c", "done"])
    assert_path(engine, run.id, ["a", "b", "c", "done"])
    with pytest.raises(PathMismatch) as caught:
        assert_path(engine, run, ["a", "c", "done"])
    message = str(caught.value)
    assert "expected: a -> c -> done" in message
    assert "actual:   a -> b -> c -> done" in message
    assert "\n+b\n" in message  # the unified diff marks the unexpected state


def test_assert_events__exact_subsequence_and_fields(engine: TestEngine) -> None:
    flow = three_steps()
    run = engine.start(flow, {"name": "e"})
    engine.run_until_idle()
    assert kinds(engine, run)[:2] == [j.RUN_CREATED, j.STEP_STARTED]
    assert_events(
        engine,
        run,
        ["step_succeeded:a", {"kind": "step_succeeded", "next_state": "done"}],
        exact=False,
    )
    with pytest.raises(AssertionError, match="no journal entry 'step_failed:b'"):
        assert_events(engine, run, ["step_failed:b"], exact=False)
    with pytest.raises(AssertionError, match="journal differs") as caught:
        assert_events(engine, run, ["run_created", "step_started:a"])
    assert "+step_succeeded:a" in str(caught.value)


def test_assert_events__misuse_is_refused_in_one_line_not_passed_or_crashed(
    engine: TestEngine,
) -> None:
    run = engine.start(three_steps(), {"name": "m"})
    engine.run_until_idle()
    # One string for the list: "" passed without looking at the journal, and
    # "step_failed:b" was read as the entries "s", "t", "e", ….
    for given in ("", "step_failed:b"):
        with pytest.raises(FlowloopError, match="a list of entries, not one string"):
            assert_events(engine, run, given, exact=False)
        with pytest.raises(FlowloopError, match="a list of states, not one string"):
            assert_path(engine, run, given)
    # A misspelt field raised a bare AttributeError from inside the helper.
    with pytest.raises(FlowloopError, match="no field 'stat'; use one of run_id, seq, kind"):
        assert_events(engine, run, [{"kind": "step_started", "stat": "a"}], exact=False)
    assert_events(engine, run, [{"kind": "step_started", "state": "a"}], exact=False)


def test_context_at_and_attempts__read_any_seq(engine: TestEngine) -> None:
    flow = three_steps()
    run = engine.start(flow, {"name": "c"})
    engine.run_until_idle()
    assert context_at(engine, run, 1)["trail"] == []
    succeeded_b = next(
        e.seq for e in engine.history(run.id) if e.kind == j.STEP_SUCCEEDED and e.state == "b"
    )
    assert context_at(engine, run, succeeded_b)["trail"] == ["a", "b"]
    assert [(a.state, a.attempt, a.outcome) for a in engine.attempts(run)] == [
        ("a", 1, j.STEP_SUCCEEDED),
        ("b", 1, j.STEP_SUCCEEDED),
        ("c", 1, j.STEP_SUCCEEDED),
    ]


# -- the engine itself and the pytest fixtures ------------------------------------------


def test_test_engine__temporary_sqlite_file_in_wal_removed_on_close() -> None:
    engine = TestEngine()
    path = Path(engine.url.removeprefix("sqlite:///"))
    try:
        assert path.is_file()
        store = engine.store
        assert isinstance(store, SQLStore)
        with store.engine.connect() as conn:
            mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar_one()
        assert mode == "wal"
    finally:
        engine.close()
    assert not path.parent.exists()


def test_test_engine__run_ids_reproducible_with_a_seed(tmp_path: Path) -> None:
    flow = waiting()
    ids = []
    for name in ("one.db", "two.db"):
        with TestEngine(tmp_path / name, seed=7) as engine:
            ids.append([engine.start(flow, {}).id for _ in range(2)])
    assert ids[0] == ids[1] and ids[0][0] != ids[0][1]


def test_plugin_fixtures__engine_on_the_fake_clock(
    flowloop_engine: TestEngine, fake_clock: FakeClock, tmp_path: Path
) -> None:
    assert flowloop_engine.clock is fake_clock
    assert flowloop_engine.url == f"sqlite:///{tmp_path / 'flowloop.db'}"
    run = flowloop_engine.start(waiting(), {})
    flowloop_engine.advance(timedelta(days=2))
    assert flowloop_engine.get(run.id).state == "expired"


def test_plugin_fixtures__usable_from_async_code(flowloop_engine: TestEngine) -> None:
    async def scenario() -> str:
        run = await flowloop_engine.arun(three_steps(), {"name": "async"})
        flowloop_engine.start(waiting(), {})
        await flowloop_engine.aadvance(timedelta(days=3))
        return run.status

    assert asyncio.run(scenario()) == "succeeded"
    assert {r.state for r in flowloop_engine.runs()} == {"done", "expired"}


# -- the README example ------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def test_readme__testing_example_is_the_tested_file_and_runs_as_plain_python(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Testing your workflows") :]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    example = (ROOT / "tests" / "examples" / "test_readme_testing_example.py").read_text()
    body = example[example.index("from datetime import timedelta") :]
    assert block.startswith(body), "README's testing example differs from its test file"
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md (Testing your workflows)", "exec"), {"__name__": "readme"})


# -- loops --------------------------------------------------------------------------------


def test_run_loops__hourly_function_fires_each_slot_on_the_fake_clock(engine: TestEngine) -> None:
    slots: list[float] = []

    @loop(every=timedelta(hours=1))
    def hourly(iteration: Iteration) -> None:
        slots.append(iteration.slot)

    start = engine.clock.now()
    events = engine.run_loops([hourly], timedelta(days=1))
    assert [slot - start for slot in slots] == [3600.0 * h for h in range(25)]
    assert engine.clock.now() == start + DAY
    assert [e.kind for e in events].count("iteration_succeeded") == 25
    assert engine.loop("hourly").next_fire_at == start + 25 * 3600
    # The day went by in jumps of the fake clock from slot to slot: the loop's journal
    # holds nothing written between two slots.
    assert {e.at - start for e in events} <= {3600.0 * h for h in range(25)}


def test_run_loops__workflow_loop_whose_run_sleeps_and_a_retried_iteration(
    engine: TestEngine,
) -> None:
    nightly_flow = sleeper(naps=1, hours=1)  # each run sleeps an hour, then ends
    nightly = Loop("nightly", workflow=nightly_flow, every=timedelta(days=1), context={})
    failures = [1]

    @loop(every=timedelta(hours=6), retry=Retry(attempts=2, backoff="fixed", base=60))
    def flaky(iteration: Iteration) -> None:
        if failures:
            failures.pop()
            raise ConnectionError("once")

    start = engine.clock.now()
    events = engine.run_loops([nightly, flaky], timedelta(days=2))
    runs = engine.runs(workflow="sleeper")
    assert sorted(r.created_at - start for r in runs) == [0.0, DAY, 2 * DAY]
    assert all(r.status == "succeeded" for r in runs)
    # The run of the last slot slept its hour: the iteration ends past the duration.
    assert engine.clock.now() == start + 2 * DAY + 3600
    flaky_events = [(e.kind, e.at - start, e.attempt) for e in events if e.loop == "flaky"]
    # The first iteration failed once and succeeded a (fake) minute later, on attempt 2.
    assert flaky_events[1:3] == [("iteration_started", 0.0, 1), ("iteration_succeeded", 60.0, 2)]
    assert flaky_events[-1] == ("iteration_succeeded", 2 * DAY, 1)


def test_run_loops__a_slow_def_loop_function_beside_a_sleeping_run(engine: TestEngine) -> None:
    """A plain ``def`` loop function still running in its thread while a workflow loop's
    run sleeps: the kit moved the clock to the run's wake-up meanwhile, so the function's
    retry was counted from there (3,660 s, not 60 s). It waits for the thread now,
    however long the function takes (here 0.3 real seconds: a slow call)."""
    nightly = Loop(
        "nightly", workflow=sleeper(naps=1, hours=1), every=timedelta(days=1), context={}
    )
    failures = [1]

    @loop(every=timedelta(hours=6), retry=Retry(attempts=2, backoff="fixed", base=60))
    def slow_flaky(iteration: Iteration) -> None:
        if failures:
            failures.pop()
            threading.Event().wait(0.3)  # (a slow call, then a failure)
            raise ConnectionError("once")

    start = engine.clock.now()
    events = engine.run_loops([nightly, slow_flaky], timedelta(hours=2))
    ends = [(e.kind, e.at - start) for e in events if e.loop == "slow_flaky"]
    assert ("iteration_succeeded", 60.0) in ends, ends


def test_writes_after_crash__sees_a_write_that_reaches_the_database_after_the_crash(
    engine: TestEngine,
) -> None:
    flow = three_steps()
    run = engine.start(flow, {"name": "leak"})
    engine.crash_at("b", "inside")
    with pytest.raises(SimulatedCrash):
        engine.run_until_idle()
    assert engine.writes_after_crash() == []  # the dead engine wrote nothing
    # What a worker that was not really dead would do: release the run it held.
    other = SQLStore(engine.url)
    try:
        other.release(worker=engine.worker_id, run_ids=[run.id])
    finally:
        other.close()
    assert engine.writes_after_crash() == [f"run row {run.id} changed after the crash"]
    engine.resume()
    with pytest.raises(FlowloopError, match="has not crashed"):
        engine.writes_after_crash()


def test_test_engine__two_engines_with_one_seed_on_one_database_never_share_an_id(
    tmp_path: Path,
) -> None:
    flow = waiting()
    db = tmp_path / "shared.db"
    with TestEngine(db) as first, TestEngine(db) as second:
        a = first.start(flow, {})
        b = second.start(flow, {})
        assert a.id != b.id
        assert {r.id for r in first.runs()} == {a.id, b.id}


def test_crash__amid_a_group_commit_of_several_runs(
    engine: TestEngine, caplog: pytest.LogCaptureFixture
) -> None:
    flow = three_steps()
    ids = [engine.start(flow, {"name": f"g{i}"}).id for i in range(5)]
    created = len(engine.commits)
    # The first commit after the claim holds the five runs' first step_started: the runs
    # are spawned in one event-loop turn, so their starts share one group commit (later
    # boundaries batch only as their threads happen to finish together: no timing luck).
    engine.crash_at_commit(created + 1, "after")
    with pytest.raises(SimulatedCrash):
        engine.run_until_idle()
    batch = engine.commits[-1]
    assert len({e.run_id for e in batch.events}) > 1  # one commit for several runs
    assert engine.writes_after_crash() == []
    engine.resume()
    assert {engine.get(run_id).status for run_id in ids} == {"succeeded"}
    assert not [r for r in caplog.records if "Exception in callback" in r.getMessage()]
