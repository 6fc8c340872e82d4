"""What the scheduler writes for each loop decision (flowloop.loop_slots), as plain data:
no database, no event loop. The scheduler's integration tests run the same writes for real."""

from __future__ import annotations

from typing import Any

from loopkit import loop_row

from flowloop.loop_slots import (
    INTERRUPTED_MESSAGE,
    LEASE_LOST_MESSAGE,
    firing,
    giving_up,
    interrupted,
    outcome,
)
from flowloop.loops import Iteration, Loop, Wake
from flowloop.store.loops import LoopRow

T0 = 1_800_000_000.0
WORKER = "w1"


def tick(it: Iteration) -> None:
    return None


def every_minute(**options: Any) -> Loop:
    return Loop("tick", tick, every=60, **options)


def row(**fields: Any) -> LoopRow:
    """A row of ``tick`` while its iteration of slot T0 runs (4 done, 7 slots skipped)."""
    running: dict[str, Any] = {
        "name": "tick",
        "schedule": "every 60s",
        "status": "running",
        "last_slot": T0,
        "last_started_at": T0,
        "iterations": 4,
        "skipped": 7,
        "missed": 2,
        "owner": WORKER,
        "lease_epoch": 3,
        "last_seq": 10,
    }
    return loop_row(**{**running, **fields})


def recorded(loop: Loop, stored: LoopRow, **given: Any) -> Any:
    options: dict[str, Any] = {
        "slot": T0,
        "started_at": T0,
        "result": "ok",
        "error": None,
        "attempts": 1,
        "duration": 1.0,
        "now": T0 + 1,
        "control": None,
        "manual": False,
        "worker": WORKER,
    }
    options.update(given)
    return outcome(loop, stored, **options)


def test_interrupted__schedules_the_next_slot_and_is_never_run_twice() -> None:
    write = interrupted(every_minute(), row(), now=T0 + 90, worker=WORKER)
    assert [e.kind for e in write.events] == ["iteration_interrupted"]
    assert write.events[0].slot == T0 and write.events[0].error_type == "Interrupted"
    assert write.changes["next_fire_at"] == T0 + 60
    assert write.changes["consecutive_failures"] == 1
    assert write.changes["iterations"] == row().iterations + 1  # counted: it.number moves on
    assert (write.status, write.gave_up) == ("scheduled", False)


def test_interrupted__says_whether_the_worker_went_away_or_lost_its_lease() -> None:
    gone = interrupted(every_minute(), row(), now=T0 + 90, worker="w2")
    fenced = interrupted(every_minute(), row(), now=T0 + 90, worker=WORKER, lease_lost=True)
    assert gone.events[0].error_message == gone.changes["last_error"] == INTERRUPTED_MESSAGE
    assert fenced.events[0].error_message == fenced.changes["last_error"] == LEASE_LOST_MESSAGE
    assert "died" not in INTERRUPTED_MESSAGE  # it may be alive, frozen past its lease
    assert "self-fenced" in LEASE_LOST_MESSAGE
    assert gone.changes == {**fenced.changes, "last_error": INTERRUPTED_MESSAGE}


def test_interrupted__the_max_failures_th_pauses_the_loop() -> None:
    write = interrupted(
        every_minute(max_failures=3), row(consecutive_failures=2), now=T0 + 5, worker=WORKER
    )
    assert [e.kind for e in write.events] == ["iteration_interrupted", "loop_paused"]
    assert write.changes["status"] == "paused" and write.changes["next_fire_at"] is None
    assert write.reason == "3 consecutive failures (max_failures=3)" and write.gave_up


def test_firing__journals_missed_and_coalesced_slots_before_the_start() -> None:
    stored = row(status="scheduled", next_fire_at=T0)
    wake = Wake(True, T0 + 120, 1, "coalesced", coalesced=2)
    write = firing(stored, wake, now=T0 + 125, worker=WORKER)
    assert [(e.kind, e.slot, e.count) for e in write.events] == [
        ("missed", T0, 1),
        ("coalesced", T0 + 120, 2),
        ("iteration_started", T0 + 120, 0),
    ]
    assert write.events[-1].data == {"reason": "coalesced", "late": 5.0}
    assert write.changes["missed"] == 2 + 1 + 2 and write.changes["next_fire_at"] is None
    on_time = firing(stored, Wake(True, T0, 0, "on_time"), now=T0, worker=WORKER)
    assert [e.kind for e in on_time.events] == ["iteration_started"]


