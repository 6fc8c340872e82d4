"""Runs resting in a wait state, in the dashboard as `flowloop status` shows them: listed,
counted and filtered as ``waiting`` (apart from ``scheduled``), with the events a run's
page says it waits for — on SQLite and PostgreSQL, over HTTP from a real server."""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import BaseModel
from uikit import serve
from waitkit import review

from flowloop import Engine, FakeClock, Workflow
from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app


class Ticket(BaseModel):
    n: int = 0


# A step state named as review's wait state: a run queued there is not waiting (the wait
# states are each definition's own).
queued = Workflow("queued", context=Ticket)


@queued.step(initial=True, next="done")
def awaiting(ctx: Ticket) -> None:
    ctx.n += 1


queued.final("done")


def get(base: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(base + path, params=params, timeout=30)


def _runs(url: str) -> dict[str, str]:
    """Two runs waiting for approval, one paused there, one approved, one queued."""
    with Engine(url, clock=FakeClock(auto_advance=False)) as engine:
        engine.register(review, queued)
        made = {name: engine.run(review, {"doc_id": name}).id for name in ("w1", "w2", "p", "a")}
        engine.pause(made["p"])
        engine.send(made["a"], "approve", {"by": "ann"})
        made["q"] = engine.start(queued, Ticket()).id
    return made


def test_waiting_runs_are_listed_counted_and_filtered_as_waiting(store_url: str) -> None:
    made = _runs(store_url)
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store)) as base:  # no -w: the stored definitions say it
            page = get(base, "/api/runs").json()
            counts = {status: n for status, n in page["counts"].items() if n}
            assert counts == {"waiting": 2, "scheduled": 1, "paused": 1, "succeeded": 1}
            shown = {run["id"]: (run["status"], run["display_status"]) for run in page["runs"]}
            assert shown[made["w1"]] == ("scheduled", "waiting")
            assert shown[made["q"]] == ("scheduled", "scheduled")
            assert shown[made["p"]] == ("paused", "paused")

            waiting = get(base, "/api/runs", status="waiting").json()["runs"]
            assert {run["id"] for run in waiting} == {made["w1"], made["w2"]}
            scheduled = get(base, "/api/runs", status="scheduled").json()["runs"]
            assert [run["id"] for run in scheduled] == [made["q"]]
            by_workflow = get(base, "/api/runs", workflow="queued").json()["counts"]
            assert (by_workflow["waiting"], by_workflow["scheduled"]) == (0, 1)

            row = get(base, f"/api/runs/{made['w1']}").json()
            assert (row["display_status"], row["waits_for"]) == ("waiting", ["approve", "reject"])
            assert get(base, f"/api/runs/{made['q']}").json()["waits_for"] is None

            cards = {w["name"]: w for w in get(base, "/api/workflows").json()["workflows"]}
            assert cards["review"]["counts"] == {"waiting": 2, "paused": 1, "succeeded": 1}

            listing = get(base, "/runs", status="waiting").text
            assert listing.count('class="badge s-waiting"') == 2
            assert made["q"][:16] not in listing
            run_page = get(base, f"/runs/{made['w1']}").text
            assert 'id="run-waits"' in run_page and "approve or reject" in run_page
            assert 'id="run-waits"' not in get(base, f"/runs/{made['q']}").text
            enum = get(base, "/api/openapi.json").json()["paths"]["/api/runs"]["get"]
            statuses = next(p for p in enum["parameters"] if p["name"] == "status")
            assert "waiting" in statuses["schema"]["enum"]
    finally:
        store.close()
