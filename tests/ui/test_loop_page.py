"""A loop's page draws the loop's own machine (scheduled → running → scheduled, paused,
stopped) with what it did on it, as `flowloop diagram --loop` does — not the run lifecycle
(idle, retrying, succeeded …) a loop never passes through; with or without -w."""

from __future__ import annotations

import asyncio
from xml.etree import ElementTree

import httpx
import pytest
from loopkit import LoopHarness, SteppedClock, drive
from uikit import Parcel, chromium, new_page, off_loop, parcel, serve

from flowloop.loops import Iteration, Loop
from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app


def beat(iteration: Iteration) -> None:
    if iteration.number == 2:
        raise RuntimeError("the probe timed out")


HEARTBEAT = Loop("heartbeat", beat, every=10, max_failures=3)


@pytest.mark.parametrize("loaded", [True, False], ids=["with -w", "without"])
def test_loop_page__draws_the_loop_machine_with_its_counts(store_url: str, loaded: bool) -> None:
    async def fill() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [HEARTBEAT], clock=clock):
            await drive(clock, 40)

    off_loop(asyncio.run, fill())
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store, loops={"heartbeat": HEARTBEAT} if loaded else None)) as base:
            page = httpx.get(f"{base}/loops/heartbeat", timeout=30).text
    finally:
        store.close()
    svg = page[page.index("<svg") : page.index("</svg>") + len("</svg>")]
    texts = " ".join(ElementTree.fromstring(svg).itertext())
    for state in ("scheduled", "running", "paused", "stopped"):
        assert state in texts
    for not_a_loop_state in ("idle", "retrying"):
        assert not_a_loop_state not in texts
    assert "slot due" in texts and "1 failed" in texts  # its transitions, with counts
    assert ("after 3 failures in a row" in texts) is loaded  # its settings: when loaded


def test_loop_page__a_workflow_loop_links_running_to_its_workflow_page(store_url: str) -> None:
    """The running state of a workflow loop linked to `<workflow>.svg` (the CLI's file
    beside the loop's): from /loops/NAME that was /loops/parcel.svg, "no loop" (a 404)."""
    crates = Loop("crates", workflow=parcel, context=Parcel(), every=10)
    store = SQLStore(store_url)  # the loop's row, as a worker registers it
    try:
        off_loop(asyncio.run, _register(store_url, crates))
        app = create_app(store, loops={"crates": crates}, workflows={"parcel": parcel})
        with serve(app) as base, chromium() as browser:
            page = new_page(browser)
            page.goto(f"{base}/loops/crates")
            page.locator(".diagram svg g.node", has_text="running").locator("a").click()
            page.wait_for_url(f"{base}/workflows/parcel")
            assert page.locator("h1").inner_text() == "parcel"
    finally:
        store.close()


async def _register(url: str, loop: Loop) -> None:
    clock = SteppedClock()
    async with LoopHarness(url, [loop], clock=clock):
        await drive(clock, 1)
