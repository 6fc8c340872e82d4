"""Loops: definition-time validation and the pure slot maths (no database, no event loop)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from pydantic import BaseModel

from flowloop import Workflow
from flowloop.errors import DefinitionError, LoopDefinitionError
from flowloop.loops import Iteration, Loop, Wake, decide, loop

T0 = 1_800_000_000.0  # a multiple of every interval used here


def tick(it: Iteration) -> None:
    return None


def every(seconds: float, **options: Any) -> Loop:
    return Loop("tick", tick, every=seconds, **options)


class Counter(BaseModel):
    n: int


def counter_workflow() -> Workflow:
    wf = Workflow("count", context=Counter)

    @wf.step(initial=True, next="done")
    def bump(ctx: Counter) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


def no_arguments() -> None:
    return None


# -- definition errors -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"every": 0}, r"every=0 must be a positive duration"),
        ({"every": -5}, r"every=-5 must be a positive duration"),
        ({"every": timedelta(0)}, r"must be a positive duration"),
        ({"every": math.nan}, r"every=nan must be a finite duration"),
        ({"every": math.inf}, r"every=inf must be a finite duration"),
        ({"every": "10"}, r"every='10' must be seconds \(a number\) or a timedelta"),
        ({"every": True}, r"every=True must be seconds"),
        ({"cron": "every monday"}, r"cron='every monday' is not a valid cron expression"),
        ({"cron": "61 * * * *"}, r"cron='61 \* \* \* \*' is not a valid cron expression"),
        ({"cron": ""}, r"is not a valid cron expression"),
        # A date that never comes fails here, not at the first fire.
        ({"cron": "0 0 31 2 *"}, r"cron='0 0 31 2 \*' is not a valid cron expression"),
        # Six fields mean seconds to some parsers, years to others: refused.
        ({"cron": "*/10 * * * * *"}, r"is not a valid cron expression"),
        ({"every": 10, "mode": "sometimes"}, r"mode='sometimes' must be one of fixed_rate, "),
        ({"cron": "* * * * *", "mode": "fixed_delay"}, r"fixed_delay' needs every="),
        ({"every": 10, "cron": "* * * * *"}, r"give exactly one of every= .* or cron="),
        ({}, r"give exactly one of every= .* or cron="),
        ({"every": 10, "timeout": 0}, r"timeout=0 must be a positive duration"),
        ({"every": 10, "jitter": -1}, r"jitter=-1 must not be negative"),
        ({"every": 10, "misfire_grace": -1}, r"misfire_grace=-1 must not be negative"),
        ({"every": 10, "max_failures": 0}, r"max_failures=0 must be an integer of at least 1"),
        ({"every": 10, "max_failures": 2.5}, r"max_failures=2.5 must be an integer"),
        ({"every": 10, "start_at": T0, "end_at": T0}, r"end_at must be after start_at"),
        ({"every": 10, "start_at": "tomorrow"}, r"start_at='tomorrow' must be a datetime"),
        ({"every": 10, "retry": 3}, r"retry=3 must be a flowloop Retry"),
    ],
)
def test_loop__invalid_parameter_is_a_clear_definition_error(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(DefinitionError, match=message) as raised:
        Loop("tick", tick, **options)
    assert isinstance(raised.value, LoopDefinitionError)
    assert str(raised.value).startswith("loop 'tick': ")


def test_loop__function_and_workflow_are_exclusive() -> None:
    with pytest.raises(LoopDefinitionError, match="exactly one of a function or workflow="):
        Loop("l", every=10)
    with pytest.raises(LoopDefinitionError, match="exactly one of a function or workflow="):
        Loop("l", tick, every=10, workflow=counter_workflow(), context={"n": 0})


def test_loop__function_must_take_the_iteration() -> None:
    with pytest.raises(LoopDefinitionError, match="'no_arguments' must take one argument"):
        Loop("l", no_arguments, every=10)


def test_loop__bad_name_is_refused() -> None:
    with pytest.raises(LoopDefinitionError, match="only ASCII letters, digits"):
        Loop("two words", tick, every=10)
    with pytest.raises(LoopDefinitionError, match="start with an ASCII letter"):
        Loop("größe", tick, every=10)


def test_loop__workflow_loop_needs_a_fitting_context() -> None:
    wf = counter_workflow()
    with pytest.raises(LoopDefinitionError, match="needs context="):
        Loop("l", workflow=wf, every=10)
    with pytest.raises(LoopDefinitionError, match=r"context= does not fit workflow 'count'.*n"):
        Loop("l", workflow=wf, every=10, context={"n": "many"})
    # A misspelt key was taken here and refused by every run the loop started (review).
    with pytest.raises(LoopDefinitionError, match=r"context= does not fit .*no field\(s\) 'nn'"):
        Loop("l", workflow=wf, every=10, context={"nn": 1})
    fine = Loop("l", workflow=wf, every=10, context=lambda it: {"n": it.number})
    assert fine.context_for(Iteration(loop="l", slot=T0, number=3, attempt=1)) == {"n": 3}


def test_loop__durations_accept_timedeltas_and_datetimes() -> None:
    start = datetime.fromtimestamp(T0, UTC)
    made = Loop(
        "l",
        tick,
        every=timedelta(minutes=1),
        timeout=timedelta(seconds=5),
        jitter=timedelta(seconds=2),
        misfire_grace=math.inf,
        start_at=start,
        end_at=start.replace(tzinfo=None) + timedelta(hours=1),
    )
    assert (made.every, made.timeout, made.jitter) == (60.0, 5.0, 2.0)
    assert made.misfire_grace is None  # infinite grace: never give a slot up
    assert (made.start_at, made.end_at) == (T0, T0 + 3600)
    assert made.schedule == "every 60s (fixed_rate)"


def test_loop__naive_start_and_end_are_wall_time_in_the_loop_zone() -> None:
    """Beside tz=, a naive datetime means that zone's wall time (before: UTC); without tz=
    it is UTC, as before; an aware one is what it says."""
    berlin = ZoneInfo("Europe/Berlin")
    made = Loop(
        "l",
        tick,
        cron="30 2 * * *",
        tz="Europe/Berlin",
        start_at=datetime(2026, 6, 1, 10),
        end_at=datetime(2026, 6, 30, 10, tzinfo=UTC),
    )
    assert made.start_at == datetime(2026, 6, 1, 10, tzinfo=berlin).timestamp()
    assert made.end_at == datetime(2026, 6, 30, 10, tzinfo=UTC).timestamp()
    plain = Loop("l", tick, cron="30 2 * * *", start_at=datetime(2026, 6, 1, 10))
    assert plain.start_at == datetime(2026, 6, 1, 10, tzinfo=UTC).timestamp()
    # Spring forward: 02:30 does not exist in Berlin that night; it is the end of the gap.
    gap = Loop("l", tick, cron="30 2 * * *", tz=berlin, start_at=datetime(2026, 3, 29, 2, 30))
    assert gap.start_at == datetime(2026, 3, 29, 3, 0, tzinfo=berlin).timestamp()


def test_loop__a_cron_with_no_time_from_start_at_until_end_at_is_refused() -> None:
    """'0 0 1 * *' from 01-02 until 01-20: its first time is 02-01, at or after end_at, so
    the loop would never fire. Refused here (before, the worker rescheduled it to 02-01,
    showed that as its next fire, and ended it only then)."""
    jan = {"start_at": datetime(2026, 1, 2), "end_at": datetime(2026, 1, 20)}
    with pytest.raises(LoopDefinitionError) as raised:
        Loop("monthly", tick, cron="0 0 1 * *", **jan)
    assert str(raised.value) == (
        "loop 'monthly': cron='0 0 1 * *' has no time from start_at 2026-01-02 00:00 UTC until "
        "end_at 2026-01-20 00:00 UTC (its first is 2026-02-01 00:00 UTC), so the loop would "
        "never fire: move end_at past that time, start_at earlier, or change cron="
    )
    # Read in the loop's zone; a cron time exactly at end_at is not the loop's.
    with pytest.raises(LoopDefinitionError, match=r"its first is 2026-02-01 00:00 CET\)"):
        Loop("m", tick, cron="@monthly", tz="Europe/Berlin", **jan)
    feb = datetime(2026, 2, 1)
    with pytest.raises(LoopDefinitionError, match="has no time from start_at"):
        Loop("m", tick, cron="0 0 1 * *", start_at=datetime(2026, 1, 1, 0, 0, 1), end_at=feb)
    # One time in the range is enough (at start_at itself too); every= fires at start_at.
    at_start = Loop("m", tick, cron="0 0 1 * *", start_at=feb, end_at=feb.replace(minute=1))
    assert at_start.earliest_slot() == at_start.start_at
    assert every(365 * 86400, **jan).earliest_slot() == datetime(2026, 1, 2, tzinfo=UTC).timestamp()


def test_over__no_slot_left_from_the_pending_one() -> None:
    """What the scheduler stops at once: a pending slot, or the first one start_at allows,
    at or after end_at (end_at moved earlier after the slot was written)."""
    lp = Loop("c", tick, cron="*/5 * * * *", start_at=T0 + 61, end_at=T0 + 900)
    assert not lp.over(T0)  # start_at moves it to T0 + 300
    assert not lp.over(T0 + 600)
    assert lp.over(T0 + 900)
    assert lp.over(T0 + 3600)
    assert not Loop("c", tick, cron="*/5 * * * *").over(T0 + 10**9)
    assert every(10, end_at=T0).over(T0) and not every(10, end_at=T0).over(T0 - 10)


def test_loop_decorator__names_the_loop_after_the_function() -> None:
    @loop(every=5, mode="fixed_delay", max_failures=2)
    def poll(it: Iteration) -> int:
        return it.number

    assert isinstance(poll, Loop)
    assert (poll.name, poll.every, poll.mode, poll.max_failures) == ("poll", 5.0, "fixed_delay", 2)
    with pytest.raises(LoopDefinitionError, match="loop 'nope'"):
        loop(every=-1, name="nope")(tick)


def test_iteration__idempotency_key_is_stable_per_slot() -> None:
    first = Iteration(loop="l", slot=T0 + 0.1234, number=1, attempt=1)
    retry = Iteration(loop="l", slot=T0 + 0.1234, number=1, attempt=2)
    assert first.idempotency_key == retry.idempotency_key == "loop:l:1800000000.123"
    assert first.scheduled_for == datetime.fromtimestamp(T0 + 0.1234, UTC)
    assert first.scheduled_for.utcoffset() == timedelta(0)


def test_iteration__scheduled_for_is_in_the_loop_zone() -> None:
    """00:30 in Berlin on 2 June is 22:30 UTC on 1 June: the date is Berlin's."""
    slot = datetime(2026, 6, 1, 22, 30, tzinfo=UTC).timestamp()
    it = Iteration(loop="l", slot=slot, number=1, attempt=1, tz="Europe/Berlin")
    assert it.scheduled_for.isoformat() == "2026-06-02T00:30:00+02:00"
    assert it.scheduled_for.timestamp() == slot
    assert Iteration(loop="l", slot=slot, number=1, attempt=1).scheduled_for.day == 1


