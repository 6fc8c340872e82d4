"""Manual loop iterations: ``trigger`` and ``backfill`` requests honoured by the scheduler on
a real database (a clock the test moves), and the CLI that asks for them and shows them."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from loopkit import T0, LoopHarness, SteppedClock, assert_no_duplicate_slots, drive, settle
from loopkit_proc import cli

from flowloop import Engine
from flowloop.loop_requests import BackfillRequest, LoopRequestRefused
from flowloop.loops import Iteration, Loop
from flowloop.operations import _user
from flowloop.store.loops import LoopEvent, LoopRow

HOUR = 3600.0
PAST = T0 - 1000 * 24 * HOUR
"""A base for the tests whose CLI reads the wall clock (T0 is in 2027): a backfill of a
range in the future is refused."""


def started(events: list[LoopEvent], reason: str | None = None) -> list[float]:
    return [
        e.slot - T0
        for e in events
        if e.kind == "iteration_started"
        and e.slot is not None
        and (reason is None or e.data.get("reason") == reason)
    ]


def test_trigger__runs_one_iteration_now_and_keeps_the_schedule(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock(T0 + 60)
        seen: list[float] = []

        async def fn(it: Iteration) -> None:
            seen.append(it.slot)

        daily = Loop("daily", fn, cron="0 3 * * *")
        async with LoopHarness(sqlite_url, [daily], clock=clock) as h:
            scheduled = h.row("daily").next_fire_at
            h.engine.trigger_loop("daily")
            with pytest.raises(LoopRequestRefused, match="already has a trigger request"):
                h.engine.trigger_loop("daily")
            await drive(clock, 3)
            row = h.row("daily")
            assert seen == [T0 + 60 + 1] or len(seen) == 1  # fired at the next poll
            assert (row.iterations, row.control, row.next_fire_at) == (1, None, scheduled)
            [manual] = [e for e in h.journal("daily") if e.kind == "iteration_started"]
            assert manual.data["reason"] == "manual"
            assert [e.kind for e in h.journal("daily")][-1] == "iteration_succeeded"

    asyncio.run(main())


def test_trigger__waits_for_the_running_iteration_no_overlap(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        release = asyncio.Event()
        running = 0
        most = 0

        async def fn(it: Iteration) -> None:
            nonlocal running, most
            running += 1
            most = max(most, running)
            if it.number == 1:
                await release.wait()
            running -= 1

        slow = Loop("slow", fn, every=HOUR)
        async with LoopHarness(sqlite_url, [slow], clock=clock) as h:
            await settle()
            assert h.row("slow").status == "running"
            h.engine.trigger_loop("slow")
            await drive(clock, 5)
            assert started(h.journal("slow")) == [0]  # the trigger waits
            release.set()
            await drive(clock, 3)
            assert started(h.journal("slow"), "manual") and most == 1
            assert h.row("slow").next_fire_at == T0 + HOUR  # the schedule is untouched

    asyncio.run(main())


def test_backfill__runs_the_missed_slots_once_each_oldest_first(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'f.db'}"

    async def main() -> None:
        clock = SteppedClock()
        hourly = Loop("hourly", lambda it: None, every=HOUR, misfire_grace=60)
        async with LoopHarness(url, [hourly], clock=clock) as h:
            await drive(clock, HOUR + 1, step=60)  # slots 0 and 1h run
        clock.advance(4 * HOUR)  # down: 2h, 3h, 4h, 5h pass
        async with LoopHarness(url, [hourly], clock=clock) as h:
            await drive(clock, 60, step=10)  # 2h-4h past the grace: missed; 5h fires
            assert started(h.journal("hourly")) == [0, HOUR, 5 * HOUR]
            h.engine.backfill_loop("hourly", BackfillRequest(T0, T0 + 6 * HOUR, 2))
            await drive(clock, 10)
            events = h.journal("hourly")
            assert_no_duplicate_slots(events)
            assert started(events, "backfill") == [2 * HOUR, 3 * HOUR]  # --max 2
            assert events[-1].kind == "backfill_finished" and h.row("hourly").control is None
            h.engine.backfill_loop("hourly", BackfillRequest(T0, T0 + 6 * HOUR))
            await drive(clock, 10)
            events = h.journal("hourly")
            assert_no_duplicate_slots(events)
            # The rest of the range, not the future slot 6h: never a slot twice.
            assert started(events, "backfill") == [2 * HOUR, 3 * HOUR, 4 * HOUR]
            assert events[-1].kind == "backfill_finished" and h.row("hourly").control is None
            # A second backfill of the same range finds nothing left.
            h.engine.backfill_loop("hourly", BackfillRequest(T0, T0 + 4 * HOUR))
            await drive(clock, 3)
            assert started(h.journal("hourly"), "backfill") == [2 * HOUR, 3 * HOUR, 4 * HOUR]
            assert h.journal("hourly")[-1].kind == "backfill_finished"
            assert h.row("hourly").next_fire_at == T0 + 6 * HOUR

    asyncio.run(main())


def test_backfill__a_future_range_is_refused_and_a_partly_future_one_says_what_is_left(
    store_url: str,
) -> None:
    """A backfill of a range in the future was taken, then journaled ``backfill_finished``
    "every slot of the range has run" with nothing run (ops audit): refused when asked for,
    nothing written. A range partly in the future, or cut by ``--max``, ends with a reason
    that says what of the range did not run; the entry counts the slots the backfill ran."""

    async def main() -> None:
        clock = SteppedClock()
        hourly = Loop("hourly_f", lambda it: None, every=HOUR, misfire_grace=60)
        async with LoopHarness(store_url, [hourly], clock=clock) as h:
            await drive(clock, HOUR + 1, step=60)  # slots 0 and 1h run
        clock.advance(4 * HOUR)  # down: 2h, 3h, 4h, 5h pass
        async with LoopHarness(store_url, [hourly], clock=clock) as h:
            await drive(clock, 60, step=10)  # 2h-4h missed; 5h fires
            seq = h.row("hourly_f").last_seq
            future = clock.now() + 1
            with pytest.raises(LoopRequestRefused, match=r"--from .* is in the future: future"):
                h.engine.backfill_loop("hourly_f", BackfillRequest(future, future + 10))
            row = h.row("hourly_f")
            assert (row.control, row.last_seq) == (None, seq)  # nothing asked, nothing written
            h.engine.backfill_loop("hourly_f", BackfillRequest(T0, T0 + 8 * HOUR, 2))
            await drive(clock, 10)
            end = h.journal("hourly_f")[-1]
            assert started(h.journal("hourly_f"), "backfill") == [2 * HOUR, 3 * HOUR]
            assert (end.kind, end.count) == ("backfill_finished", 2)
            assert end.data["reason"] == (
                "--max 2 reached: 1 slot of the range not run (backfill again); "
                "3 slots later left to the schedule"
            )
            h.engine.backfill_loop("hourly_f", BackfillRequest(T0, T0 + 8 * HOUR))
            await drive(clock, 10)
            end = h.journal("hourly_f")[-1]
            assert started(h.journal("hourly_f"), "backfill") == [2 * HOUR, 3 * HOUR, 4 * HOUR]
            assert (end.kind, end.count) == ("backfill_finished", 1)
            assert end.data["reason"] == (
                "every due slot of the range has run; 3 slots later left to the schedule"
            )
            h.engine.backfill_loop("hourly_f", BackfillRequest(T0, T0 + 4 * HOUR))
            await drive(clock, 3)
            end = h.journal("hourly_f")[-1]
            assert (end.kind, end.count) == ("backfill_finished", 0)
            assert end.data["reason"] == "every slot of the range has run"

    asyncio.run(main())


def test_manual_cli__trigger_and_backfill_journaled_and_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI (real processes) asks; a worker (the scheduler here) runs; `flowloop loops
    NAME` shows the manual and backfill iterations. Refusals are one line, exit 2."""
    monkeypatch.setenv("COLUMNS", "200")  # the journal table on one line per entry
    db = tmp_path / "loops.db"
    url = f"sqlite:///{db}"
    start = datetime.fromtimestamp(PAST, UTC).isoformat()
    end = datetime.fromtimestamp(PAST + 2 * HOUR, UTC).replace(tzinfo=None).isoformat()
    future = (datetime.now(UTC) + timedelta(days=1)).isoformat()

    async def work(seconds: float) -> None:
        clock = SteppedClock(PAST + 3 * HOUR + 30)
        daily = Loop("nightly", lambda it: None, every=HOUR, misfire_grace=60)
        async with LoopHarness(url, [daily], clock=clock):
            await drive(clock, seconds)

    asyncio.run(work(1))  # registers the loop (its first slot is now)
    asked = cli("trigger", "nightly", db=db)
    assert "trigger requested" in asked.stdout
    refused = cli("backfill", "nightly", "--from", start, "--to", end, db=db, check=False)
    assert refused.returncode == 2 and "already has a trigger request pending" in refused.stderr
    asyncio.run(work(3))
    asked = cli("backfill", "nightly", "--from", start, "--to", end, db=db)
    assert "backfill of" in asked.stdout and "requested" in asked.stdout
    asyncio.run(work(5))
    shown = cli("loops", "nightly", db=db).stdout
    assert "manual" in shown and "backfill_finished" in shown
    assert shown.count("backfill") >= 3  # two slots of the loop's chain, and the end
    with Engine(url) as engine:
        events = engine.loop_history("nightly")
    # The loop's chain runs through its first slot (T0 + 3h 30s): 30 s past each hour.
    backfilled = [e.slot for e in events if e.data.get("reason") == "backfill"]
    assert backfilled == [PAST + 30, PAST + HOUR + 30]
    asked = cli("trigger", "nightly", db=db)
    withdrawn = cli("trigger", "nightly", "--withdraw", db=db)
    assert withdrawn.stdout.strip() == "loop nightly: trigger withdrawn; the schedule goes on"
    for args, message in [
        (("trigger", "nope"), "no loop 'nope'"),
        (("trigger", "nightly", "--withdraw"), "loop 'nightly' has no trigger or backfill pending"),
        (("backfill", "nightly", "--to", end), "backfill needs --from and --to (or --withdraw)"),
        (("backfill", "nightly", "--to", end, "--withdraw"), "drop --to"),
        (("backfill", "nightly", "--max", "5", "--withdraw"), "drop --max"),
        (
            ("backfill", "nightly", "--withdraw", "--wait", "--timeout", "1m"),
            "drop --wait/--timeout",
        ),
        (("backfill", "nightly", "--from", "yesterday", "--to", end), "is not an ISO 8601"),
        (("backfill", "nightly", "--from", end, "--to", start), "--to is before --from"),
        (("backfill", "nightly", "--from", future, "--to", future), "is in the future: future"),
    ]:
        refused = cli(*args, db=db, check=False)
        assert refused.returncode == 2, refused.stderr
        assert message in refused.stderr and "Traceback" not in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    cli("stop", "nightly", db=db)
    [stopped] = [
        line
        for line in cli("loops", "nightly", db=db).stdout.splitlines()
        if "loop_stopped" in line
    ]
    assert f"by {_user()}" in stopped  # the entry an operator wrote says who (ops audit)
    refused = cli("pause", "nightly", db=db, check=False)  # it said "run 'nightly' is …"
    assert refused.returncode == 2
    assert refused.stderr.strip() == "error: loop 'nightly' is stopped: cannot pause it"


