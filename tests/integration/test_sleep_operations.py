"""A run asleep (``step.sleep``) before its next state, under an operator's hand and a
deadline, on SQLite and PostgreSQL, on a fake clock: a migration keeps the sleep (it made
the run wait at once, or run its next step at once, and refused a final state with advice
no mapping could follow); a deadline passing during a sleep before a compensating state
moves the run to ``on_deadline`` (it ran the compensations at the deadline); a run stopped
asleep before its final state can be retried; ``flowloop run`` says the run is asleep, not
waiting; schema revision 0020 makes an older flowloop refuse the database and its
downgrade refuses while such a run could be misread."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest
from pydantic import BaseModel
from storekit import to_revision

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.events import NotWaiting
from flowloop.testing import TestEngine

HOUR = 3600.0
SLEEP = 2 * HOUR


class C(BaseModel):
    log: list[str] = []


def napper(
    version: int,
    wait: str = "w",
    *,
    migrates: Mapping[int, Mapping[str, str]] | None = None,
    into: str = "wait",
) -> Workflow:
    """Sleeps two hours into wait ``wait`` (one hour's timeout), or into final ``done``."""
    wf = Workflow("napper", context=C, version=version, migrates_from=migrates)

    @wf.step(initial=True, next=wait if into == "wait" else "done")
    def first(ctx: C, step: Step) -> object:
        return step.sleep(SLEEP)

    if into == "wait":
        wf.wait(wait, on={"reply": "done"}, timeout=HOUR, on_timeout="done")
    wf.final("done")
    return wf


def checker(version: int = 2) -> Workflow:
    """v2 of :func:`napper`: its wait ``w`` became the step ``check`` (v1: sleeps two hours
    into the step ``check``)."""
    migrates = {1: {"w": "check"}} if version == 2 else None
    wf = Workflow("napper", context=C, version=version, migrates_from=migrates)

    @wf.step(initial=True, next="check")
    def first(ctx: C, step: Step) -> object:
        return step.sleep(SLEEP)

    @wf.step(next="done")
    def check(ctx: C) -> None:
        ctx.log.append("checked")

    wf.final("done")
    return wf


def asleep(engine: TestEngine, wf: Workflow) -> tuple[str, float]:
    """A run of ``wf`` asleep after its first step; its id and when the sleep ends."""
    run = engine.start(wf, C())
    until = engine.clock.now() + SLEEP
    engine.run_until_idle(skip_time=False)
    assert engine.get(run.id).reason == j.ASLEEP
    return run.id, until


# -- migrate -----------------------------------------------------------------------------


@pytest.mark.parametrize("paused", [False, True])
def test_migrate__a_run_asleep_before_a_renamed_wait_sleeps_on(
    store_url: str, paused: bool
) -> None:
    v1, v2 = napper(1), napper(2, "w2", migrates={1: {"w": "w2"}})
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[v1, v2]) as engine:
        run_id, until = asleep(engine, v1)
        if paused:
            engine.pause(run_id)
        engine.migrate(run_id, to=2)
        if paused:
            engine.unpause(run_id)
        info = engine.get(run_id)
        assert (info.version, info.status, info.state) == (2, "scheduled", "w2")
        assert (info.reason, info.next_run_at) == (j.ASLEEP, until)
        with pytest.raises(NotWaiting, match="asleep before state 'w2'"):
            engine.send(run_id, "reply")
        engine.advance(SLEEP - 1)
        assert engine.get(run_id).reason == j.ASLEEP
        engine.advance(1)
        info = engine.get(run_id)
        assert (info.state, info.reason, info.next_run_at) == ("w2", None, until + HOUR)
        engine.advance(HOUR)
        info = engine.get(run_id)
        assert (info.status, info.state) == ("succeeded", "done")
        assert engine.history(run_id)[-1].event == "timeout"
        assert engine.replay(run_id).differences == []


