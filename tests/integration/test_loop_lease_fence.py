"""A loop worker whose lease renewals fail gives its iteration up by its own clock before
the lease can end in the database — even when each failed renewal takes a while (a silent
network, a lock not granted: the call fails only after a timeout) — and one transient
failure, with plenty of lease left, does not cost a healthy iteration.

The renewals are the store's real ``renew_loops`` (or a failure in its place, after a
real wait); the lease is counted by the real database, its end read from the row."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import sqlalchemy.exc
from loopkit import LoopHarness, SteppedClock, drive, until
from test_loop_runaways import run_bounded

from flowloop.loops import Iteration, Loop

LEASE_S = 3.0
"""The loop lease (real seconds): renewals every second, the fence 1 s before its end."""
FAIL_AFTER_S = 0.9
"""How long each failed renewal takes to fail (a statement or network timeout)."""
ONE_FAILURE_LEASE_S = 6.0
"""The lease where one renewal fails: renewals every 2 s, the fence 1.5 s before its end,
so the retry after the failure lands about 1.3 s before the fence (with 3 s: 0.3 s, which
a stall of the loaded machine — a GC, a slow fsync — could eat)."""


def test_slow_failing_renewals__the_iteration_given_up_before_the_lease_ends(
    store_url: str,
) -> None:
    """Before, the worker looked at its own clock only once a failed renewal had returned
    (the renewal blocking its event loop), with no allowance for the next one's failure:
    with renewals failing after 0.9 s it gave up about 0.8 s after its lease had ended in
    the database, and another worker, started once it had, ran the loop beside it."""
    live: list[str] = []
    calls: list[str] = []
    most = [0]
    cancelled_at: list[float] = []

    def function(worker: str) -> Any:
        async def fn(it: Iteration) -> None:
            calls.append(f"{worker}:{it.number}")
            live.append(worker)
            most[0] = max(most[0], len(live))
            try:
                if worker == "w1":
                    await asyncio.Event().wait()  # until cut off
            except asyncio.CancelledError:
                cancelled_at.append(time.time())
                raise
            finally:
                live.remove(worker)

        return fn

    def second_worker(lease_end: Any) -> None:
        """Once w1's lease has ended in the database: a worker that recovers the loop.
        (``lease_end()`` read again: a real renewal under way as they were swapped may
        have moved it on after it was first read.)"""
        while time.time() <= lease_end() + 0.02:
            time.sleep(0.05)

        async def main2() -> None:
            clock2 = SteppedClock(start=1_800_000_001.0)
            async with LoopHarness(
                store_url,
                [Loop("s", function("w2"), every=10)],
                clock=clock2,
                worker_id="w2",
                lease_seconds=LEASE_S,
            ):
                await drive(clock2, 12)  # its recovery sweep, then the loop's next slot
                await until(lambda: any(c.startswith("w2") for c in calls), what="w2's call")

        asyncio.run(main2())

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", function("w1"), every=10)], clock=clock, lease_seconds=LEASE_S
        ) as h1:
            await drive(clock, 1)
            await until(lambda: calls == ["w1:1"], what="w1's iteration")

            def renew(**_: Any) -> set[str]:
                time.sleep(FAIL_AFTER_S)
                raise sqlalchemy.exc.OperationalError("UPDATE loops", {}, Exception("timeout"))

            h1.store.renew_loops = renew  # type: ignore[method-assign]

            def lease_end() -> float:
                end = h1.row("s").lease_expires_at
                assert end is not None
                return end

            w2 = threading.Thread(target=second_worker, args=(lease_end,), daemon=True)
            w2.start()
            await until(lambda: bool(cancelled_at), what="w1 to give its iteration up")
            end = lease_end()  # (after the fence: no renewal that worked can move it on)
            while w2.is_alive():
                await asyncio.sleep(0.05)
            assert cancelled_at[0] < end, (cancelled_at, end)  # (before: 0.8 s after it)
            assert most[0] == 1, f"two calls of the loop at once: {calls}"
            assert calls[:2] == ["w1:1", "w2:2"], calls

    run_bounded(main)


def test_one_failed_renewal_with_plenty_of_lease_left__the_iteration_goes_on(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A renewal granted late (it waited 0.5 s for a lock), then one that failed after
    0.5 s (a busy timeout), then renewals that work: the database held the lease all
    along. Before, the worker gave the healthy iteration up at the failure, half the
    lease left (its next try a whole period away); now it tries again sooner and the fence
    alone decides."""
    finished: list[int] = []
    cancelled: list[int] = []

    async def fn(it: Iteration) -> None:
        try:
            await asyncio.sleep(9)  # a healthy iteration (real seconds: past the failure)
            finished.append(it.number)
        except asyncio.CancelledError:
            cancelled.append(it.number)
            raise

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", fn, every=10)], clock=clock, lease_seconds=ONE_FAILURE_LEASE_S
        ) as h:
            await drive(clock, 1)
            await until(lambda: h.scheduler.running == ["s"], what="the iteration")
            real = h.store.renew_loops
            renewals = [0]

            def renew(**kw: Any) -> set[str]:
                renewals[0] += 1
                if renewals[0] == 1:
                    time.sleep(0.5)  # waited for the write lock, then granted
                    return real(**kw)
                if renewals[0] == 2:
                    time.sleep(0.5)
                    raise sqlalchemy.exc.OperationalError(
                        "UPDATE loops", {}, Exception("database is locked")
                    )
                return real(**kw)

            h.store.renew_loops = renew  # type: ignore[method-assign]
            await until(lambda: renewals[0] >= 3, what="a renewal after the failure")
            await until(lambda: finished or cancelled, timeout=30, what="the iteration's end")
            assert (finished, cancelled) == ([1], []), "a healthy iteration given up"
            await until(lambda: "iteration_succeeded" in h.kinds("s"), what="its outcome")
            assert not [r for r in caplog.records if "self-fencing" in r.getMessage()]

    run_bounded(main)


def test_a_stop_then_the_fence__the_function_cancelled_again_before_the_lease_ends(
    store_url: str,
) -> None:
    """An operator's stop gives the function 4 s to clean up; the renewals fail meanwhile
    and the fence comes: its lease may end soon, so the function, still cleaning up, is
    cancelled again (its grace cut to 1 s, which the fence's margin covers). Before, it
    was not: its cleanup went on past the lease's end in the database."""
    cleanup_ended: list[float] = []
    cancelled_again: list[bool] = []

    async def fn(it: Iteration) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            try:
                await asyncio.sleep(3.5)  # a slow cleanup: within a stop's 4 s grace
            except asyncio.CancelledError:
                cancelled_again.append(True)
                raise
            finally:
                cleanup_ended.append(time.time())
            raise

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", fn, every=10)], clock=clock, lease_seconds=LEASE_S
        ) as h:
            await drive(clock, 1)
            await until(lambda: h.scheduler.running == ["s"], what="the iteration")

            def renew(**_: Any) -> set[str]:
                raise sqlalchemy.exc.OperationalError("UPDATE loops", {}, Exception("partition"))

            h.store.renew_loops = renew  # type: ignore[method-assign]
            h.engine.stop_loop("s")
            await drive(clock, 1, step=0.5)  # the poll sees the stop: its cancellation
            await until(lambda: bool(cleanup_ended), what="the cleanup's end")
            # (Read after the fence: a renewal that worked, under way at the swap, counts.)
            end = h.row("s").lease_expires_at
            assert end is not None
            assert cleanup_ended[0] < end, f"cleanup ran {cleanup_ended[0] - end:.2f}s past"
            assert cancelled_again == [True]

    run_bounded(main)
