"""Wait states and events, in one process on a FakeClock, on SQLite and PostgreSQL:
events accepted, rejected, buffered, deduplicated; timeouts taken only when due; replay."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from waitkit import (
    ALL,
    Approval,
    Doc,
    approved,
    assert_journal_sound,
    chain,
    ctx,
    inbox_rows,
    initial_wait,
    kinds,
    napper,
    parked,
    received,
    review,
)

from flowloop import Engine, FakeClock, Retry, Workflow
from flowloop import journal as j
from flowloop.errors import DefinitionError, InvalidEvent, InvalidTransition
from flowloop.events import InvalidPayload, NeverAccepted, NotWaiting
from flowloop.store import InboxEvent
from flowloop.testing import TestEngine

DAY = 86_400.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(auto_advance=False)


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[Engine]:
    # flowloop.testing's engine (dogfooding): the real engine whose run_until_idle can
    # also jump the fake clock to the next due timer.
    with TestEngine(store_url, clock=clock, workflows=ALL) as engine:
        yield engine


def waiting(engine: Engine, doc_id: str = "D1") -> str:
    info = engine.run(review, {"doc_id": doc_id})
    assert (info.status, info.state) == ("scheduled", "awaiting")
    return str(info.id)


# -- a run in a wait state --------------------------------------------------------------------


def test_wait__entering_holds_no_worker_and_stores_the_timeout_as_due_time(
    engine: Engine, clock: FakeClock
) -> None:
    run_id = waiting(engine)
    info = engine.get(run_id)
    assert info.owner is None
    assert info.next_run_at == pytest.approx(clock.now() + 2 * DAY, abs=1e-3)
    info = engine.run(parked, {})  # no timeout: no due time at all
    assert (info.state, info.owner, info.next_run_at) == ("parked", None, None)


def test_wait__nothing_happens_before_the_timeout_is_due(engine: Engine, clock: FakeClock) -> None:
    run_id = waiting(engine)
    clock.advance(2 * DAY - 60)
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(run_id).state == "awaiting"
    assert kinds(engine, run_id)[-1] == "step_succeeded"


def test_wait__timeout_branch_taken_once_and_replay_matches(
    engine: TestEngine, clock: FakeClock
) -> None:
    run_id = waiting(engine)
    due = engine.get(run_id).next_run_at
    engine.run_until_idle()  # the test engine jumps the clock to the timeout
    assert clock.now() == due
    engine.run_until_idle()
    info = engine.get(run_id)
    assert (info.status, info.state) == ("succeeded", "expired")
    timeouts = received(engine, run_id, "timeout")
    assert [(e.state, e.next_state) for e in timeouts] == [("awaiting", "expired")]
    assert_journal_sound(engine, run_id)


def test_wait__unpaused_waiting_run_keeps_its_timeout(engine: Engine, clock: FakeClock) -> None:
    # Bug: unpausing made the run due now, and the claim fired the timeout at once.
    run_id = waiting(engine)
    due = engine.get(run_id).next_run_at
    engine.pause(run_id)
    engine.unpause(run_id)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(run_id)
    assert (info.status, info.state, info.next_run_at) == ("scheduled", "awaiting", due)
    assert received(engine, run_id) == []
    clock.advance(2 * DAY + 1)
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(run_id).state == "expired"
    assert_journal_sound(engine, run_id)


def test_wait__paused_past_its_timeout_times_out_at_once_when_unpaused(
    engine: Engine, clock: FakeClock
) -> None:
    run_id = waiting(engine)
    engine.pause(run_id)
    clock.advance(3 * DAY)
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(run_id).status == "paused"
    engine.unpause(run_id)
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(run_id).state == "expired"
    assert len(received(engine, run_id, "timeout")) == 1


def test_wait__initial_wait_state_is_not_timed_out_at_creation(
    engine: Engine, clock: FakeClock
) -> None:
    # Bug: a run created in a wait state was due at once and its timeout fired on claim.
    info = engine.start(initial_wait, {})
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, info.state) == ("scheduled", "gate")
    assert info.next_run_at == pytest.approx(clock.now() + 100, abs=1e-3)
    assert engine.send(info.id, "open").status == "applied"
    assert engine.get(info.id).state == "opened"
    assert_journal_sound(engine, info.id)


def test_wait__engine_run_of_a_workflow_that_starts_waiting_returns_it_waiting(
    engine: Engine,
) -> None:
    class Ctx(BaseModel):
        n: int = 0

    gate = Workflow("gate_first", context=Ctx)
    gate.wait("gate", on={"open": "opened"}, initial=True)
    gate.final("opened")
    info = engine.run(gate, {})
    assert (info.status, info.state, info.owner) == ("scheduled", "gate", None)


def test_wait__due_timeout_yields_to_an_event_kept_before_it(
    engine: Engine, clock: FakeClock
) -> None:
    run_id = waiting(engine)
    engine.pause(run_id)
    assert engine.send(run_id, "approve", {"by": "ann"}, buffer=True).status == "buffered"
    clock.advance(3 * DAY)  # the timeout is overdue by the time the run is unpaused
    engine.unpause(run_id)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(run_id)
    assert (info.state, info.owner) == ("approved", None)
    assert [e.event for e in received(engine, run_id)] == ["approve"]
    assert_journal_sound(engine, run_id)


# -- events accepted and rejected ---------------------------------------------------------------


def test_send__accepted_event_validates_the_payload_and_the_handler_merges_it(
    engine: Engine,
) -> None:
    run_id = waiting(engine)
    result = engine.send(run_id, "approve", {"by": "ann", "note": "fine"})
    assert result.status == "applied"
    info = result.run
    assert (info.status, info.state) == ("succeeded", "approved")
    assert ctx(info).approved_by == "ann"
    [event] = received(engine, run_id)
    assert (event.event, event.state, event.next_state) == ("approve", "awaiting", "approved")
    assert '"approved_by":"ann"' in (event.context or "")
    assert_journal_sound(engine, run_id)


def test_send__payload_model_instance_is_accepted(engine: Engine) -> None:
    from waitkit import Approval

    run_id = waiting(engine)
    engine.send(run_id, "reject", Approval(by="bob", note="too dear"))
    info = engine.get(run_id)
    assert info.state == "rejected"
    assert ctx(info).rejected_because == "bob: too dear"


def test_send__event_the_state_does_not_accept_is_rejected_listing_what_it_accepts(
    engine: Engine,
) -> None:
    run_id = waiting(engine)
    with pytest.raises(InvalidEvent) as caught:
        engine.send(run_id, "paid", {"by": "ann"})
    message = str(caught.value)
    assert "'awaiting' does not accept event 'paid'" in message
    assert "it accepts: approve, reject" in message
    assert engine.send(run_id, "approve", {"by": "ann"}).status == "applied"  # nothing broke
    assert inbox_rows(engine.url, run_id)[0].event == "approve"
    assert len(inbox_rows(engine.url, run_id)) == 1  # the rejected one was not kept


def test_send__timeout_cannot_be_sent_from_outside(engine: Engine) -> None:
    run_id = waiting(engine)
    with pytest.raises(InvalidEvent, match="it accepts: approve, reject"):
        engine.send(run_id, "timeout")


def test_send__invalid_payload_is_rejected_listing_the_fields(engine: Engine) -> None:
    run_id = waiting(engine)
    with pytest.raises(InvalidPayload) as caught:
        engine.send(run_id, "approve", {"note": 3})
    message = str(caught.value)
    assert "payload of event 'approve' is invalid" in message
    assert "by: Field required" in message
    assert "note: Input should be a valid string" in message
    with pytest.raises(InvalidPayload, match="by: Field required"):
        engine.send(run_id, "approve")  # no payload at all
    assert engine.get(run_id).state == "awaiting"
    assert received(engine, run_id) == []
    assert inbox_rows(engine.url, run_id) == []


def test_send__to_a_run_in_a_step_state_is_rejected(engine: Engine) -> None:
    info = engine.start(review, {"doc_id": "D9"})  # queued at `prepare`, a step
    refused = r"'prepare' does not accept event 'approve' \(it accepts: none\)"
    with pytest.raises(InvalidEvent, match=refused):
        engine.send(info.id, "approve", {"by": "ann"})


def test_send__to_a_paused_waiting_run_says_it_is_paused(engine: Engine) -> None:
    # Bug: the error said the state "does not accept event 'approve' (it accepts: approve, …)".
    run_id = waiting(engine)
    engine.pause(run_id)
    with pytest.raises(NotWaiting) as caught:
        engine.send(run_id, "approve", {"by": "ann"})
    assert "is paused in state 'awaiting'" in str(caught.value)
    assert "unpause it" in str(caught.value)
    assert engine.send(run_id, "approve", {"by": "ann"}, buffer=True).status == "buffered"
    engine.unpause(run_id)
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(run_id).state == "approved"


def test_send__to_a_finished_run_is_rejected(engine: Engine) -> None:
    run_id = waiting(engine)
    engine.send(run_id, "approve", {"by": "ann"})
    with pytest.raises(InvalidTransition, match="is succeeded: cannot send 'approve' to it"):
        engine.send(run_id, "approve", {"by": "ann"})


# -- buffered events ---------------------------------------------------------------------------


def test_send__buffered_event_is_kept_until_the_run_reaches_the_wait_then_consumed_once(
    engine: Engine, clock: FakeClock
) -> None:
    info = engine.start(review, {"doc_id": "D2"})  # still at `prepare`
    sent_at = clock.now()
    result = engine.send(info.id, "approve", {"by": "early"}, buffer=True)
    assert result.status == "buffered"
    assert result.run.state == "prepare"
    clock.advance(5)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, info.state) == ("succeeded", "approved")
    assert ctx(info).approved_by == "early"
    [event] = received(engine, info.id)
    assert event.data["buffered_at"] == pytest.approx(sent_at, abs=1e-3)
    assert event.at == pytest.approx(sent_at + 5, abs=1e-3)
    [row] = inbox_rows(engine.url, info.id)
    assert row.consumed_seq == event.seq
    engine.run_until_idle(idle_horizon=0)
    assert len(received(engine, info.id)) == 1
    assert_journal_sound(engine, info.id)


def test_send__without_buffer_an_event_for_a_later_state_is_rejected_not_kept(
    engine: Engine,
) -> None:
    info = engine.start(review, {"doc_id": "D3"})
    with pytest.raises(InvalidEvent, match=r"it accepts: none"):
        engine.send(info.id, "approve", {"by": "ann"})
    assert inbox_rows(engine.url, info.id) == []


def test_send__buffered_event_no_wait_state_accepts_is_refused_not_kept(engine: Engine) -> None:
    # Bug: it was kept for ever.
    info = engine.start(review, {"doc_id": "D4"})
    with pytest.raises(NeverAccepted) as caught:
        engine.send(info.id, "paid", buffer=True)
    assert "no wait state of workflow 'review' accepts event 'paid'" in str(caught.value)
    assert "approve, reject" in str(caught.value)
    assert inbox_rows(engine.url, info.id) == []


def test_send__buffered_event_with_an_invalid_payload_is_refused_not_kept(engine: Engine) -> None:
    # Bug: it was kept, and later blocked (or failed) the run when it reached the wait.
    info = engine.start(review, {"doc_id": "D5"})
    with pytest.raises(InvalidPayload, match="by: Field required"):
        engine.send(info.id, "approve", {"note": "ann"}, buffer=True)
    # A key the model has not (a misspelt `by`) is refused as such (UnknownPayloadField).
    with pytest.raises(InvalidPayload, match="no field 'who' in Approval"):
        engine.send(info.id, "approve", {"who": "ann"}, buffer=True)
    assert inbox_rows(engine.url, info.id) == []
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(info.id).state == "awaiting"


def test_send__buffered_event_is_taken_after_a_wait_to_wait_transition(engine: Engine) -> None:
    # Bug: `go` sent directly moved the run into `second`, but the `note` kept for `second`
    # stayed in the inbox until the next send.
    info = engine.run(chain, {})
    assert info.state == "first"
    assert engine.send(info.id, "note", {"text": "kept"}, buffer=True).status == "buffered"
    assert engine.send(info.id, "go").status == "applied"
    info = engine.get(info.id)
    assert (info.state, ctx(info).notes) == ("second", ["kept"])
    assert [r.consumed_seq is not None for r in inbox_rows(engine.url, info.id)] == [True, True]
    assert_journal_sound(engine, info.id)


def test_send__kept_events_follow_the_run_through_unpause_into_a_second_wait(
    engine: Engine,
) -> None:
    info = engine.start(chain, {})
    engine.run_until_idle(idle_horizon=0)
    engine.send(info.id, "note", {"text": "one"}, buffer=True)
    engine.send(info.id, "note", {"text": "two"}, buffer=True)
    engine.pause(info.id)  # `go` cannot be taken while paused: kept too
    assert engine.send(info.id, "go", buffer=True).status == "buffered"
    engine.unpause(info.id)  # the claim takes `go`, then the kept notes in `second`
    engine.run_until_idle(idle_horizon=0)
    engine.send(info.id, "note", {"text": "three"})
    info = engine.get(info.id)
    assert ctx(info).notes == ["one", "two", "three"]
    assert_journal_sound(engine, info.id)


def test_send__event_kept_earlier_is_taken_before_a_later_direct_one(
    engine: Engine, clock: FakeClock
) -> None:
    # Bug: a direct send overtook an event kept earlier for the same state. Here the kept
    # one is left as a sender killed between keeping it and delivering it would leave it.
    info = engine.run(chain, {})
    engine.send(info.id, "go")
    kept = InboxEvent(
        run_id=info.id,
        event="note",
        payload='{"text": "one"}',
        dedupe_key=None,
        sent_at=clock.now(),
        sender="killed",
    )
    assert engine.store.deliver(kept, None) == "buffered"
    clock.advance(1)
    assert engine.send(info.id, "note", {"text": "two"}).status == "applied"
    info = engine.get(info.id)
    assert ctx(info).notes == ["one", "two"]
    first, second = received(engine, info.id, "note")
    assert first.data["buffered_at"] == pytest.approx(clock.now() - 1, abs=1e-3)
    assert "buffered_at" not in second.data
    assert_journal_sound(engine, info.id)


def test_send__kept_event_whose_handler_raises_is_rejected_and_the_next_is_taken(
    engine: Engine,
) -> None:
    info = engine.run(chain, {})  # waits in `first`, which does not take notes
    for text in ("!shout", "calm"):
        assert engine.send(info.id, "note", {"text": text}, buffer=True).status == "buffered"
    assert engine.send(info.id, "go").status == "applied"
    info = engine.get(info.id)
    assert (info.status, info.state) == ("scheduled", "second")
    assert ctx(info).notes == ["calm"]
    [rejected] = [e for e in engine.history(info.id) if e.kind == "event_rejected"]
    assert (rejected.state, rejected.event, rejected.error_type) == ("second", "note", "ValueError")
    assert rejected.error_message == "notes may not start with '!'"
    consumed = {row.consumed_seq for row in inbox_rows(engine.url, info.id)}
    assert rejected.seq in consumed and None not in consumed  # both left the inbox
    assert_journal_sound(engine, info.id)


def test_wait__kept_event_it_cannot_take_does_not_fail_the_run_at_its_timeout(
    engine: Engine, clock: FakeClock
) -> None:
    # Left as a sender killed between keeping it and delivering it would leave it: the
    # worker that claims the run for its timeout finds it first.
    run_id = waiting(engine)
    kept = InboxEvent(
        run_id=run_id,
        event="approve",
        payload='{"by": "!mallory"}',
        dedupe_key=None,
        sent_at=clock.now(),
        sender="killed",
    )
    assert engine.store.deliver(kept, None) == "buffered"
    clock.advance(3 * DAY)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(run_id)
    assert (info.status, info.state, info.owner) == ("succeeded", "expired", None)
    assert kinds(engine, run_id)[-2:] == ["event_rejected", "event_received"]
    [rejected] = [e for e in engine.history(run_id) if e.kind == "event_rejected"]
    assert (rejected.error_type, rejected.error_message) == (
        "PermissionError",
        "!mallory may not approve",
    )
    assert [row.consumed_seq for row in inbox_rows(engine.url, run_id)] == [rejected.seq]
    assert_journal_sound(engine, run_id)


def test_send__to_a_waiting_run_a_worker_holds_for_a_moment_is_taken_when_it_lets_go(
    engine: Engine, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without buffer=True the sender gets a definite answer: the event is not kept behind a
    # worker's claim (which might be firing the timeout that ends the run).
    run_id = waiting(engine)
    [claimed] = engine.store.claim(
        worker="w2", now=clock.now() + 3 * DAY, limit=1, lease_seconds=30, run_ids=[run_id]
    )
    assert claimed.owner == "w2"
    seen_held: list[str] = []
    read = engine._stored

    def let_go_once_seen(run: str) -> Any:
        stored = read(run)  # what send decides on: the run as it was, held
        if stored.owner == "w2" and not seen_held:
            seen_held.append(run)
            clock.advance(60)  # the holder works for a minute, then lets go
            engine.store.release(worker="w2", run_ids=[run])
        return stored

    monkeypatch.setattr(engine, "_stored", let_go_once_seen)
    sent_at = clock.now()
    result = engine.send(run_id, "approve", {"by": "ann"})
    assert seen_held == [run_id]
    assert (result.status, result.run.state) == ("applied", "approved")
    assert inbox_rows(engine.url, run_id)[0].consumed_seq is not None
    [event] = received(engine, run_id)
    assert event.at == pytest.approx(sent_at + 60, abs=1e-3)  # journaled when taken, not when sent
    assert_journal_sound(engine, run_id)


# -- dedupe ------------------------------------------------------------------------------------


def test_send__same_dedupe_key_twice_has_effect_once(engine: Engine) -> None:
    info = engine.run(chain, {})
    engine.send(info.id, "go")
    first = engine.send(info.id, "note", {"text": "a"}, dedupe_key="n-1")
    second = engine.send(info.id, "note", {"text": "a"}, dedupe_key="n-1")
    assert (first.status, second.status) == ("applied", "duplicate")
    assert engine.send(info.id, "note", {"text": "b"}, dedupe_key="n-2").status == "applied"
    assert ctx(engine.get(info.id)).notes == ["a", "b"]
    [event] = [e for e in received(engine, info.id, "note") if e.data.get("dedupe_key") == "n-1"]
    assert event.next_state == "second"
    assert_journal_sound(engine, info.id)


def test_send__dedupe_key_of_a_buffered_event_counts_too(engine: Engine) -> None:
    info = engine.start(review, {"doc_id": "D6"})
    statuses = [
        engine.send(info.id, "approve", {"by": "ann"}, buffer=True, dedupe_key="k").status
        for _ in range(3)
    ]
    assert statuses == ["buffered", "duplicate", "duplicate"]
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(info.id).state == "approved"
    assert engine.send(info.id, "approve", {"by": "x"}, dedupe_key="k").status == "duplicate"
    assert len(received(engine, info.id)) == 1


# -- durable sleep, correlation, definitions ------------------------------------------------------


def test_sleep__is_a_stored_due_time_not_an_in_process_wait(
    engine: Engine, clock: FakeClock
) -> None:
    # (engine.run would wait out a sleep shorter than its 300 s idle horizon in-process.)
    info = engine.start(napper, {})
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, info.state, info.owner) == ("scheduled", "after", None)
    assert info.next_run_at == pytest.approx(clock.now() + 1.5, abs=1e-3)
    engine.run_until_idle(idle_horizon=0)
    assert kinds(engine, info.id).count("step_started") == 1  # `after` has not started
    clock.advance(1.5)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(info.id)
    assert (info.status, ctx(info).after) == ("succeeded", 1)
    assert_journal_sound(engine, info.id)


def test_find__by_business_key(engine: Engine) -> None:
    run_id = waiting(engine, "A1")
    waiting(engine, "A2")
    found = engine.find(review, key="A1")
    assert found is not None and found.id == run_id
    assert engine.find("review", key="A1") == found
    assert engine.find(review, key="nope") is None
    assert engine.start(review, {"doc_id": "A1"}).id == run_id  # unique key: the same run


def test_wait__definition_refuses_bad_payloads_handlers_and_visits() -> None:
    class Ctx(BaseModel):
        n: int = 0

    wf = Workflow("bad", context=Ctx)
    with pytest.raises(DefinitionError, match="payload of 'e' must be a pydantic BaseModel"):
        wf.wait("w", on={"e": "done"}, payloads={"e": dict})  # type: ignore[dict-item]
    with pytest.raises(DefinitionError, match="handler of 'e' is not callable"):
        wf.wait("w", on={"e": "done"}, handlers={"e": "nope"})  # type: ignore[dict-item]
    with pytest.raises(DefinitionError, match="max_visits must be at least 1"):
        wf.wait("w", on={"e": "done"}, max_visits=0)
    with pytest.raises(DefinitionError, match="give timeout= and on_timeout= together"):
        wf.wait("w", on={"e": "done"}, timeout=5)


def test_wait__failed_step_entered_by_an_event_can_be_retried(engine: TestEngine) -> None:
    # Bug: retry looked for the context a state was entered with among step outcomes
    # only, so a run failed in a state entered by a wait's event "never reached" it.
    flow = Workflow("after_wait", context=Doc)
    failures = [1]

    @flow.step(initial=True, next="awaiting")
    def draft(ctx: Doc) -> None:
        ctx.prepared += 1

    flow.wait(
        "awaiting",
        on={"approve": "publish"},
        payloads={"approve": Approval},
        handlers={"approve": approved},
    )

    @flow.step(next="published", retry=Retry(attempts=1))
    def publish(ctx: Doc) -> None:
        if failures:
            failures.pop()
            raise RuntimeError("publisher down")

    flow.final("published")
    run = engine.start(flow, {})
    engine.run_until_idle()
    engine.send(run.id, "approve", {"by": "ann"})
    engine.run_until_idle()
    assert (engine.get(run.id).status, engine.get(run.id).state) == ("failed", "publish")
    engine.retry(run.id)
    engine.run_until_idle()
    info = engine.get(run.id)
    assert (info.status, info.context.approved_by) == ("succeeded", "ann")  # type: ignore[union-attr]


# -- an operator's retry of a run stopped in a wait state ------------------------------------


def test_retry__a_run_stopped_waiting_waits_again_its_timeout_counted_from_the_retry(
    engine: Engine, clock: FakeClock
) -> None:
    """Before, retrying a run stopped in a wait state was refused ("not a state with a
    step"): only a retry from an earlier step, which ran that step again, brought it
    back."""
    run_id = waiting(engine)
    engine.stop(run_id)
    clock.advance(DAY)
    info = engine.retry(run_id)
    assert (info.status, info.state, info.owner) == ("scheduled", "awaiting", None)
    assert info.next_run_at == pytest.approx(clock.now() + 2 * DAY, abs=1e-3)
    clock.advance(2 * DAY - 60)
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(run_id).state == "awaiting"  # not timed out early
    assert engine.send(run_id, "approve", {"by": "ann"}).status == "applied"
    done = engine.get(run_id)
    assert (done.status, done.state, done.context.prepared) == ("succeeded", "approved", 1)  # type: ignore[attr-defined]
    assert_journal_sound(engine, run_id)


def test_retry__into_a_wait_times_out_when_due_and_one_without_a_timeout_is_not_due(
    engine: TestEngine, clock: FakeClock
) -> None:
    run_id = waiting(engine)
    engine.stop(run_id)
    engine.retry(run_id)
    clock.advance(2 * DAY + 1)
    engine.run_until_idle(idle_horizon=0)
    assert (engine.get(run_id).status, engine.get(run_id).state) == ("succeeded", "expired")
    assert_journal_sound(engine, run_id)
    parked_run = engine.run(parked, {}).id
    engine.stop(parked_run)
    info = engine.retry(parked_run)
    assert (info.status, info.state, info.next_run_at) == ("scheduled", "parked", None)
    assert engine.send(parked_run, "go").status == "applied"
    assert engine.get(parked_run).status == "succeeded"
    assert_journal_sound(engine, parked_run)


def test_unpause__from_a_process_without_the_definition_does_not_time_the_wait_out(
    store_url: str, engine: Engine, clock: FakeClock
) -> None:
    """An operator's unpause from a process that does not load the workflow (the CLI
    without -w) cannot know the wait's timeout and made the run due at once; its next
    claim took that for the timeout and the 2-day approval expired. The unpause now takes
    the due time the entry into the state stored (the journal's; the stored definition
    says the state is a wait)."""
    run_id = waiting(engine)
    due = engine.get(run_id).next_run_at
    with Engine(store_url, clock=clock) as operator:  # no workflow registered
        operator.pause(run_id)
        unpaused = operator.unpause(run_id)
    assert unpaused.next_run_at == pytest.approx(due, abs=1e-3)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(run_id)
    assert (info.status, info.state) == ("scheduled", "awaiting"), info
    assert info.next_run_at == pytest.approx(due, abs=1e-3)
    clock.advance(2 * DAY + 1)
    engine.run_until_idle(idle_horizon=0)
    assert (engine.get(run_id).status, engine.get(run_id).state) == ("succeeded", "expired")
    assert_journal_sound(engine, run_id)


# -- every way into a wait keeps its timeout through a pause ---------------------------------


class Item(BaseModel):
    n: int = 0
    items: list[int] = [1, 2]


def _into_waits() -> list[Workflow]:
    """A step whose error routes into a 2-day wait; a call whose child's end leads into
    one; a map whose children (one at a time) start in one."""
    routed = Workflow("routed", context=Item)

    @routed.step(initial=True, next="done", retry=Retry(attempts=1), on_error={"*": "review"})
    def fails(ctx: Item) -> None:
        raise ValueError("routed to a person")

    routed.wait("review", on={"go": "done"}, timeout=timedelta(days=2), on_timeout="expired")
    routed.final("done", "expired")
    item = _held_item("held_item")
    quick = Workflow("quick_child", context=Item)

    @quick.step(initial=True, next="done")
    def count(ctx: Item) -> None:
        ctx.n += 1

    quick.final("done")
    calling = Workflow("calling", context=Item)
    calling.call(
        "call", child=quick, context=lambda ctx: Item(), on={"succeeded": "review"}, initial=True
    )
    calling.wait("review", on={"go": "done"}, timeout=timedelta(days=2), on_timeout="expired")
    calling.final("done", "expired")
    return [routed, item, quick, calling, _one_at_a_time("fan_waits", item)]


def _held_item(name: str, **options: Any) -> Workflow:
    """A child that starts in a 2-day wait for "go"."""
    item = Workflow(name, context=Item, **options)
    item.wait(
        "hold", on={"go": "done"}, timeout=timedelta(days=2), on_timeout="expired", initial=True
    )
    item.final("done", "expired", *([options["on_deadline"]] if "on_deadline" in options else []))
    return item


def _one_at_a_time(name: str, child: Workflow, max_parallel: int = 1, **options: Any) -> Workflow:
    """A map of ``child`` over ``ctx.items``, one child at a time (the rest held)."""
    fan = Workflow(name, context=Item)
    fan.map(
        "each",
        child=child,
        items=lambda ctx: ctx.items,
        context=lambda ctx, n: Item(n=n),
        max_parallel=max_parallel,
        on={"done": "done"},
        initial=True,
        **options,
    )
    fan.final("done")
    return fan


@pytest.mark.parametrize("operator", ["with the definition", "without it"])
@pytest.mark.parametrize("workflow", ["routed", "calling"])
def test_unpause__a_wait_entered_by_an_error_route_or_a_join_keeps_its_timeout(
    store_url: str, workflow: str, operator: str
) -> None:
    """Before, the due time of a wait entered by an ``on_error`` route or by a call's join
    was not found in the journal (``-inf``): the unpause made the run overdue and the
    2-day wait expired at once. The same from a process without the definition."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=_into_waits()) as engine:
        info = engine.run(engine.workflow(workflow), Item())
        assert (info.state, info.status) == ("review", "scheduled"), info
        due = info.next_run_at
        clock.advance(60)  # (an unpause "at once" differs from the entry's time)
        with Engine(store_url, clock=clock) as bare:
            by = engine if operator == "with the definition" else bare
            by.pause(info.id)
            assert by.unpause(info.id).next_run_at == pytest.approx(due, abs=1e-3)
        engine.run_until_idle(idle_horizon=0)
        assert (engine.get(info.id).state, engine.get(info.id).status) == ("review", "scheduled")
        assert_journal_sound(engine, info.id)


