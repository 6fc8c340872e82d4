"""A run page says when the run next moves, and a map's child held back says so (the
dashboard audit): an asleep run (``step.sleep`` before a wait), a retrying one and one
waiting with a timeout show that time (UTC, and "in 60 min" counted down in the page);
a child held back by its parent's ``max_parallel`` says so as `flowloop status` does, and
its parent counts such children ``held``, apart from ``scheduled``.

Real Chromium (Debian's, driven by Playwright) on SQLite and PostgreSQL; the engines run on
a fake clock that starts now and never moves, so every run stays where it is."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel
from uikit import chromium, new_page, off_loop, serve

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app

playwright = pytest.importorskip("playwright.sync_api")
HOUR = 3600.0
HELD_BACK = "held back by its parent's max_parallel: starts when a sibling ends"
IN_MINUTES = re.compile(r"\(in \d+ min\)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium() as launched:
        yield launched


def utc(at: float) -> str:
    """A time as the dashboard writes it (UTC)."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")


def clock() -> FakeClock:
    # Starts now (the page says "in 60 min" from the database's clock) and never moves.
    return FakeClock(start=time.time(), auto_advance=False)


class Item(BaseModel):
    n: int = 0


class Fan(BaseModel):
    items: list[int] = []


def napping_fan() -> tuple[Workflow, Workflow]:
    """A map over six items, two at a time, each child asleep for an hour before its wait."""
    item = Workflow("ui_nap_item", context=Item)

    @item.step(initial=True, next="hold")
    def nap(ctx: Item, step: Step) -> object:
        return step.sleep(HOUR)

    item.wait("hold", on={"go": "done"})
    item.final("done")
    fan = Workflow("ui_nap_fan", context=Fan)
    fan.map(
        "each",
        child=item,
        items=lambda ctx: ctx.items,
        context=lambda ctx, n: Item(n=n),
        max_parallel=2,
        on={"done": "done"},
        initial=True,
    )
    fan.final("done")
    return fan, item


def start_family(url: str) -> tuple[str, list[tuple[str, float]], list[str]]:
    """The parent, its two children asleep (with when they wake) and its four held back."""
    fan, item = napping_fan()
    with Engine(url, clock=clock(), workflows=[fan, item]) as engine:
        parent = engine.start(fan, Fan(items=list(range(6)))).id
        engine.run_until_idle(idle_horizon=0)
        children = [engine.get(c.id) for c in engine.store.children_of(parent)]  # type: ignore[attr-defined]
        held = [c.id for c in children if engine.is_held(c.id)]
        asleep = [(c.id, c.next_run_at) for c in children if c.reason == "asleep"]
    assert len(held) == 4 and len(asleep) == 2
    return parent, [(run_id, float(at)) for run_id, at in asleep], held


def test_run_page__an_asleep_run_says_when_it_wakes_and_counts_down(
    browser: Any, store_url: str, tmp_path: Path
) -> None:
    _, asleep, _ = off_loop(start_family, store_url)
    (napping, wakes), _ = asleep
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = new_page(browser)
            page.clock.install()  # Date.now and the page's timers move when told
            page.goto(f"{base}/runs/{napping}")
            assert page.locator("#run-status").inner_text() == "scheduled"
            shown = page.locator("#run-next").inner_text()
            assert utc(wakes) in shown and "wakes from its step.sleep" in shown, shown
            assert IN_MINUTES.search(shown), shown
            reason = page.locator(".run-reason").inner_text()
            assert f"Why scheduled: asleep until {utc(wakes)} UTC" in reason, reason
            assert page.locator("#run-held").count() == 0
            page.screenshot(path=str(tmp_path / "asleep.png"), full_page=True)
            # Left open, the page counts down (not "in 60 min" for the hour).
            page.clock.fast_forward("30:00")
            until = page.locator("#run-next .until")
            playwright.expect(until).to_have_text(re.compile(r"in (29|30) min"))
            page.clock.fast_forward("31:00")
            playwright.expect(until).to_have_text("due now")
            page.close()
            assert httpx.get(f"{base}/api/runs/{napping}", timeout=30).json()["held"] is False
    finally:
        store.close()


