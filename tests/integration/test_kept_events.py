"""Events kept for a run (its inbox) that a worker died before handing over, and events a
wait's handler refuses: on SQLite and PostgreSQL, on a FakeClock (and, for a worker that
keeps running, with real worker processes)."""

from __future__ import annotations

import logging
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, field_validator
from storekit import to_revision
from waitkit import (
    ALL,
    HERE,
    Chain,
    Empty,
    _env,
    assert_journal_sound,
    chain,
    ctx,
    gated,
    hold_command,
    inbox_rows,
    kinds,
    parked,
    received,
    review,
    wait_until,
    workers,
)

from flowloop import Engine, FakeClock, Workflow, kept
from flowloop.cli import main
from flowloop.events import EventRefused
from flowloop.kept import accepting, hand_over_stranded
from flowloop.store import InboxEvent
from flowloop.testing import SimulatedCrash, TestEngine


@pytest.fixture
def engine(store_url: str) -> Iterator[TestEngine]:
    with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=ALL) as engine:
        yield engine


def test_kept_event__a_worker_killed_after_entering_the_wait_leaves_it_to_the_next_worker(
    engine: TestEngine,
) -> None:
    # Sent before the run reached its wait (kept), the event is handed over by the worker
    # right after the commit that enters the wait. Killed between the two, the run waited
    # for ever (the wait has no timeout; no claim, no sender would come back for it).
    run = engine.start(chain, Chain())
    assert engine.send(run.id, "go", buffer=True).status == "buffered"
    engine.crash_at("begin_chain", "after")  # step_succeeded → first committed, then dead
    with pytest.raises(SimulatedCrash):
        engine.run_until_idle()
    engine.resume()  # the next worker to start
    info = engine.get(run.id)
    assert (info.status, info.state) == ("scheduled", "second")
    [taken] = received(engine, run.id, "go")
    assert [row.consumed_seq for row in inbox_rows(engine.url, run.id)] == [taken.seq]
    assert_journal_sound(engine, run.id)


STARTUP_S = 20.0
"""Bound for a worker process to start and act (imports included), on a slow machine."""
LEASE_S = 4
"""The running worker's lease: its recovery sweep comes every half of it (2 s)."""


def test_kept_event__a_worker_killed_after_entering_the_wait_leaves_it_to_a_running_worker(
    store_url: str, tmp_path: Path
) -> None:
    # Worker A drives a run; an event is kept for it meanwhile; A is SIGKILLed right after
    # the commit that enters the wait, before it hands the event over. Worker B was running
    # all along (its start, and the look for stranded events it did then, came before):
    # it hands the event over at one of its recovery sweeps, and the run goes on. Before,
    # nothing did until some process started: the wait has no timeout.
    with (
        Engine(store_url, workflows=[*ALL, gated]) as engine,
        workers(store_url, tmp_path) as start,
    ):
        b = start("--lease", str(LEASE_S))
        marker = engine.start(parked, Empty()).id  # B has begun claiming: its start is over
        wait_until(
            lambda: engine.get(marker).state == "parked" and engine.get(marker).owner is None,
            timeout=STARTUP_S,
            what="worker B drives a run (its start-up sweep done)",
            diagnose=b.output,
        )
        out = tmp_path / "a.log"
        with out.open("w") as log:
            a = subprocess.Popen(
                hold_command(store_url),
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(),
                text=True,
            )
        try:
            holding = wait_until(
                lambda: re.search(r"holding (\w+)", out.read_text()),
                timeout=STARTUP_S,
                what="worker A holds its run in its first step",
                diagnose=out.read_text,
            )
            run_id = holding.group(1)
            assert engine.send(run_id, "go", buffer=True).status == "buffered"  # A holds it
            assert a.stdin is not None
            a.stdin.write("\n")  # A's step returns: A enters the wait, and is killed
            a.stdin.flush()
            assert a.wait(timeout=STARTUP_S) == -9, out.read_text()
        finally:
            if a.poll() is None:
                a.kill()
                a.wait()
        info = wait_until(
            lambda: (i := engine.get(run_id)).finished and i,
            timeout=3 * LEASE_S,
            what="worker B hands the kept event over and the run goes on",
            diagnose=b.output,
        )
        assert b.proc.poll() is None  # the same B, never restarted
        assert (info.status, info.state, ctx(info).n) == ("succeeded", "done", 1)
        [taken] = received(engine, run_id, "go")
        assert f":{b.pid}:" in (taken.worker or "")
        assert [row.consumed_seq for row in inbox_rows(store_url, run_id)] == [taken.seq]
        entered = kinds(engine, run_id)[taken.seq - 2]
        assert entered == "step_succeeded"  # taken right after the wait began: nothing between
        assert_journal_sound(engine, run_id)


