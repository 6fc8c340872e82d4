"""Actions from the dashboard (only with --allow-actions): refused without the token,
refused from a form without the CSRF field, carried out by the engine with the same
one-line errors as the CLI, and journaled with who did them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import HTMLResponse
from starlette.routing import Route
from uikit import Parcel, chromium, new_page, parcel, serve

from flowloop import Engine
from flowloop.store.sql import SQLStore
from flowloop.ui.actions import csrf_for
from flowloop.ui.app import create_app

TOKEN = "the-test-token"


@pytest.fixture
def site(store_url: str) -> Iterator[tuple[str, str, str]]:
    with Engine(store_url, workflows=[parcel]) as engine:
        run_id = engine.start(parcel, Parcel(parcel_id="A")).id  # queued: nobody owns it
    store = SQLStore(store_url, create=False)
    try:
        app = create_app(store, workflows={"parcel": parcel}, allow_actions=True, token=TOKEN)
        with serve(app) as base:
            yield base, run_id, store_url
    finally:
        store.close()


def post(base: str, path: str, token: str | None = TOKEN, **body: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.post(base + path, json=body, headers=headers, timeout=30)


def journal(base: str, run_id: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = httpx.get(f"{base}/api/runs/{run_id}/journal").json()["events"]
    return events


def test_actions__refused_without_the_right_token(site: tuple[str, str, str]) -> None:
    base, run_id, _ = site
    assert post(base, f"/api/runs/{run_id}/pause", token=None).status_code == 403
    assert post(base, f"/api/runs/{run_id}/pause", token="guess").status_code == 403
    assert [e["kind"] for e in journal(base, run_id)] == ["run_created"]


def test_actions__pause_unpause_stop_journaled_with_who(site: tuple[str, str, str]) -> None:
    base, run_id, _ = site
    paused = post(base, f"/api/runs/{run_id}/pause")
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    assert post(base, f"/api/runs/{run_id}/unpause").json()["status"] == "scheduled"
    assert post(base, f"/api/runs/{run_id}/stop").json()["status"] == "stopped"
    events = journal(base, run_id)
    assert [e["kind"] for e in events[1:]] == ["run_paused", "run_unpaused", "run_stopped"]
    assert all(e["worker"].startswith("operator:") for e in events[1:])
    retried = post(base, f"/api/runs/{run_id}/retry", **{"from": "weigh"})
    assert retried.status_code == 200 and retried.json()["status"] == "scheduled"
    last = journal(base, run_id)[-1]
    assert last["kind"] == "run_retried" and last["data"]["by"].startswith("ui:")
    assert last["data"]["by"].endswith("@127.0.0.1")


def test_actions__without_the_token_refused_before_the_body_is_read(
    site: tuple[str, str, str],
) -> None:
    """A client without the token got its body's faults (400 "the body is not JSON"),
    read whole first: now a 403, whatever it sends."""
    base, run_id, _ = site
    for body, kind in ((b"{", "application/json"), (b"x" * 100_000, "text/plain")):
        refused = httpx.post(
            f"{base}/api/runs/{run_id}/pause", content=body, headers={"content-type": kind}
        )
        assert refused.status_code == 403, refused.text[:200]
        assert "need the token" in refused.json()["error"]


def test_actions__same_one_line_error_as_the_cli(site: tuple[str, str, str]) -> None:
    base, run_id, url = site
    assert post(base, f"/api/runs/{run_id}/stop").status_code == 200
    refused = post(base, f"/api/runs/{run_id}/pause")
    cli = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", "pause", run_id, "--db", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 2
    assert refused.status_code == 400
    assert cli.stderr.strip() == f"error: {refused.json()['error']}"
    unknown = post(base, "/api/runs/nope/pause")
    assert unknown.status_code == 404 and "nope" in unknown.json()["error"]
    assert post(base, f"/api/runs/{run_id}/explode").status_code == 404
    assert post(base, f"/api/runs/{run_id}/send").status_code == 400  # no event named


def test_actions__an_api_client_gets_json_whatever_content_type_its_body_says(
    site: tuple[str, str, str],
) -> None:
    """`curl -X POST -H 'Authorization: Bearer T' -d '{"event": …}'` says its body is a
    form: it was read as one, and the error came back as a redirect to an HTML page. A
    Bearer request is an API client's: JSON answers, a JSON object read as JSON."""
    base, run_id, _ = site
    as_form = {"Authorization": f"Bearer {TOKEN}"}
    as_form["Content-Type"] = "application/x-www-form-urlencoded"

    def raw(path: str, body: str) -> httpx.Response:
        return httpx.post(base + path, content=body, headers=as_form, timeout=30)

    paused = raw(f"/api/runs/{run_id}/pause", "")
    assert (paused.status_code, paused.json()["status"]) == (200, "paused")
    refused = raw(f"/api/runs/{run_id}/send", '{"data": {}}')
    assert refused.status_code == 400 and refused.json()["error"] == "event is required"
    assert raw(f"/api/runs/{run_id}/stop", "").status_code == 200
    again = raw(f"/api/runs/{run_id}/retry", '{"from": "weigh"}')
    assert again.status_code == 200 and journal(base, run_id)[-1]["state"] == "weigh"
    basic = httpx.post(
        f"{base}/api/runs/{run_id}/pause", headers={"Authorization": f"Basic {TOKEN}"}
    )
    assert basic.status_code == 403 and "Bearer" in basic.json()["error"]
    document = httpx.get(f"{base}/api/openapi.json").json()
    post_run = document["paths"]["/api/runs/{run_id}/{action}"]["post"]
    action = next(p for p in post_run["parameters"] if p["name"] == "action")
    assert action["schema"]["enum"] == ["pause", "unpause", "stop", "retry", "send"]
    fields = post_run["requestBody"]["content"]["application/json"]["schema"]["properties"]
    assert set(fields) == {"event", "data", "dedupe_key", "from"}


