"""The dashboard's JSON API over HTTP, against a real uvicorn server on 127.0.0.1, on SQLite
and PostgreSQL: runs paged by keyset, filters, counts, a run's journal, its context at a
seq and diffs, workflows with heat, loops, workers, and every kind of bad input as a 4xx."""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import sqlalchemy as sa
from conftest import pg_base_url, require_pg, with_search_path
from uikit import parcel, parcels, serve

from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    """One server per database for the whole module (the tests only read)."""
    with module_url(request.param, tmp_path_factory) as url:
        parcels(url, 7, failing=2)
        store = SQLStore(url, create=False)
        try:
            with serve(create_app(store, workflows={"parcel": parcel})) as base:
                yield base, url
        finally:
            store.close()


@contextmanager
def module_url(backend: str, factory: pytest.TempPathFactory) -> Iterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{factory.mktemp('api') / 'flowloop.db'}"
        return
    require_pg()
    schema = f"t_{uuid.uuid4().hex[:16]}"
    admin = sa.create_engine(pg_base_url())
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        yield with_search_path(pg_base_url(), schema)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def get(base: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(base + path, params=params, timeout=30)


def test_runs__newest_first_keyset_pages_cover_every_run_once(served: tuple[str, str]) -> None:
    base, _ = served
    first = get(base, "/api/runs", limit=3).json()
    assert first["counts"]["succeeded"] == 5 and first["counts"]["failed"] == 2
    seen = [run["id"] for run in first["runs"]]
    cursor = first["next"]
    while cursor:
        page = get(base, "/api/runs", limit=3, after=cursor).json()
        seen += [run["id"] for run in page["runs"]]
        cursor = page["next"]
    everything = get(base, "/api/runs", limit=100).json()["runs"]
    assert seen == [run["id"] for run in everything]
    assert len(set(seen)) == 7
    created = [(-run["created_at"], run["id"]) for run in everything]
    assert created == sorted(created)


def test_runs__filters_by_status_key_workflow_and_id_prefix(served: tuple[str, str]) -> None:
    base, _ = served
    failed = get(base, "/api/runs", status="failed").json()["runs"]
    assert {run["key"] for run in failed} == {"P0", "P1"}
    by_key = get(base, "/api/runs", key="P4").json()["runs"]
    assert [run["key"] for run in by_key] == ["P4"]
    prefix = by_key[0]["id"][:6]
    assert by_key[0]["id"] in {r["id"] for r in get(base, "/api/runs", id=prefix).json()["runs"]}
    assert get(base, "/api/runs", workflow="nothing").json()["runs"] == []
    assert len(get(base, "/api/runs", workflow="parcel").json()["runs"]) == 7


def test_run__row_journal_context_and_diff(served: tuple[str, str]) -> None:
    base, _ = served
    run = get(base, "/api/runs", key="P5").json()["runs"][0]
    row = get(base, f"/api/runs/{run['id']}").json()
    assert row["status"] == "succeeded" and row["context"]["note"] == "on its way"
    journal = get(base, f"/api/runs/{run['id']}/journal").json()
    assert [e["seq"] for e in journal["events"]] == list(range(1, row["last_seq"] + 1))
    steps = [item for item in journal["timeline"] if item["kind"] == "step"]
    assert [s["state"] for s in steps] == ["weigh", "pack", "send"]
    assert all(s["outcome"] == "succeeded" and s["duration"] >= 0 for s in steps)
    first = get(base, f"/api/runs/{run['id']}/context", seq=1).json()
    assert first["context"]["weight"] == 1 and first["context"]["packed"] is False
    changes = get(base, f"/api/runs/{run['id']}/diff", **{"from": 1}).json()["changes"]
    assert {c["path"]: c["after"] for c in changes} == {
        "$.note": "on its way",
        "$.packed": True,
        "$.weight": 2,
    }
    progress = get(base, f"/api/runs/{run['id']}/progress").json()
    assert progress == {
        "last_seq": row["last_seq"],
        "status": "succeeded",
        "state": "sent",
        "updated_at": row["updated_at"],
    }
    svg = get(base, f"/api/runs/{run['id']}/diagram.svg")
    assert svg.headers["content-type"].startswith("image/svg+xml") and "<svg" in svg.text


def test_failed_run__error_and_traceback_in_the_journal(served: tuple[str, str]) -> None:
    base, _ = served
    run = get(base, "/api/runs", key="P0").json()["runs"][0]
    journal = get(base, f"/api/runs/{run['id']}/journal").json()
    failed = [s for s in journal["timeline"] if s.get("outcome") == "failed"]
    assert failed[0]["state"] == "pack"
    assert failed[0]["error"]["message"] == "the box is torn"
    assert "ValueError" in failed[0]["error"]["traceback"]


def test_workflows__versions_counts_stats_and_heat(served: tuple[str, str]) -> None:
    base, _ = served
    listed = get(base, "/api/workflows").json()["workflows"]
    assert [w["name"] for w in listed] == ["parcel"]
    assert listed[0]["versions"][0]["fingerprint"] == parcel.fingerprint
    one = get(base, "/api/workflows/parcel", since="1h").json()
    assert one["runs"] == 7 and one["success_rate"] == pytest.approx(5 / 7)
    states = {s["state"]: s for s in one["states"]}
    assert states["pack"]["count"] == 7 and states["pack"]["failed"] == 2
    edges = {(e["source"], e["event"], e["dest"]): e["runs"] for e in one["heat"]["edges"]}
    assert edges[("weigh", "next", "pack")] == 7 and edges[("pack", "next", "send")] == 5
    assert one["heat"]["states"]["pack"]["failure_rate"] == pytest.approx(2 / 7)
    assert "<svg" in get(base, "/api/workflows/parcel/heat.svg", since="all").text
    whole = one["whole_runs"]
    assert whole["finished"] == 7 and 0 <= whole["p50"] <= whole["p95"] <= whole["p99"]
    started = sum(sum(b["counts"].values()) for b in whole["buckets"])
    assert started == 7 and whole["peak"] >= 1


def test_loops_workers_and_openapi_answer(served: tuple[str, str]) -> None:
    base, _ = served
    assert get(base, "/api/loops").json() == {"loops": []}
    workers = get(base, "/api/workers").json()
    assert workers["owners"] == [] and workers["due"] == {}
    document = get(base, "/api/openapi.json").json()
    assert (
        document["openapi"].startswith("3.") and "/api/runs/{run_id}/journal" in document["paths"]
    )


@pytest.mark.parametrize(
    ("path", "params", "status", "words"),
    [
        ("/api/runs/nope", {}, 404, "no run nope"),
        ("/api/runs/nope/journal", {}, 404, "no run"),
        ("/api/runs", {"status": "sleepy"}, 400, "not a status"),
        ("/api/runs", {"limit": "ten"}, 400, "not a whole number"),
        ("/api/runs", {"limit": "0"}, 400, "out of range"),
        ("/api/runs", {"after": "not-a-cursor"}, 400, "cursor"),
        ("/api/runs", {"id": "ab%cd"}, 400, "run id"),
        ("/api/workflows/parcel", {"since": "yesterday"}, 400, "not a duration"),
        ("/api/workflows/nothing", {}, 404, "no workflow"),
        ("/api/loops/nothing", {}, 404, "no loop"),
        ("/api/nothing", {}, 404, "no such page"),
        ("/runs", {"limit": "x"}, 400, "not a whole number"),
        ("/runs/nope", {}, 404, "no run nope"),
    ],
)
def test_bad_input__a_4xx_with_a_message_never_a_5xx(
    served: tuple[str, str], path: str, params: dict[str, str], status: int, words: str
) -> None:
    base, _ = served
    response = get(base, path, **params)
    assert response.status_code == status
    text = response.json()["error"] if path.startswith("/api/") else response.text
    assert words in text
    assert "Traceback" not in response.text


@pytest.mark.parametrize(
    ("path", "params", "status"),
    [
        ("/api/runs", {"key": "a\x00b"}, 400),
        ("/api/runs", {"workflow": "\x00"}, 400),
        ("/runs", {"key": "\x00"}, 400),
        ("/api/runs/a\x00bcd", {}, 404),
        ("/api/runs/a\x00bcd/journal", {}, 404),
        ("/runs/0000\x00", {}, 404),
        ("/loops/a\x00", {}, 404),
        ("/api/loops/a\x00", {}, 404),
    ],
)
def test_bad_input__a_nul_character_is_a_4xx_on_both_databases(
    served: tuple[str, str], path: str, params: dict[str, str], status: int
) -> None:
    """PostgreSQL's driver refuses a NUL in text: a NUL in a filter, run id or loop name
    was a 503 "the database could not answer; try again" there (a 4xx on SQLite)."""
    base, _ = served
    response = httpx.get(base + quote(path), params=params, timeout=30)
    assert response.status_code == status, response.text[:300]
    assert "NUL" in response.text or "no " in response.text
    # A cursor naming a run id with a NUL in it, too.
    cursor = base64.urlsafe_b64encode(b'[1.0,"a\\u0000"]').decode()
    assert get(base, "/api/runs", after=cursor).status_code == 400


def test_bad_seq__400_on_the_context_diff_and_run_page(served: tuple[str, str]) -> None:
    base, _ = served
    run_id = get(base, "/api/runs", limit=1).json()["runs"][0]["id"]
    for path, params in (
        (f"/api/runs/{run_id}/context", {"seq": "999"}),
        (f"/api/runs/{run_id}/context", {"seq": "-1"}),
        (f"/api/runs/{run_id}/diff", {"from": "x"}),
        (f"/runs/{run_id}", {"seq": "abc"}),
    ):
        response = get(base, path, **params)
        assert response.status_code == 400, (path, params, response.text[:200])


def test_reader__never_takes_the_sqlite_write_lock(sqlite_url: str) -> None:
    """While a writer holds SQLite's write lock (BEGIN IMMEDIATE, uncommitted), every
    page and API call still answers: the dashboard only reads."""
    import sqlite3

    parcels(sqlite_url, 2)
    path = sqlite_url.removeprefix("sqlite:///")
    store = SQLStore(sqlite_url, create=False)
    writer = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        writer.execute("BEGIN IMMEDIATE")
        writer.execute("UPDATE flowloop_runs SET priority = priority")
        with serve(create_app(store, workflows={"parcel": parcel})) as base:
            run_id = get(base, "/api/runs").json()["runs"][0]["id"]
            for page in ("/runs", f"/runs/{run_id}", "/workflows/parcel", "/loops", "/workers"):
                assert get(base, page).status_code == 200, page
            assert json.loads(get(base, f"/api/runs/{run_id}/journal").text)["events"]
    finally:
        writer.execute("ROLLBACK")
        writer.close()
        store.close()


def test_run_page__a_unique_id_prefix_redirects_to_the_whole_id(served: tuple[str, str]) -> None:
    base, _ = served
    run_id = get(base, "/api/runs", limit=1).json()["runs"][0]["id"]
    prefix = run_id[:16]  # ids share their first digits with runs started the same moment
    moved = httpx.get(f"{base}/runs/{prefix}", follow_redirects=False)
    assert moved.status_code == 307 and moved.headers["location"] == f"/runs/{run_id}"
    assert httpx.get(f"{base}/runs/{prefix}", follow_redirects=True).status_code == 200
    # The query is kept (it dropped ?seq=), and the API takes a prefix too (it was a 404).
    kept = httpx.get(f"{base}/runs/{prefix}?seq=1", follow_redirects=False)
    assert kept.headers["location"] == f"/runs/{run_id}?seq=1"
    api = httpx.get(f"{base}/api/runs/{prefix}/journal?limit=2", follow_redirects=True)
    assert api.status_code == 200 and len(api.json()["events"]) == 2
    row = httpx.get(f"{base}/api/runs/{prefix}", follow_redirects=True, timeout=30).json()
    assert row["id"] == run_id
    assert httpx.get(f"{base}/runs/{'0' * 3}").status_code == 404  # too short to be a prefix
    # A prefix several runs share (made the same moment) says so, as the CLI does: it said
    # "no run" (new-user audit).
    shared = run_id[:4]
    assert len([r for r in get(base, "/api/runs").json()["runs"] if r["id"].startswith(shared)]) > 1
    for path in (f"/runs/{shared}", f"/api/runs/{shared}"):
        ambiguous = httpx.get(f"{base}{path}", follow_redirects=False)
        assert ambiguous.status_code == 400, path
        assert "is ambiguous" in ambiguous.text and shared in ambiguous.text


def test_home__keeps_the_query_on_its_way_to_the_runs(served: tuple[str, str]) -> None:
    """`/?status=failed` redirected to `/runs`, every run listed (new-user audit)."""
    base, _ = served
    moved = httpx.get(f"{base}/?status=failed", follow_redirects=False)
    assert moved.status_code == 307 and moved.headers["location"] == "/runs?status=failed"
    assert httpx.get(f"{base}/", follow_redirects=False).headers["location"] == "/runs"
    page = httpx.get(f"{base}/?status=failed", follow_redirects=True, timeout=30)
    assert page.status_code == 200 and page.url.path == "/runs"
    assert page.url.query == b"status=failed"


def test_an_internal_error__its_page_carries_the_security_headers_too(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: Starlette answers an unexpected error outside every middleware, so the 500
    page went out without the policy, X-Frame-Options and nosniff every other answer has."""
    from flowloop.ui import queries

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    parcels(sqlite_url, 1)
    store = SQLStore(sqlite_url, create=False)
    monkeypatch.setattr(queries, "list_runs", broken)
    try:
        with serve(create_app(store, workflows={"parcel": parcel})) as base:
            response = get(base, "/runs")
    finally:
        store.close()
    assert response.status_code == 500
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["x-content-type-options"] == "nosniff"


def test_cut_head__a_long_traceback_keeps_its_end() -> None:
    """Review: a traceback cut to its first 20,000 characters lost its innermost frames
    and the error itself (a chain's last exception comes last)."""
    from flowloop.ui.pages import cut_head

    traceback = "Traceback:\n" + "  frame\n" * 5_000 + "ValueError: what failed"
    shown = cut_head(traceback, 100)
    assert shown.endswith("ValueError: what failed") and "characters in all" in shown
    assert cut_head("short", 100) == "short"
