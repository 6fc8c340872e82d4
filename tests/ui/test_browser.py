"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven by Playwright):
the runs page and its filters, a run page that follows a worker without a reload, a loop.
Every wait is on a condition of the page; screenshots go to the test's tmp directory."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from loopkit import LoopHarness, SteppedClock, drive
from uikit import (
    GATES,
    Parcel,
    chromium,
    gated,
    new_page,
    off_loop,
    open_gates,
    parcel,
    parcels,
    serve,
    start_gated,
)

from flowloop import Engine
from flowloop.loops import Iteration, Loop
from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app

playwright = pytest.importorskip("playwright.sync_api")
LATENCIES: list[float] = []


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with chromium() as launched:
        yield launched


def test_runs_page__filter_then_open_a_run_that_moves_without_a_reload(
    browser: object, sqlite_url: str, tmp_path: Path
) -> None:
    off_loop(parcels, sqlite_url, 3, failing=1)
    engine, worker, run = off_loop(start_gated, sqlite_url, "T-live")
    store = SQLStore(sqlite_url, create=False)
    try:
        with serve(create_app(store, workflows={"parcel": parcel, "gated": gated})) as base:
            page = new_page(browser)
            page.goto(f"{base}/runs")
            assert page.locator("#runs tbody tr").count() == 4
            page.select_option("select[name=status]", "failed")
            page.click("#filters button[type=submit]")
            page.wait_for_url("**/runs?*status=failed*")
            assert page.locator("#runs tbody tr").count() == 1
            assert page.locator("#runs tbody td.key").inner_text() == "P0"
            page.screenshot(path=str(tmp_path / "runs-filtered.png"), full_page=True)

            page.fill("input[name=key]", "T-live")
            page.select_option("select[name=status]", "")
            page.click("#filters button[type=submit]")
            page.wait_for_selector(f"tr[data-run='{run.id}']")
            page.click(f"tr[data-run='{run.id}'] a")
            page.wait_for_url(f"**/runs/{run.id}")
            page.wait_for_selector("#run-state:text-is('first')")
            page.evaluate("window.__same_page = true")

            for state, after in (("first", "second"), ("second", "third"), ("third", "done")):
                opened = time.monotonic()
                GATES[state].set()
                page.wait_for_selector(f"#run-state:text-is('{after}')")
                LATENCIES.append(time.monotonic() - opened)
                assert page.evaluate("window.__same_page") is True  # no reload happened
            page.wait_for_selector("#live-body[data-status=succeeded]")
            assert "done" in page.locator("#diagram svg").text_content()
            # The context shown is the latest one, also swapped in without a reload.
            assert '"third"' in page.locator("#context-json").inner_text()
            page.screenshot(path=str(tmp_path / "run-live.png"), full_page=True)
            page.close()
    finally:
        open_gates()
        worker.join(timeout=30)
        engine.close()
        store.close()
    print(
        "live-update latency (gate opened -> page shows the new state): "
        + ", ".join(f"{seconds * 1000:.0f} ms" for seconds in LATENCIES)
    )
    # The page polls every 250 ms; a commit must show well within the ~1 s promise.
    assert max(LATENCIES) < 5.0


def test_loop_page__schedule_iterations_and_decisions(
    browser: object, sqlite_url: str, tmp_path: Path
) -> None:
    def beat(iteration: Iteration) -> None:
        if iteration.number == 2:
            raise RuntimeError("the probe timed out")

    async def fill() -> None:
        clock = SteppedClock()
        async with LoopHarness(sqlite_url, [Loop("heartbeat", beat, every=10)], clock=clock):
            await drive(clock, 40)

    off_loop(asyncio.run, fill())
    store = SQLStore(sqlite_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = new_page(browser)
            page.goto(f"{base}/loops")
            page.click("tr[data-loop='heartbeat'] a")
            page.wait_for_selector("#iterations")
            assert page.locator("#loop-facts").inner_text().count("every 10") >= 1
            outcomes = page.locator("#iterations tbody tr .outcome").all_inner_texts()
            assert "failed" in outcomes and "succeeded" in outcomes
            assert "the probe timed out" in page.locator("#iterations").inner_text()
            page.screenshot(path=str(tmp_path / "loop.png"), full_page=True)
            page.close()
    finally:
        store.close()


def test_actions__sign_in_then_pause_and_unpause_from_the_run_page(
    browser: object, sqlite_url: str, tmp_path: Path
) -> None:
    def queued() -> str:
        with Engine(sqlite_url, workflows=[parcel]) as engine:
            return engine.start(parcel, Parcel(parcel_id="Q1")).id

    run_id = off_loop(queued)
    store = SQLStore(sqlite_url, create=False)
    try:
        app = create_app(store, workflows={"parcel": parcel}, allow_actions=True, token="tok")
        with serve(app) as base:
            page = new_page(browser)
            page.goto(f"{base}/runs/{run_id}")
            assert page.locator("#actions").count() == 0  # not signed in: no buttons
            page.goto(f"{base}/login")
            page.fill("input[name=token]", "tok")
            page.click("button[type=submit]")
            page.wait_for_url("**/runs")
            page.goto(f"{base}/runs/{run_id}")
            page.click("button[data-action=pause]")
            page.wait_for_selector(".flash.done")
            assert "the run is paused" in page.locator(".flash.done").inner_text()
            page.wait_for_selector("#live-body[data-status=paused]")
            page.screenshot(path=str(tmp_path / "actions.png"), full_page=True)
            page.click("button[data-action=retry]")
            refused = page.locator(".flash.error[role=alert]")
            refused.wait_for()
            assert "is paused" in refused.inner_text()
            page.click("button[data-action=unpause]")
            page.wait_for_selector("#live-body[data-status=scheduled]")
            page.close()
    finally:
        store.close()


def test_actions__without_the_definition_send_and_retry_are_disabled_saying_why(
    browser: object, sqlite_url: str, tmp_path: Path
) -> None:
    """Started without -w, the run page offered Send and Retry, and each failed with
    `unknown workflow … (known: none)`: now disabled, the page saying to start with -w."""
    from waitkit import review

    def waiting() -> str:
        with Engine(sqlite_url, workflows=[review]) as engine:
            return engine.run(review, {"doc_id": "B1"}).id

    run_id = off_loop(waiting)
    store = SQLStore(sqlite_url, create=False)
    try:
        with serve(create_app(store, allow_actions=True, token="tok")) as base:
            page = new_page(browser)
            page.goto(f"{base}/login")
            page.fill("input[name=token]", "tok")
            page.click("button[type=submit]")
            page.wait_for_url("**/runs")
            page.goto(f"{base}/runs/{run_id}")
            note = page.locator("#not-loaded")
            note.wait_for()
            assert "start flowloop ui with -w FILE_OR_DIR" in note.inner_text()
            assert page.locator("button[data-action=send]").is_disabled()
            assert page.locator("input[name=event]").is_disabled()
            assert page.locator("button[data-action=retry]").is_disabled()
            assert page.locator("button[data-action=pause]").is_enabled()
            page.screenshot(path=str(tmp_path / "not-loaded.png"), full_page=True)
            page.close()
    finally:
        store.close()