def test_backfill_wait_with_no_worker_says_so(tmp_path: Path) -> None:
    """`backfill --wait` with no worker running the loop printed its request, then nothing
    until its timeout (new-user audit): it asks whether a worker runs the loop."""
    db = tmp_path / "loops.db"
    url = f"sqlite:///{db}"
    start = datetime.fromtimestamp(PAST, UTC).isoformat()
    end = datetime.fromtimestamp(PAST + 2 * HOUR, UTC).isoformat()

    async def register() -> None:
        clock = SteppedClock(PAST + 3 * HOUR + 30)
        async with LoopHarness(url, [Loop("lonely", lambda it: None, every=HOUR)], clock=clock):
            await drive(clock, 1)

    asyncio.run(register())
    args = ("backfill", "lonely", "--from", start, "--to", end, "--wait", "--timeout", "1s")
    waited = cli(*args, db=db, check=False)
    assert waited.returncode != 0
    assert "nothing has taken the backfill yet: is a worker running loop 'lonely'?" in (
        waited.stderr
    )
    assert "nothing took the backfill of loop 'lonely' in 1s" in waited.stderr


def fired_from(h: LoopHarness, read: LoopRow) -> bool:
    """Whether another worker, firing the loop's request from the row it ``read``, could."""
    fired = h.store.fire_loop(
        name=read.name,
        follows_seq=read.last_seq,
        worker="w2",
        lease_seconds=30,
        events=[],
        changes={"control": None},
    )
    return fired is not None


