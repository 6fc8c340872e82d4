"""Hostile names render as text: a state, event, key, context value and error message made of
``<script>`` and DOT syntax (``"]; [label="``) appear literally in the pages and in the SVG,
and no script they carry runs in a real browser."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote
from xml.etree import ElementTree

import httpx
import pytest
from pydantic import BaseModel
from uikit import (
    HOSTILE,
    HOSTILE_ERROR,
    HOSTILE_NOTE,
    HOSTILE_WORKFLOW,
    SCRIPT_STATE,
    chromium,
    hostile_run,
    serve,
)

from flowloop import Engine, Workflow
from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app


@pytest.fixture
def hostile_site(sqlite_url: str) -> Iterator[tuple[str, str]]:
    run_id = hostile_run(sqlite_url)
    store = SQLStore(sqlite_url, create=False)
    try:
        with serve(create_app(store)) as base:
            yield base, run_id
    finally:
        store.close()


def test_hostile_names__escaped_in_html_and_svg(hostile_site: tuple[str, str]) -> None:
    base, run_id = hostile_site
    workflow = quote(HOSTILE_WORKFLOW, safe="")
    for path in (f"/runs/{run_id}", "/runs", f"/workflows/{workflow}?since=all", "/workflows"):
        response = httpx.get(base + path, timeout=30)
        assert response.status_code == 200, path
        assert "<script>alert" not in response.text, path
        assert "<img src=x" not in response.text, path
    page = httpx.get(f"{base}/runs/{run_id}", timeout=30).text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(2)&gt;" in page  # the context, as text
    svg = httpx.get(f"{base}/api/runs/{run_id}/diagram.svg", timeout=30).text
    texts = "".join(ElementTree.fromstring(svg).itertext())  # well-formed XML, names as text
    assert HOSTILE in texts and SCRIPT_STATE in texts
    heat = httpx.get(f"{base}/api/workflows/{workflow}/heat.svg?since=all", timeout=30).text
    assert HOSTILE in "".join(ElementTree.fromstring(heat).itertext())


def test_hostile_names__no_script_runs_in_the_browser(
    hostile_site: tuple[str, str], tmp_path: Path
) -> None:
    base, run_id = hostile_site
    dialogs: list[str] = []
    with chromium() as browser:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        workflow = quote(HOSTILE_WORKFLOW, safe="")
        for path in (f"/runs/{run_id}", "/runs", f"/workflows/{workflow}?since=all"):
            page.goto(base + path)
            page.wait_for_load_state("load")
            # Only the dashboard's own script may be on the page.
            sources = page.eval_on_selector_all("script", "nodes => nodes.map(n => n.src)")
            assert all(src.endswith("/static/app.js") for src in sources), sources
        page.goto(f"{base}/runs/{run_id}")
        assert page.locator("#run-state").inner_text() == SCRIPT_STATE
        assert HOSTILE in page.locator("#live-body .facts .key").inner_text()
        assert HOSTILE_ERROR in page.locator("#errors").inner_text()
        assert HOSTILE_NOTE in page.locator("#context-json").inner_text()
        assert SCRIPT_STATE in (page.locator("#diagram svg").text_content() or "")
        page.screenshot(path=str(tmp_path / "hostile.png"), full_page=True)
    assert dialogs == []


class Place(BaseModel):
    city: str = "Bern"
    note: str = ""


place = Workflow("place", context=Place)


@place.step(initial=True, next="done")
def move(ctx: Place) -> None:
    ctx.city, ctx.note = "Zürich 東京", "<b>R&D</b> 'ok'"


place.final("done")


def test_context_and_changes__letters_of_every_script_shown_as_they_are(sqlite_url: str) -> None:
    """The context and its changes were shown as JSON with ``\\u`` escapes ("Z\\u00fcrich",
    "\\u003cb\\u003e"): text as it is now, escaped as HTML by the page."""
    with Engine(sqlite_url) as engine:
        run_id = engine.run(place, Place()).id
    store = SQLStore(sqlite_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = httpx.get(f"{base}/runs/{run_id}", params={"from": 1}, timeout=30).text
    finally:
        store.close()
    context = page[page.index('id="context"') :]
    changes = page[page.index('class="d-changed"') :]
    for shown in (context, changes):
        assert "Zürich 東京" in shown and "&lt;b&gt;R&amp;D&lt;/b&gt;" in shown
        assert "\\u" not in shown[:2000]
