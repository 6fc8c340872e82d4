"""A debounce burst's run in each state it can be in before its first step (paused,
stopped, waiting in its first state, taken an event there), on SQLite and PostgreSQL: the
store's ``debounce_start`` and the engine over it (a fake clock, real databases)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from pydantic import BaseModel
from storekit import new_run, pause

from flowloop import Engine, FakeClock, Workflow
from flowloop import journal as j
from flowloop.store import Boundary, Fence, RunFilter, SQLStore, StoredRun
from flowloop.store.admission import ATTEMPTS

MARKER = "debounce:w:c"


def burst_start(store: SQLStore, n: int, *, due: float) -> tuple[StoredRun, bool]:
    """A start of key ``c``'s burst with context ``{"n": n}``, due at ``due``."""
    new = new_run(idempotency_key=MARKER, context=f'{{"n":{n}}}', due=due)
    return store.debounce_start(new, MARKER, due=due, now=time.time(), key="c")


def operator_entry(stored: StoredRun, kind: str, **fields: object) -> Boundary:
    record = stored.record
    entry = j.JournalEvent(
        run_id=record.id,
        seq=record.last_seq + 1,
        kind=kind,
        at=time.time(),
        **fields,  # type: ignore[arg-type]
    )
    return Boundary(
        events=[entry], record=j.apply(record, entry), fence=Fence(None, stored.lease_epoch)
    )


def replayed(store: SQLStore, run_id: str) -> list[str]:
    """Where replaying the run's journal differs from its row (nothing: it equals)."""
    stored = store.get_run(run_id)
    assert stored is not None
    return j.compare(j.fold(store.journal(run_id)), stored.record)


def test_debounce_start__a_run_paused_before_its_first_step_takes_the_start_paused(
    store: SQLStore,
) -> None:
    first, made = burst_start(store, 1, due=time.time() + 30)
    assert made
    assert store.write([pause(first)]) == [True]
    later = time.time() + 60
    merged, made = burst_start(store, 2, due=later)
    # The operator's pause holds the burst: one run, the last context, still paused and
    # due at nothing until it is unpaused (its entry keeps the burst's due time).
    assert (merged.id, made) == (first.id, False)
    record = merged.record
    assert (record.status, record.context, record.next_run_at) == ("paused", '{"n":2}', None)
    entries = store.journal(first.id)
    assert [e.kind for e in entries] == [j.RUN_CREATED, j.RUN_PAUSED, j.RUN_DEBOUNCED]
    assert (entries[-1].state, entries[-1].data["due"]) == ("a", later)
    assert replayed(store, first.id) == []
    assert len(store.find_runs(RunFilter())) == 1


def test_debounce_start__a_run_stopped_before_its_first_step_leaves_a_new_burst(
    store: SQLStore,
) -> None:
    first, _ = burst_start(store, 1, due=time.time() + 30)
    stop = operator_entry(first, j.RUN_STOPPED, state="a")
    assert store.write([stop]) == [True]
    second, made = burst_start(store, 2, due=time.time() + 30)
    assert made and second.id != first.id and second.record.context == '{"n":2}'
    stopped = store.get_run(first.id)
    assert stopped is not None and stopped.record.status == "stopped"
    assert stopped.idempotency_key == f"{MARKER}:{first.id}"  # its own marker now


def test_debounce_start__a_run_that_took_an_event_in_its_first_state_has_begun(
    store: SQLStore,
) -> None:
    first, _ = burst_start(store, 1, due=time.time() + 30)
    # Its first state (a wait) took an event: it moved on, scheduled, no step begun yet.
    took = operator_entry(
        first, j.EVENT_RECEIVED, state="a", event="go", next_state="b", context='{"n":1}'
    )
    assert store.write([took]) == [True]
    second, made = burst_start(store, 2, due=time.time() + 30)
    assert made and second.id != first.id
    moved = store.get_run(first.id)
    assert moved is not None
    assert (moved.record.state, moved.record.context) == ("b", '{"n":1}')  # not replaced


