"""A loop's bounds and zone, driven by the worker's scheduler on a fake clock (run_loops),
on both databases: the slots before ``end_at`` after downtime, a cron loop's first slot
after ``start_at``, ``it.scheduled_for`` in the loop's zone, a naive ``start_at`` read in it."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from zoneinfo import ZoneInfo

from pydantic import BaseModel

from flowloop import Workflow
from flowloop.clock import FakeClock
from flowloop.loops import Iteration, Loop
from flowloop.store.loops import LoopEvent
from flowloop.testing import TestEngine

BERLIN = ZoneInfo("Europe/Berlin")
ELEVEN = datetime(2026, 6, 1, 11, 0, tzinfo=UTC).timestamp()
NOON = ELEVEN + 3600
MINUTE = 60.0


def tick(it: Iteration) -> None:
    return None


def journal(events: list[LoopEvent], name: str) -> list[tuple[str, float | None, int, str]]:
    """(kind, slot as minutes after 11:00 UTC, count, reason) of each entry of loop ``name``."""
    return [
        (
            e.kind,
            None if e.slot is None else (e.slot - ELEVEN) / MINUTE,
            e.count,
            str(e.data.get("reason", "")),
        )
        for e in events
        if e.loop == name and e.kind != "loop_created"
    ]


def down_until(engine: TestEngine, lp: Loop, minutes: float) -> list[LoopEvent]:
    """The loop runs 11:00-11:05, its worker is down until ``minutes`` after 11:00, then
    runs half an hour more."""
    events = engine.run_loops([lp], timedelta(minutes=5))
    engine.clock.advance(timedelta(minutes=minutes - 5))
    return events + engine.run_loops([lp], timedelta(minutes=30))


# -- end_at after downtime -----------------------------------------------------------------


def test_end_at_after_downtime__slots_before_it_are_missed_or_coalesced_then_it_ends(
    store_url: str,
) -> None:
    """every 10 min, end_at 12:00, down 11:05-12:25 (grace 1 h): 11:10 and 11:20 are past
    the grace (missed), 11:30-11:50 within it (coalesced into 11:50, which runs); then the
    loop ends at end_at. Before, it ended at once and journaled none of those slots."""
    with TestEngine(store_url, clock=FakeClock(ELEVEN)) as engine:
        lp = Loop("b", tick, every=600, start_at=ELEVEN, end_at=NOON)
        events = down_until(engine, lp, 85)
        assert journal(events, "b") == [
            ("iteration_started", 0, 0, "on_time"),
            ("iteration_succeeded", 0, 0, ""),
            ("missed", 10, 2, ""),
            ("coalesced", 50, 2, ""),
            ("iteration_started", 50, 0, "coalesced"),
            ("iteration_succeeded", 50, 0, ""),
            ("loop_stopped", None, 0, "end_at reached"),
        ]
        row = engine.loop("b")
        assert (row.status, row.reason, row.missed, row.next_fire_at) == (
            "stopped",
            "end_at reached",
            4,
            None,
        )


def test_end_at_after_downtime__without_coalescing_each_slot_within_grace_runs(
    store_url: str,
) -> None:
    with TestEngine(store_url, clock=FakeClock(ELEVEN)) as engine:
        lp = Loop("d", tick, every=600, start_at=ELEVEN, end_at=NOON, coalesce=False)
        events = down_until(engine, lp, 85)
        entries = journal(events, "d")
        ran = [(slot, why) for kind, slot, _, why in entries if kind == "iteration_started"]
        assert ran == [(0, "on_time"), (30, "catch_up"), (40, "catch_up"), (50, "on_time")]
        assert entries[-1] == ("loop_stopped", None, 0, "end_at reached")
        assert ("missed", 10, 2, "") in entries
        assert engine.loop("d").status == "stopped"


def test_end_at_after_downtime__all_past_the_grace_are_missed_and_it_ends_in_one_write(
    store_url: str,
) -> None:
    """Down 11:05-13:30: every slot before end_at is past the grace. They are journaled
    missed, and the loop ends in the same write (not when a slot past end_at comes due)."""
    with TestEngine(store_url, clock=FakeClock(ELEVEN)) as engine:
        lp = Loop("m", tick, every=600, start_at=ELEVEN, end_at=NOON)
        events = down_until(engine, lp, 150)
        assert journal(events, "m")[2:] == [
            ("missed", 10, 5, ""),
            ("loop_stopped", None, 0, "end_at reached"),
        ]
        assert len({e.at for e in events[-2:]}) == 1
        row = engine.loop("m")
        assert (row.status, row.reason, row.missed) == ("stopped", "end_at reached", 5)


def test_end_at__down_past_the_grace_before_end_at_goes_on_until_it(store_url: str) -> None:
    """Slots missed while end_at is still ahead: the loop goes on to its next slot."""
    with TestEngine(store_url, clock=FakeClock(ELEVEN)) as engine:
        lp = Loop("g", tick, every=600, start_at=ELEVEN, end_at=NOON, misfire_grace=60)
        events = down_until(engine, lp, 35)  # back at 11:35, runs until 12:05
        assert journal(events, "g")[2:] == [
            ("missed", 10, 3, ""),
            ("iteration_started", 40, 0, "on_time"),
            ("iteration_succeeded", 40, 0, ""),
            ("iteration_started", 50, 0, "on_time"),
            ("iteration_succeeded", 50, 0, ""),
            ("loop_stopped", None, 0, "end_at reached"),
        ]


# -- start_at on a cron loop ---------------------------------------------------------------


def berlin(*fields: int) -> float:
    return datetime(*fields, tzinfo=BERLIN).timestamp()  # type: ignore[misc]


def started(events: list[LoopEvent], name: str) -> list[str]:
    return [
        datetime.fromtimestamp(e.slot, BERLIN).strftime("%m-%d %H:%M")
        for e in events
        if e.loop == name and e.kind == "iteration_started" and e.slot is not None
    ]


def test_cron_start_at__first_slot_is_the_first_cron_time_at_or_after_it(
    store_url: str,
) -> None:
    """start_at 06-01 10:00 is not a cron time of '30 2 * * *': the first slot is 06-02
    02:30 (before, the loop fired at 10:00 too)."""
    with TestEngine(store_url, clock=FakeClock(berlin(2026, 5, 31, 12))) as engine:
        lp = Loop(
            "a",
            tick,
            cron="30 2 * * *",
            tz="Europe/Berlin",
            start_at=datetime(2026, 6, 1, 10, tzinfo=BERLIN),
        )
        events = engine.run_loops([lp], timedelta(days=3))
        created = [e for e in events if e.kind == "loop_created"]
        assert created[0].slot == berlin(2026, 6, 2, 2, 30)
        assert started(events, "a") == ["06-02 02:30", "06-03 02:30"]


def test_every_start_at__is_the_anchor_and_fires_first(store_url: str) -> None:
    """every= keeps the chain from start_at (README): its first slot is start_at itself."""
    with TestEngine(store_url, clock=FakeClock(ELEVEN)) as engine:
        lp = Loop("e", tick, every=3600, start_at=ELEVEN + 25 * MINUTE)
        events = engine.run_loops([lp], timedelta(hours=2))
        slots = [e.slot for e in events if e.kind == "iteration_started"]
        assert slots == [ELEVEN + 25 * MINUTE, ELEVEN + 85 * MINUTE]


def test_start_at_moved_later__the_slot_written_before_waits_for_it(store_url: str) -> None:
    """The row's next slot is the old start_at (12:00), due at 13:00; the loop now says
    start_at 15:00. The slot moves to 15:00, journaled (before, the scheduler re-armed the
    due slot at once, again and again: a busy loop until 15:00)."""
    with TestEngine(store_url, clock=FakeClock(ELEVEN)) as engine:
        engine.run_loops([Loop("s", tick, every=600, start_at=NOON)], timedelta(minutes=1))
        engine.clock.advance(timedelta(hours=2))
        later = Loop("s", tick, every=600, start_at=ELEVEN + 4 * 3600)
        events = engine.run_loops([later], timedelta(hours=3), max_jumps=100)
        assert journal(events, "s")[:3] == [
            ("loop_rescheduled", 240, 0, "start_at is later than the slot"),
            ("iteration_started", 240, 0, "on_time"),
            ("iteration_succeeded", 240, 0, ""),
        ]
        assert len([e for e in events if e.kind == "iteration_started"]) == 7  # 15:00-16:00


# -- the loop's zone -----------------------------------------------------------------------


class Day(BaseModel):
    day: str


def report_workflow() -> Workflow:
    wf = Workflow("report", context=Day)

    @wf.step(initial=True, next="sent")
    def send(ctx: Day) -> None:
        return None

    wf.final("sent")
    return wf


def test_scheduled_for__is_in_the_loop_zone_so_its_date_is_the_local_day(
    store_url: str,
) -> None:
    """The 00:30 Berlin slot of 06-02 is 22:30 UTC of 06-01: it.scheduled_for is the Berlin
    time, and the README's nightly pattern labels the run 2026-06-02 (before: 06-01)."""
    seen: list[datetime] = []
    with TestEngine(store_url, clock=FakeClock(berlin(2026, 6, 1, 12))) as engine:
        nightly = Loop("nightly", seen.append, cron="30 0 * * *", tz="Europe/Berlin")
        report = Loop(
            "nightly-report",
            workflow=report_workflow(),
            cron="30 0 * * *",
            tz="Europe/Berlin",
            context=lambda it: {"day": it.scheduled_for.date().isoformat()},
        )
        plain = Loop("utc", seen.append, cron="30 0 * * *")
        engine.run_loops([nightly, report, plain], timedelta(days=1))
        berlin_it, utc_it = sorted(seen, key=lambda it: it.loop)
        assert berlin_it.scheduled_for == datetime(2026, 6, 2, 0, 30, tzinfo=BERLIN)
        assert berlin_it.scheduled_for.utcoffset() == timedelta(hours=2)
        assert berlin_it.scheduled_for.date() == date(2026, 6, 2)
        assert berlin_it.scheduled_for.timestamp() == berlin_it.slot
        assert [r.context.day for r in engine.runs(workflow="report")] == ["2026-06-02"]
        # A loop without tz=: UTC, as before.
        assert utc_it.scheduled_for == datetime(2026, 6, 2, 0, 30, tzinfo=UTC)
        assert utc_it.scheduled_for.utcoffset() == timedelta(0)