def test_a_map_child_released_into_its_wait_is_not_timed_out_at_once(store_url: str) -> None:
    """A map's child held back (``max_parallel=1``) that starts in a 2-day wait is made
    due at once when its turn comes; its first claim took that for the timeout and it
    expired. It now waits, until its turn plus the timeout."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=_into_waits()) as engine:
        top = engine.start(engine.workflow("fan_waits"), Item()).id
        engine.run_until_idle(idle_horizon=0)
        first, second = sorted(engine.runs(workflow="held_item"), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        engine.pause(top)  # cascaded to the held child too: it has more than its creation
        engine.unpause(top)
        assert len(engine.history(second.id)) > 1
        clock.advance(60)  # released later than its row's last write
        assert engine.send(first.id, "go").status == "applied"
        engine.run_until_idle(idle_horizon=0)  # the first ends; the second's turn comes
        info = engine.get(second.id)
        assert (info.state, info.status) == ("hold", "scheduled"), info
        assert info.next_run_at == pytest.approx(second.created_at + 60 + 2 * DAY, abs=1e-3)
        assert engine.send(second.id, "go").status == "applied"
        engine.run_until_idle(idle_horizon=0)
        assert engine.get(top).status == "succeeded"


@pytest.mark.parametrize("operator", ["with the definition", "without it"])
def test_a_map_child_held_back_counts_its_timeout_from_its_turn(
    store_url: str, operator: str
) -> None:
    """A map's child held back behind a sibling that took 3 days expired the moment its
    turn came (its 2-day timeout counted from its creation). It now counts from its turn,
    also through a pause and unpause (by a process with or without the definition)."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=_into_waits()) as engine:
        engine.start(engine.workflow("fan_waits"), Item(items=[1, 2, 3]))
        engine.run_until_idle(idle_horizon=0)
        first, second, _ = sorted(engine.runs(workflow="held_item"), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        clock.advance(DAY)
        assert engine.send(first.id, "go").status == "applied"
        engine.run_until_idle(idle_horizon=0)  # the second's turn: at a day
        turn = clock.now()
        clock.advance(1.5 * DAY)  # past its creation plus 2 days, not its turn plus 2 days
        engine.run_until_idle(idle_horizon=0)
        with Engine(store_url, clock=clock) as bare:
            by = engine if operator == "with the definition" else bare
            by.pause(second.id)
            unpaused = by.unpause(second.id)
        if operator == "with the definition":
            assert unpaused.next_run_at == pytest.approx(turn + 2 * DAY, abs=1e-3)
        # (Without it, the turn's timeout is the definition's to say: due at once, and the
        # claim that follows judges it by the journal.)
        engine.run_until_idle(idle_horizon=0)
        info = engine.get(second.id)
        assert (info.state, info.status) == ("hold", "scheduled"), info
        assert info.next_run_at == pytest.approx(turn + 2 * DAY, abs=1e-3)
        turns = [e for e in engine.history(second.id) if e.data.get(j.TURN)]
        assert [(e.kind, e.at) for e in turns] == [(j.RUN_DEFERRED, turn)]
        clock.advance(DAY)  # now past its turn plus 2 days: the timeout fires
        engine.run_until_idle(idle_horizon=0)
        assert (engine.get(second.id).state, engine.get(second.id).status) == (
            "expired",
            "succeeded",
        )
        assert_journal_sound(engine, second.id)


@pytest.mark.parametrize("operator", ["with the definition", "without it"])
def test_a_map_child_paused_after_its_turn_before_its_claim_keeps_its_turns_timeout(
    store_url: str, operator: str
) -> None:
    """The turn's time lived only in the row's due time, which a pause clears: a child
    paused and unpaused (its parent's pause, workers behind) between its turn and its first
    claim went back to its creation's timeout and expired at once. The turn is journaled
    when it comes now."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=_into_waits()) as engine:
        engine.start(engine.workflow("fan_waits"), Item(items=[1, 2]))
        engine.run_until_idle(idle_horizon=0)
        first, second = sorted(engine.runs(workflow="held_item"), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        engine.pause(first.id)  # the first stays live 5 days (its 2-day wait would end)
        clock.advance(5 * DAY)
        engine.unpause(first.id)
        assert engine.send(first.id, "go").status == "applied"  # the second's turn
        turn = clock.now()
        with Engine(store_url, clock=clock) as bare:  # before a worker claims the second
            by = engine if operator == "with the definition" else bare
            by.pause(second.id)
            clock.advance(10)
            by.unpause(second.id)
        engine.run_until_idle(idle_horizon=0)
        info = engine.get(second.id)
        assert (info.state, info.status) == ("hold", "scheduled"), info
        assert info.next_run_at == pytest.approx(turn + 2 * DAY, abs=1e-3)
        assert_journal_sound(engine, second.id)


@pytest.mark.parametrize("operator", ["with the definition", "without it"])
def test_a_held_map_child_in_a_wait_stays_held_through_its_parents_pause(
    store_url: str, operator: str
) -> None:
    """A held child starting in a timed wait, unpaused by its parent's unpause, was made due
    (at its creation's timeout, or at once without the definition) although its turn had
    not come: claimed, it expired while its sibling still ran (max_parallel broken)."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=_into_waits()) as engine:
        top = engine.start(engine.workflow("fan_waits"), Item(items=[1, 2])).id
        engine.run_until_idle(idle_horizon=0)
        first, second = sorted(engine.runs(workflow="held_item"), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        with Engine(store_url, clock=clock) as bare:
            by = engine if operator == "with the definition" else bare
            by.pause(top)
            clock.advance(10)
            by.unpause(top)
        assert engine.get(second.id).next_run_at is None  # held again
        engine.pause(first.id)  # the first stays live: the second's turn does not come
        for _ in range(2):
            clock.advance(2 * DAY + 60)
            engine.run_until_idle(idle_horizon=0)
        info = engine.get(second.id)
        assert (info.state, info.status) == ("hold", "scheduled"), info
        assert not [e for e in engine.history(second.id) if e.data.get(j.TURN)]


def test_a_held_map_child_whose_turn_comes_while_its_parent_is_paused_is_unpaused_with_it(
    store_url: str,
) -> None:
    """The turn's entry set the paused child's reason to "its turn came": the parent's
    unpause, which unpauses the children its pause paused ("parent paused"), left it paused
    and the map waited for it for ever (review)."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=_into_waits()) as engine:
        top = engine.start(engine.workflow("fan_waits"), Item(items=[1, 2])).id
        engine.run_until_idle(idle_horizon=0)
        first, second = sorted(engine.runs(workflow="held_item"), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        engine.pause(top)  # both children paused by it
        engine.stop(first.id)  # the first ends while the parent is paused: the second's turn
        assert engine.get(second.id).reason == "parent paused"
        assert [e.kind for e in engine.history(second.id)][-1] == j.RUN_DEFERRED
        engine.unpause(top)
        assert engine.get(second.id).status == "scheduled"
        assert engine.send(second.id, "go").status == "applied"
        engine.run_until_idle(idle_horizon=0)
        # The map joins (failed: its first child was stopped), not waiting for ever.
        assert (engine.get(top).status, engine.get(top).reason) == ("failed", "child_failed")
        assert_journal_sound(engine, second.id)


def test_a_map_child_written_by_another_writer_at_its_turn_is_released_without_waiting(
    pg_url: str,
) -> None:
    """PostgreSQL: the release held the join's row and waited on a journal entry another
    writer of the child had not committed — whose own end needs the join's row: a
    deadlock. A child being written is passed by (released as before, its turn unjournaled)."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(pg_url, clock=clock, workflows=_into_waits()) as engine:
        engine.start(engine.workflow("fan_waits"), Item(items=[1, 2]))
        engine.run_until_idle(idle_horizon=0)
        first, second = sorted(engine.runs(workflow="held_item"), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        other = sa.create_engine(pg_url)
        try:
            with other.connect() as writer:
                # Another writer of the second child, mid-transaction: the row held as an
                # append holds it, its next entry written, nothing committed.
                writer.execute(
                    sa.text("SELECT id FROM flowloop_runs WHERE id = :r FOR KEY SHARE"),
                    {"r": second.id},
                )
                seq = len(engine.history(second.id)) + 1
                writer.execute(
                    sa.text(
                        "INSERT INTO flowloop_journal (run_id, seq, kind, at, attempt) "
                        "VALUES (:r, :s, 'run_deferred', 0, 0)"
                    ),
                    {"r": second.id, "s": seq},
                )
                sent: list[str] = []
                sender = threading.Thread(
                    target=lambda: sent.append(engine.send(first.id, "go").status)
                )
                sender.start()
                sender.join(timeout=30)  # bounded: before, it waited for the writer
                assert sent == ["applied"]
                writer.rollback()
        finally:
            other.dispose()
        info = engine.get(second.id)
        assert (info.status, info.next_run_at) == ("scheduled", clock.now())
        engine.run_until_idle(idle_horizon=0)
        assert (engine.get(second.id).state, engine.get(second.id).status) == ("hold", "scheduled")


def test_unpause__without_the_definition_hands_over_the_events_kept_meanwhile(
    store_url: str, engine: Engine, clock: FakeClock
) -> None:
    """An event kept while the run was paused: an unpause from a process without the
    definition makes the run due at once (not at its timeout), and its claim hands the
    event over."""
    run_id = waiting(engine)
    with Engine(store_url, clock=clock) as operator:  # no workflow registered
        operator.pause(run_id)
        assert engine.send(run_id, "approve", {"by": "ann"}, buffer=True).status == "buffered"
        operator.unpause(run_id)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(run_id)
    assert (info.status, info.state) == ("succeeded", "approved"), info
    assert_journal_sound(engine, run_id)


def test_unpause__a_run_created_in_its_wait_with_run_at_keeps_its_timeout(store_url: str) -> None:
    """A run started into a 2-day wait with ``run_at`` 5 days ahead is due at 7 days; an
    unpause with the definition went by the creation's time instead (2 days), and at 3
    days the wait expired at once."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=_into_waits()) as engine:
        info = engine.start(engine.workflow("held_item"), Item(), run_at=clock.now() + 5 * DAY)
        assert info.next_run_at == pytest.approx(clock.now() + 7 * DAY, abs=1e-3)
        clock.advance(3 * DAY)
        engine.pause(info.id)
        unpaused = engine.unpause(info.id)
        assert unpaused.next_run_at == pytest.approx(info.next_run_at, abs=1e-3)
        engine.run_until_idle(idle_horizon=0)
        assert (engine.get(info.id).state, engine.get(info.id).status) == ("hold", "scheduled")


@pytest.mark.parametrize(
    ("workflow", "event", "end"),
    [(review, "approve", "approved"), (parked, "go", "done")],
    ids=["a 2-day wait", "a wait without timeout"],
)
def test_unpause__without_the_definition_hands_over_an_event_kept_while_it_decided(
    store_url: str, engine: Engine, clock: FakeClock, workflow: Workflow, event: str, end: str
) -> None:
    """An event kept after the unpause looked for kept events and before it wrote (the
    sender saw the run still paused, so its hand-over found nothing to do) waited for the
    2-day timeout's claim — for ever in a wait without a timeout. The unpause looks again
    once written: the run is due at once, and its claim hands the event over."""
    run_id = engine.run(workflow, {"doc_id": "D1"} if workflow is review else {}).id
    with Engine(store_url, clock=clock) as operator:  # no workflow registered
        operator.pause(run_id)
        looked = operator.store.pending_events

        def pending_then_sent(asked: str) -> list[InboxEvent]:
            found = looked(asked)
            if not found:  # the sender's keep lands between the look and the write
                payload = {"by": "ann"} if workflow is review else None
                sent = engine.send(run_id, event, payload, buffer=True)
                assert sent.status == "buffered"
            return found

        operator.store.pending_events = pending_then_sent  # type: ignore[method-assign]
        operator.unpause(run_id)
    engine.run_until_idle(idle_horizon=0)
    info = engine.get(run_id)
    assert (info.status, info.state) == ("succeeded", end), info
    assert_journal_sound(engine, run_id)


def test_a_held_map_child_ending_as_its_sibling_releases_it_does_not_deadlock(
    pg_url: str,
) -> None:
    """PostgreSQL: a held child's end (an operator's stop; an event too, when a held child
    still took one) held its own row and waited for the join's row, which its sibling's
    end held while its release waited for the child's row: a deadlock, and one of the two
    writers got ``DeadlockDetected``. A child's end now takes its join's row first."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(pg_url, clock=clock, workflows=_into_waits()) as engine:
        top = engine.start(engine.workflow("fan_waits"), Item(items=[1, 2])).id
        engine.run_until_idle(idle_horizon=0)
        first, second = sorted(engine.runs(workflow="held_item"), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        watcher = sa.create_engine(pg_url)
        sibling_errors: list[BaseException] = []

        def end_the_sibling() -> None:
            try:
                assert engine.send(first.id, "go").status == "applied"
            except BaseException as error:  # reported by the test's thread
                sibling_errors.append(error)

        sibling = threading.Thread(target=end_the_sibling)
        try:
            with TestEngine(pg_url, clock=clock, workflows=_into_waits()) as other:
                store: Any = other.store
                report_ends = store._report_ends

                def sibling_ends_meanwhile(conn: sa.Connection, boundaries: Any) -> None:
                    # The held child's end is written, not yet reported to its join: the
                    # sibling's end starts now and this transaction goes on once it waits.
                    pid = conn.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
                    sibling.start()
                    with watcher.connect() as look:
                        for _ in range(3000):  # bounded: 30 s
                            blocked = look.execute(
                                sa.text(
                                    "SELECT count(*) FROM pg_stat_activity"
                                    " WHERE :pid = ANY(pg_blocking_pids(pid))"
                                ),
                                {"pid": pid},
                            ).scalar()
                            if blocked or not sibling.is_alive():
                                break
                            threading.Event().wait(0.01)
                    report_ends(conn, boundaries)

                store._report_ends = sibling_ends_meanwhile
                assert other.stop(second.id).status == "stopped"
                store._report_ends = report_ends
        finally:
            sibling.join(timeout=30)
            watcher.dispose()
        assert not sibling.is_alive()
        assert sibling_errors == []
        engine.run_until_idle(idle_horizon=0)
        assert (engine.get(top).status, engine.get(top).reason) == ("failed", "child_failed")
        for child in (first.id, second.id):
            assert_journal_sound(engine, child)


def test_a_held_map_child_a_worker_holds_at_its_turn_keeps_its_next_write(
    store_url: str,
) -> None:
    """A held child with a deadline is due at it: claimed there, its sibling's end (an
    operator's stop) released it meanwhile, and the turn's entry took the seq the worker's
    ``deadline_passed`` was to take: the write was refused and the child sat owned until
    its lease ran out. A child a worker holds is released without the turn's entry."""
    item = _held_item("late_item", deadline=timedelta(hours=1), on_deadline="late")
    fan = _one_at_a_time("fan_late", item, tolerate_failures=1)
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item()).id
        engine.run_until_idle(idle_horizon=0)
        first, second = sorted(engine.runs(workflow="late_item"), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        engine.pause(first.id)  # not claimed at its deadline: an operator ends it then
        store: Any = engine.store
        write = store.write
        stopped: list[str] = []

        def sibling_ends_meanwhile(boundaries: Any) -> Any:
            if not stopped and any(b.run_id == second.id for b in boundaries):
                # The worker holds the second at its deadline: its sibling ends now.
                with Engine(store_url, clock=clock) as other:
                    stopped.append(other.stop(first.id).status)
            return write(boundaries)

        store.write = sibling_ends_meanwhile
        clock.advance(3600 + 5)
        engine.run_until_idle(idle_horizon=0)
        store.write = write
        assert stopped == ["stopped"]
        info = engine.get(second.id)
        assert (info.status, info.state, info.owner) == ("succeeded", "late", None), info
        assert engine.get(top).status == "succeeded"
        assert_journal_sound(engine, second.id)


@pytest.mark.parametrize("stopped", [[4, 5], [2], [3, 2]])
def test_a_held_map_child_stopped_takes_no_slot_and_frees_none(
    store_url: str, stopped: list[int]
) -> None:
    """A held child that ended (an operator's stop) counted as a slot freed: another held
    child was released for it, and with the held ones stopped a map of ``max_parallel=2``
    had six children running (fault-injection audit). Nor may a stopped child at the head
    of the queue swallow the next release."""
    clock = FakeClock(auto_advance=False)
    item = _held_item("slot_item")
    fan = _one_at_a_time("fan_slots", item, max_parallel=2, tolerate_failures=2)
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=[0, 1, 2, 3, 4, 5])).id
        engine.run_until_idle(idle_horizon=0)
        children = sorted(engine.runs(workflow="slot_item"), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        ids = [c.id for c in children]

        def running() -> list[int]:
            store: Any = engine.store
            return [
                n
                for n, run_id in enumerate(ids)
                if engine.get(run_id).status == "scheduled" and not store.is_held(run_id)
            ]

        assert running() == [0, 1]
        for n in stopped:
            engine.stop(ids[n])
            assert running() == [0, 1]
        for n in range(6):
            if n in stopped:
                continue
            assert len(running()) <= 2
            assert engine.send(ids[n], "go").status == "applied"
            engine.run_until_idle(idle_horizon=0)
            queued = [m for m in range(n + 1, 6) if m not in stopped]
            assert running() == queued[:2], (n, running())
        assert engine.get(top).status == "succeeded"


@pytest.mark.parametrize("action", ["stop", "pause"])
@pytest.mark.parametrize("fan_out", ["one transaction", "in batches"])
def test_a_request_made_while_a_parent_fans_out_reaches_every_child(
    store_url: str, action: str, fan_out: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's stop or pause of a parent its worker held in its fan-out: the cascade
    read the children that existed then, the request waited for the worker's next
    boundary — and the fan-out's own let the parent go waiting, the request on it for ever
    (shown `scheduled`), the children made after the read neither stopped nor paused
    (fault-injection audit: 1,003 children of a stopped map left waiting)."""
    from flowloop import children as kids
    from flowloop.store.joins import JoinStoreMixin

    clock = FakeClock(auto_advance=False)
    item = _held_item("fanned_item")
    fan = _one_at_a_time("fanned", item, max_parallel=2)
    items = list(range(3 if fan_out == "one transaction" else 7))
    monkeypatch.setattr(kids, "CREATE_BATCH", 3)  # (7 items: three batches)
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=items)).id
        hooked = "start_children" if fan_out == "one transaction" else "create_children"
        original = getattr(JoinStoreMixin, hooked)
        asked: list[str] = []
        told: set[str] = set()  # the runs whose stop or pause a listener heard of
        kind = j.RUN_STOPPED if action == "stop" else j.RUN_PAUSED

        def hear(record: Any, events: Any) -> None:
            told.update(record.id for e in events if e.kind == kind)

        engine.listen(hear)

        def ask() -> None:
            with Engine(store_url, clock=clock) as other:
                other.listen(hear, direct=True)  # what the operator's cascade writes
                asked.append(getattr(other, action)(top).status)

        def operator_meanwhile(self: Any, *args: Any, **kwargs: Any) -> Any:
            # A call or small map: before its one transaction; a large map: after its
            # first batch. Either way while the worker holds the parent.
            if not asked and hooked == "start_children":
                ask()
            made = original(self, *args, **kwargs)
            if not asked:
                ask()
            return made

        monkeypatch.setattr(JoinStoreMixin, hooked, operator_meanwhile)
        engine.run_until_idle(idle_horizon=0)
        monkeypatch.undo()
        assert len(asked) == 1  # asked while its worker held it
        parent = engine.get(top)
        kids_now = [engine.get(r.id) for r in engine.runs(workflow="fanned_item")]
        assert len(kids_now) == len(items)
        # Those the worker wrote too (before, past its listeners: metrics, tracing).
        assert told == {top, *(c.id for c in kids_now)}
        if action == "stop":
            assert parent.status == "stopped"
            assert {c.status for c in kids_now} == {"stopped"}
        else:
            assert parent.status == "paused"
            assert engine.store.get_run(top).control is None  # type: ignore[union-attr]
            assert {(c.status, c.reason) for c in kids_now} == {("paused", "parent paused")}
            engine.unpause(top)
            assert {engine.get(c.id).status for c in kids_now} == {"scheduled"}


def test_turns_owed_while_a_large_map_is_still_created_go_to_its_next_batch(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Children ending while their parent still creates its batches give turns no held
    child can take (the one held was stopped): the next batch's first children are created
    due for them — neither more than ``max_parallel`` running, nor none (which would leave
    the map waiting for ever)."""
    from flowloop import children as kids
    from flowloop.store.joins import JoinStoreMixin

    clock = FakeClock(auto_advance=False)
    item = _held_item("batched_item")
    fan = _one_at_a_time("batched", item, max_parallel=2, tolerate_failures=1)
    monkeypatch.setattr(kids, "CREATE_BATCH", 3)  # 0-2, 3-5, 6
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=list(range(7)))).id
        create = JoinStoreMixin.create_children
        batches: list[int] = []

        def ends_between_batches(self: Any, join_id: str, first: int, build: Any) -> Any:
            made = create(self, join_id, first, build)
            batches.append(first)
            if first == 0:  # 0 and 1 running, 2 held: 2 stopped, then 0 and 1 end
                ids = {r.context.n: r.id for r in engine.runs(workflow="batched_item")}  # type: ignore[attr-defined]
                with Engine(store_url, clock=clock, workflows=[item, fan]) as other:
                    other.stop(ids[2])
                    for n in (0, 1):
                        assert other.send(ids[n], "go").status == "applied"
            return made

        monkeypatch.setattr(JoinStoreMixin, "create_children", ends_between_batches)
        engine.run_until_idle(idle_horizon=0)
        monkeypatch.undo()
        assert batches == [0, 3, 6]
        store: Any = engine.store

        def running() -> list[int]:
            runs_now = engine.runs(workflow="batched_item")
            return sorted(
                r.context.n  # type: ignore[attr-defined]
                for r in runs_now
                if r.status == "scheduled" and not store.is_held(r.id)
            )

        assert running() == [3, 4]
        for n in (3, 4, 5, 6):
            ids = {r.context.n: r.id for r in engine.runs(workflow="batched_item")}  # type: ignore[attr-defined]
            assert engine.send(ids[n], "go").status == "applied"
            engine.run_until_idle(idle_horizon=0)
            assert len(running()) <= 2
        assert engine.get(top).status == "succeeded"


def test_migration_0019__joins_in_flight_count_no_held_end_and_go_on(store_url: str) -> None:
    """The join's ``ended_held`` arrives as 0 on a database with a map in flight, which
    then goes on; a downgrade drops it and keeps the joins."""
    from storekit import to_revision

    from flowloop.store.schema import joins

    clock = FakeClock(auto_advance=False)
    item = _held_item("migrated_item")
    fan = _one_at_a_time("migrated", item, max_parallel=1)
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=[0, 1])).id
        engine.run_until_idle(idle_horizon=0)
    to_revision(store_url, "0018")
    looking = sa.create_engine(store_url)
    try:
        columns = sa.inspect(looking).get_columns("flowloop_joins")
    finally:
        looking.dispose()
    assert "ended_held" not in {c["name"] for c in columns}
    to_revision(store_url, "head")
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        store: Any = engine.store
        with store.engine.connect() as conn:
            assert conn.execute(sa.select(joins.c.ended_held)).scalars().all() == [0]
        for n in (0, 1):
            ids = {r.context.n: r.id for r in engine.runs(workflow="migrated_item")}  # type: ignore[attr-defined]
            assert engine.send(ids[n], "go").status == "applied"
            engine.run_until_idle(idle_horizon=0)
        assert engine.get(top).status == "succeeded"


