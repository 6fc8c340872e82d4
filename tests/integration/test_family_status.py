"""``flowloop status`` of a map and its children, on a SQLite file (read without
SQLAlchemy) and on PostgreSQL: the children held back by ``max_parallel`` are counted
apart, and a held child says so, with the events kept for it."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner
from heldkit import Fan, held_fan

from flowloop import FakeClock, Workflow
from flowloop.cli import cli
from flowloop.testing import TestEngine


def fan() -> Workflow:
    return held_fan("status")[0]


def status(url: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["status", *args, "--db", url])
    assert result.exit_code == 0, result.output
    return result.output


def test_status_tells_the_children_held_back_and_the_events_kept(store_url: str) -> None:
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[fan()]) as engine:
        parent = engine.start(engine.workflow("status_fan"), Fan(items=[1, 2, 3])).id
        engine.run_until_idle(idle_horizon=0)
        store: Any = engine.store
        first, second, _third = (c.id for c in store.children_of(parent))
        assert engine.send(second, "go").status == "buffered"
    assert "children  3 (2 held, 1 scheduled)" in status(store_url, parent)
    shown = status(store_url, second)
    assert f"parent    {parent}" in shown
    assert "held      back by its parent's max_parallel: starts when a sibling ends" in shown
    assert "kept      1 event(s) sent to it, not taken yet" in shown
    assert "held " not in status(store_url, first) and "kept " not in status(store_url, first)
    held = json.loads(status(store_url, second, "--json"))
    assert (held["held"], held["kept_events"]) == (True, 1)
    free = json.loads(status(store_url, first, "--json"))
    assert (free["held"], free["kept_events"]) == (False, 0)
    # Stopped, it waits for no turn and takes no event: neither line (review).
    with TestEngine(store_url, clock=clock, workflows=[fan()]) as engine:
        assert engine.stop(second).status == "stopped"
    stopped = status(store_url, second)
    assert "held " not in stopped and "kept " not in stopped


def listed(url: str, *args: str) -> dict[str, str]:
    """``status --json`` listing: each run's id and shown status."""
    page = json.loads(status(url, "--workflow", "status_item", "--json", *args))
    return {run["id"]: run["display_status"] for run in page["runs"]}


def test_listings_show_the_children_held_back_as_held(store_url: str) -> None:
    """A held child was listed `scheduled` (`waiting` when it starts in a wait) while
    its own `status RUN`, its parent's counts and the dashboard said held (audit)."""
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[fan()]) as engine:
        parent = engine.start(engine.workflow("status_fan"), Fan(items=[1, 2, 3])).id
        engine.run_until_idle(idle_horizon=0)
        store: Any = engine.store
        first, second, third = (c.id for c in store.children_of(parent))
    assert listed(store_url) == {first: "waiting", second: "held", third: "held"}
    assert listed(store_url, "--status", "held") == {second: "held", third: "held"}
    assert listed(store_url, "--status", "waiting") == {first: "waiting"}
    assert listed(store_url, "--status", "scheduled") == {}
    one_page = listed(store_url, "--status", "held", "--limit", "1")
    assert len(one_page) == 1 and set(one_page) <= {second, third}, one_page
    table = status(store_url, "--workflow", "status_item", "--status", "held")
    assert table.count(" held ") == 2 and "scheduled" not in table, table
    shown = status(store_url, second)
    assert "status    held\n" in shown and "waits " not in shown, shown
    one = json.loads(status(store_url, second, "--json"))
    assert (one["display_status"], one["status"], one["waiting"]) == ("held", "scheduled", None)


def test_a_paused_held_child_shows_paused_in_status_run(store_url: str) -> None:
    # Review: `status RUN` showed a held child paused with its parent as `held` (text and
    # display_status) while the listing and the dashboard said paused; its `held` flag
    # (its join state) stays as it was.
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[fan()]) as engine:
        parent = engine.start(engine.workflow("status_fan"), Fan(items=[1, 2, 3])).id
        engine.run_until_idle(idle_horizon=0)
        store: Any = engine.store
        _, second, _ = (c.id for c in store.children_of(parent))
        engine.pause(parent)
    shown = status(store_url, second)
    assert "status    paused" in shown and "held" not in shown.split("\n")[1], shown
    one = json.loads(status(store_url, second, "--json"))
    assert (one["status"], one["display_status"], one["held"]) == ("paused", "paused", True)
    assert listed(store_url)[second] == "paused"


def test_held_among_a_page_past_a_drivers_parameter_limit(store_url: str) -> None:
    # Review: every scheduled id of a page went into one IN list: past 65,535 ids psycopg
    # refused the statement (`status --limit 70000` exited 1), older SQLite builds past 999.
    from flowloop import family

    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[fan()]) as engine:
        parent = engine.start(engine.workflow("status_fan"), Fan(items=[1, 2, 3])).id
        engine.run_until_idle(idle_horizon=0)
        store: Any = engine.store
        _, second, third = (c.id for c in store.children_of(parent))
        ids = [f"absent{n:06d}" for n in range(70_000)]
        ids[12_345], ids[69_999] = second, third
        assert family.held_among(store, ids) == {second, third}
