"""A loop function cut off (its timeout) is said abandoned, and its loop reported held,
only once the whole grace has passed: not when a second cancellation (a stop, the worker's
end, a lost lease) cut the grace short while the function was merely cleaning up; and
``TestEngine.run_loops`` ends, with its own error, on a function that never ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

import pytest

from flowloop import loop_calls
from flowloop.errors import FlowloopError, StepTimeout
from flowloop.loops import Iteration, Loop
from flowloop.testing import TestEngine
from flowloop.testing import loops as testing_loops

WAIT_S = 10.0


def said_abandoned(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "did not end within" in r.getMessage()]


def test_a_second_cancellation_during_the_grace__not_said_abandoned(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    monkeypatch.setattr(loop_calls, "CUT_OFF_GRACE_SECONDS", WAIT_S)
    reported: list[tuple[str, str]] = []

    async def main() -> None:
        timed = loop_calls.TimedCalls()
        timed.on_abandoned = lambda *told: reported.append(told)
        cleaning, cleaned = asyncio.Event(), asyncio.Event()

        async def fn() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                cleaning.set()
                await cleaned.wait()  # a cleanup still going when the stop lands

        caller = asyncio.ensure_future(timed.call(fn, name="s", timeout=0.01))
        await asyncio.wait_for(cleaning.wait(), WAIT_S)
        caller.cancel()  # (a stop during the grace)
        await asyncio.wait([caller], timeout=WAIT_S)
        assert caller.cancelled()
        assert timed.running("s") is not None  # still tracked: the loop is held
        cleaned.set()
        await asyncio.wait_for(timed.ended("s"), WAIT_S)

    asyncio.run(main())
    assert said_abandoned(caplog) == []  # (before: "did not end within 10s …")
    assert reported == []


def test_the_whole_grace_elapsed__said_abandoned_and_reported(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    monkeypatch.setattr(loop_calls, "CUT_OFF_GRACE_SECONDS", 0.02)
    reported: list[tuple[str, str]] = []

    async def main() -> None:
        timed = loop_calls.TimedCalls()
        timed.on_abandoned = lambda *told: reported.append(told)
        release = asyncio.Event()

        async def fn() -> None:
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()

        with pytest.raises(StepTimeout):
            await asyncio.wait_for(timed.call(fn, name="s", timeout=0.01), WAIT_S)
        release.set()
        await asyncio.wait_for(timed.ended("s"), WAIT_S)

    asyncio.run(main())
    assert len(said_abandoned(caplog)) == 1
    assert reported == [("s", "0.02s of its timeout (0.01s)")]


def test_run_loops__a_function_that_never_ends__its_error_not_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, run_loops hung for ever (asyncio.run waiting for the abandoned function)."""
    monkeypatch.setattr(loop_calls, "CUT_OFF_GRACE_SECONDS", 0.02)
    monkeypatch.setattr(testing_loops, "STUCK_SECONDS", 0.2)
    raised: list[BaseException] = []
    ended = threading.Event()

    async def hung(it: Iteration) -> None:
        while True:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()

    def drive() -> None:
        try:
            with TestEngine() as engine:
                engine.run_loops([Loop("s", hung, every=10, timeout=0.05)], 45)
        except BaseException as error:
            raised.append(error)
        ended.set()

    threading.Thread(target=drive, daemon=True).start()
    assert ended.wait(WAIT_S * 3), "run_loops did not end"
    assert len(raised) == 1 and isinstance(raised[0], FlowloopError), raised
    assert "made no progress" in str(raised[0])
