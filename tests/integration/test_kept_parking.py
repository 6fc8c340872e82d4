"""The recovery sweep's look for stranded kept events parks only a run that still waits as
it read it (flowloop/kept.py): not one an operator paused or stopped meanwhile, not one
that went on, not for a pool's timeout; a run a claim would fail ends its wait once, in its
journal. On SQLite and PostgreSQL, on a FakeClock."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from waitkit import ALL, Empty, chain_with_go_kept, inbox_rows, initial_wait, keep_stranded, kinds

from flowloop import Engine, FakeClock, Workflow, kept
from flowloop.kept import hand_over_stranded
from flowloop.store.schema import runs
from flowloop.testing import TestEngine

OPERATOR: dict[str, Callable[[Engine, str], Any]] = {
    "pause": lambda engine, run_id: engine.pause(run_id),
    "stop": lambda engine, run_id: engine.stop(run_id),
}


@pytest.fixture
def engine(store_url: str) -> Iterator[TestEngine]:
    with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=ALL) as engine:
        yield engine


def _operators_end(engine: Engine, run_id: str, action: str) -> None:
    """The run as the operator's ``action`` left it: one entry of it, nothing after."""
    info = engine.get(run_id)
    ran = kinds(engine, run_id)
    if action == "pause":
        assert info.status == "paused" and ran.count("run_paused") == 1, ran
        assert not (info.reason or "").startswith(("definition_mismatch", "kept_events_failed"))
    else:
        assert info.status == "stopped" and ran[-1] == "run_stopped", ran
    assert "run_paused" not in ran or ran[-1] == "run_paused"


def _two_versions(version: int) -> Workflow:
    """A wait that takes ``a`` or ``b`` (v1), or only ``a`` (v2 parks a v1 run there)."""
    workflow = Workflow("kept_parking_versions", context=Empty, version=version)

    @workflow.step(initial=True, next="w")
    def begin(ctx: Empty) -> None: ...

    workflow.wait("w", on={"a": "x", "b": "y"} if version == 1 else {"a": "x"})
    workflow.final(*(("x", "y") if version == 1 else ("x",)))
    return workflow


