"""``return step.sleep(delay, event)`` toward every kind of state, on SQLite and PostgreSQL,
on a fake clock: the run sits scheduled until the delay is over, then enters the next
state — a step starts, a wait's timeout counts and its events are taken, a call starts its
child, a final state ends the run, a compensating one runs its compensations. (The delay
was kept only toward a step: a wait counted its timeout from the sleep's start and took
events during it, a call started its child and a final state ended the run at once.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from flowloop import FakeClock, Step, Workflow
from flowloop import journal as j
from flowloop.cli.support import WAITING, WaitStates
from flowloop.cli.views import describe_event
from flowloop.clock import iso
from flowloop.events import NotWaiting
from flowloop.testing import SimulatedCrash, TestEngine

HOUR = 3600.0
SLEEP = 2 * HOUR


class C(BaseModel):
    target: str
    log: list[str] = []


def kid() -> Workflow:
    wf = Workflow("sleep_kid", context=C)

    @wf.step(initial=True, next="kdone")
    def k(ctx: C) -> None:
        ctx.log.append("kid ran")

    wf.final("kdone")
    return wf


def sleeper(deadline: float | None = None) -> Workflow:
    wf = Workflow(
        "sleep_then",
        context=C,
        deadline=deadline,
        on_deadline="expired" if deadline is not None else None,
    )
    on = {
        "step": "s2",
        "wait": "w",
        "call": "c",
        "map": "m",
        "final": "done",
        "undo": "cancelled",
    }

    @wf.step(initial=True, on=on, compensate=lambda ctx: ctx.log.append("undone"))
    def first(ctx: C, step: Step) -> object:
        return step.sleep(SLEEP, ctx.target)

    @wf.step(next="done")
    def s2(ctx: C) -> None:
        ctx.log.append("s2 ran")

    wf.wait("w", on={"reply": "done"}, timeout=HOUR, on_timeout="done")
    wf.call("c", child=kid(), context=lambda ctx: C(target="kid"), on={"succeeded": "done"})
    wf.map(
        "m",
        child=kid(),
        items=lambda ctx: [1, 2],
        context=lambda ctx, item: C(target="kid"),
        on={"done": "done", "failed": "done"},
    )
    wf.final("done", *(["expired"] if deadline is not None else []))
    wf.final("cancelled", compensate=True)
    return wf


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(auto_advance=False)


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[TestEngine]:
    with TestEngine(store_url, clock=clock, workflows=[sleeper(), kid()]) as engine:
        yield engine


def started(engine: TestEngine, target: str) -> tuple[str, float]:
    """A run of ``sleeper`` toward ``target``, its first step done (asleep); its id and
    when the sleep ends."""
    run = engine.start(sleeper(), C(target=target))
    t0 = engine.clock.now()
    engine.run_until_idle(skip_time=False)
    return run.id, t0 + SLEEP


def assert_asleep(engine: TestEngine, run_id: str, state: str, until: float) -> None:
    info = engine.get(run_id)
    assert (info.status, info.state, info.next_run_at) == ("scheduled", state, until)


def test_sleep__then_a_step_starts_it_after_the_delay(engine: TestEngine) -> None:
    run_id, until = started(engine, "step")
    assert_asleep(engine, run_id, "s2", until)
    engine.advance(SLEEP - 1)
    assert engine.get(run_id).context.log == []  # type: ignore[union-attr]
    engine.advance(1)
    info = engine.get(run_id)
    assert (info.status, info.context.log) == ("succeeded", ["s2 ran"])  # type: ignore[union-attr]
    assert engine.replay(run_id).differences == []


def test_sleep__then_a_wait_counts_its_timeout_from_the_sleeps_end(engine: TestEngine) -> None:
    run_id, until = started(engine, "wait")
    assert_asleep(engine, run_id, "w", until)
    assert engine.get(run_id).reason == j.ASLEEP
    engine.advance(SLEEP - 1)
    assert_asleep(engine, run_id, "w", until)  # no timeout an hour in
    engine.advance(1)
    info = engine.get(run_id)
    assert (info.status, info.state, info.next_run_at) == ("scheduled", "w", until + HOUR)
    assert info.reason is None
    engine.advance(HOUR - 1)
    assert engine.get(run_id).state == "w"
    engine.advance(1)
    info = engine.get(run_id)
    assert (info.status, info.state) == ("succeeded", "done")
    history = engine.history(run_id)
    assert [(e.kind, e.at) for e in history[-2:]] == [
        (j.SLEEP_ENDED, until),
        (j.EVENT_RECEIVED, until + HOUR),
    ]
    assert history[-1].event == "timeout"
    # `flowloop history` says so.
    assert describe_event(history[-3]) == f"first --wait--> w (asleep until {iso(until)})"
    assert describe_event(history[-2]) == f"waits in w until {iso(until + HOUR)}"
    assert engine.replay(run_id).differences == []


def test_sleep__then_a_wait_takes_no_event_before_the_sleeps_end(engine: TestEngine) -> None:
    run_id, until = started(engine, "wait")
    shown = WaitStates(engine)
    assert shown.status(engine.get(run_id)) == "scheduled"  # not shown waiting
    with pytest.raises(NotWaiting, match="asleep before state 'w'"):
        engine.send(run_id, "reply")
    assert engine.send(run_id, "reply", buffer=True).status == "buffered"
    assert engine.get(run_id).state == "w"  # kept, not taken
    engine.advance(SLEEP)
    info = engine.get(run_id)
    assert (info.status, info.state) == ("succeeded", "done")
    kinds = [(e.kind, e.event, e.at) for e in engine.history(run_id)[-2:]]
    assert kinds == [(j.SLEEP_ENDED, None, until), (j.EVENT_RECEIVED, "reply", until)]
    assert engine.replay(run_id).differences == []


def test_sleep__then_a_wait_shown_waiting_once_it_is_there(engine: TestEngine) -> None:
    run_id, _ = started(engine, "wait")
    engine.advance(SLEEP)
    assert WaitStates(engine).status(engine.get(run_id)) == WAITING
    engine.send(run_id, "reply")
    assert engine.get(run_id).status == "succeeded"


def test_sleep__then_a_call_starts_the_child_after_the_delay(engine: TestEngine) -> None:
    run_id, until = started(engine, "call")
    assert_asleep(engine, run_id, "c", until)
    engine.advance(SLEEP - 1)
    assert j.CHILDREN_STARTED not in [e.kind for e in engine.history(run_id)]
    engine.advance(1)
    info = engine.get(run_id)
    assert (info.status, info.state) == ("succeeded", "done")
    children = [e for e in engine.history(run_id) if e.kind == j.CHILDREN_STARTED]
    assert [e.at for e in children] == [until]
    assert engine.replay(run_id).differences == []


def test_sleep__then_a_final_state_ends_the_run_after_the_delay(engine: TestEngine) -> None:
    run_id, until = started(engine, "final")
    assert_asleep(engine, run_id, "done", until)
    engine.advance(SLEEP - 1)
    assert engine.get(run_id).status == "scheduled"
    engine.advance(1)
    info = engine.get(run_id)
    assert (info.status, info.state, info.reason) == ("succeeded", "done", None)
    last = engine.history(run_id)[-1]
    assert (last.kind, last.at) == (j.SLEEP_ENDED, until)
    assert engine.replay(run_id).differences == []


def test_sleep__then_a_compensating_state_undoes_after_the_delay(engine: TestEngine) -> None:
    run_id, until = started(engine, "undo")
    assert_asleep(engine, run_id, "cancelled", until)
    engine.advance(SLEEP - 1)
    assert engine.get(run_id).context.log == []  # type: ignore[union-attr]
    engine.advance(1)
    info = engine.get(run_id)
    assert (info.status, info.context.log) == ("succeeded", ["undone"])  # type: ignore[union-attr]
    undo = [e.at for e in engine.history(run_id) if e.kind == j.COMPENSATION_STARTED]
    assert undo == [until]
    assert engine.replay(run_id).differences == []


STATES = {"step": "s2", "wait": "w", "call": "c", "map": "m", "final": "done", "undo": "cancelled"}
ENTERS = {  # the entry by which the run enters (or starts) the state after its sleep
    "step": j.STEP_STARTED,
    "wait": j.SLEEP_ENDED,
    "call": j.CHILDREN_STARTED,
    "map": j.CHILDREN_STARTED,
    "final": j.SLEEP_ENDED,
    "undo": j.COMPENSATION_STARTED,
}


def entered(engine: TestEngine, run_id: str, target: str) -> list[float]:
    """When the run entered (or started) the state ``target`` names, after its sleep."""
    state, kind = STATES[target], ENTERS[target]
    if kind == j.COMPENSATION_STARTED:  # (in the state each undoes)
        return [e.at for e in engine.history(run_id) if e.kind == kind]
    return [e.at for e in engine.history(run_id) if e.kind == kind and e.state == state]


@pytest.mark.parametrize("target", list(STATES))
def test_sleep__paused_and_unpaused_it_sleeps_on(engine: TestEngine, target: str) -> None:
    """Toward a step, call, map or compensating state the unpause made the run due at
    once: the rest of the sleep was skipped (kept only toward a wait or final state)."""
    run_id, until = started(engine, target)
    engine.advance(HOUR)
    engine.pause(run_id)
    engine.advance(HOUR / 2)
    engine.unpause(run_id)
    assert_asleep(engine, run_id, STATES[target], until)
    asleep = target in ("wait", "final")
    assert engine.get(run_id).reason == (j.ASLEEP if asleep else None)
    engine.advance(HOUR / 2 - 1)
    assert engine.get(run_id).status == "scheduled"
    assert entered(engine, run_id, target) == []
    # Paused and unpaused again: the same end.
    engine.pause(run_id)
    engine.unpause(run_id)
    assert_asleep(engine, run_id, STATES[target], until)
    engine.advance(1)
    assert entered(engine, run_id, target) == [until]
    assert engine.replay(run_id).differences == []


@pytest.mark.parametrize("target", list(STATES))
def test_sleep__unpaused_after_its_end_enters_the_state_at_once(
    engine: TestEngine, target: str
) -> None:
    run_id, until = started(engine, target)
    engine.advance(HOUR)
    engine.pause(run_id)
    engine.advance(2 * HOUR)
    engine.unpause(run_id)
    now = engine.clock.now()
    assert engine.get(run_id).next_run_at == until  # (past: due at once)
    engine.run_until_idle(skip_time=False)
    assert entered(engine, run_id, target) == [now]
    assert engine.replay(run_id).differences == []


@pytest.mark.parametrize("target", ["step", "wait", "final", "undo"])
def test_sleep__unpaused_without_the_definition_it_sleeps_on(
    store_url: str, clock: FakeClock, target: str
) -> None:
    """`flowloop unpause` without -w: the stored definition's wait states and the journal
    tell the sleep (and whether the run sleeps ``asleep``)."""
    with TestEngine(store_url, clock=clock, workflows=[sleeper(), kid()]) as engine:
        run_id, until = started(engine, target)
        engine.advance(HOUR)
        engine.pause(run_id)
    with TestEngine(store_url, clock=clock) as bare:
        bare.unpause(run_id)
    with TestEngine(store_url, clock=clock, workflows=[sleeper(), kid()]) as engine:
        assert_asleep(engine, run_id, STATES[target], until)
        asleep = target in ("wait", "final")
        assert engine.get(run_id).reason == (j.ASLEEP if asleep else None)
        engine.advance(HOUR - 1)
        assert entered(engine, run_id, target) == []
        engine.advance(1)
        assert entered(engine, run_id, target) == [until]
        assert engine.replay(run_id).differences == []


def test_sleep__a_child_asleep_sleeps_on_through_its_parents_pause(
    store_url: str, clock: FakeClock
) -> None:
    """A parent's pause and unpause reach its child asleep before a step: it sleeps on."""
    parent = Workflow("sleep_parent", context=C)
    parent.call(
        "p",
        child=sleeper(),
        context=lambda ctx: C(target="step"),
        on={"succeeded": "pdone"},
        initial=True,
    )
    parent.final("pdone")
    with TestEngine(store_url, clock=clock, workflows=[parent, sleeper(), kid()]) as engine:
        run = engine.start(parent, C(target="parent"))
        engine.run_until_idle(skip_time=False)
        until = clock.now() + SLEEP
        (child,) = engine.runs(workflow="sleep_then")
        assert_asleep(engine, child.id, "s2", until)
        engine.advance(HOUR)
        engine.pause(run.id)
        assert engine.get(child.id).status == "paused"
        engine.unpause(run.id)
        assert_asleep(engine, child.id, "s2", until)
        engine.advance(HOUR - 1)
        assert entered(engine, child.id, "step") == []
        engine.advance(1)
        assert entered(engine, child.id, "step") == [until]
        assert engine.get(run.id).status == "succeeded"
        assert engine.replay(child.id).differences == []


