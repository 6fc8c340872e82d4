"""The OpenAPI document fuzzed with schemathesis against the real server: whatever the
parameters, no request gets a 5xx (bounded: a few examples per operation, seconds)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings
from uikit import hostile_run, parcel, parcels, serve

from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app
from flowloop.ui.openapi import document

schemathesis = pytest.importorskip("schemathesis")
schema = schemathesis.openapi.from_dict(document(actions=True))
CALLS: list[int] = []
MAX_EXAMPLES = int(__import__("os").environ.get("UI_FUZZ_EXAMPLES", "6"))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = f"sqlite:///{tmp_path_factory.mktemp('fuzz') / 'flowloop.db'}"
    parcels(url, 3, failing=1)
    hostile_run(url)
    store = SQLStore(url, create=False)
    try:
        # Actions on, so their endpoints are fuzzed too (without the token: refused).
        app = create_app(store, workflows={"parcel": parcel}, allow_actions=True)
        with serve(app) as base:
            yield base
    finally:
        store.close()


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_api__no_request_gets_a_server_error(case: object, site: str) -> None:
    response = case.call(base_url=site, timeout=30)  # type: ignore[attr-defined]
    CALLS.append(response.status_code)
    assert response.status_code < 500, (
        f"{case.method} {response.request.url} -> {response.status_code}: "  # type: ignore[attr-defined]
        f"{response.text[:300]}"
    )
    if case.method == "POST":  # type: ignore[attr-defined]
        assert response.status_code in (400, 403, 404, 405), response.text[:300]


def test_api__the_fuzzer_really_sent_requests() -> None:
    """Runs after the fuzz test (file order): it must have sent many, of several kinds."""
    if not CALLS:
        pytest.skip("checks what test_api__no_request_gets_a_server_error sent; run the file")
    print(f"fuzz: {len(CALLS)} requests, statuses {sorted(set(CALLS))}")
    assert len(CALLS) >= 15, CALLS
    assert {200, 400, 404} <= set(CALLS), sorted(set(CALLS))