def test_actions__a_form_needs_the_session_and_the_csrf_field(site: tuple[str, str, str]) -> None:
    base, run_id, _ = site
    with httpx.Client(base_url=base, timeout=30) as browser:
        assert browser.post("/login", data={"token": "guess"}).status_code == 403
        signed = browser.post("/login", data={"token": TOKEN})
        assert signed.status_code == 303 and "flowloop_session" in browser.cookies
        # What another site's page could send: the cookie rides along, the CSRF field not.
        forged = browser.post(f"/api/runs/{run_id}/pause", data={"csrf": "x"})
        assert forged.status_code == 403
        done = browser.post(f"/api/runs/{run_id}/pause", data={"csrf": csrf_for(TOKEN)})
        assert done.status_code == 303 and "paused" in done.headers["location"]
        page = browser.get(done.headers["location"]).text
        assert "the run is paused" in page and 'data-action="unpause"' in page
        again = browser.post(f"/api/runs/{run_id}/retry", data={"csrf": csrf_for(TOKEN)})
        assert again.status_code == 303 and "error=" in again.headers["location"]
        assert "cannot retry" in browser.get(again.headers["location"]).text
    assert [e["kind"] for e in journal(base, run_id)] == ["run_created", "run_paused"]


def test_read_only__no_action_endpoint_at_all(sqlite_url: str) -> None:
    with Engine(sqlite_url, workflows=[parcel]) as engine:
        run_id = engine.start(parcel, Parcel(parcel_id="B")).id
    store = SQLStore(sqlite_url, create=False)
    try:
        with serve(create_app(store, workflows={"parcel": parcel})) as base:
            refused = post(base, f"/api/runs/{run_id}/pause")
            assert refused.status_code in (404, 405)
            assert httpx.get(f"{base}/runs/{run_id}").text.count("data-action") == 0
            assert [e["kind"] for e in journal(base, run_id)] == ["run_created"]
    finally:
        store.close()


