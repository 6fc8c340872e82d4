"""A loop overlay drawn from what the real scheduler journaled on a real database: retries,
a slot skipped for overlap, consecutive failures pausing the loop — the counts on the
diagram agree with the loop row the scheduler wrote."""

from __future__ import annotations

import asyncio

from loopkit import LoopHarness, SteppedClock, drive

from flowloop import Retry, render, render_loops
from flowloop.loops import Iteration, Loop


def test_loop_overlay__from_a_scheduled_loop_on_sqlite(sqlite_url: str) -> None:
    async def main() -> None:
        clock = SteppedClock()
        calls: list[int] = []

        async def flaky(it: Iteration) -> None:
            calls.append(it.number)
            if it.number == 1 and it.attempt == 1:
                raise ConnectionError("first try refused")
            if it.number == 2:
                await clock.sleep(25)  # two slots come due meanwhile: skipped
            if it.number >= 3:
                raise ValueError(f"bad feed in iteration {it.number}")

        loop = Loop(
            "flaky",
            flaky,
            every=10,
            retry=Retry(attempts=2, backoff="fixed", base=1, on=(ConnectionError,)),
            max_failures=2,
        )
        async with LoopHarness(sqlite_url, [loop], clock=clock) as h:
            await drive(clock, 80)
            row, events = h.row("flaky"), h.journal("flaky")
        assert row.status == "paused"
        overlay = render_loops.LoopOverlay.from_store(row, events)
        counts = overlay.counts
        assert (counts["succeeded"], counts["failed"], counts["retried"]) == (2, 2, 1)
        assert counts["skipped"] == row.skipped == 2
        assert counts["succeeded"] + counts["failed"] == row.iterations
        assert overlay.taken[("running", "max_failures", "paused")] == 1
        assert overlay.taken[("running", "failed", "scheduled")] == 1
        assert overlay.last_error == "ValueError: bad feed in iteration 4"

        dot = render_loops.stored_loop_digraph(loop, row, events).source
        assert f'label="max_failures {render.TIMES}1"' in dot
        assert "4 iterations: 2 succeeded, 2 failed" in dot and "2 skipped for overlap" in dot
        assert "now paused: 2 consecutive failures (max_failures=2)" in dot

    asyncio.run(main())
