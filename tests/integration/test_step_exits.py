"""A step, a compensation or a loop's function that calls ``sys.exit()`` fails like any
error (SQLite and PostgreSQL).

Before, the ``SystemExit`` left the event loop (asyncio lets a task's ``SystemExit`` out):
``flowloop worker`` ended with the step's exit code and not a word, the run and every other
run it held left ``running`` (new-user audit). Now it is a ``StepExited``: retried under the
step's policy, routed by ``on_error``, journaled as the step's failure; other runs go on.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
from loopkit import T0, LoopHarness, SteppedClock, drive
from pydantic import BaseModel

from flowloop import Engine, Retry, Workflow
from flowloop.errors import StepExited
from flowloop.loops import Iteration, Loop


class Mode(BaseModel):
    exit: bool = True


def exiting(kind: str, timeout: float | None) -> Workflow:
    workflow = Workflow(f"exits_{kind}_{'t' if timeout else 'n'}", context=Mode)
    options = {
        "initial": True,
        "next": "done",
        "retry": Retry(attempts=2, base=0),
        "timeout": timeout,
    }
    if kind == "async":

        @workflow.step(**options)  # type: ignore[arg-type]
        async def work(ctx: Mode) -> None:
            if ctx.exit:
                sys.exit(3)

    else:

        @workflow.step(**options)  # type: ignore[arg-type]
        def work(ctx: Mode) -> None:
            if ctx.exit:
                raise SystemExit("bye")

    workflow.final("done")
    return workflow


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["inline", "own-task-or-thread"])
@pytest.mark.parametrize("kind", ["async", "def"])
def test_a_step_that_exits_fails_and_other_runs_go_on(
    store_url: str, kind: str, timeout: float | None
) -> None:
    workflow = exiting(kind, timeout)
    with Engine(store_url, workflows=[workflow]) as engine:
        info = engine.run(workflow, Mode())  # the caller's thread drives it (inline def)
        assert (info.status, info.attempt) == ("failed", 2)
        assert info.error is not None and "StepExited" in info.error
        code = "3" if kind == "async" else "'bye'"
        assert f"step 'work' called sys.exit({code})" in info.error
        # Through a worker's drive (def steps in threads): both runs end.
        exits = engine.start(workflow, Mode()).id
        goes_on = engine.start(workflow, Mode(exit=False)).id
        engine.run_until_idle(idle_horizon=0)
        assert engine.get(exits).status == "failed"
        assert engine.get(goes_on).status == "succeeded"
        failures = [e for e in engine.history(exits) if e.kind == "step_failed"]
        assert [e.error_type for e in failures] == ["StepExited", "StepExited"]
        assert engine.replay(exits).matches


def test_a_step_that_exits_can_be_routed_by_on_error(store_url: str) -> None:
    workflow = Workflow("exits_routed", context=Mode)

    @workflow.step(initial=True, next="done", on_error={StepExited: "gave_up"})
    async def work(ctx: Mode) -> None:
        sys.exit(0)

    workflow.final("done", "gave_up")
    with Engine(store_url, workflows=[workflow]) as engine:
        info = engine.run(workflow, Mode())
        assert (info.status, info.state) == ("succeeded", "gave_up")


def test_a_compensation_that_exits_fails_like_one_that_raises(store_url: str) -> None:
    workflow = Workflow("exits_undo", context=Mode)

    def undo(ctx: Mode) -> None:
        sys.exit(4)

    @workflow.step(initial=True, next="check", compensate=undo, compensate_retry=Retry(attempts=1))
    def charge(ctx: Mode) -> None:
        pass

    @workflow.step(next="done", retry=Retry(attempts=1), on_error={"*": "undone"})
    def check(ctx: Mode) -> None:
        raise ValueError("declined")

    workflow.final("done")
    workflow.final("undone", compensate=True)
    with Engine(store_url, workflows=[workflow]) as engine:
        info = engine.run(workflow, Mode())
        assert info.status == "failed"
        [failed] = [e for e in engine.history(info.id) if e.kind == "compensation_failed"]
        assert failed.error_type == "StepExited"
        assert "compensation of 'charge' called sys.exit(4)" in (failed.error_message or "")


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["awaited", "own-task"])
def test_a_loop_function_that_exits_fails_its_iteration_and_the_loop_goes_on(
    sqlite_url: str, timeout: float | None
) -> None:
    async def main() -> None:
        clock = SteppedClock(T0)
        calls: list[float] = []

        async def fn(it: Iteration) -> None:
            calls.append(it.slot)
            sys.exit(5)

        loop = Loop("exits", fn, every=60, timeout=timeout)
        async with LoopHarness(sqlite_url, [loop], clock=clock) as h:
            await drive(clock, 200)
            kinds = [e.kind for e in h.journal("exits")]
            assert kinds.count("iteration_failed") >= 2, kinds  # fired again after a failure
            [first] = [e for e in h.journal("exits") if e.kind == "iteration_failed"][:1]
            assert "StepExited: loop 'exits' called sys.exit(5)" in (first.error_message or "")

    asyncio.run(main())
