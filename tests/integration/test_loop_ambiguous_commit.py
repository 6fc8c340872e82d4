"""The write of an iteration's outcome commits, then raises (a connection lost during its
COMMIT): the worker keeps the outcome for its next poll (an outage), where the write is
refused — the loop moved on by that very outcome. Not a lost lease, and the loop goes on."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import sqlalchemy.exc
from loopkit import LoopHarness, SteppedClock, drive, until
from test_loop_runaways import run_bounded

from flowloop.alerts import Alert
from flowloop.loops import Iteration, Loop


def test_an_outcome_that_committed_then_raised__no_lost_lease_and_the_loop_goes_on(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the worker said "lost its lease" (and told the lease-lost hooks), and never
    armed the loop again: it stalled after that iteration, for good (also on main)."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    calls: list[int] = []

    async def fn(it: Iteration) -> None:
        calls.append(it.number)

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [Loop("s", fn, every=10)], clock=clock) as h:
            lost: list[tuple[str, str]] = []
            h.scheduler.lease_lost.append(lambda name, why: lost.append((name, why)))
            real = h.store.write_loop
            once = [True]

            def write_loop(**kw: Any) -> bool:
                written = real(**kw)
                if once[0] and kw.get("owner") == "w1":
                    once[0] = False
                    raise sqlalchemy.exc.OperationalError(
                        "COMMIT", {}, Exception("server closed the connection unexpectedly")
                    )
                return written

            h.store.write_loop = write_loop  # type: ignore[method-assign]
            await drive(clock, 10)  # (the first slot's outcome was written at the start)
            await until(lambda: not once[0], what="the outcome's write to raise")
            await drive(clock, 60)
            await until(lambda: len(calls) >= 5, what="the loop to go on")
            assert not lost, lost
            said = [r.getMessage() for r in caplog.records]
            assert not [m for m in said if "lost its lease" in m], said
            assert [m for m in said if "written after all" in m], said

    run_bounded(main)


def test_an_outcome_that_committed_then_raised__a_renewal_before_the_poll(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The lease renewal comes before the next poll: it finds the lease released (by the
    outcome's committed write) and gives the outcome up. Before, without a look at the
    journal: "lost its lease", the lease-lost hooks told, the loop never armed again (it
    stalled for good); now the write is tried once more (refused: the journal says it was
    written after all, and the loop is armed again)."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    calls: list[int] = []

    async def fn(it: Iteration) -> None:
        calls.append(it.number)

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", fn, every=10)], clock=clock, lease_seconds=1.5
        ) as h:
            lost: list[tuple[str, str]] = []
            h.scheduler.lease_lost.append(lambda name, why: lost.append((name, why)))
            real = h.store.write_loop
            real_renew = h.store.renew_loops
            once = [True]
            renewals_without_s: list[set[str]] = []

            def write_loop(**kw: Any) -> bool:
                written = real(**kw)
                if once[0] and kw.get("owner") == "w1":
                    once[0] = False
                    raise sqlalchemy.exc.OperationalError(
                        "COMMIT", {}, Exception("server closed the connection unexpectedly")
                    )
                return written

            def renew_loops(**kw: Any) -> set[str]:
                kept = real_renew(**kw)
                if not once[0] and "s" in kw["names"] and "s" not in kept:
                    renewals_without_s.append(kept)
                return kept

            h.store.write_loop = write_loop  # type: ignore[method-assign]
            h.store.renew_loops = renew_loops  # type: ignore[method-assign]
            await drive(clock, 10)  # (the first slot's outcome was written at the start)
            await until(lambda: not once[0], what="the outcome's write to raise")
            # (The poll waits for the stepped clock: the renewal, every 0.5 s, comes first.)
            await until(lambda: renewals_without_s, what="a renewal to find the lease gone")
            await until(lambda: "s" not in h.scheduler._unrecorded, what="the outcome handled")
            n = len(calls)
            await drive(clock, 60)
            await until(lambda: len(calls) >= n + 5, what="the loop to go on")
            assert not lost, lost
            said = [r.getMessage() for r in caplog.records]
            assert not [m for m in said if "lost its lease" in m], said
            assert [m for m in said if "written after all" in m], said

    run_bounded(main)


def test_an_outcome_written_after_all__its_listeners_and_the_pause_alert(
    store_url: str,
) -> None:
    """The failure that committed then raised was the loop's max_failures-th: it paused
    the loop. Before, an outcome written after all told nobody: no iteration listener
    (metrics), no "loop paused" alert, though the loop was paused."""
    calls: list[int] = []

    async def fn(it: Iteration) -> None:
        calls.append(it.number)
        if it.number >= 2:
            raise RuntimeError("broken")

    async def main() -> None:
        clock = SteppedClock()
        loop = Loop("s", fn, every=10, max_failures=1)
        async with LoopHarness(store_url, [loop], clock=clock) as h:
            alerts: list[Alert] = []
            h.scheduler.alert = alerts.append
            told: list[tuple[str, str]] = []
            h.scheduler.iteration_listeners.append(
                lambda name, outcome, *_: told.append((name, outcome))
            )
            real = h.store.write_loop
            once = [True]

            def write_loop(**kw: Any) -> bool:
                written = real(**kw)
                if once[0] and kw.get("owner") == "w1":
                    once[0] = False
                    raise sqlalchemy.exc.OperationalError(
                        "COMMIT", {}, Exception("server closed the connection unexpectedly")
                    )
                return written

            h.store.write_loop = write_loop  # type: ignore[method-assign]
            await drive(clock, 10)
            await until(lambda: not once[0], what="the outcome's write to raise")
            await drive(clock, 30)
            await until(lambda: "s" not in h.scheduler._unrecorded, what="the outcome handled")
            assert h.row("s").status == "paused"
            assert ("s", "failed") in told, told
            assert [a for a in alerts if "paused" in a.what], alerts

    run_bounded(main)