def test_a_stop_landing_after_a_fan_out_let_its_parent_go_reaches_every_child(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop's cascade read the children of the first batch; the worker made the rest
    and let the parent go before the stop's request landed — which then wrote the parent's
    stop (nobody held it) and cascaded no further: the parent stopped, four children ran
    on (review). The stop cascades again once the parent's is made."""
    import threading

    from flowloop import children as kids
    from flowloop.store.joins import JoinStoreMixin

    clock = FakeClock(auto_advance=False)
    item = _held_item("raced_item")
    fan = _one_at_a_time("raced", item, max_parallel=2)
    monkeypatch.setattr(kids, "CREATE_BATCH", 3)
    cascaded, worker_looked = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=list(range(7)))).id
        create, honour = JoinStoreMixin.create_children, kids.honour_left_request
        operators: list[threading.Thread] = []

        def operator() -> None:
            try:
                with Engine(store_url, clock=clock, workflows=[item, fan]) as other:
                    store: Any = other.store
                    request = store.request_control

                    def after_the_fan_out(run_id: str, action: Any, **options: Any) -> bool:
                        if run_id == top:  # the children's stops are made: the parent's now
                            cascaded.set()
                            assert worker_looked.wait(30)
                        return bool(request(run_id, action, **options))

                    store.request_control = after_the_fan_out
                    other.stop(top)
            except BaseException as error:  # reported by the test's thread
                errors.append(error)
                cascaded.set()

        def first_batch_then_the_operator(self: Any, *args: Any, **kwargs: Any) -> Any:
            made = create(self, *args, **kwargs)
            if not operators:
                operators.append(threading.Thread(target=operator))
                operators[0].start()
                assert cascaded.wait(30)
            return made

        def looked(executor: Any, run_id: str) -> None:
            honour(executor, run_id)
            worker_looked.set()

        monkeypatch.setattr(JoinStoreMixin, "create_children", first_batch_then_the_operator)
        monkeypatch.setattr(kids, "honour_left_request", looked)
        engine.run_until_idle(idle_horizon=0)
        operators[0].join(30)
        monkeypatch.undo()
        assert errors == []
        assert engine.get(top).status == "stopped"
        assert {r.status for r in engine.runs(workflow="raced_item")} == {"stopped"}