def test_withdraw__a_pending_trigger_is_never_run(store_url: str) -> None:
    """A trigger or backfill asked for could not be taken back: it refused the next request
    until a worker ran it (new-user audit). Withdrawn while the loop waits for its slot,
    journaled, fenced on the row as read: a worker firing it from that row is refused."""

    async def main() -> None:
        clock = SteppedClock(T0 + 60)
        seen: list[float] = []
        daily = Loop("daily_w", lambda it: seen.append(it.slot), cron="0 3 * * *")
        async with LoopHarness(store_url, [daily], clock=clock) as h:
            await drive(clock, 1)
            h.engine.trigger_loop("daily_w")
            stale = h.row("daily_w")
            row = h.engine.withdraw_loop_request("daily_w")
            assert row.control is None
            assert h.journal("daily_w")[-1].kind == "request_withdrawn"
            assert h.journal("daily_w")[-1].data == {"request": "trigger"}
            # A worker that read the row before: its fenced fire of the trigger fails.
            assert not fired_from(h, stale)
            await drive(clock, 5)
            assert seen == [] and started(h.journal("daily_w")) == []
            with pytest.raises(LoopRequestRefused, match="has no trigger or backfill pending"):
                h.engine.withdraw_loop_request("daily_w")
            h.engine.trigger_loop("daily_w")  # a new request is taken again
            await drive(clock, 3)
            assert len(seen) == 1

    asyncio.run(main())


