"""Cron loops in time zones: the DST policy of flowloop/tz.py as a table (pure slot maths).

Each row walks one local day, slot after slot, with ``Loop.slot_after`` — the function the
scheduler uses — and compares the wall-clock times it fires with the documented policy.
"""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from flowloop.errors import LoopDefinitionError
from flowloop.loops import Iteration, Loop, decide
from flowloop.tz import describe, in_gap, wall_epoch, wall_time_schedule


def tick(it: Iteration) -> None:
    return None


def day_slots(loop: Loop, day: str) -> list[str]:
    """Every slot of ``loop`` during the local calendar day ``day``, as wall-clock text."""
    assert loop.tz is not None
    zone = ZoneInfo(loop.tz)
    start = datetime.fromisoformat(day).replace(tzinfo=zone)
    end = (start + timedelta(days=1)).timestamp()
    shown, slot = [], start.timestamp() - 1
    while (slot := loop.slot_after(slot)) < end:
        shown.append(describe(slot, loop.tz))
    return shown


BERLIN, NEW_YORK = "Europe/Berlin", "America/New_York"
# Spring forward / fall back in 2026: Berlin 29 March 02:00→03:00, 25 October 03:00→02:00;
# New York 8 March 02:00→03:00, 1 November 02:00→01:00.
DAILY_AT_FIXED_TIME = [
    # zone, cron, day, the slots that day
    (BERLIN, "30 2 * * *", "2026-03-29", ["2026-03-29 03:00 CEST"]),  # 02:30 does not exist
    (BERLIN, "30 2 * * *", "2026-10-25", ["2026-10-25 02:30 CEST"]),  # twice: first only
    (BERLIN, "30 2 * * *", "2026-10-26", ["2026-10-26 02:30 CET"]),  # back to normal
    (BERLIN, "0 2 * * *", "2026-03-29", ["2026-03-29 03:00 CEST"]),
    (BERLIN, "30 1 * * *", "2026-03-29", ["2026-03-29 01:30 CET"]),  # before the gap
    (NEW_YORK, "30 2 * * *", "2026-03-08", ["2026-03-08 03:00 EDT"]),
    (NEW_YORK, "30 1 * * *", "2026-11-01", ["2026-11-01 01:30 EDT"]),  # twice: first only
    (NEW_YORK, "30 2 * * *", "2026-11-01", ["2026-11-01 02:30 EST"]),  # once (not ambiguous)
    (NEW_YORK, "15 9 * * 1-5", "2026-11-02", ["2026-11-02 09:15 EST"]),
]


@pytest.mark.parametrize(("tz", "cron", "day", "expected"), DAILY_AT_FIXED_TIME)
def test_cron_tz__fixed_wall_time_fires_once_per_day_as_documented(
    tz: str, cron: str, day: str, expected: list[str]
) -> None:
    assert day_slots(Loop("daily", tick, cron=cron, tz=tz), day) == expected


ELAPSED_TIME = [
    # zone, cron, day, slots that day, the real seconds between consecutive slots
    (BERLIN, "0 * * * *", "2026-03-29", 23, 3600),
    (BERLIN, "0 * * * *", "2026-10-25", 25, 3600),
    (BERLIN, "0 * * * *", "2026-06-01", 24, 3600),
    (NEW_YORK, "0 * * * *", "2026-03-08", 23, 3600),
    (NEW_YORK, "0 * * * *", "2026-11-01", 25, 3600),
    (BERLIN, "*/15 * * * *", "2026-10-25", 100, 900),
    (NEW_YORK, "*/30 * * * *", "2026-03-08", 46, 1800),
]


@pytest.mark.parametrize(("tz", "cron", "day", "count", "gap"), ELAPSED_TIME)
def test_cron_tz__hourly_jobs_fire_once_per_real_hour(
    tz: str, cron: str, day: str, count: int, gap: int
) -> None:
    loop = Loop("hourly", tick, cron=cron, tz=tz)
    zone = ZoneInfo(tz)
    start = datetime.fromisoformat(day).replace(tzinfo=zone).timestamp()
    slots = [loop.slot_after(start - 1)]
    end = (datetime.fromisoformat(day).replace(tzinfo=zone) + timedelta(days=1)).timestamp()
    while (nxt := loop.slot_after(slots[-1])) < end:
        slots.append(nxt)
    assert len(slots) == count
    assert {b - a for a, b in itertools.pairwise(slots)} == {gap}