def test_a_childs_own_pause_made_while_its_parents_pause_reaches_it_stays_its_own(
    store_url: str,
) -> None:
    """The parent's pause of a child, refused because the child changed, looked at it again
    and wrote "parent paused" over the operator's own pause made meanwhile: the parent's
    unpause would then unpause a child an operator had paused (review)."""
    from flowloop import children as kids

    clock = FakeClock(auto_advance=False)
    item = _held_item("own_item")
    fan = _one_at_a_time("own_fan", item)
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=[0])).id
        engine.run_until_idle(idle_horizon=0)
        (child,) = engine.runs(workflow="own_item")
        store: Any = engine.store
        write = store.write
        paused: list[str] = []

        def own_pause_first(boundaries: Any) -> Any:
            if not paused and any(b.run_id == child.id for b in boundaries):
                with Engine(store_url, clock=clock, workflows=[item, fan]) as other:
                    paused.append(other.pause(child.id).status)
            return write(boundaries)

        store.write = own_pause_first
        try:
            kids.pause_children(store, top, now=clock.now(), worker="w")
        finally:
            store.write = write
        assert paused == ["paused"]
        info = engine.get(child.id)
        assert (info.status, info.reason) == ("paused", "paused"), info  # not "parent paused"
        assert [e.kind for e in engine.history(child.id)].count(j.RUN_PAUSED) == 1