def test_stranded_look__finds_only_free_runs_whose_state_takes_a_kept_event(
    engine: TestEngine,
) -> None:
    # Every recovery sweep looks: a run waiting with events kept for a later state is not
    # stranded, and is not read again (found by the look, it cost two reads per sweep).
    run = engine.start(chain, Chain())
    engine.run_until_idle()
    assert engine.get(run.id).state == "first"
    assert engine.send(run.id, "note", {"text": "later"}, buffer=True).status == "buffered"
    takers = accepting(engine.workflows)
    assert ("chain", "first", "go") in takers and ("chain", "first", "note") not in takers
    assert engine.store.kept_for_free_runs(takers, after="", limit=10) == []
    # A `go` kept and not handed over (its worker killed right after the run's wait began).
    stranded = InboxEvent(
        run_id=run.id, event="go", payload=None, dedupe_key=None, sent_at=engine.clock.now()
    )
    assert engine.store.deliver(stranded, None) == "buffered"
    assert engine.store.kept_for_free_runs(takers, after="", limit=10) == [run.id]
    assert engine.store.kept_for_free_runs(takers, after=run.id, limit=10) == []
    now = engine.clock.now()
    assert hand_over_stranded(engine.store, engine.workflows, now=now, worker="w") == 2
    info = engine.get(run.id)  # `go`, then `note` (second takes it), in the order kept
    assert (info.status, info.state, ctx(info).notes) == ("scheduled", "second", ["later"])
    assert engine.store.kept_for_free_runs(takers, after="", limit=10) == []
    assert_journal_sound(engine, run.id)