def test_outcome__an_iteration_that_outlasts_slots_skips_them() -> None:
    write = recorded(every_minute(), row(), duration=150.0, now=T0 + 150)
    assert [e.kind for e in write.events] == ["iteration_succeeded", "skipped_overlap"]
    assert write.skipped == 2 and write.changes["skipped"] == 7 + 2
    assert write.changes["next_fire_at"] == T0 + 180
    assert write.changes["consecutive_failures"] == 0 and "control" not in write.changes


def test_outcome__a_manual_iteration_keeps_the_schedules_next_slot() -> None:
    write = recorded(every_minute(), row(next_fire_at=T0 + 600), duration=150.0, manual=True)
    assert write.changes["next_fire_at"] == T0 + 600 and write.skipped == 0


def test_outcome__operator_pause_wins_over_max_failures_and_raises_no_alert() -> None:
    loop = every_minute(max_failures=1)
    failed = recorded(loop, row(), result="failed", error="ValueError: x")
    assert (failed.status, failed.gave_up) == ("paused", True)
    assert failed.changes["control"] is None and failed.events[-1].kind == "loop_paused"
    paused = recorded(loop, row(), result="failed", control="pause")
    assert (paused.status, paused.reason, paused.gave_up) == (
        "paused",
        "paused by an operator",
        False,
    )


def test_outcome__shutdown_keeps_the_failure_count_and_end_at_stops() -> None:
    cancelled = recorded(every_minute(), row(consecutive_failures=2), result="cancelled")
    assert cancelled.events[0].kind == "iteration_cancelled"
    assert cancelled.changes["consecutive_failures"] == 2
    ending = recorded(every_minute(end_at=T0 + 30), row())
    assert (ending.status, ending.reason) == ("stopped", "end_at reached")


def test_outcome__slots_at_or_after_end_at_are_not_skipped() -> None:
    """The iteration of T0 runs 150 s; end_at is T0 + 90: only T0 + 60 was the loop's slot
    (before, T0 + 120 was counted skipped too)."""
    ending = recorded(every_minute(end_at=T0 + 90), row(), duration=150.0, now=T0 + 150)
    assert [(e.kind, e.count) for e in ending.events] == [
        ("iteration_succeeded", 0),
        ("skipped_overlap", 1),
        ("loop_stopped", 0),
    ]
    assert (ending.skipped, ending.changes["skipped"]) == (1, row().skipped + 1)
    past = recorded(every_minute(end_at=T0 + 60), row(), duration=150.0, now=T0 + 150)
    assert [e.kind for e in past.events] == ["iteration_succeeded", "loop_stopped"]
    assert past.skipped == 0


def test_giving_up__missed_slots_then_the_next_slot_or_the_end() -> None:
    due = row(status="scheduled", next_fire_at=T0, owner=None)
    goes_on = giving_up(
        every_minute(), due, Wake(False, T0 + 120, 3, "missed"), now=T0 + 150, worker=WORKER
    )
    assert [(e.kind, e.slot, e.count) for e in goes_on.events] == [("missed", T0, 3)]
    assert goes_on.changes["next_fire_at"] == T0 + 180
    assert goes_on.changes["missed"] == due.missed + 3
    assert goes_on.status == "scheduled"
    ends = every_minute(end_at=T0 + 150)
    ended = giving_up(ends, due, Wake(False, T0 + 120, 3, "missed"), now=T0 + 4000, worker=WORKER)
    assert [(e.kind, e.data) for e in ended.events] == [
        ("missed", {}),
        ("loop_stopped", {"reason": "end_at reached"}),
    ]
    assert (ended.status, ended.reason) == ("stopped", "end_at reached")
    assert (ended.changes["status"], ended.changes["next_fire_at"]) == ("stopped", None)
