"""Events kept for a run (its inbox) that a worker died before handing over, and events a
wait's handler refuses: on SQLite and PostgreSQL, on a FakeClock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from waitkit import (
    ALL,
    HERE,
    Chain,
    assert_journal_sound,
    chain,
    inbox_rows,
    kinds,
    received,
    review,
)

from flowloop import FakeClock
from flowloop.cli import main
from flowloop.events import EventRefused
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