def test_retry_menu__lists_every_state_a_retry_may_start_from(store_url: str) -> None:
    """The run page's "retry from" menu listed step states only, while a retry may start a
    run in a wait state (or a call or map state) too."""
    from waitkit import review

    with Engine(store_url, workflows=[review]) as engine:
        run_id = engine.run(review, {"doc_id": "D1"}).id
    store = SQLStore(store_url, create=False)
    try:
        app = create_app(store, workflows={"review": review}, allow_actions=True, token=TOKEN)
        with serve(app) as base, httpx.Client(base_url=base, timeout=30) as client:
            client.post("/login", data={"token": TOKEN})
            page = client.get(f"/runs/{run_id}").text
    finally:
        store.close()
    menu = page[page.index('<select name="from">') : page.index("</select>")]
    assert '<option value="prepare">' in menu and '<option value="awaiting">' in menu
    assert '<option value="approved">' not in menu  # a final state: nothing to start from


@pytest.fixture
def unloaded(store_url: str) -> Iterator[tuple[str, str, str]]:
    """A dashboard with actions on and no workflow loaded (`flowloop ui --allow-actions`
    without -w): a run waiting for an event, and a stopped one to retry."""
    from waitkit import review

    with Engine(store_url, workflows=[review]) as engine:
        waiting = engine.run(review, {"doc_id": "W1"}).id
        stopped = engine.start(review, {"doc_id": "W2"}).id
        engine.stop(stopped)
    store = SQLStore(store_url, create=False)
    try:
        with serve(create_app(store, allow_actions=True, token=TOKEN)) as base:
            yield base, waiting, stopped
    finally:
        store.close()


NOT_LOADED_HINT = (
    "unknown workflow 'review' (known: none): start flowloop ui with -w FILE_OR_DIR to send "
    "events to or retry runs of it"
)


def test_actions__send_and_retry_without_the_definition_say_to_start_with_w(
    unloaded: tuple[str, str, str],
) -> None:
    """Without -w a send was refused with `unknown workflow 'review' (known: none)` and no
    word of what to do (the CLI says "pass -w FILE_OR_DIR"); the page offered the forms."""
    base, waiting, stopped = unloaded
    sent = post(base, f"/api/runs/{waiting}/send", event="approve", data={"by": "x"})
    assert (sent.status_code, sent.json()["error"]) == (400, NOT_LOADED_HINT)
    retried = post(base, f"/api/runs/{stopped}/retry")
    assert (retried.status_code, retried.json()["error"]) == (400, NOT_LOADED_HINT)
    assert [e["kind"] for e in journal(base, stopped)][-1] == "run_stopped"
    assert post(base, f"/api/runs/{waiting}/pause").json()["status"] == "paused"  # needs none
    with httpx.Client(base_url=base, timeout=30) as browser:
        browser.post("/login", data={"token": TOKEN})
        page = browser.get(f"/runs/{waiting}").text
        assert '<p class="muted" id="not-loaded">' in page
        assert "start flowloop ui with -w FILE_OR_DIR" in page
        assert 'data-action="send" disabled>' in page and 'data-action="retry" disabled>' in page
        assert 'data-action="pause">' in page
        form = browser.post(
            f"/api/runs/{stopped}/retry", data={"csrf": csrf_for(TOKEN), "from": ""}
        )
        assert form.status_code == 303
        assert "start flowloop ui with -w" in browser.get(form.headers["location"]).text


def test_actions__a_loaded_workflow_keeps_its_forms_enabled(site: tuple[str, str, str]) -> None:
    base, run_id, _ = site
    with httpx.Client(base_url=base, timeout=30) as browser:
        browser.post("/login", data={"token": TOKEN})
        page = browser.get(f"/runs/{run_id}").text
    assert 'data-action="send">' in page and "not-loaded" not in page


def test_actions__a_field_the_action_does_not_take_is_refused_naming_it(
    site: tuple[str, str, str],
) -> None:
    """`{"event": …, "payload": {…}}` (data misnamed) was sent with no data: the field was
    ignored and the error that followed said the event's data was invalid."""
    base, run_id, _ = site
    sent = post(base, f"/api/runs/{run_id}/send", event="go", payload={"by": "x"})
    assert sent.status_code == 400
    assert sent.json()["error"] == "unknown field 'payload' (accepted: event, data, dedupe_key)"
    paused = post(base, f"/api/runs/{run_id}/pause", reason="x", by="y")
    assert paused.json()["error"] == "unknown fields 'by', 'reason' (pause takes none)"
    retried = post(base, f"/api/runs/{run_id}/retry", **{"from_state": "weigh"})
    assert retried.json()["error"] == "unknown field 'from_state' (accepted: from)"
    loop = post(base, "/api/loops/nightly/stop", force=True)
    assert (loop.status_code, loop.json()["error"]) == (
        400,
        "unknown field 'force' (stop takes none)",
    )
    assert [e["kind"] for e in journal(base, run_id)] == ["run_created"]
    # Refused only once the token checks out: without it, a 403 as before.
    assert post(base, f"/api/runs/{run_id}/send", token=None, payload={}).status_code == 403


