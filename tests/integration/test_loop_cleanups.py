"""A loop function (no ``timeout=``) that handles the cancellation of its iteration — a stop,
the worker's drain — and cleans up for a while (a flush, closing a connection) is given the
time: no false "loop held" alert, its cleanup not cut short by the worker's exit; and what
it raises as it ends is said and kept in the iteration's error, not dropped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from loopkit import LoopHarness, SteppedClock, drive, until
from test_loop_runaways import run_bounded

from flowloop.loops import Iteration, Loop

CLEANUP_S = 2.0
"""How long the function cleans up after its cancellation (real seconds): less than a
stop's or the drain's grace (loop_calls.CANCEL_GRACE_SECONDS, 4 s)."""


def cleaning_up(cleaned: list[str]) -> Any:
    async def fn(it: Iteration) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(CLEANUP_S)
            cleaned.append("done")
            raise

    return fn


def test_the_drain_gives_a_cleanup_its_time(store_url: str) -> None:
    """Before, the drain gave it 1 s (the timeout's grace), then the worker exited, its
    cleanup cut short; on main it had up to CUT_OFF_WRITE_SECONDS, as now (less a second
    for the outcome)."""
    cleaned: list[str] = []

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", cleaning_up(cleaned), every=10)], clock=clock
        ) as h:
            await drive(clock, 1)
            await until(lambda: h.scheduler.running == ["s"], what="the iteration")
            await h.stop()
            assert cleaned == ["done"], "its cleanup cut short by the worker's end"
            assert "iteration_cancelled" in h.kinds("s"), h.kinds("s")
            assert not h.alerts

    run_bounded(main)


def test_a_stop_waits_for_a_cleanup_without_a_held_alert(store_url: str) -> None:
    """Before, 1 s after the stop the loop was said held (a critical alert, its note) while
    the function was merely cleaning up."""
    cleaned: list[str] = []

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", cleaning_up(cleaned), every=10)], clock=clock
        ) as h:
            await drive(clock, 1)
            await until(lambda: h.scheduler.running == ["s"], what="the iteration")
            h.engine.stop_loop("s")
            await drive(clock, 2, step=0.5)  # the poll sees the stop: cancels the iteration
            await until(lambda: h.row("s").status == "stopped", what="the stop")
            assert cleaned == ["done"]
            assert not h.alerts, [(a.level, a.what) for a in h.alerts]
            assert not (h.row("s").reason or "").startswith("held"), h.row("s").reason
            assert "iteration_stopped" in h.kinds("s"), h.kinds("s")

    run_bounded(main)


def test_an_error_raised_in_the_cleanup_after_a_stop_is_said_and_journaled(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, it vanished: journaled ``iteration_stopped`` "stopped by an operator", the
    error neither logged nor journaled (on main it was journaled ``iteration_failed``)."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")

    async def fn(it: Iteration) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed: connection left open") from None

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [Loop("s", fn, every=10)], clock=clock) as h:
            await drive(clock, 1)
            await until(lambda: h.scheduler.running == ["s"], what="the iteration")
            h.engine.stop_loop("s")
            await drive(clock, 2, step=0.5)
            await until(lambda: h.row("s").status == "stopped", what="the stop")
            said = [
                r
                for r in caplog.records
                if "cleanup failed" in r.getMessage() and r.levelno == logging.WARNING
            ]
            assert [r.getMessage() for r in said] == [
                "loop s: its function raised as it ended after the cancellation of its "
                "iteration: RuntimeError: cleanup failed: connection left open"
            ]
            stopped = [e for e in h.journal("s") if e.kind == "iteration_stopped"]
            assert len(stopped) == 1, h.kinds("s")
            assert stopped[0].error_message == (
                "stopped by an operator; its function raised as it ended: "
                "RuntimeError: cleanup failed: connection left open"
            )

    run_bounded(main)
