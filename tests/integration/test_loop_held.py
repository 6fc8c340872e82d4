"""A loop held by its function abandoned still running is visible (an alert, its note in
`flowloop loops`, what a stop does); an outcome left for the next poll is written during
the worker's drain, or said dropped. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from loopkit import WAIT_S, LoopHarness, SteppedClock, drive, settle, until
from test_loop_runaways import Stubborn, run_bounded

from flowloop import loop_calls, loop_outcomes
from flowloop.loops import Iteration, Loop


def test_an_abandoned_function__alerted_and_noted_until_it_ends(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The function swallows its timeout's cancellation and does not end within the grace.
    Before, nothing said so: no alert, the row `running` with an empty note, and `flowloop
    stop` promising a cancel. Now a critical alert, the row's note says it is held (and
    what a stop waits for); the outcome's write replaces the note once the function ends."""
    monkeypatch.setattr(loop_calls, "CUT_OFF_GRACE_SECONDS", 0.05)
    fn = Stubborn()

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", fn, every=10, timeout=0.05, max_failures=1)], clock=clock
        ) as h:
            await until(lambda: h.alerts, what="the alert")
            assert [(a.level, a.what, a.subject) for a in h.alerts] == [
                ("critical", "loop held", "s")
            ]
            from flowloop.cli.loops import _note
            from flowloop.cli.operators import is_held, loop_request

            row = h.row("s")
            assert row.status == "running" and is_held(row), row
            assert _note(row).startswith(
                "held: its function did not end within 0.05s of its timeout (0.05s) at "
            ), _note(row)
            h.engine.stop_loop("s")
            row = h.row("s")
            assert _note(row).endswith("; stop requested"), _note(row)
            assert "once it ends" in loop_request(row.control, held=is_held(row))
            fn.release.set()
            await drive(clock, 2, step=0.5)
            await until(lambda: h.row("s").status == "stopped", what="the stop, once it ended")
            row = h.row("s")
            assert not is_held(row) and row.last_error is not None, row
            assert "iteration_failed" in h.kinds("s")

    run_bounded(main)


@pytest.mark.parametrize("settles", [True, False], ids=["written", "dropped"])
def test_an_outcome_pending_for_the_next_poll__written_as_the_worker_stops(
    store_url: str, caplog: pytest.LogCaptureFixture, settles: bool
) -> None:
    """The outcome's request changed before each of its writes; the worker stops before its
    next poll. Before, the outcome was dropped silently (the loop left running, its lease
    held; recovery then journaled a success interrupted). Now it is written during the
    drain, or, refused again, said dropped."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    release = asyncio.Event()

    async def fn(it: Iteration) -> None:
        if it.number == 1:
            await release.wait()

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [Loop("s", fn, every=10)], clock=clock) as h:
            await drive(clock, 1)
            store = h.scheduler.store
            write = store.write_loop
            flips = [0]
            limit = loop_outcomes.OUTCOME_TRIES if settles else 10**6

            def racing(**kw: Any) -> bool:
                if kw["owner"] == "w1" and flips[0] < limit:
                    flips[0] += 1
                    row = store.get_loop("s")
                    assert row is not None
                    store.request_loop_control("s", None if row.control == "pause" else "pause")
                return write(**kw)

            store.write_loop = racing  # type: ignore[method-assign]
            release.set()
            await until(lambda: flips[0] >= loop_outcomes.OUTCOME_TRIES, what="8 refusals")
            await settle()
            assert list(h.scheduler._unrecorded) == ["s"]
            await asyncio.wait_for(h.stop(), WAIT_S)
            dropped = [r for r in caplog.records if getattr(r, "event", None) == "outcome_dropped"]
            if settles:
                assert h.row("s").status == "scheduled", h.row("s")
                assert "iteration_succeeded" in h.kinds("s"), h.kinds("s")
                assert dropped == []
            else:
                assert [r.getMessage() for r in dropped] == [
                    "loop s: its iteration's outcome could not be written before the worker "
                    "stopped (its request kept changing, or the database did not answer); "
                    "dropped: recovery journals the iteration interrupted"
                ]

    run_bounded(main)