def test_sleep__a_deadline_during_it_moves_the_run_on(store_url: str, clock: FakeClock) -> None:
    wf = sleeper(deadline=HOUR)
    with TestEngine(store_url, clock=clock, workflows=[wf, kid()]) as engine:
        run = engine.start(wf, C(target="final"))
        engine.run_until_idle(skip_time=False)
        assert engine.get(run.id).next_run_at == clock.now() + HOUR  # the deadline first
        engine.advance(HOUR)
        info = engine.get(run.id)
        assert (info.status, info.state) == ("succeeded", "expired")
        kinds = [e.kind for e in engine.history(run.id)]
        assert kinds[-1] == j.DEADLINE_PASSED and j.SLEEP_ENDED not in kinds
        assert engine.replay(run.id).differences == []


def test_sleep__a_crash_after_the_step_keeps_the_sleep(engine: TestEngine) -> None:
    run = engine.start(sleeper(), C(target="wait"))
    until = engine.clock.now() + SLEEP
    engine.crash_at("first", "after")
    with pytest.raises(SimulatedCrash):
        engine.run_until_idle()
    engine.resume()
    history = engine.history(run.id)
    assert [(e.kind, e.at) for e in history if e.kind == j.SLEEP_ENDED] == [(j.SLEEP_ENDED, until)]
    assert history[-1].at == until + HOUR  # the wait's timeout, counted from then
    assert engine.replay(run.id).differences == []


def test_sleep__engine_run_drives_through_it_to_the_wait(store_url: str) -> None:
    """``engine.run`` waits out a short sleep as it does before a step: it returns once
    the run waits in the state, not while it is still asleep before it."""
    wf = Workflow("nap_then_wait", context=C)

    @wf.step(initial=True, next="w")
    def nap(ctx: C, step: Step) -> object:
        return step.sleep(60)

    wf.wait("w", on={"reply": "done"})
    wf.final("done")
    with TestEngine(store_url, clock=FakeClock(auto_advance=True), workflows=[wf]) as engine:
        t0 = engine.clock.now()
        info = engine.run(wf, C(target="wait"))
        assert (info.status, info.state, info.reason) == ("scheduled", "w", None)
        assert [e.at for e in engine.history(info.id) if e.kind == j.SLEEP_ENDED] == [t0 + 60]