@pytest.mark.parametrize("paused", [False, True])
def test_migrate__a_run_asleep_before_a_wait_made_a_step_runs_it_when_the_sleep_ends(
    store_url: str, paused: bool
) -> None:
    """Paused (by an operator) while asleep, then moved and unpaused, it ran the step at
    once: the rest of the sleep was lost."""
    v1, v2 = napper(1), checker()
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[v1, v2]) as engine:
        run_id, until = asleep(engine, v1)
        if paused:
            engine.pause(run_id)
        engine.migrate(run_id, to=2)
        slept = HOUR if paused else 0.0
        if paused:
            engine.advance(slept)
            engine.unpause(run_id)
        info = engine.get(run_id)
        assert (info.state, info.reason, info.next_run_at) == ("check", None, until)
        engine.advance(SLEEP - slept - 1)
        assert engine.get(run_id).context.log == []  # type: ignore[union-attr]
        engine.advance(1)
        info = engine.get(run_id)
        assert (info.status, info.context.log) == ("succeeded", ["checked"])  # type: ignore[union-attr]
        assert [e.at for e in engine.history(run_id) if e.kind == j.STEP_STARTED][-1] == until
        assert engine.replay(run_id).differences == []


@pytest.mark.parametrize("paused", [False, True])
def test_migrate__a_run_asleep_before_a_step_made_a_wait_sleeps_on_before_it(
    store_url: str, paused: bool
) -> None:
    """Moved into a wait while asleep before a step, the run was in the wait at once: it
    took events during the sleep, and its timeout came at the sleep's end."""
    v1, v2 = checker(1), napper(2, migrates={1: {"check": "w"}})
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[v1, v2]) as engine:
        run = engine.start(v1, C())
        until = clock.now() + SLEEP
        engine.run_until_idle(skip_time=False)
        info = engine.get(run.id)
        assert (info.state, info.reason, info.next_run_at) == ("check", None, until)
        engine.advance(HOUR)
        if paused:
            engine.pause(run.id)
        engine.migrate(run.id, to=2)
        if paused:
            engine.unpause(run.id)
        info = engine.get(run.id)
        assert (info.version, info.status, info.state) == (2, "scheduled", "w")
        assert (info.reason, info.next_run_at) == (j.ASLEEP, until)
        with pytest.raises(NotWaiting, match="asleep before state 'w'"):
            engine.send(run.id, "reply")
        engine.advance(HOUR - 1)
        assert engine.get(run.id).reason == j.ASLEEP
        engine.advance(1)
        info = engine.get(run.id)
        assert (info.state, info.reason, info.next_run_at) == ("w", None, until + HOUR)
        engine.advance(HOUR)
        info = engine.get(run.id)
        assert (info.status, info.state) == ("succeeded", "done")
        last = engine.history(run.id)[-1]
        assert (last.event, last.at) == ("timeout", until + HOUR)
        assert engine.replay(run.id).differences == []


def test_migrate__a_run_asleep_before_its_final_state_moves_and_ends_when_the_sleep_ends(
    store_url: str,
) -> None:
    """A run asleep before its final state has not ended: it moves (it was refused with
    "add it to migrates_from", which no mapping could satisfy)."""
    v1, v2 = napper(1, into="final"), napper(2, into="final", migrates={1: {}})
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[v1, v2]) as engine:
        run_id, until = asleep(engine, v1)
        assert engine.migrate_workflow("napper", to=2)[0].problem is None
        info = engine.get(run_id)
        assert (info.version, info.status, info.state) == (2, "scheduled", "done")
        assert (info.reason, info.next_run_at) == (j.ASLEEP, until)
        engine.advance(SLEEP)
        info = engine.get(run_id)
        assert (info.status, info.state, info.reason) == ("succeeded", "done", None)
        assert (engine.history(run_id)[-1].kind, engine.history(run_id)[-1].at) == (
            j.SLEEP_ENDED,
            until,
        )
        assert engine.replay(run_id).differences == []


# -- a deadline during a sleep before a compensating state -------------------------------


def undoer(*, deadline: float, sleep: float, fails: int = 0) -> Workflow:
    """Sleeps ``sleep`` into ``cancelled`` (compensating); its compensation fails
    ``fails`` times first, each retried an hour later."""
    wf = Workflow("undoer", context=C, deadline=deadline, on_deadline="expired")
    failures = [fails]

    def undo(ctx: C) -> None:
        if failures[0]:
            failures[0] -= 1
            raise RuntimeError("not yet")
        ctx.log.append("undone")

    retry = Retry(attempts=3, backoff="fixed", base=HOUR)

    @wf.step(initial=True, next="cancelled", compensate=undo, compensate_retry=retry)
    def first(ctx: C, step: Step) -> object:
        return step.sleep(sleep)

    wf.final("cancelled", compensate=True)
    wf.final("expired")
    return wf


