"""Loops under faults and races: a deploy that changes a loop's schedule while another
worker runs an iteration of it, an iteration that raises a BaseException, and the CLI's
answers to bad input. On SQLite and PostgreSQL where a database is involved."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any

import pytest
from loopkit import T0, LoopHarness, SteppedClock, describe, drive, settle

from flowloop import Engine
from flowloop.errors import FlowloopError
from flowloop.loops import Iteration, Loop
from flowloop.store.loops import LoopStoreMixin


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def test_schedule_changed_while_another_worker_runs_an_iteration__its_outcome_is_kept(
    store_url: str,
) -> None:
    """A deploy: worker "new" starts with `every=5` while worker "old" (`every=10`) runs an
    iteration. Before, registering the new schedule moved the row's `last_seq` under the
    running iteration: its outcome write was fenced off ("lost its lease"), the loop stayed
    running until the lease ran out, and the iteration that had succeeded was journaled
    interrupted — a failure. Now the new schedule waits for the iteration's end."""

    async def main() -> None:
        clock = SteppedClock()
        release = asyncio.Event()

        async def fn(it: Iteration) -> None:
            await release.wait()

        async with LoopHarness(store_url, [Loop("tick", fn, every=10)], clock=clock) as old:
            await drive(clock, 1)
            assert old.row("tick").status == "running"
            new_loop = Loop("tick", fn, every=5)
            async with LoopHarness(store_url, [new_loop], clock=clock, worker_id="new"):
                await drive(clock, 1)
                row = old.row("tick")
                assert (row.status, row.owner, row.schedule) == (
                    "running",
                    "w1",
                    "every 10s (fixed_rate)",
                ), row
                release.set()
                await drive(clock, 20)
                events = old.journal("tick")
                kinds = [e.kind for e in events]
                assert kinds[:4] == [
                    "loop_created",
                    "iteration_started",
                    "iteration_succeeded",
                    "loop_rescheduled",
                ], describe(events)
                assert "iteration_interrupted" not in kinds, describe(events)
                assert events[3].worker == "new"
                assert events[3].data["was"] == "every 10s (fixed_rate)"
                row = old.row("tick")
                assert row.last_result == "ok" and row.consecutive_failures == 0, row
                # The new schedule fires: slots 5 apart from the rescheduled one.
                started = [e.slot for e in events if e.kind == "iteration_started"]
                gaps = [round(b - a, 3) for a, b in itertools.pairwise(started[1:])]
                assert gaps == [5.0] * (len(started) - 2), describe(events)
                assert len(started) >= 3, describe(events)
                await settle()

    run(main())


class Boom(BaseException):
    """A loop function's own BaseException (not an Exception)."""


@pytest.mark.parametrize(
    ("raised", "timeout"),
    [(Boom("custom base"), None), (KeyboardInterrupt("from the function"), 30.0)],
    ids=["own-base-exception", "keyboard-interrupt-with-timeout"],
)
def test_iteration_raising_a_base_exception__fails_the_iteration_only(
    store_url: str, raised: BaseException, timeout: float | None
) -> None:
    """Before: a KeyboardInterrupt raised by a loop's function left the event loop and ended
    the worker (exit 130, "interrupted", every other iteration cancelled); any other
    BaseException ended the iteration's task unrecorded, the loop left running until its
    lease ran out and then journaled interrupted, "self-fenced". Now the iteration fails
    with it, like with any error, and the other loops go on."""
    ticks: list[int] = []

    async def bad(it: Iteration) -> None:
        raise raised

    async def good(it: Iteration) -> None:
        ticks.append(it.number)

    async def main() -> None:
        clock = SteppedClock()
        loops = [Loop("bad", bad, every=10, timeout=timeout), Loop("good", good, every=10)]
        async with LoopHarness(store_url, loops, clock=clock) as h:
            await drive(clock, 25)
            events = h.journal("bad")
            kinds = [e.kind for e in events]
            assert kinds == ["loop_created"] + ["iteration_started", "iteration_failed"] * 3, (
                describe(events)
            )
            name = type(raised).__name__
            assert events[2].error_message == (
                f"RaisedBaseException: loop 'bad' raised {name}: {raised}, a BaseException "
                "that would end the worker: raise an Exception"
            )
            row = h.row("bad")
            assert (row.status, row.last_result, row.consecutive_failures) == (
                "scheduled",
                "failed",
                3,
            )
            assert ticks == [1, 2, 3]

    try:
        run(main())
    except KeyboardInterrupt:
        pytest.fail("the iteration's KeyboardInterrupt ended the worker's event loop")


def test_loops_journal_limit_below_zero__refused_as_bad_input(store_url: str) -> None:
    """`flowloop loops NAME --limit -3` printed the whole journal on SQLite (LIMIT -1 is no
    limit there) and "a value does not fit the database column" on PostgreSQL; the API
    likewise. Now both refuse it, saying what a limit must be."""
    from click.testing import CliRunner

    from flowloop.cli import cli as command

    with Engine(store_url) as engine:
        store = engine.store
        assert isinstance(store, LoopStoreMixin)
        store.sync_loop(name="tick", schedule="every 10s", first_slot=T0, at=T0, worker="w")
        with pytest.raises(FlowloopError, match=r"limit=-3 must be a whole number"):
            engine.loop_history("tick", limit=-3)
        assert [e.kind for e in engine.loop_history("tick", limit=0)] == []
    result = CliRunner().invoke(command, ["loops", "tick", "--limit", "-3", "--db", store_url])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--limit': -3 is not in the range x>=0." in result.output
    assert "Traceback" not in result.output and "loop_created" not in result.output
