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
