"""flowloop.testing's fixtures in async tests under pytest-asyncio (skipped without it)."""

from __future__ import annotations

import pytest

pytest.importorskip("pytest_asyncio")

from kitflows import three_steps, waiting

from flowloop import FakeClock
from flowloop.testing import SimulatedCrash, TestEngine


@pytest.mark.asyncio
async def test_asyncio__fixtures_drive_runs_from_an_async_test(
    flowloop_engine: TestEngine, fake_clock: FakeClock
) -> None:
    start = fake_clock.now()
    run = await flowloop_engine.arun(three_steps(), {"name": "a1"})
    assert run.status == "succeeded"
    waiting_run = flowloop_engine.start(waiting(), {})
    await flowloop_engine.arun_until_idle()
    assert flowloop_engine.get(waiting_run.id).state == "expired"
    assert fake_clock.now() - start == pytest.approx(2 * 86_400.0)


@pytest.mark.asyncio
async def test_asyncio__a_crash_and_resume_inside_an_async_test(
    flowloop_engine: TestEngine,
) -> None:
    flow = three_steps()
    flowloop_engine.register(flow)
    run = flowloop_engine.start(flow, {"name": "a2"})
    flowloop_engine.crash_at("b", "inside")
    with pytest.raises(SimulatedCrash):
        await flowloop_engine.arun_until_idle()
    await flowloop_engine.aresume()
    assert flowloop_engine.get(run.id).status == "succeeded"


@pytest.mark.asyncio
async def test_asyncio__a_sync_drive_in_an_async_test_names_its_awaitable(
    flowloop_engine: TestEngine,
) -> None:
    # They raised asyncio's own "asyncio.run() cannot be called from a running event
    # loop" (and warned of a coroutine never awaited); Engine.run names engine.arun.
    flowloop_engine.start(three_steps(), {"name": "a3"})
    for call, awaitable in (
        (flowloop_engine.run_until_idle, "arun_until_idle"),
        (lambda: flowloop_engine.advance(5), "aadvance"),
        (flowloop_engine.resume, "aresume"),
        (lambda: flowloop_engine.run_loops([], 5), "arun_loops"),
    ):
        with pytest.raises(RuntimeError, match=f"await engine.{awaitable}"):
            call()
    await flowloop_engine.arun_until_idle()  # nothing was half done
    assert [r.status for r in flowloop_engine.runs()] == ["succeeded"]