def test_run_page__a_held_child_says_so_and_its_parent_counts_it_held(
    browser: Any, store_url: str, tmp_path: Path
) -> None:
    parent, _, held = off_loop(start_family, store_url)
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = new_page(browser)
            page.goto(f"{base}/runs/{held[0]}")
            # Shown as its parent's children list and counts show it (its row's status
            # stays scheduled: the API says both).
            assert page.locator("#run-status").inner_text() == "held"
            told = page.locator("#run-held").inner_text()
            assert told == f"Waits for its turn: {HELD_BACK}", told
            assert page.locator("#run-next").count() == 0  # its turn has no time
            page.screenshot(path=str(tmp_path / "held.png"), full_page=True)

            page.goto(f"{base}/runs/{parent}")
            summary = page.locator("#family p.muted").inner_text()
            assert summary == "6 child run(s): held 4 · scheduled 2", summary
            badges = page.locator("#children tbody .badge").all_inner_texts()
            assert sorted(badges) == ["held"] * 4 + ["scheduled"] * 2
            page.screenshot(path=str(tmp_path / "parent.png"), full_page=True)
            page.close()
            # The API says it too (as `flowloop status --json`).
            shown = httpx.get(f"{base}/api/runs/{held[0]}", timeout=30).json()
            assert (shown["held"], shown["status"], shown["display_status"]) == (
                True,
                "scheduled",
                "held",
            )
    finally:
        store.close()


def test_run_list_and_counts_show_the_held_children_held(
    browser: Any, store_url: str, tmp_path: Path
) -> None:
    """The runs list, its counts and status filter, the workflows page and the run's
    diagram said `scheduled` of a held child while its run page's badge said held (audit)."""
    parent, asleep, held = off_loop(start_family, store_url)
    napping = {run_id for run_id, _ in asleep}
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = new_page(browser)
            page.goto(f"{base}/runs?workflow=ui_nap_item")
            shown = {
                row.get_attribute("data-run"): row.locator(".badge").inner_text()
                for row in page.locator("#runs tbody tr").all()
            }
            assert shown == {**dict.fromkeys(held, "held"), **dict.fromkeys(napping, "scheduled")}
            counts = page.locator("#counts .count[data-status]").all_inner_texts()
            assert [" ".join(c.split()) for c in counts] == ["2 scheduled", "4 held"], counts
            page.screenshot(path=str(tmp_path / "held_list.png"), full_page=True)
            # The held count's link filters by it (the select offers it too).
            page.locator('#counts .count[data-status="held"]').click()
            page.wait_for_url("**status=held**")
            rows = page.locator("#runs tbody tr")
            playwright.expect(rows).to_have_count(4)
            assert sorted(rows.locator(".badge").all_inner_texts()) == ["held"] * 4
            assert page.locator('#filters select[name="status"]').input_value() == "held"
            page.goto(f"{base}/runs?workflow=ui_nap_item&status=scheduled")
            listed = page.locator("#runs tbody tr").evaluate_all(
                "rows => rows.map(r => r.dataset.run)"
            )
            assert set(listed) == napping, listed
            page.goto(f"{base}/workflows")
            card = page.locator('.card.wf[data-workflow="ui_nap_item"] p.small').inner_text()
            assert card == "2 scheduled · 4 held", card
            # The run's diagram says held, and what releases it (it said "now scheduled").
            page.goto(f"{base}/runs/{held[0]}")
            drawn = page.locator("#diagram svg").text_content() or ""
            assert "now held: starts when a sibling ends" in drawn, drawn
            assert "now scheduled" not in drawn
            page.screenshot(path=str(tmp_path / "held_diagram.png"), full_page=True)
            page.close()
            api = httpx.get(f"{base}/api/runs", params={"workflow": "ui_nap_item"}, timeout=30)
            found = api.json()
            assert (found["counts"]["held"], found["counts"]["scheduled"]) == (4, 2)
            assert {r["id"] for r in found["runs"] if r["display_status"] == "held"} == set(held)
            assert all(r["held"] == (r["id"] in held) for r in found["runs"])
            fans = httpx.get(f"{base}/api/runs", params={"status": "held"}, timeout=30).json()
            assert {r["id"] for r in fans["runs"]} == set(held)
            assert parent not in {r["id"] for r in fans["runs"]}
    finally:
        store.close()


def retrying_and_waiting() -> tuple[Workflow, Workflow]:
    flaky = Workflow("ui_flaky", context=Item)

    @flaky.step(initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=HOUR))
    def dial(ctx: Item) -> None:
        raise ConnectionError("the line is busy")

    flaky.final("done")
    approval = Workflow("ui_approval", context=Item)
    approval.wait("approve", on={"yes": "done"}, timeout=HOUR, on_timeout="done", initial=True)
    approval.final("done")
    return flaky, approval