@pytest.mark.parametrize("action", ["pause", "stop"])
def test_stranded_look__an_operators_pause_or_stop_after_it_read_the_run_is_left_as_it_is(
    store_url: str, action: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Review: the look parked a run its loaded definition refuses without looking at its
    # status: an operator's pause that landed between the look's read and the park was
    # overwritten by a second run_paused (definition_mismatch), and a stop made the park
    # raise FoldError (a failed look, counted towards kept_events_failed).
    v1, v2 = _two_versions(1), _two_versions(2)
    with Engine(store_url, workflows=[v1]) as first:
        run_id = first.start(v1, Empty()).id
        first.run_until_idle()
        keep_stranded(first, run_id, "a")
    failing: dict[str, int] = {}
    with Engine(store_url, workflows=[v2]) as later, caplog.at_level(logging.DEBUG, "flowloop"):
        look = later.store.kept_for_free_runs

        def read_then_operator(*args: Any, **kwargs: Any) -> list[str]:
            found = look(*args, **kwargs)
            assert found == [run_id]
            with Engine(store_url) as operator:  # (another process: loads no definition)
                OPERATOR[action](operator, run_id)
            return found

        later.store.kept_for_free_runs = read_then_operator  # type: ignore[method-assign]
        workflows = {v2.name: v2}
        handed = hand_over_stranded(later.store, workflows, now=0.0, worker="w2", failing=failing)
        assert (handed, failing) == (0, {})
        _operators_end(later, run_id, action)
    assert "could not" not in caplog.text
    assert [row.consumed_seq for row in inbox_rows(store_url, run_id)] == [None]  # kept


@pytest.mark.parametrize("action", ["pause", "stop"])
def test_stranded_look__a_failing_run_an_operator_paused_or_stopped_is_not_parked_over_it(
    engine: TestEngine,
    action: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The same for a run whose hand-over failed at its HAND_OVER_TRIES-th look: paused by
    # an operator meanwhile, it was parked over it (kept_events_failed); stopped, the park
    # raised FoldError ("could not park it").
    run_id = chain_with_go_kept(engine)

    def operator_then_broken(*args: object, **kwargs: object) -> int:
        OPERATOR[action](engine, run_id)
        raise RuntimeError("a journal entry the database refuses")

    monkeypatch.setattr("flowloop.kept.deliver_pending", operator_then_broken)
    failing = {run_id: kept.HAND_OVER_TRIES - 1}
    with caplog.at_level(logging.DEBUG, logger="flowloop"):
        now = engine.clock.now()
        hand_over_stranded(engine.store, engine.workflows, now=now, worker="w", failing=failing)
    _operators_end(engine, run_id, action)
    assert "could not park" not in caplog.text


def test_stranded_look__one_that_hands_some_over_then_fails_is_a_look_that_handed_it_over(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review: a look that handed `go` over (first → second) and then failed on `note`
    # counted as a failed look (the count handed thrown away), and at the HAND_OVER_TRIES-
    # th parked the run that had just gone on (kept_events_failed). It handed one over:
    # the count starts again, and the run waits in second, `note` kept.
    run_id = chain_with_go_kept(engine)
    keep_stranded(engine, run_id, "note", '{"text": "later"}')
    take = kept.take_kept
    calls: list[str] = []

    def second_fails(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[2].event)
        if len(calls) > 1:
            raise RuntimeError("a context that no longer loads")
        return take(*args, **kwargs)

    monkeypatch.setattr(kept, "take_kept", second_fails)
    failing = {run_id: kept.HAND_OVER_TRIES - 1}
    now = engine.clock.now()
    handed = hand_over_stranded(
        engine.store, engine.workflows, now=now, worker="w", failing=failing
    )
    assert (calls, handed, failing) == (["go", "note"], 1, {})
    info = engine.get(run_id)
    assert (info.status, info.state, info.reason) == ("scheduled", "second", None)
    assert [row.consumed_seq is None for row in inbox_rows(engine.url, run_id)] == [False, True]


def test_stranded_look__a_run_that_went_on_after_its_hand_over_failed_is_not_parked(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its hand-over failed; before the look parked it (at its HAND_OVER_TRIES-th), another
    # sender moved it on: the run it parks must be the one that failed, as that read it.
    run_id = chain_with_go_kept(engine)
    take = kept.take_kept

    def moved_then_fails(*args: Any, **kwargs: Any) -> Any:
        monkeypatch.setattr(kept, "take_kept", take)
        assert engine.send(run_id, "go").status == "applied"  # (another sender's)
        raise RuntimeError("a context that no longer loads")

    monkeypatch.setattr(kept, "take_kept", moved_then_fails)
    failing = {run_id: kept.HAND_OVER_TRIES - 1}
    now = engine.clock.now()
    hand_over_stranded(engine.store, engine.workflows, now=now, worker="w", failing=failing)
    info = engine.get(run_id)
    assert (info.status, info.state, info.reason) == ("scheduled", "second", None)
    assert "run_paused" not in kinds(engine, run_id)


def test_stranded_look__a_pool_timeout_is_not_a_failed_look(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Review: a pool with no connection free in time (sqlalchemy.exc.TimeoutError, not an
    # outage by is_outage) counted towards parking healthy runs: a busy worker parked
    # every stranded run it looked at, kept_events_failed.
    run_id = chain_with_go_kept(engine)

    def pool_busy(*args: object, **kwargs: object) -> int:
        raise sa.exc.TimeoutError("QueuePool limit of size 5 overflow 10 reached")

    monkeypatch.setattr("flowloop.kept.deliver_pending", pool_busy)
    failing = {run_id: kept.HAND_OVER_TRIES - 1}
    now = engine.clock.now()
    for _ in range(kept.HAND_OVER_TRIES):
        hand_over_stranded(engine.store, engine.workflows, now=now, worker="w", failing=failing)
        assert failing == {run_id: kept.HAND_OVER_TRIES - 1}  # not counted
    info = engine.get(run_id)
    assert (info.status, info.state) == ("scheduled", "first")


@pytest.mark.parametrize(
    ("column", "stored"), [("context", "[1, 2]"), ("visits", "{oops")], ids=["context", "row"]
)
def test_stranded_look__a_run_a_claim_would_fail_ends_its_wait_once_visibly(
    engine: TestEngine, column: str, stored: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Review: a run a claim fails — a context that is not a JSON object, a column that
    # cannot be read — was left as it is by the look: a wait without a timeout is never
    # claimed, so it waited for ever, its event kept, retried at every sweep (at DEBUG
    # after the first). The look ends that once, in the journal: the context run is
    # parked invalid_context (an unpause after a repair judges it again); the row run is
    # failed invalid_row, as a claim fails it (a pause would write the row back without
    # its unreadable visits, and an unpause move it on with them lost). The event stays
    # kept either way. (Third pass: the context run is failed invalid_context, as its
    # claim fails it — parked, a run that also waits with a timeout ended one way or the
    # other by whichever came first, the look or the timeout's claim.)
    run_id = chain_with_go_kept(engine)
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(sa.update(runs).where(runs.c.id == run_id).values({column: stored}))
    failing: dict[str, int] = {}
    now = engine.clock.now()
    with caplog.at_level(logging.DEBUG, logger="flowloop"):
        for _ in range(kept.HAND_OVER_TRIES + 1):
            handed = hand_over_stranded(
                engine.store, engine.workflows, now=now, worker="w", failing=failing
            )
            assert (handed, failing) == (0, {})
    assert "could not park" not in caplog.text
    info = engine.get(run_id)
    ran = kinds(engine, run_id)
    if column == "context":
        assert (info.status, info.state, info.reason) == ("failed", "first", "invalid_context")
        assert info.error is not None and "context" in info.error
        assert ran.count("run_failed") == 1 and ran[-1] == "run_failed", ran
    else:
        assert (info.status, info.state, info.reason) == ("failed", "first", "invalid_row")
        assert info.error is not None and "stored visits are not valid JSON" in info.error
        assert ran.count("run_failed") == 1 and ran[-1] == "run_failed", ran
    assert [row.consumed_seq for row in inbox_rows(engine.url, run_id)] == [None]  # kept


def test_stranded_look__a_run_failed_invalid_context_goes_on_when_retried(
    engine: TestEngine,
) -> None:
    # The failed run is taken up by an operator's retry (the context its state was entered
    # with, from the journal): the kept event is handed over then.
    run_id = chain_with_go_kept(engine)
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(sa.update(runs).where(runs.c.id == run_id).values(context="[1, 2]"))
    now = engine.clock.now()
    hand_over_stranded(engine.store, engine.workflows, now=now, worker="w", failing={})
    assert engine.get(run_id).reason == "invalid_context"
    engine.retry(run_id)
    info = engine.get(run_id)
    assert (info.status, info.state) == ("scheduled", "second")
    assert [row.consumed_seq is None for row in inbox_rows(engine.url, run_id)] == [False]


def test_stranded_look_and_claim_agree_on_a_timed_wait_with_an_invalid_context(
    engine: TestEngine,
) -> None:
    # Review: a run whose context is not a JSON object, waiting with a timeout, was parked
    # invalid_context by the look, and failed invalid_context by its claim when the
    # timeout fired: which one it got depended on which came first. Both fail it now.
    ids = [engine.start(initial_wait, Empty()).id for _ in range(2)]
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(sa.update(runs).where(runs.c.id.in_(ids)).values(context="[1, 2]"))
    by_look = ids[0]  # (the other, with nothing kept, is left to its claim)
    keep_stranded(engine, by_look, "open")
    now = engine.clock.now()
    hand_over_stranded(engine.store, engine.workflows, now=now, worker="w", failing={})
    engine.clock.advance(101)
    engine.run_until_idle()
    ended = [(engine.get(i).status, engine.get(i).reason) for i in ids]
    assert ended == [("failed", "invalid_context")] * 2
    assert [kinds(engine, i)[-1] for i in ids] == ["run_failed", "run_failed"]
    assert [row.consumed_seq for row in inbox_rows(engine.url, by_look)] == [None]  # kept


def _failing_take(monkeypatch: pytest.MonkeyPatch, event: str | None = None) -> None:
    """take_kept refusing ``event`` (every event when None), as a database refusing the
    journal entry of its hand-over would."""
    take = kept.take_kept

    def refused(*args: Any, **kwargs: Any) -> Any:
        if event is None or args[2].event == event:
            raise RuntimeError("a journal entry the database refuses")
        return take(*args, **kwargs)

    monkeypatch.setattr(kept, "take_kept", refused)


def test_an_unpause_starts_the_count_again_for_a_worker_that_counted_before(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two failed looks, then an operator's pause and unpause (the journal's count starts
    again): the same worker's next failed look is the first of a new count, not the third
    (its memory of the two before does not override the journal)."""
    run_id = chain_with_go_kept(engine)
    _failing_take(monkeypatch, "go")
    failing: dict[str, int] = {}
    for _ in range(2):
        hand_over_stranded(
            engine.store, engine.workflows, now=engine.clock.now(), worker="w", failing=failing
        )
    assert failing == {run_id: 2}
    engine.pause(run_id)
    engine.unpause(run_id)
    assert kept.failed_in_a_row(engine.store.journal(run_id)) == 0
    hand_over_stranded(
        engine.store, engine.workflows, now=engine.clock.now(), worker="w", failing=failing
    )
    assert engine.get(run_id).status == "scheduled", kinds(engine, run_id)
    assert kept.failed_in_a_row(engine.store.journal(run_id)) == 1


def test_a_count_does_not_follow_the_run_into_its_next_wait(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two failed looks in ``first``; the cause fixed, the kept ``go`` handed over, the run
    waits in ``second``, where a kept ``note`` fails once: a first failure there, not a
    third (the run is not parked)."""
    run_id = chain_with_go_kept(engine)
    take = kept.take_kept
    _failing_take(monkeypatch)
    failing: dict[str, int] = {}
    for _ in range(2):
        hand_over_stranded(
            engine.store, engine.workflows, now=engine.clock.now(), worker="w", failing=failing
        )
    monkeypatch.setattr(kept, "take_kept", take)
    handed = kept.try_deliver_pending(
        engine.store, engine.workflows, run_id, now=engine.clock.now(), worker="s"
    )
    assert handed == 1 and engine.get(run_id).state == "second", kinds(engine, run_id)
    keep_stranded(engine, run_id, "note", '{"text": "x"}')
    _failing_take(monkeypatch)
    hand_over_stranded(
        engine.store, engine.workflows, now=engine.clock.now(), worker="w", failing=failing
    )
    assert engine.get(run_id).status == "scheduled", kinds(engine, run_id)
    assert kept.failed_in_a_row(engine.store.journal(run_id)) == 1


def test_a_journal_that_cannot_be_read_still_parks_at_the_third_try(
    engine: TestEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: counted by the journal alone, a journal that could not be read (a store
    timeout on a long one) made every failure the first — a WARNING and one more entry at
    every sweep, for ever, never parked. The worker's own count stands in for it then."""
    run_id = chain_with_go_kept(engine)
    _failing_take(monkeypatch, "go")
    monkeypatch.setattr(kept, "_readable_journal", lambda *_: None)
    failing: dict[str, int] = {}
    for _ in range(kept.HAND_OVER_TRIES):
        hand_over_stranded(
            engine.store, engine.workflows, now=engine.clock.now(), worker="w", failing=failing
        )
    info = engine.get(run_id)
    assert (info.status, info.reason) == ("paused", "kept_events_failed"), kinds(engine, run_id)
    assert failing == {}