def test_cron_tz__from_inside_the_repeated_hour_the_next_slot_is_tomorrow() -> None:
    loop = Loop("daily", tick, cron="30 1 * * *", tz=NEW_YORK)
    zone = ZoneInfo(NEW_YORK)
    # 01:10 EST on 1 November: the second pass of 01:00-02:00; 01:30 EDT has already fired.
    second_pass = datetime(2026, 11, 1, 1, 10, fold=1, tzinfo=zone).timestamp()
    assert describe(loop.slot_after(second_pass), NEW_YORK) == "2026-11-02 01:30 EST"
    first = datetime(2026, 11, 1, 1, 30, tzinfo=zone).timestamp()
    assert loop.missed_slots(first, second_pass + 3600) == 1  # counted once, too


def test_cron_tz__a_whole_dst_year_has_one_slot_per_day() -> None:
    loop = Loop("daily", tick, cron="30 2 * * *", tz=BERLIN)
    start = datetime(2026, 1, 1, tzinfo=ZoneInfo(BERLIN)).timestamp()
    assert loop.missed_slots(loop.slot_after(start), start + 365 * 86400) == 365


def test_cron_tz__downtime_over_the_change_coalesces_into_one_slot() -> None:
    loop = Loop("daily", tick, cron="30 2 * * *", tz=BERLIN, misfire_grace=None)
    zone = ZoneInfo(BERLIN)
    first = loop.slot_after(datetime(2026, 10, 24, tzinfo=zone).timestamp())
    wake = decide(loop, first, datetime(2026, 10, 26, 12, tzinfo=zone).timestamp())
    assert (wake.fire, wake.reason, wake.coalesced) == (True, "coalesced", 2)
    assert describe(wake.slot, BERLIN) == "2026-10-26 02:30 CET"


def test_cron_tz__utc_default_is_unchanged() -> None:
    assert Loop("u", tick, cron="30 2 * * *").slot_after(0) == 2 * 3600 + 1800
    assert Loop("u", tick, cron="30 2 * * *").schedule == "cron 30 2 * * *"
    assert (
        Loop("b", tick, cron="30 2 * * *", tz=BERLIN).schedule == "cron 30 2 * * * (Europe/Berlin)"
    )


def test_cron_tz__a_zoneinfo_is_taken_by_its_name() -> None:
    """``tz=ZoneInfo("UTC")`` was refused as "not an IANA time-zone name"."""
    from zoneinfo import ZoneInfo

    named = Loop("b", tick, cron="30 2 * * *", tz=ZoneInfo(BERLIN))
    assert (named.tz, named.schedule) == (BERLIN, "cron 30 2 * * * (Europe/Berlin)")
    assert named.slot_after(0) == Loop("b", tick, cron="30 2 * * *", tz=BERLIN).slot_after(0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cron": "30 2 * * *", "tz": "Europe/Berln"}, r"tz='Europe/Berln' is not an IANA"),
        ({"cron": "30 2 * * *", "tz": ""}, r"tz='' is not an IANA"),
        ({"cron": "30 2 * * *", "tz": "../etc/passwd"}, r"is not an IANA"),
        ({"cron": "30 2 * * *", "tz": 5}, r"tz=5 is not an IANA"),
        ({"every": 60, "tz": BERLIN}, r"tz= applies to cron= schedules"),
    ],
)
def test_cron_tz__bad_zone_is_one_definition_error(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(LoopDefinitionError, match=message) as caught:
        Loop("daily", tick, **options)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value)


def test_wall_time_schedule__fixed_fields_vs_stars() -> None:
    assert wall_time_schedule("30 2 * * *")
    assert wall_time_schedule("0,30 9-17 * * 1-5")
    assert not wall_time_schedule("0 * * * *")
    assert not wall_time_schedule("*/5 * * * *")
    assert not wall_time_schedule("0 */2 * * *")


def test_cron_tz__a_zoneinfo_without_a_name_is_refused() -> None:
    """A ZoneInfo made from a file has no IANA name: taken as none, the loop ran on UTC
    (review)."""
    import io
    from pathlib import Path
    from zoneinfo import ZoneInfo

    berlin = Path("/usr/share/zoneinfo/Europe/Berlin")
    if not berlin.exists():
        pytest.skip("no /usr/share/zoneinfo on this machine")
    unnamed = ZoneInfo.from_file(io.BytesIO(berlin.read_bytes()))
    with pytest.raises(LoopDefinitionError, match="ZoneInfo without an IANA name"):
        Loop("b", tick, cron="30 2 * * *", tz=unnamed)