# -- slots -----------------------------------------------------------------------------------


def test_first_slot__now_or_start_at() -> None:
    assert every(10).first_slot(T0 + 3.3) == T0 + 3.3
    assert every(10, start_at=T0 + 100).first_slot(T0) == T0 + 100
    # A start_at in the past keeps its phase: the next point of its grid.
    assert every(10, start_at=T0).first_slot(T0 + 25) == T0 + 30
    assert every(10, start_at=T0).first_slot(T0 + 30) == T0 + 30
    assert Loop("c", tick, cron="*/5 * * * *").first_slot(T0 + 1) == T0 + 300


def test_first_slot__a_cron_loop_starts_at_its_first_cron_time_at_or_after_start_at() -> None:
    """start_at is not a slot of a cron loop unless it is a cron time (before, a loop fired
    at start_at, then on its schedule)."""
    five = Loop("c", tick, cron="*/5 * * * *", start_at=T0 + 61)
    assert five.first_slot(T0) == five.earliest_slot() == T0 + 300
    exact = Loop("c", tick, cron="*/5 * * * *", start_at=T0 + 600)
    assert exact.first_slot(T0) == exact.earliest_slot() == T0 + 600
    # every= starts its chain at start_at itself.
    assert every(10, start_at=T0 + 61).earliest_slot() == T0 + 61
    assert every(10).earliest_slot() is None


