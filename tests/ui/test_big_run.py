"""A run page stays bounded whatever the run holds: 10,000 journal entries (it was a
2.5 MB page, fetched again at each commit while the run moved) or a 1 MB context (shown
whole, twice in a diff): the newest timeline rows, the context and changed values cut, each
cut said with a link to the JSON API, which gives them whole (its journal paged)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from uikit import chromium, new_page, serve, written_run

from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app

STEPS = 5_000  # 10,002 journal entries: run_created, then a step per 2
PAGE_BYTES = 400_000
TIMELINE_SHOWN = 500  # flowloop.ui.pages: the rows and characters a run page shows
CONTEXT_SHOWN = 100_000


@pytest.fixture
def site(store_url: str) -> Iterator[tuple[str, str, str]]:
    long = written_run(store_url, "long", [json.dumps({"n": i}) for i in range(STEPS)])
    blob = "x" * 1_000_000
    big = written_run(
        store_url,
        "big",
        [json.dumps({"blob": blob + str(i), "n": i}) for i in range(2)],
        first=json.dumps({"blob": blob, "n": -1}),
    )
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            yield base, long, big
    finally:
        store.close()


def test_long_run__its_page_shows_the_newest_rows_and_says_where_the_rest_are(
    site: tuple[str, str, str], tmp_path: Path
) -> None:
    base, long, _ = site
    for path in (f"/runs/{long}", f"/runs/{long}/live"):
        response = httpx.get(base + path, timeout=60)
        assert response.status_code == 200 and len(response.content) < PAGE_BYTES, path
    journal = httpx.get(f"{base}/api/runs/{long}/journal", params={"limit": 10}, timeout=60)
    assert len(journal.json()["events"]) == 10 and len(journal.content) < 20_000
    assert [t["seq"] for t in journal.json()["timeline"]] == [1, 2, 4, 6, 8, 10]
    later = httpx.get(f"{base}/api/runs/{long}/journal", params={"after": 9, "limit": 4})
    timeline = later.json()["timeline"]  # the step started at 10, ended at 11: paired
    assert [(t["seq"], t["end_seq"]) for t in timeline] == [(10, 11), (12, 13)]
    with chromium() as browser:
        page = new_page(browser)
        page.goto(f"{base}/runs/{long}")
        rows = page.locator("#timeline tbody tr")
        assert rows.count() == TIMELINE_SHOWN
        assert rows.last.locator("td").first.inner_text() == str(2 * STEPS + 2)  # the newest
        note = page.locator("#timeline-cut").inner_text()
        assert f"The last {TIMELINE_SHOWN} of {STEPS + 2:,} rows" in note
        page.locator("#timeline-cut a").click()
        page.wait_for_url(f"**/api/runs/{long}/journal")
        page.goto(f"{base}/runs/{long}")
        page.screenshot(path=str(tmp_path / "long.png"))


def test_big_context__cut_on_the_page_whole_through_the_api(
    site: tuple[str, str, str], tmp_path: Path
) -> None:
    base, _, big = site
    response = httpx.get(f"{base}/runs/{big}", params={"from": 1}, timeout=60)
    assert response.status_code == 200 and len(response.content) < PAGE_BYTES
    with chromium() as browser:
        page = new_page(browser)
        page.goto(f"{base}/runs/{big}?from=1")
        shown = page.locator("#context-json").inner_text()
        assert CONTEXT_SHOWN <= len(shown) < CONTEXT_SHOWN + 200
        assert "(cut: 1,000,0" in shown and "characters in all" in shown
        for cell in page.locator("#diff td.mono").all_inner_texts():  # $.blob and $.n
            assert len(cell) < 3_000
        # The long string scrolls in its column: the changes beside it stay on the page
        # (the context's column grew to its width, the changes pushed out of sight).
        for part in ("#context-json", "#diff"):
            box = page.locator(part).bounding_box()
            assert box is not None and box["x"] + box["width"] <= 1280, (part, box)
        page.screenshot(path=str(tmp_path / "big.png"), full_page=False)
        link = page.locator("#context-cut a").get_attribute("href")
    whole = httpx.get(base + str(link), timeout=60).json()["context"]
    assert len(whole["blob"]) == 1_000_001 and whole["n"] == 1


JOURNAL_CONTEXTS = 2_000_000  # flowloop.ui.queries: the context characters a journal page holds


def test_big_context__the_journal_api_answers_bounded_each_context_a_link_away(
    store_url: str,
) -> None:
    # Audit: every entry of a journal page held its whole context: a run with a 1 MB
    # context gave 1 MB an entry, up to 5,000 of them (5 GB) at the API's limit. A page
    # holds a context only where it changed, within JOURNAL_CONTEXTS characters in all;
    # every entry that wrote one links it (`context_url`), whole.
    blob = "x" * 900_000  # two fit in a page's JOURNAL_CONTEXTS, not three
    contexts = [json.dumps({"blob": blob, "n": i}) for i in range(6)]
    contexts[3] = contexts[2]  # a step that changed nothing
    run_id = written_run(store_url, "wide", contexts, first=contexts[0])
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            answer = httpx.get(f"{base}/api/runs/{run_id}/journal", timeout=120)
            assert answer.status_code == 200
            assert len(answer.content) < JOURNAL_CONTEXTS + 50_000  # was 7 MB
            events = answer.json()["events"]
            written = [e for e in events if e["kind"] in ("run_created", "step_succeeded")]
            assert [e["context_status"] for e in written] == [
                "shown",  # seq 1, created: the first context
                "unchanged",  # the first step wrote the same
                "shown",  # n=1
                "cut",  # n=2: over the page's budget
                "unchanged",  # n=2 again: the same as the entry before, cut or not
                "cut",
                "cut",
            ]
            assert all(e["context_status"] is None for e in events if e not in written)
            assert [e["context"] is not None for e in written] == [True, False, True] + [False] * 4
            for entry in written:
                assert entry["context_url"] == f"/api/runs/{run_id}/context?seq={entry['seq']}"
                whole = httpx.get(base + entry["context_url"], timeout=60).json()["context"]
                assert whole == json.loads(store.journal(run_id)[entry["seq"] - 1].context or "")
            # Paged: a page after the cut holds its own changed contexts again.
            later = httpx.get(
                f"{base}/api/runs/{run_id}/journal", params={"after": 8}, timeout=60
            ).json()["events"]
            shown = [(e["seq"], e["context_status"]) for e in later if e["context_status"]]
            assert shown == [(9, "unchanged"), (11, "shown"), (13, "shown")]
            assert httpx.get(f"{base}/runs/{run_id}", timeout=60).status_code == 200
    finally:
        store.close()