def test_an_event_sent_to_a_held_map_child_waits_for_its_turn(store_url: str) -> None:
    """An event sent to a child held back by ``max_parallel`` was taken at once and the
    child went on into its step beside the one running (review). It is kept, and taken
    when the child's turn comes."""
    clock = FakeClock(auto_advance=False)
    ran: list[int] = []
    item = Workflow("turned_item", context=Item)
    item.wait("hold", on={"go": "work"}, initial=True)

    @item.step(next="done")
    def work(ctx: Item) -> None:
        ran.append(ctx.n)

    item.final("done")
    fan = _one_at_a_time("turned", item)
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=[0, 1])).id
        engine.run_until_idle(idle_horizon=0)
        ids = {r.context.n: r.id for r in engine.runs(workflow="turned_item")}  # type: ignore[attr-defined]
        kept = engine.send(ids[1], "go")
        assert (kept.status, kept.run.state) == ("buffered", "hold")
        engine.run_until_idle(idle_horizon=0)
        assert ran == [] and engine.get(ids[1]).state == "hold"
        assert engine.send(ids[0], "go").status == "applied"
        engine.run_until_idle(idle_horizon=0)  # the first ends: the second's turn, its event
        assert ran == [0, 1]
        assert engine.get(top).status == "succeeded"
        assert_journal_sound(engine, ids[1])


