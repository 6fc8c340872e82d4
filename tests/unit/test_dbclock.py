"""The database-corrected clock (flowloop/dbclock.py) goes on by the monotonic clock between
two measurements: a host's wall clock that jumps moves it only once a measurement sees the
jump (tests/acceptance/test_clock_jump.py: the same with a real process and server)."""

from __future__ import annotations

import time

import pytest

from flowloop.clock import FakeClock
from flowloop.dbclock import DatabaseClock


def test_a_wall_clock_jump_moves_nothing_until_measured() -> None:
    base = FakeClock(1_800_000_000.0)
    clock = DatabaseClock(time.time, base=base)
    base.jump_wall(3600.0)
    assert clock.now() == 1_800_000_000.0
    base.jump_wall(-7200.0)
    assert clock.now() == 1_800_000_000.0


def test_time_goes_on_by_the_monotonic_clock() -> None:
    base = FakeClock(1_800_000_000.0)
    clock = DatabaseClock(time.time, base=base)
    base.advance(2.5)
    assert clock.now() == 1_800_000_002.5


def test_a_measurement_takes_the_database_clock() -> None:
    clock = DatabaseClock(lambda: time.time() + 90.0)
    clock.refresh()
    assert abs(clock.offset - 90.0) < 1.0
    assert abs(clock.now() - (time.time() + 90.0)) < 1.0


def test_a_suspend_of_the_host_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real clocks go on by the time since boot, which counts a suspend: the monotonic
    clock stops while the host sleeps, and a client engine (which measures again never)
    ran that far behind the database for good — a deadline set after a 2-hour suspend was
    already past (a review)."""
    import flowloop.dbclock as dbclock

    slept = 0.0
    real = time.clock_gettime

    def boottime(clock_id: int) -> float:
        return real(clock_id) + (slept if clock_id == time.CLOCK_BOOTTIME else 0.0)

    monkeypatch.setattr(dbclock.time, "clock_gettime", boottime)
    clock = DatabaseClock(time.time)
    before = clock.now()
    slept = 7200.0  # the host slept two hours: the wall clock and boot time moved on
    assert clock.now() - before >= 7200.0


def test_a_jump_during_a_measurement_is_not_taken() -> None:
    """The wall clock stepped an hour on while the database was asked (the acceptance test
    of a jumping clock failed 2 runs in 10 on a loaded machine): the midpoint of the two
    readings, with no offset (the span too uncertain), set the clock half an hour on, and
    runs due within that half hour were claimed. The measurement is not taken now."""
    base = FakeClock(1_800_000_000.0)

    def db_now() -> float:
        base.jump_wall(3600.0)  # during the database's answer
        return 1_800_000_000.0

    clock = DatabaseClock(db_now, base=base)
    assert clock.refresh() == 0.0
    assert clock.now() == 1_800_000_000.0  # not 1_800_001_800
    clock._db_now = lambda: 1_800_000_000.0  # the next measurement, no jump in it
    assert clock.refresh() == pytest.approx(-3600.0)
    assert clock.now() == pytest.approx(1_800_000_000.0)
