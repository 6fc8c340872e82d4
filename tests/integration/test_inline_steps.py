"""Plain ``def`` steps that ``Engine.run`` calls on its own thread (issue 13: no thread hop
when the loop drives that one run): an operator's stop or pause and a Ctrl-C that arrive
while such a step runs take effect when it returns, before its outcome is committed; the
step may run event loops of its own (``asyncio.run``, a nested ``Engine.run``) as it could
in a thread."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop import journal as j

BOUND_S = 30.0
"""Bounded waits inside the steps (a broken run fails the test instead of hanging)."""


class C(BaseModel):
    n: int = 0
    note: str = ""


def _kinds(engine: Engine, run_id: str) -> list[tuple[str, str | None]]:
    return [(e.kind, e.state) for e in engine.history(run_id)]


def _polled(engine: Engine) -> threading.Event:
    """Set once the lease thread's poll of control requests has returned one (the real
    store call, observed): the request is then on its way to the loop."""
    seen = threading.Event()
    store: Any = engine.store
    real = store.pending_controls

    def observed(*, worker: str) -> dict[str, str]:
        found: dict[str, str] = real(worker=worker)
        if found:
            seen.set()
        return found

    store.pending_controls = observed
    return seen


@pytest.mark.parametrize("action", ["stop", "pause"])
def test_a_control_that_arrives_during_an_inline_step_lands_before_the_next(
    tmp_path: Path, action: str
) -> None:
    calls: list[str] = []
    wf = Workflow("held", context=C)
    with Engine(f"sqlite:///{tmp_path / 'c.db'}", poll_seconds=0.05) as engine:
        polled = _polled(engine)
        leases = engine._executor().leases  # the executor Engine.run drives its run with

        @wf.step(initial=True, next="b")
        def a(ctx: C) -> None:
            calls.append(threading.current_thread().name)
            run_id = engine.runs(limit=1)[0].id
            handed = leases.handed
            getattr(engine, action)(run_id)
            assert polled.wait(BOUND_S), "the lease thread never polled the request"
            poll(
                lambda: leases.handed != handed,
                timeout=BOUND_S,
                what="the request to be handed to the loop",
                every=0.001,
            )
            ctx.n = 1

        @wf.step(next="done")
        def b(ctx: C) -> None:
            calls.append("b")

        wf.final("done")
        info = engine.run(wf, C())
        assert calls == [threading.current_thread().name]  # inline, and b never ran
        kind = j.RUN_STOPPED if action == "stop" else j.RUN_PAUSED
        assert _kinds(engine, info.id) == [
            (j.RUN_CREATED, "a"),
            (j.STEP_STARTED, "a"),
            (j.STEP_SUCCEEDED, "a"),
            (kind, "b"),
        ]
        assert info.status == ("stopped" if action == "stop" else "paused")
        assert info.context == C(n=1)


def test_ctrl_c_during_an_inline_step_cuts_the_run_before_its_next_step(
    tmp_path: Path,
) -> None:
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT reaches the main thread only")
    wf = Workflow("interrupted", context=C)
    started: list[str] = []

    @wf.step(initial=True, next="b")
    def a(ctx: C) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the runner's handler: cancel the run
        ctx.n = 1

    @wf.step(next="done")
    def b(ctx: C) -> None:
        started.append("b")

    wf.final("done")
    with Engine(f"sqlite:///{tmp_path / 'i.db'}") as engine:
        with pytest.raises(KeyboardInterrupt):
            engine.run(wf, C())
        run_id = engine.runs(limit=1)[0].id
        # Its outcome was not committed: the protocol's "cut off during this step".
        assert _kinds(engine, run_id) == [
            (j.RUN_CREATED, "a"),
            (j.STEP_STARTED, "a"),
            (j.STEP_INTERRUPTED, "a"),
        ]
        assert started == []


def test_an_inline_step_may_run_event_loops_of_its_own(tmp_path: Path) -> None:
    async def five() -> int:
        await asyncio.sleep(0)
        return 5

    inner = Workflow("inner", context=C)

    @inner.step(initial=True, next="done")
    def only(ctx: C) -> None:
        ctx.n = 7

    inner.final("done")
    outer = Workflow("outer", context=C)
    with Engine(f"sqlite:///{tmp_path / 'n.db'}", workflows=[inner]) as engine:

        @outer.step(initial=True, next="b")
        def a(ctx: C) -> None:
            ctx.n = asyncio.run(five())

        @outer.step(next="done")
        def b(ctx: C) -> None:
            nested = engine.run(inner, C())
            ctx.note = f"{nested.status} {nested.context}"

        outer.final("done")
        info = engine.run(outer, C())
        assert info.status == "succeeded"
        assert info.context == C(n=5, note="succeeded n=7 note=''")
        # The engine's own loop is still its own afterwards.
        again = engine.run(outer, C())
        assert again.status == "succeeded"


def test_engine_run_inside_a_running_loop_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    """``Engine.run`` from async code: one clear error (await ``arun``), no run created and
    no coroutine left never awaited."""
    import gc
    import warnings

    wf = Workflow("refused", context=C)

    @wf.step(initial=True, next="done")
    def a(ctx: C) -> None:
        ctx.n = 1

    wf.final("done")
    with Engine(f"sqlite:///{tmp_path / 'r.db'}") as engine:

        async def from_async_code() -> list[str]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with pytest.raises(RuntimeError, match=r"await engine\.arun"):
                    engine.run(wf, C())
                gc.collect()
            return [str(warning.message) for warning in caught]

        messages = asyncio.run(from_async_code())
        assert not [message for message in messages if "never awaited" in message]
        assert engine.runs() == []
        assert engine.run(wf, C()).status == "succeeded"  # outside a loop: as ever


def _recorder(ran: list[str], name: str, kind: str) -> Any:
    """A trivial step (``def`` or ``async def``) that notes it ran."""
    if kind == "def":

        def step(ctx: C) -> None:
            ran.append(name)

        return step

    async def step_async(ctx: C) -> None:
        ran.append(name)

    return step_async


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_control_that_arrives_during_a_commit_lands_at_the_next_boundary(
    tmp_path: Path, kind: str
) -> None:
    """A pause the lease thread hands to the loop while a boundary is being written (not
    while a step runs) lands at the next boundary: the step that boundary started runs,
    no other. Runs of trivial steps never suspend; without a turn taken for it the pause
    waited for the loop's periodic turn, dozens of steps later."""
    steps = [f"s{i}" for i in range(40)]
    ran: list[str] = []
    wf = Workflow(f"paused_{kind[:5]}", context=C)
    for i, name in enumerate(steps):
        following = steps[i + 1] if i + 1 < len(steps) else "done"
        wf.step(name=name, initial=i == 0, next=following)(_recorder(ran, name, kind))
    wf.final("done")
    with Engine(f"sqlite:///{tmp_path / 'p.db'}", poll_seconds=0.01) as engine:
        store: Any = engine.store
        real_write = store.write
        leases = engine._executor().leases

        def write(boundaries: Any) -> Any:
            first = boundaries[0].events[0] if boundaries[0].events else None
            if first is not None and first.kind == j.STEP_SUCCEEDED and first.state == "s2":
                # s2's outcome (and s3's start) is about to be written: the pause arrives
                # now — requested, polled by the lease thread, handed to the loop.
                handed = leases.handed
                engine.pause(boundaries[0].run_id)
                poll(
                    lambda: leases.handed != handed,
                    timeout=BOUND_S,
                    what="the pause to be handed over",
                    every=0.001,
                )
            return real_write(boundaries)

        store.write = write
        info = engine.run(wf, C())
        assert ran == ["s0", "s1", "s2", "s3"]  # s3 was started with s2's outcome
        assert info.status == "paused" and info.state == "s4"
        assert _kinds(engine, info.id)[-1] == (j.RUN_PAUSED, "s4")


def test_ctrl_c_still_interrupts_engine_run_when_a_step_swallows_the_cancellation(
    tmp_path: Path,
) -> None:
    """A step that catches the CancelledError a Ctrl-C brings (and returns) lets its run go
    on, but the caller's interruption is not lost: ``Engine.run`` raises KeyboardInterrupt
    once the run's task has ended."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT reaches the main thread only")
    wf = Workflow("swallowing", context=C)

    @wf.step(initial=True, next="done")
    async def a(ctx: C) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the runner's handler: cancel the run
        try:
            await asyncio.sleep(BOUND_S)
        except asyncio.CancelledError:
            ctx.n = 1  # swallowed: the step returns normally

    wf.final("done")
    with Engine(f"sqlite:///{tmp_path / 's.db'}") as engine:
        with pytest.raises(KeyboardInterrupt):
            engine.run(wf, C())
        run = engine.runs(limit=1)[0]
        assert run.status == "succeeded" and run.context == C(n=1)