def test_debounce_start__a_run_that_moves_under_every_write_leaves_a_new_burst(
    store: SQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its fenced write refused at each try (PostgreSQL: a claim, a pause or a stop moved
    the row between the read and the write — forced here by a stale read handed to the real
    write): the start opens a new burst with its context. (It found the marker still on
    the old run and returned it as merged: nothing written, the start's context lost.)"""
    first, _ = burst_start(store, 1, due=time.time() + 30)
    write = store._debounce_into
    refused: list[int] = []

    def moved_meanwhile(conn: Any, stored: StoredRun, *args: Any, **kwargs: Any) -> bool:
        if len(refused) < ATTEMPTS:
            stale = replace(stored.record, last_seq=stored.record.last_seq - 1)
            refused.append(stored.record.last_seq)
            stored = replace(stored, record=stale)
        return write(conn, stored, *args, **kwargs)

    monkeypatch.setattr(store, "_debounce_into", moved_meanwhile)
    second, made = burst_start(store, 2, due=time.time() + 30)
    assert len(refused) == ATTEMPTS
    assert made and second.id != first.id and second.record.context == '{"n":2}'
    old = store.get_run(first.id)
    assert old is not None and old.idempotency_key == f"{MARKER}:{first.id}"
    assert (old.record.status, old.record.context) == ("scheduled", '{"n":1}')
    assert [e.kind for e in store.journal(first.id)] == [j.RUN_CREATED]  # nothing written
    # The burst goes on in the new run.
    third, made = burst_start(store, 3, due=time.time() + 30)
    assert (third.id, made, third.record.context) == (second.id, False, '{"n":3}')
    assert replayed(store, first.id) == [] and replayed(store, second.id) == []


# -- through the engine ------------------------------------------------------------------


class Change(BaseModel):
    customer: str
    n: int


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_800_000_000.0)


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[Engine]:
    with Engine(store_url, clock=clock, poll_seconds=0.02) as e:
        yield e


def sync_workflow(seen: list[tuple[str, int]]) -> Workflow:
    wf = Workflow("sync", context=Change, key="customer")

    @wf.step(initial=True, next="synced")
    def push(ctx: Change) -> None:
        seen.append(("push", ctx.n))

    wf.final("synced")
    return wf


def inbox_workflow(seen: list[tuple[str, int]]) -> Workflow:
    """First state a wait (100 s timeout): the run waits for ``go``, else times out."""
    wf = Workflow("inbox", context=Change, key="customer")
    wf.wait("inbox", initial=True, on={"go": "push"}, timeout=100, on_timeout="late")

    @wf.step(name="push", next="done")
    def push(ctx: Change) -> None:
        seen.append(("push", ctx.n))

    @wf.step(name="late", next="done")
    def late(ctx: Change) -> None:
        seen.append(("late", ctx.n))

    wf.final("done")
    return wf


def test_debounce__a_paused_run_collects_the_burst_and_runs_once_when_unpaused(
    engine: Engine, clock: FakeClock
) -> None:
    seen: list[tuple[str, int]] = []
    wf = sync_workflow(seen)
    first = engine.start(wf, Change(customer="c", n=1), debounce=30)
    engine.pause(first.id)
    clock.advance(10)
    later = engine.start(wf, Change(customer="c", n=2), debounce=30)
    assert later.id == first.id and later.status == "paused"
    assert [e.kind for e in engine.history(first.id)] == [
        "run_created",
        "run_paused",
        "run_debounced",
    ]
    assert engine.replay(first.id).matches
    engine.run_until_idle()
    assert seen == [] and engine.get(first.id).status == "paused"  # the pause holds it
    clock.advance(5)
    unpaused = engine.unpause(first.id)
    # Due one window after the burst's last start, not at once.
    assert unpaused.next_run_at == clock.now() + 25
    engine.run_until_idle(idle_horizon=1)
    assert seen == []
    clock.advance(25)
    engine.run_until_idle()
    assert seen == [("push", 2)] and engine.get(first.id).status == "succeeded"
    assert [r.id for r in engine.runs()] == [first.id]  # one run for the burst


def test_debounce__a_paused_run_unpaused_after_its_window_runs_at_once(
    engine: Engine, clock: FakeClock
) -> None:
    seen: list[tuple[str, int]] = []
    wf = sync_workflow(seen)
    first = engine.start(wf, Change(customer="c", n=1), debounce=30)
    engine.pause(first.id)
    engine.start(wf, Change(customer="c", n=2), debounce=30)
    clock.advance(45)
    engine.unpause(first.id)
    engine.run_until_idle(idle_horizon=0)
    assert seen == [("push", 2)] and len(engine.runs()) == 1


def test_debounce__a_run_stopped_before_it_began_leaves_the_next_start_a_new_run(
    engine: Engine, clock: FakeClock
) -> None:
    seen: list[tuple[str, int]] = []
    wf = sync_workflow(seen)
    first = engine.start(wf, Change(customer="c", n=1), debounce=30)
    engine.stop(first.id)
    second = engine.start(wf, Change(customer="c", n=2), debounce=30)
    assert second.id != first.id and second.status == "scheduled"
    clock.advance(30)
    engine.run_until_idle()
    assert seen == [("push", 2)] and engine.get(first.id).status == "stopped"


def test_debounce__a_run_waiting_in_its_first_state_keeps_its_timeout_after_the_window(
    engine: Engine, clock: FakeClock
) -> None:
    seen: list[tuple[str, int]] = []
    wf = inbox_workflow(seen)
    first = engine.start(wf, Change(customer="c", n=1), debounce=30)
    assert first.next_run_at == clock.now() + 130  # the timeout, counted from the window
    clock.advance(20)
    later = engine.start(wf, Change(customer="c", n=2), debounce=30)
    assert later.id == first.id and later.next_run_at == clock.now() + 130
    clock.advance(31)  # the window has passed, the wait's timeout has not
    engine.run_until_idle(idle_horizon=0)
    assert seen == [] and engine.get(first.id).state == "inbox"
    # Paused and unpaused, it waits on with that timeout.
    engine.pause(first.id)
    assert engine.unpause(first.id).next_run_at == clock.now() + 99
    assert engine.replay(first.id).matches
    clock.advance(99)
    engine.run_until_idle()
    assert seen == [("late", 2)]


def test_debounce__a_run_that_took_an_event_in_its_first_state_is_not_changed(
    engine: Engine, clock: FakeClock
) -> None:
    seen: list[tuple[str, int]] = []
    wf = inbox_workflow(seen)
    first = engine.start(wf, Change(customer="c", n=1), debounce=30)
    engine.send(first.id, "go")  # taken: it moves on to its step, due at once
    second = engine.start(wf, Change(customer="c", n=2), debounce=30)
    assert second.id != first.id
    moved = engine.get(first.id)
    assert (moved.state, Change.model_validate(moved.context).n) == ("push", 1)
    engine.run_until_idle()
    assert sorted(seen) == [("late", 2), ("push", 1)]