def test_withdraw__the_rest_of_a_backfill_while_its_slot_runs(store_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        release = asyncio.Event()

        async def fn(it: Iteration) -> None:
            if it.slot == T0 + 2 * HOUR:  # the first slot backfilled
                await release.wait()

        hourly = Loop("hourly_w", fn, every=HOUR, misfire_grace=60)
        async with LoopHarness(store_url, [hourly], clock=clock) as h:
            await drive(clock, HOUR + 1, step=60)  # slots 0 and 1h run
        clock.advance(4 * HOUR)  # down: 2h, 3h, 4h, 5h pass
        async with LoopHarness(store_url, [hourly], clock=clock) as h:
            await drive(clock, 60, step=10)  # 2h-4h missed; 5h fires
            h.engine.backfill_loop("hourly_w", BackfillRequest(T0, T0 + 6 * HOUR))
            await drive(clock, 3)
            assert h.row("hourly_w").status == "running"
            assert started(h.journal("hourly_w"), "backfill") == [2 * HOUR]
            seq = h.row("hourly_w").last_seq
            assert h.engine.withdraw_loop_request("hourly_w").control is None
            assert h.row("hourly_w").last_seq == seq  # (the running worker is not fenced off)
            release.set()
            await drive(clock, 10)
            events = h.journal("hourly_w")
            assert started(events, "backfill") == [2 * HOUR]  # not 3h and 4h
            assert events[-1].kind == "iteration_succeeded"  # its outcome recorded
            assert h.row("hourly_w").control is None

    asyncio.run(main())


def test_withdraw__read_running_and_rescheduled_meanwhile_is_read_again(store_url: str) -> None:
    """Read while its iteration ran, written after the iteration's end had put the loop back
    on its schedule with the trigger kept: the withdrawal cleared it unfenced, and a worker
    firing from its own read fired the withdrawn trigger (review). Refused; read again."""

    async def main() -> None:
        clock = SteppedClock()
        release = asyncio.Event()

        async def fn(it: Iteration) -> None:
            await release.wait()

        slow = Loop("slow_w", fn, every=HOUR)
        async with LoopHarness(store_url, [slow], clock=clock) as h:
            await settle()
            h.engine.trigger_loop("slow_w")
            running = h.row("slow_w")
            assert (running.status, running.control) == ("running", "trigger")
            # The iteration's end, as its worker writes it: scheduled, the trigger kept.
            assert h.store.write_loop(
                name="slow_w",
                owner=running.owner,
                epoch=running.lease_epoch,
                follows_seq=running.last_seq,
                changes={"status": "scheduled", "control": "trigger"},
                events=[],
            )
            event = LoopEvent(loop="slow_w", kind="request_withdrawn", at=clock.now())
            assert not h.store.withdraw_loop_run(running, event)
            assert h.row("slow_w").control == "trigger"
            # The engine reads it again and withdraws it fenced: a stale fire is refused.
            scheduled = h.row("slow_w")
            assert h.engine.withdraw_loop_request("slow_w").control is None
            assert h.journal("slow_w")[-1].kind == "request_withdrawn"
            assert not fired_from(h, scheduled)
            release.set()

    asyncio.run(main())