def start_retrying_and_waiting(url: str) -> dict[str, tuple[str, float]]:
    flaky, approval = retrying_and_waiting()
    with Engine(url, clock=clock(), workflows=[flaky, approval]) as engine:
        made = {
            "retrying": engine.start(flaky, Item()).id,
            "waiting": engine.start(approval, Item()).id,
        }
        engine.run_until_idle(idle_horizon=0)
        found = {shown: engine.get(run_id) for shown, run_id in made.items()}
    assert found["retrying"].status == "retrying"
    return {shown: (info.id, float(info.next_run_at or 0)) for shown, info in found.items()}


def test_run_page__a_retrying_run_says_when_its_next_attempt_is(
    browser: Any, store_url: str, tmp_path: Path
) -> None:
    retrying, again = off_loop(start_retrying_and_waiting, store_url)["retrying"]
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = new_page(browser)
            page.goto(f"{base}/runs/{retrying}")
            assert page.locator("#run-status").inner_text() == "retrying"
            shown = page.locator("#run-next").inner_text()
            assert utc(again) in shown and "attempt 2 of dial" in shown, shown
            assert IN_MINUTES.search(shown), shown
            error = page.locator("#errors summary").last.inner_text()
            assert f"(retried: attempt 2 at {utc(again)} UTC)" in error, error
            page.screenshot(path=str(tmp_path / "retrying.png"), full_page=True)
            page.close()
    finally:
        store.close()


def test_run_page__a_waiting_run_says_how_long_until_its_timeout(
    browser: Any, store_url: str
) -> None:
    waiting, timeout = off_loop(start_retrying_and_waiting, store_url)["waiting"]
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = new_page(browser)
            page.goto(f"{base}/runs/{waiting}")
            assert page.locator("#run-status").inner_text() == "waiting"
            waits = page.locator("#run-waits").inner_text()
            assert f"yes until {utc(timeout)} UTC" in waits and IN_MINUTES.search(waits), waits
            assert page.locator("#run-next").count() == 0  # "Waits for" says until when
            page.close()
    finally:
        store.close()


# -- a deadline sooner than what the run waits for -------------------------------------------
# journal.apply makes a run with a deadline due by it at the latest: the page took that time
# for the sleep's end, the retry's attempt or the wait's timeout (flowloop/dues.py).

DEADLINE = 600.0
DEADLINE_WORDS = "its deadline passes: moves to expired"
SHOWN = ("asleep", "retrying", "waiting", "refunding")


def deadlined() -> list[Workflow]:
    """An hour's sleep before a wait, an hour's retry backoff, an hour's wait timeout and
    an hour's sleep before a compensating state, each in a run whose deadline is ten
    minutes away."""
    nap = Workflow("ui_nap_dl", context=Item, deadline=DEADLINE, on_deadline="expired")

    @nap.step(initial=True, next="hold")
    def doze(ctx: Item, step: Step) -> object:
        return step.sleep(HOUR)

    nap.wait("hold", on={"go": "done"})
    nap.final("done", "expired")
    flaky = Workflow("ui_flaky_dl", context=Item, deadline=DEADLINE, on_deadline="expired")

    @flaky.step(initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=HOUR))
    def dial(ctx: Item) -> None:
        raise ConnectionError("the line is busy")

    flaky.final("done", "expired")
    approval = Workflow("ui_approval_dl", context=Item, deadline=DEADLINE, on_deadline="expired")
    approval.wait("approve", on={"yes": "done"}, timeout=HOUR, on_timeout="done", initial=True)
    approval.final("done", "expired")
    refund = Workflow("ui_refund_dl", context=Item, deadline=DEADLINE, on_deadline="expired")

    def undo(ctx: Item, step: Step) -> None:
        ctx.n -= 1

    @refund.step(initial=True, next="refunded", compensate=undo)
    def charge(ctx: Item, step: Step) -> object:
        return step.sleep(HOUR)

    refund.final("refunded", compensate=True)
    refund.final("expired")
    return [nap, flaky, approval, refund]


def start_deadlined(url: str) -> dict[str, tuple[str, float]]:
    """Each run (asleep, retrying, waiting) with its deadline; they start at the clock's
    start, so their own times are an hour from it."""
    workflows = deadlined()
    with Engine(url, clock=clock(), workflows=workflows) as engine:
        made = {
            shown: engine.start(wf, Item()).id for shown, wf in zip(SHOWN, workflows, strict=True)
        }
        engine.run_until_idle(idle_horizon=0)
        found = {shown: engine.get(run_id) for shown, run_id in made.items()}
    assert found["asleep"].reason == "asleep" and found["retrying"].status == "retrying"
    return {shown: (info.id, float(info.next_run_at or 0)) for shown, info in found.items()}