@pytest.mark.parametrize(
    ("zone", "wall", "fold", "shown"),
    [
        (BERLIN, "2026-06-01T10:00", 0, "2026-06-01 10:00 CEST"),
        (BERLIN, "2026-01-15T10:00", 0, "2026-01-15 10:00 CET"),
        # Spring forward: a wall time that does not exist is the first moment after the gap.
        (BERLIN, "2026-03-29T02:00", 0, "2026-03-29 03:00 CEST"),
        (BERLIN, "2026-03-29T02:30", 1, "2026-03-29 03:00 CEST"),
        (BERLIN, "2026-03-29T01:59", 0, "2026-03-29 01:59 CET"),
        (NEW_YORK, "2026-03-08T02:30", 0, "2026-03-08 03:00 EDT"),
        # Fall back: a wall time that happens twice is its first occurrence (fold=1: second).
        (BERLIN, "2026-10-25T02:30", 0, "2026-10-25 02:30 CEST"),
        (BERLIN, "2026-10-25T02:30", 1, "2026-10-25 02:30 CET"),
        (NEW_YORK, "2026-11-01T01:30", 0, "2026-11-01 01:30 EDT"),
        (None, "2026-06-01T10:00", 0, "2026-06-01 10:00 UTC"),
    ],
)
def test_wall_epoch__a_naive_time_in_a_zone_under_the_dst_policy(
    zone: str | None, wall: str, fold: int, shown: str
) -> None:
    """How a naive start_at/end_at beside tz= is read (flowloop.tz.wall_epoch)."""
    moment = wall_epoch(datetime.fromisoformat(wall).replace(fold=fold), zone)
    assert describe(moment, zone) == shown
    assert moment == int(moment)  # whole seconds, also inside a gap


@pytest.mark.parametrize(
    ("start", "end", "message"),
    [
        (
            "2026-03-29T02:30",
            "2026-03-29T02:45",
            "start_at 02:30 and end_at 02:45 fall in the daylight-saving gap of Europe/Berlin "
            "on 2026-03-29 (both become 03:00): end_at must be after start_at; give an end_at "
            "after 03:00",
        ),
        (
            "2026-03-29T02:30",
            "2026-03-29T03:00",
            "start_at 02:30 falls in the daylight-saving gap of Europe/Berlin on 2026-03-29 "
            "(it becomes 03:00, as end_at is): end_at must be after start_at; give an end_at "
            "after 03:00",
        ),
        # Not in order as typed: the plain message.
        ("2026-03-29T02:45", "2026-03-29T02:30", "end_at must be after start_at"),
        ("2026-06-01T10:00", "2026-06-01T09:00", "end_at must be after start_at"),
    ],
)
def test_naive_bounds_in_a_spring_forward_gap__the_error_names_the_gap(
    start: str, end: str, message: str
) -> None:
    """02:30 and 02:45 on Berlin's spring-forward night both become 03:00 (the policy):
    typed in order, they were refused as "end_at must be after start_at", unexplained."""
    with pytest.raises(LoopDefinitionError) as raised:
        Loop(
            "gap",
            tick,
            cron="*/5 * * * *",
            tz=BERLIN,
            start_at=datetime.fromisoformat(start),
            end_at=datetime.fromisoformat(end),
        )
    assert str(raised.value) == f"loop 'gap': {message}"


def test_naive_bounds_after_the_gap__are_fine() -> None:
    """The error's advice works: an end_at after 03:00 (the gap's end) is accepted, and the
    cron time in the gap (02:30) fires at 03:00, start_at."""
    made = Loop(
        "gap",
        tick,
        cron="30 2 * * *",
        tz=BERLIN,
        start_at=datetime(2026, 3, 29, 2, 30),
        end_at=datetime(2026, 3, 29, 3, 5),
    )
    assert made.earliest_slot() == made.start_at
    assert describe(made.start_at, BERLIN) == "2026-03-29 03:00 CEST"
    assert in_gap(datetime(2026, 3, 29, 2, 30), BERLIN)
    assert not in_gap(datetime(2026, 3, 29, 3, 0), BERLIN)
    assert not in_gap(datetime(2026, 10, 25, 2, 30), BERLIN)  # (fall back: twice, not none)
    assert not in_gap(datetime(2026, 3, 29, 2, 30), None)
