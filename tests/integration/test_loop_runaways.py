"""A loop function that swallows the cancellation of its iteration (its timeout's, a stop's):
the loop held until it ends, on every worker, and a worker's end not hung by it; and an
iteration's outcome whose request keeps changing. On SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from loopkit import WAIT_S, LoopHarness, SteppedClock, drive, settle, until

from flowloop import loop_calls, loop_outcomes
from flowloop.loops import Iteration, Loop
from flowloop.store.loops import LoopRow

TIMED_OUT = "StepTimeout: loop 's' iteration took longer than 0.05s"


def run_bounded(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """``asyncio.run(main())`` in a thread, which must end (its event loop too) in time."""
    finished = threading.Event()
    raised: list[BaseException] = []

    def in_a_thread() -> None:
        try:
            asyncio.run(main())  # its end cancels every task left, and waits for them
        except BaseException as error:
            raised.append(error)
        finished.set()

    thread = threading.Thread(target=in_a_thread, daemon=True)
    thread.start()
    ended = finished.wait(WAIT_S * 3)
    if raised:
        raise raised[0]
    assert ended, "the event loop did not end: the loop function still runs"
    thread.join()


class Stubborn:
    """A loop function that goes on through every cancellation until ``release`` is set
    (never, if it is not), then raises ``then`` if given; counts the calls at once."""

    def __init__(self, then: BaseException | None = None) -> None:
        self.release = asyncio.Event()
        self.then = then
        self.inside: list[int] = []
        self.swallowed: list[int] = []
        self.live = 0
        self.most = 0

    async def __call__(self, it: Iteration) -> None:
        self.inside.append(it.number)
        self.live += 1
        self.most = max(self.most, self.live)
        try:
            while not self.release.is_set():
                try:
                    await self.release.wait()
                except asyncio.CancelledError:
                    self.swallowed.append(it.number)  # and on
            if self.then is not None and it.number == 1:
                raise self.then
        finally:
            self.live -= 1


def abandoned(caplog: pytest.LogCaptureFixture) -> bool:
    return any(getattr(r, "event", None) == "iteration_runaway" for r in caplog.records)


def cut_off_again(caplog: pytest.LogCaptureFixture) -> bool:
    return any(getattr(r, "event", None) == "iteration_cut_off_again" for r in caplog.records)


def held(h: LoopHarness) -> None:
    """Loop ``s`` is still held by its first iteration (whose function was abandoned): not
    recorded, nothing fired since, its slot of --concurrency taken."""
    kinds = h.kinds("s")
    assert kinds.count("iteration_started") == 1 and "iteration_failed" not in kinds, kinds
    assert h.scheduler.capacity.loops_busy == 1


def test_function_swallowing_its_timeouts_cancellation__held_until_it_ends_and_the_worker_ends(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The function never ends. Its iteration times out; cut off, the function is abandoned
    and the loop stays held (running, its slot of --concurrency taken): its next slot fires
    nothing. The worker's end still ends (its event loop too), recording the iteration's
    failure (StepTimeout). Before, the loop was scheduled again at once, its next iteration
    (on this worker, waiting for the function) failing each slot."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    fn = Stubborn()

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", fn, every=10, timeout=0.05)], clock=clock
        ) as h:
            await until(lambda: abandoned(caplog), what="the function to be abandoned")
            held(h)
            await drive(clock, 12)
            held(h)
            row = h.row("s")
            assert (row.status, row.owner, fn.inside) == ("running", "w1", [1]), (row, fn.inside)
            assert h.scheduler.capacity.loops_busy == 1
            await h.stop()
            said = [  # (flowloop's: not asyncio's GC of a function left by another test)
                r.getMessage()
                for r in caplog.records
                if r.name == "flowloop.loops" and "abandoned" in r.getMessage()
            ]
            assert said == [  # (before, it said the function ignored the cancellation)
                "loop s: its function did not end within 1s of the cancellation of its "
                "iteration; abandoned, still running (the loop is held until it ends)"
            ]
            errors = [e.error_message for e in h.journal("s") if e.error_message]
            assert errors == [TIMED_OUT], h.kinds("s")
            assert h.row("s").status == "scheduled"

    run_bounded(main)


def test_a_stop_during_the_cut_off__the_abandoned_function_is_not_lost(
    store_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The iteration's timeout cancels the function, which goes on; an operator's stop
    cancels the iteration again during the function's moment to end. Before, that second
    cancellation lost track of the function: the loop was stopped at once, its next
    iteration (after an unpause) ran beside it, and asyncio.run hung at the worker's end.
    Now the loop is held until the function ends, then stopped; unpaused, its next call
    runs alone."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    monkeypatch.setattr(loop_calls, "CUT_OFF_GRACE_SECONDS", WAIT_S)  # (the stop lands in it)
    fn = Stubborn()

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", fn, every=10, timeout=0.05)], clock=clock
        ) as h:
            await until(lambda: fn.swallowed, what="the timeout's cancellation swallowed")
            h.engine.stop_loop("s")
            await drive(clock, 2, step=0.5)  # the poll sees the stop: cancels the cut-off
            # (Not said abandoned: its whole second had not passed; it may be cleaning up.)
            await until(lambda: cut_off_again(caplog), what="the cut-off cancelled again")
            assert not abandoned(caplog)
            row = h.row("s")
            assert (row.status, row.control) == ("running", "stop"), row
            assert h.scheduler._timed.running("s") is not None
            fn.release.set()
            await until(lambda: h.row("s").status == "stopped", what="the stop, once it ended")
            h.engine.unpause_loop("s")
            await drive(clock, 12)
            await until(lambda: len(fn.inside) >= 2, what="the next iteration")
            assert fn.most == 1, fn.inside
            assert h.scheduler.capacity.loops_busy == 0 or h.row("s").status == "running"

    run_bounded(main)


def test_an_abandoned_function__no_other_worker_fires_the_loop_until_it_ends(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Worker w1's iteration timed out, its function abandoned still running; worker w2
    defines the loop too. Before, the loop was scheduled again at once and w2 fired its
    next slot beside the function (and the function no longer counted against w1's
    --concurrency). Now w2 cannot fire it until the function ends; then the iteration is
    recorded failed (its timeout), the error the function raised late logged, and the
    loop goes on."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    fn = Stubborn(then=ValueError("late"))
    calls: list[str] = []

    async def other(it: Iteration) -> None:
        calls.append(f"w2:{it.number}")

    async def main() -> None:
        clock = SteppedClock()
        loop = Loop("s", fn, every=10, timeout=0.05)
        async with LoopHarness(store_url, [loop], clock=clock) as h1:
            await until(lambda: abandoned(caplog), what="the function to be abandoned on w1")
            async with LoopHarness(
                store_url, [Loop("s", other, every=10, timeout=0.05)], clock=clock, worker_id="w2"
            ) as h2:
                seen: list[str] = []  # the loop as w2 reads it when its slot is due
                get = h2.store.get_loop

                def get_watched(name: str) -> LoopRow | None:
                    row = get(name)
                    seen.append(row.status if row is not None else "none")
                    return row

                h2.store.get_loop = get_watched  # type: ignore[method-assign]
                await drive(clock, 12)  # slot 10 is due
                await until(lambda: seen, what="w2 to look at the due slot")
                held(h1)
                assert seen[0] == "running" and calls == [], (seen, calls)
                assert (h1.row("s").status, h1.row("s").owner) == ("running", "w1")
                assert h1.scheduler.capacity.loops_busy == 1
                fn.release.set()
                await until(lambda: h1.row("s").status != "running", what="the outcome")
                errors = [e.error_message for e in h1.journal("s") if e.error_message]
                assert errors == [TIMED_OUT], h1.kinds("s")
                late = [
                    r.getMessage()
                    for r in caplog.records
                    if "abandoned function ended" in r.getMessage()
                ]
                assert late == ["loop s: its abandoned function ended: raised ValueError: late"]
                assert h1.scheduler.capacity.loops_busy == 0
                await drive(clock, 10)  # slot 20 (slot 10 overlapped: skipped)
                await until(lambda: len(calls) + len(fn.inside) >= 2, what="the next iteration")
                assert fn.most == 1

    run_bounded(main)


def test_an_outcome_whose_request_keeps_changing__written_at_the_next_poll(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's pause and unpause changing the loop's request before each of the
    outcome's 8 writes. Before, the worker gave the outcome up as a lost lease: it logged
    "lost its lease", called the lease-lost hooks, and recovery journaled the iteration
    (which succeeded) interrupted. Now it says so apart, keeps the loop (its lease renewed)
    and writes the outcome at its next poll."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    release = asyncio.Event()

    async def fn(it: Iteration) -> None:
        if it.number == 1:
            await release.wait()

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [Loop("s", fn, every=10)], clock=clock) as h:
            lost: list[str] = []
            h.scheduler.lease_lost.append(lambda name, why: lost.append(why))
            await drive(clock, 1)
            store = h.scheduler.store
            write = store.write_loop
            flips = [0]

            def racing(**kw: Any) -> bool:
                if kw["owner"] == "w1" and flips[0] < loop_outcomes.OUTCOME_TRIES:
                    flips[0] += 1
                    row = store.get_loop("s")
                    assert row is not None
                    store.request_loop_control("s", None if row.control == "pause" else "pause")
                return write(**kw)

            store.write_loop = racing  # type: ignore[method-assign]
            release.set()
            await until(lambda: flips[0] == loop_outcomes.OUTCOME_TRIES, what="8 refused writes")
            await settle()
            assert h.row("s").status == "running"
            await drive(clock, 2)  # the next poll
            await until(lambda: h.row("s").status == "scheduled", what="the outcome written")
            kinds = h.kinds("s")
            assert "iteration_succeeded" in kinds and "iteration_interrupted" not in kinds, kinds
            assert lost == []
            said = [r.getMessage() for r in caplog.records if r.name == "flowloop.loops"]
            assert not any("lost its lease" in m for m in said), said
            assert any("writing it again at the next poll" in m for m in said), said

    run_bounded(main)