def test_actions__a_nul_character_is_a_4xx_on_both_databases(
    site: tuple[str, str, str],
) -> None:
    """PostgreSQL's driver refuses a NUL in text: an action on a run id or loop name with
    one, or a field with one, was a 503 "the database could not answer; try again"."""
    base, run_id, _ = site
    assert post(base, "/api/runs/a%00bcd/pause").status_code == 404
    assert post(base, "/api/loops/a%00/pause").status_code == 404
    sent = post(base, f"/api/runs/{run_id}/send", event="go", dedupe_key="k\x00")
    assert sent.status_code == 400 and "NUL" in sent.json()["error"]
    retried = post(base, f"/api/runs/{run_id}/retry", **{"from": "we\x00igh"})
    assert retried.status_code == 400


def test_actions__the_page_cannot_be_framed_by_another_origin(
    site: tuple[str, str, str],
) -> None:
    """A page on another port of 127.0.0.1 is the same *site*: the SameSite session cookie
    went with its frame of the run page, so the Stop button could be clicked through a
    disguise (clickjacking). The dashboard now refuses to be framed (and says so in every
    answer's headers: the policy, no script but its own, forms posted only to itself)."""
    base, run_id, _ = site
    outer = Starlette(
        routes=[
            Route(
                "/",
                lambda request: HTMLResponse(
                    f'<iframe id="f" src="{base}/runs/{run_id}" width="900" height="600"></iframe>'
                ),
            )
        ]
    )
    headers = httpx.get(f"{base}/runs/{run_id}", timeout=30).headers
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert "script-src 'self'" in headers["content-security-policy"]
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"
    with serve(outer) as other, chromium() as browser:
        page = new_page(browser)
        page.goto(f"{base}/login")
        page.fill("input[name=token]", TOKEN)
        page.click("button[type=submit]")
        page.goto(f"{base}/runs/{run_id}")  # signed in: the actions are there, at home
        assert page.locator("#actions button[data-action=stop]").count() == 1
        page.goto(other, wait_until="load")  # (load waits for the frame's own load)
        framed = page.frame_locator("#f")
        # Nothing of the dashboard shown in it (the browser's "blocked" page instead).
        for part in ("header.top", "#live", "#actions"):
            assert framed.locator(part).count() == 0, part
    assert [e["kind"] for e in journal(base, run_id)] == ["run_created"]


def test_actions__a_page_shows_only_the_message_its_action_sent(
    site: tuple[str, str, str],
) -> None:
    """``?error=`` in any link showed its text in the dashboard's own alert box ("the token
    expired: paste it at …", phishing for the token); only an action's redirect, which signs
    its message, is shown now."""
    base, run_id, _ = site
    lure = "The token expired: paste it at http://evil.example/login"
    with chromium() as browser:
        page = new_page(browser)
        page.goto(f"{base}/login")
        page.fill("input[name=token]", TOKEN)
        page.click("button[type=submit]")
        for query in (f"error={lure}", f"done={lure}", f"error={lure}&sig=00"):
            page.goto(f"{base}/runs/{run_id}?{query}")
            page.wait_for_selector("#live-body")
            assert page.locator(".flash.error, .flash.done").count() == 0, query
            assert lure not in page.content()
        page.click("button[data-action=pause]")  # the action's own message still shows
        assert "the run is paused" in page.locator(".flash.done").inner_text()
        page.click("button[data-action=retry]")
        assert "is paused" in page.locator(".flash.error[role=alert]").inner_text()
