"""Handing kept events over when it fails: a claim's own hand-over is bounded as the
sweep's is (parked ``kept_events_failed`` at the third failure in a row, counted in the
store, so a fleet of short-lived workers gets there too), and a partial hand-over says how
many it handed. On SQLite and PostgreSQL, on a FakeClock."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from waitkit import ALL, Chain, chain, inbox_rows, kinds

from flowloop import FakeClock, kept
from flowloop.kept import try_deliver_pending
from flowloop.store import InboxEvent
from flowloop.testing import TestEngine


@pytest.fixture
def engine(store_url: str) -> Iterator[TestEngine]:
    with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=ALL) as engine:
        yield engine


def _keep(engine: TestEngine, run_id: str, event: str, payload: str | None = None) -> None:
    message = InboxEvent(run_id=run_id, event=event, payload=payload, dedupe_key=None, sent_at=0)
    assert engine.store.deliver(message, None) == "buffered"


def _waiting_chain(engine: TestEngine) -> str:
    run_id = engine.start(chain, Chain()).id
    engine.run_until_idle()
    assert engine.get(run_id).state == "first"
    _keep(engine, run_id, "go")
    return run_id


def test_a_partial_hand_over_that_then_fails_says_how_many_it_handed(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review: try_deliver_pending returned None (nothing handed) when it handed `go` over
    # (first -> second) and then failed on `note`: its callers took the run for unmoved
    # (a worker did not wake it).
    run_id = _waiting_chain(engine)
    _keep(engine, run_id, "note", '{"text": "later"}')
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
