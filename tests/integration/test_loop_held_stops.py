"""A stop of a loop whose function swallows the cancellation is bounded, with or without
``timeout=``: the loop is held with its note and a critical alert — also when the stop cut
the cut-off's grace short; the worker's end still ends; and a Python without
``asyncio.tasks._unregister_task`` still ends its event loop. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging

import pytest
from loopkit import WAIT_S, LoopHarness, SteppedClock, drive, until
from test_loop_runaways import Stubborn, abandoned, cut_off_again, run_bounded

from flowloop import loop_calls
from flowloop.cli.loops import _note
from flowloop.cli.operators import is_held
from flowloop.loops import Loop


def held_alerts(h: LoopHarness) -> list[tuple[str, str, str]]:
    return [(a.level, a.what, a.subject) for a in h.alerts]


def test_a_stop_of_a_loop_without_timeout__held_with_a_note_and_an_alert(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``timeout=``; the function swallows the stop's cancellation. Before, the function
    was awaited in the iteration's own task: the stop waited for ever with nothing said (no
    note, no alert) and asyncio.run hung at the worker's end. Now, after the grace, the loop
    is held as with ``timeout=``: its note, a critical alert; stopped once it ends. (A
    stop's grace is CANCEL_GRACE_SECONDS, shortened here.)"""
    monkeypatch.setattr(loop_calls, "CANCEL_GRACE_SECONDS", 0.05)
    fn = Stubborn()

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [Loop("s", fn, every=10)], clock=clock) as h:
            await until(lambda: fn.inside, what="the iteration to start")
            h.engine.stop_loop("s")
            await drive(clock, 2, step=0.5)  # the poll sees the stop: cancels the iteration
            await until(lambda: h.alerts, what="the held alert")
            assert held_alerts(h) == [("critical", "loop held", "s")]
            row = h.row("s")
            assert row.status == "running" and is_held(row), row
            assert _note(row).startswith(
                "held: its function did not end within 0.05s of the cancellation of its "
                "iteration at "
            ), _note(row)
            assert _note(row).endswith("; stop requested"), _note(row)
            fn.release.set()
            await until(lambda: h.row("s").status == "stopped", what="the stop, once it ended")
            assert not is_held(h.row("s"))
            assert "iteration_stopped" in h.kinds("s"), h.kinds("s")

    run_bounded(main)


def test_the_workers_end_with_a_function_without_timeout_that_never_ends__ends(
    store_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``timeout=``; the worker stops while the function runs, and the function swallows
    every cancellation. Before, the drain cancelled the iteration, the function went on,
    and asyncio.run waited for it for ever. Now it is cut off, recorded cancelled, left
    behind, and the event loop ends."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    monkeypatch.setattr(loop_calls, "CUT_OFF_GRACE_SECONDS", 0.05)
    fn = Stubborn()

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [Loop("s", fn, every=10)], clock=clock) as h:
            await until(lambda: fn.inside, what="the iteration to start")
            await h.stop()
            row = h.row("s")
            assert (row.status, row.owner, row.last_result) == ("scheduled", None, "cancelled")
            assert h.kinds("s")[-1] == "iteration_cancelled", h.kinds("s")
            assert fn.swallowed, "the function saw the cancellation"
        said = [r.getMessage() for r in caplog.records if "left behind" in r.getMessage()]
        assert said == ["loop s: its function still runs as the worker stops; left behind"]

    run_bounded(main)


def test_a_stop_during_the_cut_off_of_a_function_that_never_ends__held_with_an_alert(
    store_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The iteration's timeout cancels the function, which goes on; an operator's stop
    cancels the iteration again during the grace. Before, that path logged the second
    cancellation (INFO) and nothing else, ever: no note, no alert, the stop pending for
    ever. Now, still running once the whole grace has passed, the function is said
    abandoned and the loop held: its note and a critical alert, as on the other paths."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    grace = WAIT_S / 4  # (the stop lands in it: checked below)
    monkeypatch.setattr(loop_calls, "CUT_OFF_GRACE_SECONDS", grace)
    fn = Stubborn()

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", fn, every=10, timeout=0.05)], clock=clock
        ) as h:
            await until(lambda: fn.swallowed, what="the timeout's cancellation swallowed")
            h.engine.stop_loop("s")
            await drive(clock, 2, step=0.5)  # the poll sees the stop: cancels the cut-off
            await until(lambda: cut_off_again(caplog), what="the cut-off cancelled again")
            await until(lambda: h.alerts, what="the held alert, once the grace passed")
            assert abandoned(caplog)
            assert held_alerts(h) == [("critical", "loop held", "s")]
            row = h.row("s")
            assert row.status == "running" and is_held(row), row
            assert _note(row).startswith(
                f"held: its function did not end within {grace:g}s of its timeout (0.05s) at "
            ), _note(row)
            fn.release.set()
            await until(lambda: h.row("s").status == "stopped", what="the stop, once it ended")

    run_bounded(main)


def test_without_unregister_task__the_event_loop_still_ends(
    store_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Python whose asyncio has no ``tasks._unregister_task`` (private: it may go). The
    abandoned function is closed instead (its ``finally`` runs), so asyncio.run does not
    wait for it for ever."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    monkeypatch.setattr(loop_calls, "CUT_OFF_GRACE_SECONDS", 0.05)
    monkeypatch.delattr(asyncio.tasks, "_unregister_task")
    fn = Stubborn()

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", fn, every=10, timeout=0.05)], clock=clock
        ) as h:
            await until(lambda: abandoned(caplog), what="the function to be abandoned")
            await h.stop()
        assert fn.live == 0, "closed: its finally ran"
        said = [r.getMessage() for r in caplog.records if "as the worker stop" in r.getMessage()]
        assert said == ["loop s: its function still ran as the worker stopped; closed"]
        late = [r for r in caplog.records if "abandoned function ended" in r.getMessage()]
        assert late == []  # (its end is the closing's, not the function's)

    run_bounded(main)
