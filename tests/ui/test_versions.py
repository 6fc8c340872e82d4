"""The workflow page draws each stored version: the code given with -w for its own
fingerprint, the structure kept in the database for an older one."""

from __future__ import annotations

import json

import httpx
from uikit import parcel, parcels, serve

from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app

OLD_FINGERPRINT = "0" * 16


def test_versions__each_stored_definition_is_drawn(sqlite_url: str) -> None:
    parcels(sqlite_url, 1)
    old = {
        "name": "parcel",
        "initial": "weigh",
        "finals": ["sent"],
        "states": {
            "weigh": {"kind": "step", "on": {"next": "legacy_check"}},
            "legacy_check": {"kind": "step", "on": {"next": "sent"}},
        },
    }
    store = SQLStore(sqlite_url)
    store.save_definition(OLD_FINGERPRINT, "parcel", 0, json.dumps(old))
    try:
        with serve(create_app(store, workflows={"parcel": parcel})) as base:
            versions = httpx.get(f"{base}/api/workflows/parcel", params={"since": "all"}).json()
            assert [v["version"] for v in versions["versions"]] == [1, 0]
            newest = httpx.get(f"{base}/workflows/parcel").text
            assert "legacy_check" not in newest and "3 attempts" in newest  # the -w code
            older = httpx.get(
                f"{base}/workflows/parcel", params={"fingerprint": OLD_FINGERPRINT}
            ).text
            assert "legacy_check" in older and "Definition v0" in older
            missing = httpx.get(f"{base}/workflows/parcel", params={"fingerprint": "f" * 16})
            assert missing.status_code == 404 and "no stored version" in missing.text
    finally:
        store.close()