def test_stranded_look__a_run_it_cannot_hand_over_is_parked_after_a_few_looks_event_kept(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Audit: a hand-over that failed for a cause of its own (not an outage, not the run's
    # definition) was tried again at every recovery sweep, for ever, and said once at
    # WARNING. It is parked at the HAND_OVER_TRIES-th look in a row now, the error in its
    # journal; the event stays kept, and an unpause hands it over.
    run = engine.start(chain, Chain())
    engine.run_until_idle()
    stranded = InboxEvent(
        run_id=run.id, event="go", payload=None, dedupe_key=None, sent_at=engine.clock.now()
    )
    assert engine.store.deliver(stranded, None) == "buffered"

    def broken(*args: object, **kwargs: object) -> int:
        raise RuntimeError("a journal entry the database refuses")

    failing: dict[str, int] = {}
    now = engine.clock.now()
    with monkeypatch.context() as patched, caplog.at_level(logging.DEBUG, logger="flowloop"):
        patched.setattr("flowloop.kept.deliver_pending", broken)
        for tries in range(1, kept.HAND_OVER_TRIES):
            handed = hand_over_stranded(
                engine.store, engine.workflows, now=now, worker="w", failing=failing
            )
            assert handed == 0 and failing == {run.id: tries}
            assert engine.get(run.id).status == "scheduled"
        handed = hand_over_stranded(
            engine.store, engine.workflows, now=now, worker="w", failing=failing
        )
        assert (handed, failing) == (0, {})
        info = engine.get(run.id)
        assert (info.status, info.state, info.reason) == ("paused", "first", "kept_events_failed")
        [pause] = [e for e in engine.store.journal(run.id) if e.kind == "run_paused"]
        assert pause.error_message == (
            "its kept events could not be handed over at 3 tries in a row: "
            "a journal entry the database refuses"
        )
        ran = [(e.kind, e.data.get(kept.KEPT_FAILED)) for e in engine.store.journal(run.id)]
        assert ran[-3:] == [("run_released", 1), ("run_released", 2), ("run_paused", None)]
        # Parked: not found, nor tried, again.
        assert engine.store.kept_for_free_runs(accepting(engine.workflows), after="", limit=9) == []
    said = [r.levelname for r in caplog.records if "could not deliver" in r.getMessage()]
    assert said == ["WARNING"] + ["DEBUG"] * (kept.HAND_OVER_TRIES - 1)
    assert [row.consumed_seq for row in inbox_rows(engine.url, run.id)] == [None]  # kept
    engine.unpause(run.id)  # (the cause fixed)
    info = engine.get(run.id)
    assert (info.status, info.state) == ("scheduled", "second")
    [taken] = received(engine, run.id, "go")
    assert [row.consumed_seq for row in inbox_rows(engine.url, run.id)] == [taken.seq]
    assert_journal_sound(engine, run.id)


def test_stranded_look__a_look_that_hands_it_over_starts_the_count_again(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failures in a row park a run, not failures now and then (a conflict, a deadlock).
    run = engine.start(chain, Chain())
    engine.run_until_idle()
    failing: dict[str, int] = {run.id: kept.HAND_OVER_TRIES - 1}
    stranded = InboxEvent(run_id=run.id, event="go", payload=None, dedupe_key=None, sent_at=0.0)
    assert engine.store.deliver(stranded, None) == "buffered"
    now = engine.clock.now()
    assert hand_over_stranded(engine.store, engine.workflows, now=now, worker="w", failing=failing)
    assert failing == {} and engine.get(run.id).state == "second"


def _kept_index(url: str) -> list[str]:
    inspected = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        return [
            str(index["column_names"])
            for index in sa.inspect(inspected).get_indexes("flowloop_inbox")
            if index["name"] == "ix_flowloop_inbox_kept"
        ]
    finally:
        inspected.dispose()


def test_migration_0022__the_kept_events_index_comes_and_goes(engine: TestEngine) -> None:
    assert _kept_index(engine.url) == ["['run_id', 'event']"]
    to_revision(engine.url, "0021")
    assert _kept_index(engine.url) == []
    to_revision(engine.url, "head")
    assert _kept_index(engine.url) == ["['run_id', 'event']"]


def test_kept_event__a_timed_wait_takes_it_at_the_next_worker_start_not_at_its_timeout(
    engine: TestEngine,
) -> None:
    run = engine.start(review, {"doc_id": "K1"})
    assert engine.send(run.id, "approve", {"by": "ann"}, buffer=True).status == "buffered"
    engine.crash_at("prepare", "after")
    with pytest.raises(SimulatedCrash):
        engine.run_until_idle()
    started = engine.clock.now()
    engine.resume()
    info = engine.get(run.id)
    assert (info.status, info.state) == ("succeeded", "approved")  # not "expired" 2 days on
    [taken] = received(engine, run.id, "approve")
    assert taken.at == started
    assert_journal_sound(engine, run.id)


def test_send__an_event_its_handler_refuses_is_one_flowloop_error_and_the_run_still_waits(
    engine: TestEngine,
) -> None:
    run = engine.run(review, {"doc_id": "H1"})
    before = kinds(engine, run.id)
    with pytest.raises(EventRefused) as refused:
        engine.send(run.id, "approve", {"by": "!mallory"}, dedupe_key="hook-1")
    assert str(refused.value) == (
        "state 'awaiting' refused event 'approve': its handler raised PermissionError: "
        "!mallory may not approve; the run still waits there"
    )
    assert isinstance(refused.value.__cause__, PermissionError)  # (the handler's own error)
    info = engine.get(run.id)
    assert (info.status, info.state, kinds(engine, run.id)) == ("scheduled", "awaiting", before)
    assert inbox_rows(engine.url, run.id) == []  # the same dedupe key may be sent again
    assert engine.send(run.id, "approve", {"by": "ann"}, dedupe_key="hook-1").status == "applied"


def test_cli_send__an_event_its_handler_refuses_is_one_line_and_exits_2(
    engine: TestEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    run = engine.run(review, {"doc_id": "H2"})
    argv = ["send", "H2", "approve", "--workflow", "review", "--data", '{"by": "!eve"}']
    with pytest.raises(SystemExit) as exited:
        main([*argv, "-w", str(HERE), "--db", engine.url])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "error: state 'awaiting' refused event 'approve': its handler raised PermissionError: "
        "!eve may not approve; the run still waits there"
    )
    assert engine.get(run.id).state == "awaiting"


def _two_versions(version: int) -> Workflow:
    """A wait that takes ``a`` or ``b`` (v1), or only ``a`` (v2: a run of v1 waiting
    there parks under it, judged by flowloop/verdicts.py)."""
    workflow = Workflow("kept_versions", context=Empty, version=version)

    @workflow.step(initial=True, next="w")
    def begin(ctx: Empty) -> None: ...

    workflow.wait("w", on={"a": "x", "b": "y"} if version == 1 else {"a": "x"})
    workflow.final(*(("x", "y") if version == 1 else ("x",)))
    return workflow


def test_stranded_look__parks_a_run_the_loaded_definition_cannot_take_its_event_kept(
    store_url: str,
) -> None:
    # Review: the sweep handed a v1 run's kept event over under a v2 that would park it
    # (a sender is refused with DefinitionMismatch; a claim parks it): it moved on at x.
    # Audit: it then handed nothing over, and found the run again at every look, for
    # ever (a wait without a timeout is never claimed). It parks it now, as a claim does;
    # the event stays kept, and the run takes it once a definition that fits unpauses it.
    v1, v2 = _two_versions(1), _two_versions(2)
    with Engine(store_url, workflows=[v1]) as first:
        run_id = first.start(v1, Empty()).id
        first.run_until_idle()
        kept_event = InboxEvent(
            run_id=run_id, event="a", payload=None, dedupe_key=None, sent_at=0.0
        )
        assert first.store.deliver(kept_event, None) == "buffered"
    with Engine(store_url, workflows=[v2]) as later:
        handed = hand_over_stranded(later.store, {v2.name: v2}, now=0.0, worker="w2")
        info = later.get(run_id)
        assert handed == 0 and (info.status, info.state) == ("paused", "w")
        assert (info.reason or "").startswith("definition_mismatch: ")
        assert later.store.kept_for_free_runs(accepting({v2.name: v2}), after="", limit=9) == []
    assert [row.consumed_seq for row in inbox_rows(store_url, run_id)] == [None]
    with Engine(store_url, workflows=[v1]) as fixed:
        fixed.unpause(run_id)
        info = fixed.get(run_id)
        assert (info.status, info.state) == ("succeeded", "x")
        assert [e.seq for e in received(fixed, run_id, "a")] == [
            inbox_rows(store_url, run_id)[0].consumed_seq
        ]
        assert_journal_sound(fixed, run_id)


class Count(BaseModel):
    n: int = 0


class _Strict(BaseModel):
    n: int = 0

    @field_validator("n")
    @classmethod
    def _small(cls, n: int) -> int:
        if n > 0:
            raise ValueError("n must be 0 now")
        return n


_Strict.__name__ = _Strict.__qualname__ = "Count"  # (the same schema: the same fingerprint)


def _counting(context: type[BaseModel]) -> Workflow:
    workflow = Workflow("kept_counting", context=context)

    @workflow.step(initial=True, next="w")
    def begin(ctx: Any) -> None:
        ctx.n = 1

    workflow.wait("w", on={"a": "x"})
    workflow.final("x")
    return workflow


def test_stranded_look__parks_a_run_whose_context_its_definition_no_longer_validates(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Audit: a validator changed (the fingerprint does not cover its code) and the run's
    # stored context no longer loads: the hand-over raised at every look, for ever (a
    # claim would park it: context_mismatch). The look parks it at once now, as a claim.
    before, after = _counting(Count), _counting(_Strict)
    assert before.fingerprint == after.fingerprint
    with Engine(store_url, workflows=[before]) as first:
        run_id = first.start(before, Count()).id
        first.run_until_idle()
        kept_event = InboxEvent(
            run_id=run_id, event="a", payload=None, dedupe_key=None, sent_at=0.0
        )
        assert first.store.deliver(kept_event, None) == "buffered"
    failing: dict[str, int] = {}
    with Engine(store_url, workflows=[after]) as later, caplog.at_level(logging.WARNING):
        workflows = {after.name: after}
        assert (
            hand_over_stranded(later.store, workflows, now=0.0, worker="w2", failing=failing) == 0
        )
        info = later.get(run_id)
        assert (info.status, info.state) == ("paused", "w") and failing == {}
        assert (info.reason or "").startswith("context_mismatch: n: ")
    assert f"run {run_id} parked: context_mismatch" in caplog.text
    assert [row.consumed_seq for row in inbox_rows(store_url, run_id)] == [None]


def _stranded(engine: Engine, workflow: Workflow) -> str:
    """A run waiting in ``w`` with an ``a`` kept for it and not handed over (as a worker
    killed between its wait-entering commit and the hand-over leaves it)."""
    run_id = engine.start(workflow, Empty()).id
    engine.run_until_idle()
    kept = InboxEvent(run_id=run_id, event="a", payload=None, dedupe_key=None, sent_at=0.0)
    assert engine.store.deliver(kept, None) == "buffered"
    return run_id


def test_stranded_look__a_slow_one_puts_the_next_off_and_a_failure_is_logged(
    store_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Review: the look reads every event kept and not taken (those for later states, and
    # those of runs that ended without them, stay until prune): 0.5-0.9 s a look on
    # PostgreSQL with 200,000 of them, on every worker's event loop at every sweep. A slow
    # look now puts the next one off (LOOK_SPACING times as long); an error that is not an
    # outage is logged, and no longer ends the worker's loop.

    monkeypatch.setattr(kept, "SLOW_LOOK_SECONDS", 0.0)  # every look counts as slow
    monkeypatch.setattr(kept, "LOOK_SPACING", 1e9)  # and puts the next off at most so far
    looks = kept.StrandedLooks()
    workflow = _two_versions(1)
    workflows = {workflow.name: workflow}
    with Engine(store_url, workflows=[workflow]) as engine:

        def look() -> int:
            return kept.look_for_stranded(engine.store, workflows, looks, now=0.0, worker="w")

        first = _stranded(engine, workflow)
        assert look() == 1 and engine.get(first).state == "x"
        assert 0.0 < looks.next_at <= time.monotonic() + kept.LONGEST_LOOK_GAP
        second = _stranded(engine, workflow)
        assert look() == 0 and engine.get(second).state == "w"  # put off
        looks.next_at = 0.0  # its time come
        assert look() == 1 and engine.get(second).state == "x"

        def broken(*args: object, **kwargs: object) -> list[str]:
            raise ValueError("a query the planner gave up on")

        monkeypatch.setattr(engine.store, "kept_for_free_runs", broken)
        looks.next_at = 0.0
        with caplog.at_level(logging.WARNING, logger="flowloop"):
            assert look() == 0
    assert "the look for stranded kept events failed: a query the planner gave up" in caplog.text