def test_slot_after__follows_the_chain_of_the_anchor() -> None:
    lp = every(10)
    assert lp.slot_after(T0 + 3.3, anchor=T0 + 3.3) == T0 + 13.3
    assert lp.slot_after(T0 + 27, anchor=T0 + 3.3) == pytest.approx(T0 + 33.3, abs=1e-3)
    assert lp.slot_after(T0, anchor=T0 + 3.3) == T0 + 3.3  # before the chain starts


def test_slot_after__is_strictly_after_despite_float_rounding() -> None:
    lp = every(0.1)
    slot = T0 + 0.1
    for _ in range(1000):
        nxt = lp.slot_after(slot, anchor=slot)
        assert nxt > slot
        assert nxt - slot == pytest.approx(0.1, abs=1e-6)
        slot = nxt


def test_next_slot__fixed_rate_vs_fixed_delay_for_a_known_duration() -> None:
    """every=10, each iteration takes 3 s: fixed_rate fires at 0, 10, 20 …;
    fixed_delay at 0, 13, 26 …"""

    def fire_times(lp: Loop, duration: float, count: int) -> list[float]:
        times, slot = [], T0
        for _ in range(count):
            times.append(slot - T0)
            slot, skipped = lp.next_slot(slot, started=slot, ended=slot + duration)
            assert skipped == 0
        return times

    assert fire_times(every(10), 3, 4) == [0, 10, 20, 30]
    assert fire_times(every(10, mode="fixed_delay"), 3, 4) == [0, 13, 26, 39]


