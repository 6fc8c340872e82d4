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

        @wf.step(initial=True, next="b")
        def a(ctx: C) -> None:
            calls.append(threading.current_thread().name)
            run_id = engine.runs(limit=1)[0].id
            getattr(engine, action)(run_id)
            assert polled.wait(BOUND_S), "the lease thread never polled the request"
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
