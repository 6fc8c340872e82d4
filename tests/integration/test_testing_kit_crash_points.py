"""The testing kit's crash points at a call's or map's fan-out and at the store's admission
calls: a claim that takes a slot of a workflow's limits (``concurrency_key``), a debounced,
throttled or bounded start, an event kept under ``max_inbox``. A sweep (the kit's SQLite
files) of a map workflow and of a keyed one crashes there and every resumed run ends as the
uninterrupted one, no step run twice; and a TestEngine on SQLite and PostgreSQL crashes at
each of them by number."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import pg_base_url, require_pg, with_search_path
from pydantic import BaseModel

from flowloop import FakeClock, Workflow
from flowloop import journal as j
from flowloop.admission import StartThrottled
from flowloop.testing import SimulatedCrash, TestEngine, check_crash_points
from flowloop.testing.crash import Commit
from flowloop.testing.sweep import describe

CLOCK_START = 1_800_000_000.0


class Item(BaseModel):
    n: int
    key: str = "k"
    sq: int = 0
    trail: list[str] = []


class Numbers(BaseModel):
    ns: list[int]
    total: int = 0


class Count(BaseModel):
    n: int = 0


def keyed() -> Workflow:
    """Two steps of a workflow whose runs are claimed under a per-key limit."""
    wf = Workflow("cp_keyed", context=Item, concurrency_key=lambda ctx: ctx.key, key_limit=1)

    @wf.step(initial=True, next="second")
    def first(ctx: Item) -> None:
        ctx.trail.append("first")

    @wf.step(next="done")
    def second(ctx: Item) -> None:
        ctx.sq = ctx.n * ctx.n
        ctx.trail.append("second")

    wf.final("done")
    return wf


def mapper(child: Workflow) -> Workflow:
    wf = Workflow("cp_map", context=Numbers)
    wf.map(
        "fan",
        child=child,
        items=lambda ctx: ctx.ns,
        context=lambda ctx, n: Item(n=n, key=f"k{n}"),
        max_parallel=1,
        on={"done": "sum"},
        reduce=lambda ctx, results: setattr(ctx, "total", sum(r.context.sq for r in results)),
        initial=True,
    )

    @wf.step(name="sum", next="ok")
    def add(ctx: Numbers) -> None:
        ctx.total += 1

    wf.final("ok")
    return wf


def test_sweep__a_map_crashes_at_its_fan_out_and_its_children_claims(tmp_path: Path) -> None:
    child = keyed()
    sweep = check_crash_points(mapper(child), Numbers(ns=[2, 3]), directory=tmp_path)
    sweep.assert_ok()  # each crash point ends as uninterrupted; no step ran twice
    assert (sweep.baseline.status, sweep.baseline.context["total"]) == ("succeeded", 14)
    [fan_out] = [c for c in sweep.commits if c.call == "start_children"]
    kinds = [e.kind for e in fan_out.events]
    assert kinds == [j.CHILDREN_STARTED, j.RUN_CREATED, j.RUN_CREATED]
    assert sorted(o.when for o in sweep.outcomes if o.commit is fan_out) == ["after", "before"]
    # Each child's claim took its key's slot: a crash point after it, none before.
    claims = [c for c in sweep.commits if c.call == "claim"]
    assert [len(c.claimed) for c in claims] == [1, 1], describe(sweep)
    assert {c.claimed[0][0] for c in claims} == {"cp_keyed"}
    for claim in claims:
        assert [o.when for o in sweep.outcomes if o.commit is claim] == ["after"]


def test_sweep__a_keyed_workflow_crashes_after_its_claim(tmp_path: Path) -> None:
    sweep = check_crash_points(keyed(), Item(n=3), directory=tmp_path)
    sweep.assert_ok()
    assert sweep.baseline.context["trail"] == ["first", "second"]
    calls = [c.call for c in sweep.commits]
    assert calls[:3] == ["create_run", "claim", "write"], describe(sweep)
    labels = [o.label for o in sweep.outcomes]
    assert [label for label in labels if "claim" in label] == [
        f"after {sweep.commits[1].describe()}"
    ]
    assert len(sweep.outcomes) == 2 * len(sweep.commits) - 1


# -- each new crash point by number, on SQLite and PostgreSQL ------------------------------


class Sync(BaseModel):
    rev: int


def sync() -> Workflow:
    wf = Workflow("cp_sync", context=Sync, max_queued=5)
    wf.step(name="push", initial=True, next="synced")(lambda ctx: None)
    wf.final("synced")
    return wf


Script = list[Callable[[TestEngine], object]]


def fan_out_script() -> tuple[list[Workflow], Script, Callable[[TestEngine], object]]:
    child = keyed()
    wf = mapper(child)
    script: Script = [
        lambda e: e.start(wf, Numbers(ns=[2, 3]), idempotency_key="cp"),
        lambda e: e.run_until_idle(),
    ]
    return [wf, child], script, lambda e: e.get(e.runs(workflow="cp_map")[0].id).context


def throttled(engine: TestEngine, wf: Workflow) -> None:
    try:
        engine.start(wf, Sync(rev=7), key="t", throttle=(1, 60))
    except StartThrottled:
        # Started again after a crash after its commit: the run that commit made counts.
        assert 7 in {r.context.rev for r in engine.runs(workflow="cp_sync")}  # type: ignore[union-attr]


def admission_script() -> tuple[list[Workflow], Script, Callable[[TestEngine], object]]:
    wf = sync()
    script: Script = [
        lambda e: e.start(wf, Sync(rev=1), key="s", debounce=30),
        lambda e: e.start(wf, Sync(rev=2), key="s", debounce=30),
        lambda e: throttled(e, wf),
        lambda e: e.start(wf, Sync(rev=9), idempotency_key="bounded"),  # max_queued
        lambda e: e.run_until_idle(),
    ]

    def ended(e: TestEngine) -> object:
        return sorted((r.status, r.context.rev) for r in e.runs(workflow="cp_sync"))  # type: ignore[union-attr]

    return [wf], script, ended


def inbox_script() -> tuple[list[Workflow], Script, Callable[[TestEngine], object]]:
    wf = Workflow("cp_inbox", context=Sync, max_inbox=2)
    wf.step(name="prep", initial=True, next="hold")(lambda ctx: None)
    wf.wait("hold", on={"go": "done"})
    wf.final("done")
    script: Script = [
        lambda e: e.start(wf, Sync(rev=1), idempotency_key="inbox"),
        # Kept for later (the run is not waiting yet), under max_inbox: keep_bounded.
        lambda e: e.send(e.runs(workflow="cp_inbox")[0].id, "go", buffer=True, dedupe_key="g"),
        lambda e: e.run_until_idle(),
    ]
    return [wf], script, lambda e: [(r.status, r.state) for r in e.runs(workflow="cp_inbox")]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def databases(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], str]]:
    """A new empty database per call: SQLite files, or PostgreSQL schemas (dropped after)."""
    made: list[str] = []
    admin = None
    if request.param == "postgres":
        require_pg()
        admin = sa.create_engine(pg_base_url())

    def new() -> str:
        made.append(f"t_{uuid.uuid4().hex[:16]}")
        if admin is None:
            return f"sqlite:///{tmp_path / made[-1]}.db"
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{made[-1]}"'))
        return with_search_path(pg_base_url(), made[-1])

    yield new
    if admin is not None:
        with admin.begin() as conn:
            for schema in made:
                conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@pytest.mark.parametrize(
    ("scenario", "call"),
    [
        (fan_out_script, "start_children"),
        (fan_out_script, "claim"),
        (admission_script, "debounce_start"),
        (admission_script, "throttled_start"),
        (admission_script, "start_bounded"),
        (inbox_script, "keep_bounded"),
    ],
)
def test_crash_at_commit__fan_out_and_admission_points(
    databases: Callable[[], str],
    scenario: Callable[[], tuple[list[Workflow], Script, Callable[[TestEngine], object]]],
    call: str,
) -> None:
    workflows, script, ended = scenario()

    def play(crash: tuple[int, str] | None) -> tuple[object, list[str], list[Commit]]:
        with TestEngine(databases(), workflows=workflows, clock=FakeClock(CLOCK_START)) as e:
            if crash is not None:
                e.crash_at_commit(*crash)
            crashed = []
            for part in script:
                try:
                    part(e)
                except SimulatedCrash as died:
                    crashed.append(died.point)
                    e.resume(skip_time=False)
                    part(e)  # the interrupted part of the script, again
            e.run_until_idle()
            assert all(e.replay(run.id).matches for run in e.runs())
            return ended(e), crashed, e.commits

    uninterrupted, _, commits = play(None)
    [number] = [c.number for c in commits if c.call == call][:1]
    for when in ("after",) if call == "claim" else ("before", "after"):
        end, crashed, _ = play((number, when))
        assert crashed == [f"{when} journal commit #{number}"]
        assert end == uninterrupted


def test_sweep__an_action_that_cannot_be_repeated_is_a_problem_of_its_crash_point(
    tmp_path: Path,
) -> None:
    # An event sent without a dedupe_key is sent again after a crash that came after it:
    # the run has moved on, the second send is refused. check_crash_points "raises nothing
    # itself": that InvalidTransition escaped it, naming no crash point and no remedy.
    from kitflows import waiting

    flow = waiting()

    def approve(engine: TestEngine, run_id: str) -> None:
        engine.send(run_id, "ok")  # no dedupe_key: not repeatable

    sweep = check_crash_points(flow, {}, actions=[approve], directory=tmp_path)
    assert sweep.baseline.status == "succeeded"
    broken = [o for o in sweep.failures if any("approve" in p for p in o.problems)]
    assert broken, describe(sweep)
    problem = next(p for p in broken[0].problems if "approve" in p)
    assert "InvalidTransition" in problem and "dedupe_key" in problem, problem
    with pytest.raises(AssertionError, match="dedupe_key"):
        sweep.assert_ok()

    def approve_once(engine: TestEngine, run_id: str) -> None:
        engine.send(run_id, "ok", dedupe_key="ok-1")

    assert not check_crash_points(flow, {}, actions=[approve_once], directory=tmp_path).failures


def test_sweep__an_action_that_never_ran_before_the_crash_is_not_blamed_for_repeating(
    tmp_path: Path,
) -> None:
    # A crash in the run_until_idle before an action (a non-idempotent step cut off, no
    # operator retry: the run fails) leaves the action its first call, on a failed run:
    # "actions must be repeatable" blamed an action that already sends with a dedupe_key
    # (a review). Said as what it is: the crash changed what the action found.
    flow = Workflow("sweep_once", context=Count)

    @flow.step(initial=True, next="approval", idempotent=False)
    def charge(ctx: Count) -> None:
        ctx.n += 1

    flow.wait("approval", on={"approve": "done"})
    flow.final("done")

    def approve(engine: TestEngine, run_id: str) -> None:
        engine.send(run_id, "approve", dedupe_key="approve-1")

    sweep = check_crash_points(
        flow, Count(), actions=[approve], operator_retry=False, directory=tmp_path
    )
    raised = [p for o in sweep.outcomes for p in o.problems if "raised" in p]
    assert raised, describe(sweep)
    assert not any("dedupe_key" in p for p in raised), raised
    assert all("after the crash, which changed what it found" in p for p in raised), raised
    assert all("the run is failed in state charge" in p for p in raised), raised


def test_sweep__two_lambdas_are_two_actions(tmp_path: Path) -> None:
    # Two actions both named '<lambda>': the second, not run yet when a crash cut off the
    # step before it, was blamed for being done again once the first had run (a review).
    flow = Workflow("sweep_two", context=Count)

    @flow.step(initial=True, next="asked")
    def first(ctx: Count) -> None:
        ctx.n += 1

    flow.wait("asked", on={"approve": "charge"})

    @flow.step(next="shipping", idempotent=False)
    def charge(ctx: Count) -> None:
        ctx.n += 10

    flow.wait("shipping", on={"ship": "done"})
    flow.final("done")
    actions = [
        lambda engine, run_id: engine.send(run_id, "approve", dedupe_key="a-1"),
        lambda engine, run_id: engine.send(run_id, "ship", dedupe_key="s-1"),
    ]
    sweep = check_crash_points(
        flow, Count(), actions=actions, operator_retry=False, directory=tmp_path
    )
    raised = [p for o in sweep.outcomes for p in o.problems if "raised" in p]
    assert raised, describe(sweep)
    assert all(p.startswith("action 2 '<lambda>' raised") for p in raised), raised
    assert not any("dedupe_key" in p for p in raised), raised