def test_next_slot__fixed_rate_overlap_skips_and_counts() -> None:
    lp = every(10)
    assert lp.next_slot(T0, started=T0, ended=T0 + 25) == (T0 + 30, 2)
    # Ending exactly on a slot: that slot came due while it ran.
    assert lp.next_slot(T0, started=T0, ended=T0 + 10) == (T0 + 20, 1)
    # fixed_delay simply waits.
    assert every(10, mode="fixed_delay").next_slot(T0, started=T0, ended=T0 + 25) == (
        T0 + 35,
        0,
    )


def test_next_slot__catch_up_slots_are_not_skipped() -> None:
    """An iteration of an old slot (coalesce=False catching up) does not skip the slots
    that were already due when it started: decide() fires or gives them up."""
    lp = every(10, coalesce=False)
    assert lp.next_slot(T0, started=T0 + 35, ended=T0 + 36) == (T0 + 10, 0)


def test_next_slot__cron_overlap() -> None:
    lp = Loop("c", tick, cron="* * * * *")
    assert lp.next_slot(T0, started=T0, ended=T0 + 150) == (T0 + 180, 2)
    assert lp.next_slot(T0, started=T0, ended=T0 + 1) == (T0 + 60, 0)


def test_missed_slots__counts_the_chain_up_to_now() -> None:
    lp = every(10)
    assert lp.missed_slots(T0, T0 - 1) == 0
    assert lp.missed_slots(T0, T0) == 1
    assert lp.missed_slots(T0, T0 + 9.99) == 1
    assert lp.missed_slots(T0, T0 + 10) == 2
    assert lp.missed_slots(T0 + 5, T0 + 56) == 6
    assert Loop("c", tick, cron="*/5 * * * *").missed_slots(T0, T0 + 17 * 60) == 4