def test_run_page__an_asleep_run_whose_deadline_comes_first_says_so(
    browser: Any, store_url: str, tmp_path: Path
) -> None:
    """It said "Next run … wakes from its step.sleep" and "asleep until <the deadline>":
    the run moves to its on_deadline state then, and wakes an hour later only in words."""
    napping, deadline = off_loop(start_deadlined, store_url)["asleep"]
    wakes = deadline - DEADLINE + HOUR
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = new_page(browser)
            page.clock.install()
            page.goto(f"{base}/runs/{napping}")
            shown = page.locator("#run-next").inner_text()
            assert utc(deadline) in shown and "(in 10 min)" in shown, shown
            assert f"{DEADLINE_WORDS}, before it wakes from its step.sleep" in shown, shown
            reason = page.locator(".run-reason").inner_text()
            assert reason == (
                f"Why scheduled: asleep until {utc(wakes)} UTC, then enters hold; its deadline "
                f"passes first, at {utc(deadline)} UTC: moves to expired"
            ), reason
            page.screenshot(path=str(tmp_path / "asleep_deadline.png"), full_page=True)
            # The countdown is the deadline's: due in ten minutes, not in an hour.
            until = page.locator("#run-next .until")
            page.clock.fast_forward("05:00")
            playwright.expect(until).to_have_text(re.compile(r"in (4|5) min"))
            page.clock.fast_forward("06:00")
            playwright.expect(until).to_have_text("due now")
            page.close()
    finally:
        store.close()


def test_run_page__a_retrying_run_whose_deadline_comes_first_says_so(
    browser: Any, store_url: str, tmp_path: Path
) -> None:
    """It said "Next run … attempt 2 of dial" and "retried: attempt 2 at <the deadline>":
    the deadline moves the run on before that attempt, which is an hour away."""
    runs = off_loop(start_deadlined, store_url)
    retrying, deadline = runs["retrying"]
    waiting, _ = runs["waiting"]
    again = deadline - DEADLINE + HOUR
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = new_page(browser)
            page.goto(f"{base}/runs/{retrying}")
            assert page.locator("#run-status").inner_text() == "retrying"
            shown = page.locator("#run-next").inner_text()
            assert utc(deadline) in shown and "(in 10 min)" in shown, shown
            assert f"{DEADLINE_WORDS}, before attempt 2 of dial" in shown, shown
            error = page.locator("#errors summary").last.inner_text()
            assert (
                f"(retried: attempt 2 at {utc(again)} UTC; its deadline passes first, at "
                f"{utc(deadline)} UTC: moves to expired)"
            ) in error, error
            page.screenshot(path=str(tmp_path / "retrying_deadline.png"), full_page=True)
            # A waiting run's "until" is the deadline's too, not its timeout's.
            page.goto(f"{base}/runs/{waiting}")
            waits = page.locator("#run-waits").inner_text()
            assert f"yes until {utc(deadline)} UTC (in 10 min), when {DEADLINE_WORDS}" in waits, (
                waits
            )
            page.close()
    finally:
        store.close()


def test_run_page__a_sleep_before_a_compensating_state_says_its_deadline_comes_first(
    browser: Any, store_url: str, tmp_path: Path
) -> None:
    """The deadline cuts off a sleep before a compensating state as any sleep (the run
    moves to on_deadline, no compensation run: flowloop.events.slept_past_deadline). The
    page said "Next run <the deadline>" alone (the run goes on at its state then)."""
    refunding, deadline = off_loop(start_deadlined, store_url)["refunding"]
    wakes = deadline - DEADLINE + HOUR
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:
            page = new_page(browser)
            page.goto(f"{base}/runs/{refunding}")
            assert page.locator("#run-status").inner_text() == "scheduled"
            shown = page.locator("#run-next").inner_text()
            assert utc(deadline) in shown and "(in 10 min)" in shown, shown
            said = f"{DEADLINE_WORDS}, before it goes on at refunded at {utc(wakes)} UTC"
            assert said in shown, shown
            page.screenshot(path=str(tmp_path / "refunding_deadline.png"), full_page=True)
            page.close()
    finally:
        store.close()
