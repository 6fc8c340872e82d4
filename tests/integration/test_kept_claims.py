"""Handing kept events over when it fails: a claim's own hand-over is bounded as the
sweep's is (parked ``kept_events_failed`` at the third failure in a row, counted in the
store, so a fleet of short-lived workers gets there too), and a partial hand-over says how
many it handed. On SQLite and PostgreSQL, on a FakeClock."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from waitkit import ALL, Empty, chain_with_go_kept, inbox_rows, initial_wait, keep_stranded, kinds

from flowloop import Engine, FakeClock, kept
from flowloop.kept import try_deliver_pending
from flowloop.testing import TestEngine


@pytest.fixture
def engine(store_url: str) -> Iterator[TestEngine]:
    with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=ALL) as engine:
        yield engine


def test_a_partial_hand_over_that_then_fails_says_how_many_it_handed(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review: try_deliver_pending returned None (nothing handed) when it handed `go` over
    # (first -> second) and then failed on `note`: its callers took the run for unmoved
    # (a worker did not wake it).
    run_id = chain_with_go_kept(engine)
    keep_stranded(engine, run_id, "note", '{"text": "later"}')
    take = kept.take_kept

    def second_fails(*args: Any, **kwargs: Any) -> Any:
        if args[2].event == "note":
            raise RuntimeError("a journal entry the database refuses")
        return take(*args, **kwargs)

    monkeypatch.setattr(kept, "take_kept", second_fails)
    now = engine.clock.now()
    assert try_deliver_pending(engine.store, engine.workflows, run_id, now=now, worker="w") == 1
    assert engine.get(run_id).state == "second"
    assert [row.consumed_seq is None for row in inbox_rows(engine.url, run_id)] == [False, True]
    assert kinds(engine, run_id)[-1] == "event_received"


def _no_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """No look for stranded kept events: the claim's own hand-over alone (the look would
    reach a free waiting run first)."""
    monkeypatch.setattr(kept, "hand_over_stranded", lambda *args, **kwargs: 0)


def test_a_claims_hand_over_that_keeps_failing_parks_the_run_at_the_third_try(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review: a claim's hand-over of the kept events to the waiting run it held raised out
    # of the drive: the run stayed held until its lease ran out, then was claimed and
    # failed again, for ever (run_until_idle raised the error). As the sweep's look: each
    # failure is counted in the journal and the run let go — due at its timeout, never
    # before it (claimed at once after an unpause here), and a little later once that has
    # come; at the third in a row it is parked kept_events_failed; the event stays kept,
    # and unpause, once the cause is gone, hands it over.
    _no_sweep(monkeypatch)
    run_id = engine.start(initial_wait, Empty()).id
    timeout_at = engine.clock.now() + 100
    engine.pause(run_id)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a journal entry the database refuses")

    monkeypatch.setattr("flowloop.stepping.take_kept", refused)
    keep_stranded(engine, run_id, "open")
    with Engine(engine.url) as operator:  # (`flowloop unpause`: loads no definition)
        operator.unpause(run_id)  # events kept: due at once, for a worker to hand over
    engine.run_until_idle()  # (a fake clock: on to each due time)
    info = engine.get(run_id)
    assert (info.status, info.state, info.reason) == ("paused", "gate", "kept_events_failed")
    journal = engine.history(run_id)
    retry = kept.RETRY_HAND_OVER_SECONDS
    tail = [(e.kind, e.data.get("due"), e.data.get(kept.KEPT_FAILED)) for e in journal[-3:]]
    assert tail == [
        ("run_released", timeout_at, 1),
        ("run_released", timeout_at + retry, 2),
        ("run_paused", None, None),
    ]
    assert [e.at for e in journal[-3:]] == [timeout_at - 100, timeout_at, timeout_at + retry]
    assert "a journal entry the database refuses" in (journal[-1].error_message or "")
    assert [row.consumed_seq for row in inbox_rows(engine.url, run_id)] == [None]  # kept
    monkeypatch.undo()
    engine.unpause(run_id)
    engine.run_until_idle()
    assert (engine.get(run_id).status, engine.get(run_id).state) == ("succeeded", "opened")


def test_short_lived_workers_count_a_failing_hand_over_together(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review: the sweep counted a run's failed hand-overs in its worker's memory: a fleet
    # of workers that each lived for fewer sweeps than HAND_OVER_TRIES never parked it (a
    # wait without a timeout: never claimed either), a WARNING at every start, for ever.
    # Counted in the run's journal, the third worker's look parks it.
    with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=ALL) as first:
        run_id = chain_with_go_kept(first)
    take = kept.take_kept

    def refused(*args: Any, **kwargs: Any) -> Any:
        if args[2].event == "go":
            raise RuntimeError("a journal entry the database refuses")
        return take(*args, **kwargs)

    monkeypatch.setattr(kept, "take_kept", refused)
    for _ in range(kept.HAND_OVER_TRIES):  # each a worker's start (its first look)
        with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=ALL) as one:
            one.run_until_idle()
    with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=ALL) as engine:
        info = engine.get(run_id)
        assert (info.status, info.state, info.reason) == ("paused", "first", "kept_events_failed")
        ran = kinds(engine, run_id)
        assert ran[-3:] == ["run_released", "run_released", "run_paused"], ran
        assert engine.get(run_id).next_run_at is None  # (a wait without a timeout: none)
        assert [row.consumed_seq for row in inbox_rows(engine.url, run_id)] == [None]
        monkeypatch.undo()
        engine.unpause(run_id)
        assert engine.get(run_id).state == "second"
