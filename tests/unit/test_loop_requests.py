"""Manual loop iterations: the backfill request and which slot comes next (pure)."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from flowloop.loop_requests import (
    BACKFILL_MAX_LIMIT,
    BackfillRequest,
    LoopRequestRefused,
    finished_reason,
)
from flowloop.loop_requests import first_unstarted as first
from flowloop.loop_requests import slots_left as left
from flowloop.loops import Iteration, Loop

T0 = 1_800_000_000.0


def tick(it: Iteration) -> None:
    return None


def test_first_unstarted__skips_started_slots_and_stops_at_now() -> None:
    hourly = Loop("h", tick, every=3600)
    request = BackfillRequest(T0, T0 + 5 * 3600)
    assert first(hourly, request, now=T0 + 10**6, started=[]) == T0
    assert first(hourly, request, now=T0 + 10**6, started=[T0, T0 + 3600]) == T0 + 7200
    assert first(hourly, request, now=T0 + 3000, started=[T0]) is None  # 1h is in the future
    every = [T0 + i * 3600 for i in range(6)]
    assert first(hourly, request, now=T0 + 10**6, started=every) is None


def test_first_unstarted__interval_slots_follow_the_anchor_chain() -> None:
    hourly = Loop("h", tick, every=3600)
    request = BackfillRequest(T0, T0 + 2 * 3600)
    assert first(hourly, request, now=T0 + 10**6, started=[], anchor=T0 + 5 * 3600 + 30) == (
        T0 + 30
    )


def test_first_unstarted__cron_in_a_zone_over_spring_forward() -> None:
    zone = ZoneInfo("Europe/Berlin")
    daily = Loop("d", tick, cron="30 2 * * *", tz="Europe/Berlin")
    start = datetime(2026, 3, 28, tzinfo=zone).timestamp()
    request = BackfillRequest(start, start + 3 * 86400)
    slot = first(daily, request, now=start + 10**7, started=[])
    assert slot == datetime(2026, 3, 28, 2, 30, tzinfo=zone).timestamp()
    nxt = first(daily, request, now=start + 10**7, started=[slot])
    assert nxt == datetime(2026, 3, 29, 3, 0, tzinfo=zone).timestamp()  # 02:30 is missing


def test_first_unstarted__a_cron_slot_exactly_at_from_is_in_the_range() -> None:
    """``--from`` on a slot left it out (``--to`` on one kept it): the float step back
    before the start was undone by the cron reader's datetime."""
    nightly = Loop("n", tick, cron="0 2 * * *")
    at_two = datetime(2026, 11, 20, 2, 0, tzinfo=ZoneInfo("UTC")).timestamp()
    now = at_two + 10**6
    assert first(nightly, BackfillRequest(at_two, at_two + 86400), now=now, started=[]) == at_two
    assert first(nightly, BackfillRequest(at_two, at_two), now=now, started=[]) == at_two
    half_past = Loop("m", tick, cron="30 * * * *")
    assert first(
        half_past, BackfillRequest(at_two + 0.0004, at_two + 3600), now=now, started=[]
    ) == (at_two + 1800)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((T0, T0 - 1), "--to is before --from"),
        ((T0, T0 + 1, 0), "--max=0 must be between 1 and"),
        ((T0, T0 + 1, BACKFILL_MAX_LIMIT + 1), "must be between 1 and"),
        ((float("nan"), T0), "must be times"),
    ],
)
def test_backfill_request__bad_range_is_refused(args: tuple[float, ...], message: str) -> None:
    with pytest.raises(LoopRequestRefused, match=message):
        BackfillRequest(*args)  # type: ignore[arg-type]


def test_backfill_request__round_trips_through_json() -> None:
    request = BackfillRequest(T0, T0 + 60, 5, T0 + 1)
    assert BackfillRequest.from_json(request.to_json()) == request


def test_slots_left__due_never_started_and_later_ones_up_to_end_at() -> None:
    hourly = Loop("h", tick, every=3600, end_at=T0 + 4 * 3600)
    request = BackfillRequest(T0, T0 + 10 * 3600)
    now = T0 + 3600 + 1
    assert left(hourly, request, now=now, started=[]) == (2, 2)  # 0h, 1h; 2h, 3h (4h ends)
    assert left(hourly, request, now=now, started=[T0, T0 + 3600]) == (0, 2)
    many = Loop("m", tick, every=1)
    assert left(many, BackfillRequest(T0, T0 + 10**6), now=T0, started=[]) == (
        1,
        BACKFILL_MAX_LIMIT,
    )


@pytest.mark.parametrize(
    ("counts", "reason"),
    [
        ((3, 5, 0, 0), "every slot of the range has run"),
        ((3, 5, 0, 2), "every due slot of the range has run; 2 slots later left to the schedule"),
        ((5, 5, 0, 1), "every due slot of the range has run; 1 slot later left to the schedule"),
        ((5, 5, 1, 0), "--max 5 reached: 1 slot of the range not run (backfill again)"),
        (
            (5, 5, 2, BACKFILL_MAX_LIMIT),
            "--max 5 reached: 2 slots of the range not run (backfill again); "
            f"{BACKFILL_MAX_LIMIT} or more slots later left to the schedule",
        ),
    ],
)
def test_finished_reason__never_says_every_slot_ran_when_some_did_not(
    counts: tuple[int, int, int, int], reason: str
) -> None:
    assert finished_reason(*counts) == reason