def test_naive_start_at__is_wall_time_in_the_loop_zone(store_url: str) -> None:
    """start_at=datetime(2026, 6, 2, 2, 30) beside tz='Europe/Berlin' is 02:30 in Berlin
    (before: 02:30 UTC, 04:30 in Berlin); a naive end_at likewise."""
    with TestEngine(store_url, clock=FakeClock(berlin(2026, 6, 1, 12))) as engine:
        lp = Loop(
            "n",
            tick,
            cron="30 2 * * *",
            tz="Europe/Berlin",
            start_at=datetime(2026, 6, 2, 2, 30),
            end_at=datetime(2026, 6, 4, 2, 30),
        )
        events = engine.run_loops([lp], timedelta(days=4))
        assert started(events, "n") == ["06-02 02:30", "06-03 02:30"]
        assert engine.loop("n").status == "stopped"


# -- no slot left before end_at ------------------------------------------------------------

JAN5 = datetime(2026, 1, 5, tzinfo=UTC).timestamp()
FEB1 = datetime(2026, 2, 1, tzinfo=UTC).timestamp()
JAN20 = datetime(2026, 1, 20, tzinfo=UTC)


def test_end_at_moved_before_the_pending_slot__the_loop_stops_at_once(store_url: str) -> None:
    """The row's next slot is 02-01 (cron '0 0 1 * *', registered on 01-05); the loop now
    says end_at 01-20. No slot of it is left: it stops at once, "end_at reached" (before, it
    stayed scheduled with 02-01 shown as its next fire, and stopped only then)."""
    with TestEngine(store_url, clock=FakeClock(JAN5)) as engine:
        engine.run_loops([Loop("monthly", tick, cron="0 0 1 * *")], timedelta(minutes=1))
        assert engine.loop("monthly").next_fire_at == FEB1
        engine.clock.advance(timedelta(days=1))
        now = engine.clock.now()
        bounded = Loop("monthly", tick, cron="0 0 1 * *", end_at=JAN20)
        events = engine.run_loops([bounded], timedelta(hours=1))
        assert [(e.kind, e.at, e.data.get("reason")) for e in events] == [
            ("loop_stopped", now, "end_at reached")
        ]
        row = engine.loop("monthly")
        assert (row.status, row.reason, row.next_fire_at) == ("stopped", "end_at reached", None)


def test_unpaused_after_end_at__stops_at_once_not_rescheduled_past_it(store_url: str) -> None:
    """A cron loop that ended at end_at is unpaused by an operator: its next cron time is
    after end_at, so it stops again at once (before, it was rescheduled to that time and
    shown as scheduled until then)."""
    with TestEngine(store_url, clock=FakeClock(JAN5)) as engine:
        daily = Loop("daily", tick, cron="0 0 * * *", end_at=datetime(2026, 1, 7, tzinfo=UTC))
        events = engine.run_loops([daily], timedelta(days=3))
        assert [e.kind for e in events if e.kind == "iteration_started"] == ["iteration_started"]
        assert engine.loop("daily").status == "stopped"
        engine.unpause_loop("daily")
        now = engine.clock.now()
        events = engine.run_loops([daily], timedelta(hours=1))
        assert [(e.kind, e.at, e.data.get("reason")) for e in events] == [
            ("loop_stopped", now, "end_at reached")
        ]
        assert engine.loop("daily").next_fire_at is None
