"""The dashboard's send (and ``Engine.send``) refusing a payload key the event's model does
not have, as `flowloop send --data` does; its run actions on a run whose id has spaces at
its ends (ids are the engine's to choose) — over HTTP from a real server, on SQLite and
PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field
from uikit import serve
from waitkit import Doc, review

from flowloop import Engine, Workflow
from flowloop.events import UnknownPayloadField
from flowloop.store.sql import SQLStore
from flowloop.ui.actions import csrf_for
from flowloop.ui.app import create_app

TOKEN = "the-test-token"
csrf = csrf_for(TOKEN)
PADDED = "  padded run  "
"""Spaces at both ends: the actions stripped them and found no run."""
INSIDE = "padded run"
"""Another run's id: the same without them (a stripped lookup must not land here)."""


class _ChosenIds(Engine):
    """An engine whose runs get the ids the test chose."""

    chosen: list[str] = []

    def _new_run_id(self, workflow: str, key: str | None, idempotency_key: str | None) -> str:
        return self.chosen.pop(0)


@pytest.fixture
def site(store_url: str) -> Iterator[str]:
    _ChosenIds.chosen = [PADDED, INSIDE]
    with _ChosenIds(store_url, workflows=[review]) as engine:
        for doc in ("D1", "D2"):
            assert engine.run(review, Doc(doc_id=doc)).state == "awaiting"
    store = SQLStore(store_url, create=False)
    try:
        app = create_app(store, workflows={"review": review}, allow_actions=True, token=TOKEN)
        with serve(app) as base:
            yield base
    finally:
        store.close()


def post(base: str, run_id: str, action: str, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    path = f"{base}/api/runs/{quote(run_id, safe='')}/{action}"
    return httpx.post(path, json=body, headers=headers, timeout=30)


def run_of(base: str, run_id: str) -> dict[str, Any]:
    shown: dict[str, Any] = httpx.get(
        f"{base}/api/runs/{quote(run_id, safe='')}", timeout=30
    ).json()
    return shown


def test_actions__a_run_id_with_spaces_at_its_ends_is_acted_on(site: str) -> None:
    """Reported as: the run page's pause, stop and send could not target such a run. Not
    so (the engine looks the id up whole before it strips a pasted one): kept as a guard,
    from the page's own forms and from an API client, the run beside it untouched."""
    base = site
    page = f"/runs/{quote(PADDED, safe='')}"
    with httpx.Client(base_url=base, timeout=30) as client:
        assert client.post("/login", data={"token": TOKEN}).status_code == 303
        assert f'action="/api/runs/{quote(PADDED, safe="")}/pause"' in client.get(page).text
        done = client.post(f"/api/runs/{quote(PADDED, safe='')}/pause", data={"csrf": csrf})
        assert done.status_code == 303 and done.headers["location"].startswith(page + "?done=")
        assert "the run is paused" in client.get(done.headers["location"]).text
    assert post(base, PADDED, "unpause").json()["status"] == "scheduled"
    assert post(base, PADDED, "pause").json()["id"] == PADDED
    assert post(base, PADDED, "unpause").json()["status"] == "scheduled"
    sent = post(base, PADDED, "send", event="approve", data={"by": "ann"})
    assert (sent.status_code, sent.json()["state"]) == (200, "approved")
    other = run_of(base, INSIDE)
    assert (other["status"], other["state"]) == ("scheduled", "awaiting")  # untouched
    assert post(base, INSIDE, "stop").json()["status"] == "stopped"
    assert run_of(base, PADDED)["state"] == "approved"


def test_engine__a_pasted_id_with_spaces_still_resolves(store_url: str) -> None:
    """Spaces around an id typed or pasted are dropped, as before, when no run has the id
    as given."""
    _ChosenIds.chosen = [INSIDE]
    with _ChosenIds(store_url, workflows=[review]) as engine:
        engine.run(review, Doc(doc_id="D3"))
        assert engine.get(f"  {INSIDE}\n").id == INSIDE
        assert engine.pause(" padd ").id == INSIDE  # (a prefix too)


def test_send__a_key_the_payload_model_lacks_is_refused_as_by_the_cli(site: str) -> None:
    """Before: 200, the event applied and `nte` dropped by pydantic without a word; only
    `flowloop send --data` refused it."""
    base = site
    refused = post(base, PADDED, "send", event="approve", data={"by": "ann", "nte": "ok"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == (
        "no field 'nte' in Approval, the payload of 'approve'; did you mean 'note'? "
        "(fields: by, note)"
    )
    assert run_of(base, PADDED)["state"] == "awaiting"  # nothing written


# -- Engine.send: the same rule ---------------------------------------------------------


class Signed(BaseModel):
    signed_by: str = Field(validation_alias="signedBy")


class Loose(BaseModel):
    model_config = ConfigDict(extra="allow")
    by: str


class Ticket(BaseModel):
    n: int = 0
    seen: list[str] = []


def _seen(ctx: Ticket, payload: Any) -> None:
    ctx.seen.append(repr(payload))


desk = Workflow("desk", context=Ticket)
desk.wait(
    "open",
    on={"sign": "open2", "poke": "open2"},
    payloads={"sign": Signed},
    handlers={"sign": _seen, "poke": _seen},
    initial=True,
)
desk.wait(
    "open2",
    on={"sign": "done", "loose": "done", "later": "done"},
    payloads={"sign": Signed, "loose": Loose, "later": Signed},
    handlers={"sign": _seen, "loose": _seen},
)
desk.final("done")


def test_engine_send__an_unknown_key_is_refused_others_as_before(store_url: str) -> None:
    with Engine(store_url, workflows=[desk]) as engine:
        run_id = engine.start(desk, Ticket()).id
        with pytest.raises(UnknownPayloadField) as refused:
            engine.send(run_id, "sign", {"signed_by": "ann"})  # by name: not taken
        assert str(refused.value) == (
            "no field 'signed_by' in Signed, the payload of 'sign'; did you mean 'signedBy'? "
            "(fields: signedBy)"
        )
        assert (refused.value.fields, refused.value.event) == (("signed_by",), "sign")
        assert refused.value.model is Signed
        assert engine.get(run_id).state == "open"
        # Kept for later: refused when no wait state that takes it takes the key.
        with pytest.raises(UnknownPayloadField, match="no field 'signedby' in Signed"):
            engine.send(run_id, "later", {"signedby": "x"}, buffer=True)
        # An event without a model takes any payload; aliases work; extra="allow" keeps it.
        assert engine.send(run_id, "poke", {"anything": 1}).run.state == "open2"
        kept = engine.send(run_id, "loose", {"by": "bo", "extra": 2}, buffer=True)
        assert kept.run.state == "done"
        seen = engine.get(run_id).context.seen
        assert seen == ["{'anything': 1}", "Loose(by='bo', extra=2)"]
        second = engine.start(desk, Ticket()).id
        assert engine.send(second, "sign", {"signedBy": "cy"}).run.state == "open2"
        # A model instance is journaled as before (its keys are the model's own).
        assert engine.send(second, "sign", Signed(signedBy="di")).run.state == "done"
