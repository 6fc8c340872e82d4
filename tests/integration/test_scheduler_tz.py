"""A cron loop in a time zone, driven by the scheduler over real DST changes with a clock
the test moves (no sleeping): the journal holds exactly the slots the policy promises."""

from __future__ import annotations

import asyncio
import itertools
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo

from loopkit import LoopHarness, SteppedClock, assert_no_duplicate_slots, drive, started_slots

from flowloop.loops import Iteration, Loop
from flowloop.tz import describe

BERLIN = "Europe/Berlin"


def test_scheduler__berlin_daily_0230_over_both_dst_changes(tmp_path: Path) -> None:
    """Two days around each change: on the spring-forward night 02:30 fires at 03:00, on
    the fall-back night once (02:30 CEST), never twice; hourly keeps one per real hour."""

    async def drive_days(day: str, hours: float) -> tuple[list[str], int]:
        start = datetime.fromisoformat(day).replace(tzinfo=ZoneInfo(BERLIN)).timestamp()
        clock = SteppedClock(start)
        fired: list[float] = []

        async def fn(it: Iteration) -> None:
            fired.append(it.slot)

        daily = Loop("daily", fn, cron="30 2 * * *", tz=BERLIN)
        hourly = Loop("hourly", lambda it: None, cron="0 * * * *", tz=BERLIN)
        url = f"sqlite:///{tmp_path / day}.db"
        async with LoopHarness(url, [daily, hourly], clock=clock) as h:
            await drive(clock, hours * 3600, step=300)
            events = h.journal("daily")
            assert_no_duplicate_slots(events)
            assert_no_duplicate_slots(h.journal("hourly"))
            assert started_slots(events) == fired
            hours_fired = started_slots(h.journal("hourly"))
            # One slot per real hour across the change: none doubled, none lost.
            assert {b - a for a, b in itertools.pairwise(hours_fired)} == {3600}
        return [describe(slot, BERLIN) for slot in fired], len(hours_fired)

    spring, hourly = asyncio.run(drive_days("2026-03-28", 48))
    assert spring == ["2026-03-28 02:30 CET", "2026-03-29 03:00 CEST"]
    assert hourly == 48  # 48 real hours (the wall clock shows 49 of them)
    fall, hourly = asyncio.run(drive_days("2026-10-24T12:00", 48))
    assert fall == ["2026-10-25 02:30 CEST", "2026-10-26 02:30 CET"]
    assert hourly == 48  # 48 real hours (the wall clock shows 47 of them)