# -- decisions -------------------------------------------------------------------------------


def test_decide__on_time_and_slightly_late() -> None:
    assert decide(every(10), T0, T0) == Wake(True, T0, 0, "on_time")
    assert decide(every(10), T0, T0 + 4) == Wake(True, T0, 0, "on_time")


def test_decide__a_wall_clock_behind_the_slot_still_fires() -> None:
    """Only a capped wait after a backward wall jump wakes a slot early; firing keeps the
    loop's cadence instead of stalling it for the size of the jump."""
    assert decide(every(10), T0, T0 - 3600) == Wake(True, T0, 0, "on_time")


def test_decide__single_slot_past_the_grace_is_missed() -> None:
    assert decide(every(100, misfire_grace=30), T0, T0 + 31) == Wake(False, T0, 1, "missed")


def test_decide__downtime_within_grace_is_coalesced_into_the_latest_slot() -> None:
    wake = decide(every(10), T0, T0 + 47)
    assert wake == Wake(True, T0 + 40, 0, "coalesced", coalesced=4)


def test_decide__slots_past_the_grace_are_missed_the_rest_coalesced() -> None:
    # Due: 0, 10, 20, 30, 40, 50; more than 25 s late: 0, 10, 20.
    wake = decide(every(10, misfire_grace=25), T0, T0 + 52)
    assert wake == Wake(True, T0 + 50, 3, "coalesced", coalesced=2)


def test_decide__without_coalescing_the_first_slot_within_grace_fires() -> None:
    wake = decide(every(10, misfire_grace=25, coalesce=False), T0, T0 + 52)
    assert wake == Wake(True, T0 + 30, 3, "catch_up")
    wake = decide(every(10, coalesce=False), T0, T0 + 52)
    assert wake == Wake(True, T0, 0, "catch_up")


def test_decide__everything_past_the_grace_is_missed() -> None:
    wake = decide(every(10, misfire_grace=5), T0, T0 + 57)
    assert wake == Wake(False, T0 + 50, 6, "missed")


def test_decide__infinite_grace_never_misses() -> None:
    wake = decide(every(10, misfire_grace=None), T0, T0 + 86_400)
    assert (wake.fire, wake.missed, wake.coalesced) == (True, 0, 8640)


def test_decide__only_slots_before_end_at_count() -> None:
    """Down past end_at (T0 + 60): the slots before it are decided as after any downtime —
    before, the latest due slot (past end_at) was chosen and the loop ended at once."""
    ends = {"start_at": T0, "end_at": T0 + 60}
    # At T0 + 80 with grace 25, every slot before end_at (0 … 50) is late: all missed.
    assert decide(every(10, misfire_grace=25, **ends), T0, T0 + 80) == Wake(
        False, T0 + 50, 6, "missed"
    )
    # At T0 + 70 with grace 25: 0 … 40 late, 50 within: it fires, nothing coalesced.
    assert decide(every(10, misfire_grace=25, **ends), T0, T0 + 70) == Wake(
        True, T0 + 50, 5, "on_time"
    )
    assert decide(every(10, **ends), T0, T0 + 500) == Wake(
        True, T0 + 50, 0, "coalesced", coalesced=5
    )
    assert decide(every(10, coalesce=False, **ends), T0 + 40, T0 + 500) == Wake(
        True, T0 + 40, 0, "catch_up"
    )
    assert decide(every(10, coalesce=False, **ends), T0 + 50, T0 + 500) == Wake(
        True, T0 + 50, 0, "on_time"
    )
    # A slot at or after end_at: the loop has ended, nothing is given up.
    assert decide(every(10, **ends), T0 + 60, T0 + 500) == Wake(False, T0 + 60, 0, "ended")
    cron = Loop("c", tick, cron="*/5 * * * *", end_at=T0 + 900)
    assert decide(cron, T0, T0 + 3600) == Wake(True, T0 + 600, 0, "coalesced", coalesced=2)