def test_deadline__passing_during_a_sleep_before_a_compensating_state_moves_the_run_on(
    store_url: str,
) -> None:
    wf = undoer(deadline=1.5 * HOUR, sleep=SLEEP)
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        run = engine.start(wf, C())
        t0 = clock.now()
        engine.run_until_idle(skip_time=False)
        engine.advance(1.5 * HOUR)
        info = engine.get(run.id)
        assert (info.status, info.state, info.context.log) == ("succeeded", "expired", [])  # type: ignore[union-attr]
        kinds = [(e.kind, e.at) for e in engine.history(run.id)]
        assert kinds[-1] == (j.DEADLINE_PASSED, t0 + 1.5 * HOUR)
        assert j.COMPENSATION_STARTED not in [kind for kind, _ in kinds]
        assert engine.replay(run.id).differences == []


def test_deadline__compensations_begun_before_it_are_not_cut_off(store_url: str) -> None:
    """The sleep ends before the deadline: the compensations begin, one fails and is
    retried past the deadline — still running them, the run is not moved."""
    wf = undoer(deadline=1.5 * HOUR, sleep=HOUR, fails=1)
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        run = engine.start(wf, C())
        engine.run_until_idle(skip_time=False)
        engine.advance(3 * HOUR)
        info = engine.get(run.id)
        assert (info.status, info.state, info.context.log) == ("succeeded", "cancelled", ["undone"])  # type: ignore[union-attr]
        assert j.DEADLINE_PASSED not in [e.kind for e in engine.history(run.id)]


# -- retry of a run stopped asleep ---------------------------------------------------------


@pytest.mark.parametrize("into", ["final", "wait"])
def test_retry__a_run_stopped_asleep_enters_its_state_at_once(store_url: str, into: str) -> None:
    """Stopped asleep before its final state, a run could not be retried ("cannot retry
    from 'done'"): its retry enters the state at once, as one before a wait state waits
    there at once (and one before a step runs it at once)."""
    wf = napper(1, into=into)
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        run_id, _ = asleep(engine, wf)
        engine.advance(HOUR)
        engine.stop(run_id)
        engine.advance(HOUR)
        retried_at = clock.now()
        engine.retry(run_id)
        engine.run_until_idle(skip_time=False)
        info = engine.get(run_id)
        if into == "final":
            assert (info.status, info.state) == ("succeeded", "done")
            last = engine.history(run_id)[-1]
            assert (last.kind, last.at) == (j.SLEEP_ENDED, retried_at)
        else:
            assert (info.state, info.reason, info.next_run_at) == ("w", None, retried_at + HOUR)
            assert engine.send(run_id, "reply").run.status == "succeeded"
        assert engine.replay(run_id).differences == []


# -- flowloop run ------------------------------------------------------------------------

NAP_FILE = """
from pydantic import BaseModel
from flowloop import Step, Workflow

class C(BaseModel):
    n: int = 0

nap = Workflow("cli_nap", context=C)

@nap.step(initial=True, next="w")
def first(ctx: C, step: Step):
    return step.sleep(7200)

nap.wait("w", on={"reply": "done"}, timeout=3600, on_timeout="done")
nap.final("done")
"""


def test_cli_run__says_a_run_asleep_before_its_wait_state_is_asleep(tmp_path: Path) -> None:
    """It said "waits in w for reply; times out at <the sleep's end>" with a `flowloop send`
    that was then refused."""
    from click.testing import CliRunner

    from flowloop.cli import cli
    from flowloop.clock import iso

    flows = tmp_path / "nap.py"
    flows.write_text(NAP_FILE)
    db = str(tmp_path / "nap.db")
    said = CliRunner().invoke(cli, ["run", str(flows), "--db", db], env={"COLUMNS": "300"})
    assert said.exit_code == 0, said.output
    with Engine(db) as engine:
        info = engine.runs()[0]
    last = said.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"run {info.id} is asleep until {iso(info.next_run_at)} before entering w;"
    ), last
    assert "flowloop send" not in last