def test_an_event_kept_for_a_held_child_as_its_turn_comes_is_taken(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sender found the child held and kept its event; meanwhile the child's turn came
    and a worker claimed it, read the inbox before the event landed and let it go waiting
    without a timeout: the event stayed kept and the map waited for ever (review). The
    worker hands over what was kept after it lets the run go."""
    import threading

    clock = FakeClock(auto_advance=False)
    item = Workflow("raced_turn", context=Item)
    item.wait("hold", on={"go": "done"}, initial=True)  # no timeout: no claim comes later
    item.final("done")
    fan = _one_at_a_time("raced_turns", item)
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=[0, 1])).id
        engine.run_until_idle(idle_horizon=0)
        ids = {r.context.n: r.id for r in engine.runs(workflow="raced_turn")}  # type: ignore[attr-defined]
        read_inbox, sent = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                with TestEngine(store_url, clock=clock, workflows=[item, fan]) as other:
                    store: Any = other.store
                    pending = store.pending_events

                    def read_before_the_event(run_id: str) -> Any:
                        found = pending(run_id)
                        if run_id == ids[1] and not read_inbox.is_set():
                            read_inbox.set()
                            assert sent.wait(30)
                        return found

                    store.pending_events = read_before_the_event
                    other.run_until_idle(idle_horizon=0)
            except BaseException as error:  # reported by the test's thread
                errors.append(error)
                read_inbox.set()

        workers: list[threading.Thread] = []
        held = type(engine).is_held

        def held_then_its_turn(self: Any, run_id: str) -> bool:
            answer = held(self, run_id)
            if answer and not workers:
                with Engine(store_url, clock=clock, workflows=[item, fan]) as other:
                    assert other.send(ids[0], "go").status == "applied"  # the second's turn
                workers.append(threading.Thread(target=worker))
                workers[0].start()
                assert read_inbox.wait(30)
            return bool(answer)

        monkeypatch.setattr(type(engine), "is_held", held_then_its_turn)
        kept = engine.send(ids[1], "go")
        monkeypatch.undo()
        sent.set()
        workers[0].join(30)
        assert errors == []
        assert kept.status == "buffered"
        engine.run_until_idle(idle_horizon=0)
        assert engine.get(ids[1]).state == "done"
        assert engine.get(top).status == "succeeded"


def test_held_map_children_parked_by_a_deploy_and_migrated_wait_their_turns(
    store_url: str,
) -> None:
    """A deploy that dropped the held children's wait state parked them; migrated, every
    one was made due at once and they all ran beside each other past ``max_parallel``
    (review). A held child migrated stays held: its turn makes it due."""
    clock = FakeClock(auto_advance=False)
    ran: list[int] = []

    def child(version: int) -> Workflow:
        moved = None if version == 1 else {1: {"hold": "work"}}
        wf = Workflow("moved_item", context=Item, version=version, migrates_from=moved)
        if version == 1:
            wf.wait("hold", on={"go": "work"}, initial=True)

        @wf.step(name="work", initial=version == 2, next="done")
        def work(ctx: Item) -> None:
            ran.append(ctx.n)

        wf.final("done")
        return wf

    old, new = child(1), child(2)
    with TestEngine(store_url, clock=clock, workflows=[old, _one_at_a_time("moved", old)]) as v1:
        top = v1.start(v1.workflow("moved"), Item(items=[0, 1, 2, 3])).id
        v1.run_until_idle(idle_horizon=0)
    with TestEngine(store_url, clock=clock, workflows=[new, _one_at_a_time("moved", new)]) as v2:
        v2.run_until_idle(idle_horizon=0)  # the children are parked: "hold" is gone
        assert {r.status for r in v2.runs(workflow="moved_item")} == {"paused"}
        v2.migrate_workflow("moved_item", to=2, by="release")
        store: Any = v2.store
        due = [r for r in v2.runs(workflow="moved_item") if r.next_run_at is not None]
        assert len(due) == 1 and not store.is_held(due[0].id)
        v2.run_until_idle(idle_horizon=0)
        assert sorted(ran) == [0, 1, 2, 3]
        assert v2.get(top).status == "succeeded"


@pytest.mark.parametrize("how", ["an operator's stop", "the parent's deadline"])
def test_stopping_a_map_gives_no_held_child_its_turn_on_the_way(store_url: str, how: str) -> None:
    """The stop of a map's children went in item order: each running child's end gave the
    next held one its turn (journaled, due now) before the stop reached it — a worker could
    claim it and run its first step in between (review). The last child goes first now."""
    clock = FakeClock(auto_advance=False)
    item = _held_item("cut_item")
    options: dict[str, Any] = {}
    if how == "the parent's deadline":
        options = {"deadline": timedelta(hours=1), "on_deadline": "late"}
    fan = Workflow("cut_fan", context=Item, **options)
    fan.map(
        "each",
        child=item,
        items=lambda ctx: ctx.items,
        context=lambda ctx, n: Item(n=n),
        max_parallel=2,
        on={"done": "done"},
        initial=True,
    )
    fan.final("done", *(["late"] if options else []))
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=[0, 1, 2, 3, 4])).id
        engine.run_until_idle(idle_horizon=0)
        if how == "an operator's stop":
            engine.stop(top)
        else:
            clock.advance(3600 + 5)
            engine.run_until_idle(idle_horizon=0)
        for run in engine.runs(workflow="cut_item"):
            kinds = [e.kind for e in engine.history(run.id)]
            assert kinds == [j.RUN_CREATED, j.RUN_STOPPED], (run.context, kinds)  # type: ignore[attr-defined]


HELD_FILE = """
from pydantic import BaseModel
from flowloop import Workflow


class Item(BaseModel):
    n: int = 0
    items: list[int] = [1, 2]


item = Workflow("cli_held_item", context=Item)
item.wait("hold", on={"go": "done"}, initial=True)
item.final("done")
fan = Workflow("cli_held_fan", context=Item)
fan.map("each", child=item, items=lambda ctx: ctx.items, context=lambda ctx, n: Item(n=n),
        max_parallel=1, on={"done": "done"}, initial=True)
fan.final("done")
"""


def test_send_to_a_held_child_says_it_waits_for_its_turn(tmp_path: Path) -> None:
    """`flowloop send` to a held child printed "go: buffered; run … waiting at hold;
    waiting in hold for go", which said nothing of why the event was not taken (review)."""
    import json

    from click.testing import CliRunner

    from flowloop.cli import cli

    flows = tmp_path / "held.py"
    flows.write_text(HELD_FILE)
    db = str(tmp_path / "held.db")
    runner = CliRunner()
    assert runner.invoke(cli, ["run", str(flows) + ":cli_held_fan", "--db", db]).exit_code == 0
    with Engine(db) as engine:
        second = next(
            r for r in engine.runs() if r.workflow == "cli_held_item" and r.context["n"] == 2
        )  # type: ignore[index]
    said = runner.invoke(cli, ["send", second.id, "go", "-w", str(flows), "--db", db])
    assert said.exit_code == 0, said.output
    assert " ".join(said.stdout.split()) == (
        f"go: buffered; run {second.id} is held back by its map's max_parallel at hold: it "
        "takes the event when its turn comes"
    )
    again = runner.invoke(cli, ["send", second.id, "go", "-w", str(flows), "--db", db, "--json"])
    assert json.loads(again.stdout)["held"] is True


def test_a_held_child_unpaused_as_its_turn_comes_is_due(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The unpause looked (held: no due time), the child's turn came, then the unpause
    wrote "no due time" over the release's: a child in a step state, released but never
    due, and the map waited for ever (review). It is released due once the unpause sees
    the turn came."""
    from flowloop import children as kids

    clock = FakeClock(auto_advance=False)
    item = Workflow("late_turn", context=Item)

    @item.step(initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=1e8))
    def work(ctx: Item) -> None:
        if ctx.n == 0:
            raise ValueError("the first holds its slot, retrying")

    item.final("done")
    fan = _one_at_a_time("late_turns", item, tolerate_failures=1)
    with TestEngine(store_url, clock=clock, workflows=[item, fan]) as engine:
        top = engine.start(fan, Item(items=[0, 1])).id
        engine.run_until_idle(idle_horizon=0)
        ids = {r.context.n: r.id for r in engine.runs(workflow="late_turn")}  # type: ignore[attr-defined]
        engine.pause(ids[1])
        looked = kids.is_held
        turned: list[str] = []

        def then_its_turn(store: Any, run_id: str) -> bool:
            answer = looked(store, run_id)
            if answer and run_id == ids[1] and not turned:
                with Engine(store_url, clock=clock, workflows=[item, fan]) as other:
                    turned.append(other.stop(ids[0]).status)  # frees the slot: its turn
            return answer

        monkeypatch.setattr(kids, "is_held", then_its_turn)
        engine.unpause(ids[1])
        monkeypatch.undo()
        assert turned == ["stopped"]
        assert engine.get(ids[1]).next_run_at is not None
        engine.run_until_idle(idle_horizon=0)
        assert engine.get(ids[1]).status == "succeeded"
        assert engine.get(top).status == "succeeded"
        assert_journal_sound(engine, ids[1])