def test_decide__cron_downtime_coalesces() -> None:
    wake = decide(Loop("c", tick, cron="*/5 * * * *"), T0, T0 + 17 * 60)
    assert wake == Wake(True, T0 + 15 * 60, 0, "coalesced", coalesced=3)


# -- waits -----------------------------------------------------------------------------------


def test_wait_cap__one_period_plus_jitter() -> None:
    assert every(10).wait_cap(T0) == 10
    assert every(10, jitter=2).wait_cap(T0) == 12
    monday_9 = datetime(2027, 1, 11, 9, tzinfo=UTC).timestamp()
    weekdays = Loop("c", tick, cron="0 9 * * 1-5")
    assert weekdays.wait_cap(monday_9) == 3 * 86_400  # from Friday 09:00


def test_jittered__within_the_jitter() -> None:
    lp = every(10, jitter=3)
    assert all(T0 <= lp.jittered(T0) <= T0 + 3 for _ in range(100))
    assert every(10).jittered(T0) == T0


def test_finished__at_end_at() -> None:
    lp = every(10, start_at=T0, end_at=T0 + 30)
    assert not lp.finished(T0 + 20)
    assert lp.finished(T0 + 30)
    assert lp.horizon(T0 + 29) == T0 + 29
    assert T0 + 29.999 < lp.horizon(T0 + 30) < T0 + 30
    assert lp.horizon(T0 + 900) == lp.horizon(T0 + 30)
    assert every(10).horizon(T0 + 900) == T0 + 900


def test_cron__aliases_and_fixed_results() -> None:
    """Next and previous fire times (cronsim), checked against hand-computed instants."""
    start = datetime(2027, 3, 1, 10, 7, 30, tzinfo=UTC).timestamp()
    daily = Loop("d", tick, cron="@daily")
    assert daily.slot_after(start) == datetime(2027, 3, 2, tzinfo=UTC).timestamp()
    hourly = Loop("h", tick, cron="@HOURLY")
    assert hourly.slot_after(start) == datetime(2027, 3, 1, 11, tzinfo=UTC).timestamp()
    weekdays = Loop("w", tick, cron="15,45 9-17 * * mon-fri")
    friday_end = datetime(2027, 3, 5, 17, 45, tzinfo=UTC).timestamp()  # a Friday
    assert weekdays.slot_after(friday_end) == datetime(2027, 3, 8, 9, 15, tzinfo=UTC).timestamp()
    last_day = Loop("l", tick, cron="0 12 L * *")
    assert last_day.slot_after(start) == datetime(2027, 3, 31, 12, tzinfo=UTC).timestamp()


def test_latest_slot__the_schedules_last_slot_at_or_before_now() -> None:
    def nothing(it: Iteration) -> None:
        return None

    half_hourly = Loop("h", nothing, cron="*/30 * * * *")
    assert half_hourly.latest_slot(T0 + 8400) == T0 + 7200  # 2 h 20 → 2 h
    assert half_hourly.latest_slot(T0 + 7200) == T0 + 7200  # a cron time is its own
    plain = Loop("p", nothing, every=10)
    assert plain.latest_slot(T0 + 25) == T0 + 25  # no grid: now
    grid = Loop("g", nothing, every=10, start_at=T0)
    assert grid.latest_slot(T0 + 25) == T0 + 20
    assert grid.latest_slot(T0 + 20) == T0 + 20
    assert grid.latest_slot(T0 - 5) == T0 - 5  # start_at ahead: now