@pytest.mark.parametrize("into", ["wait", "final"])
def test_cli_status__names_when_a_run_asleep_wakes_and_the_state_it_enters(
    store_url: str, into: str
) -> None:
    """It said only "scheduled (asleep)", the state line naming a state the run is not in
    yet."""
    from click.testing import CliRunner

    from flowloop.cli import cli
    from flowloop.clock import iso

    wf = napper(1, into=into)
    with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=[wf]) as engine:
        run_id, until = asleep(engine, wf)
        engine.pause(run_id)
        engine.unpause(run_id)  # (its latest entry with the sleep's end)
    said = CliRunner().invoke(cli, ["status", run_id, "--db", store_url], env={"COLUMNS": "300"})
    assert said.exit_code == 0, said.output
    state = "w" if into == "wait" else "done"
    lines = said.stdout.splitlines()
    assert f"status    scheduled (asleep until {iso(until)}, then enters {state})" in lines, lines


# -- schema revision 0020 --------------------------------------------------------------------


def test_migration_0020__downgrade_refused_while_a_run_slept_before_its_state(
    store_url: str,
) -> None:
    wf = napper(1)
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        run_id, _ = asleep(engine, wf)
    with pytest.raises(RuntimeError, match=f"run {run_id} \\(scheduled\\) slept before a wait"):
        to_revision(store_url, "0019")
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        engine.advance(SLEEP)  # waits in w now: entered by sleep_ended
        assert engine.get(run_id).reason is None
    with pytest.raises(RuntimeError, match=f"run {run_id} \\(scheduled\\)"):
        to_revision(store_url, "0019")
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        engine.send(run_id, "reply")
        assert engine.get(run_id).status == "succeeded"
    to_revision(store_url, "0019")  # (succeeded: it never moves again)
    to_revision(store_url, "head")
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        assert engine.get(run_id).status == "succeeded"


def test_migration_0020__downgrade_refused_while_a_run_passed_its_deadline_in_a_backoff(
    store_url: str,
) -> None:
    wf = Workflow("backoff_late", context=C, deadline=HOUR, on_deadline="late")

    @wf.step(initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=2 * HOUR))
    def flaky(ctx: C) -> None:
        raise RuntimeError("down")

    wf.wait("late", on={"ack": "done"})
    wf.final("done")
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        run = engine.start(wf, C())
        engine.advance(HOUR)
        assert engine.get(run.id).state == "late"
    with pytest.raises(RuntimeError, match=f"run {run.id} .* deadline in a retry backoff"):
        to_revision(store_url, "0019")
    with TestEngine(store_url, clock=clock, workflows=[wf]) as engine:
        engine.send(run.id, "ack")
    to_revision(store_url, "0019")
    to_revision(store_url, "head")


def test_migration_0020__downgrade_refused_with_an_entry_between_the_backoff_and_deadline(
    store_url: str,
) -> None:
    """A migration (or a deferral) between the failure backing off and the deadline keeps
    the run retrying: the first check looked at the entry just before only (review)."""

    def flow(version: int) -> Workflow:
        wf = Workflow(
            "backoff_moved",
            context=C,
            version=version,
            deadline=HOUR,
            on_deadline="late",
            migrates_from={1: {}} if version == 2 else None,
        )

        @wf.step(initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=2 * HOUR))
        def flaky(ctx: C) -> None:
            raise RuntimeError("down")

        wf.wait("late", on={"ack": "done"})
        wf.final("done")
        return wf

    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[flow(1)]) as engine:
        run = engine.start(engine.workflow("backoff_moved"), C())
        engine.run_until_idle(idle_horizon=0)
        assert engine.get(run.id).status == "retrying"
    with TestEngine(store_url, clock=clock, workflows=[flow(1), flow(2)]) as engine:
        engine.migrate(run.id, to=2, by="deployer")
        engine.advance(HOUR)
        kinds = [e.kind for e in engine.history(run.id)][-3:]
        assert kinds == ["step_failed", "run_migrated", "deadline_passed"], kinds
    with pytest.raises(RuntimeError, match=f"run {run.id} .* deadline in a retry backoff"):
        to_revision(store_url, "0019")
