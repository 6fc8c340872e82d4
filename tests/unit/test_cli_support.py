"""The pure parts of the CLI's helpers: JSON times, how two contexts differ, the SQLite modes."""

from __future__ import annotations

from flowloop.cli.support import differing_fields, iso8601, with_times

T = 1_764_580_568.974123  # 2025-12-01 09:16:08.974123 UTC


def test_with_times__iso_8601_utc_and_the_epoch_beside_it() -> None:
    out = with_times({"at": T, "due": None, "n": 1}, "at", "due", "missing")
    assert out == {
        "at": "2025-12-01T09:16:08.974123+00:00",
        "at_epoch": T,
        "due": None,
        "due_epoch": None,
        "n": 1,
    }
    assert iso8601(None) is None


def test_differing_fields__names_top_level_fields_that_differ() -> None:
    assert differing_fields({"a": 1, "b": [1]}, {"a": 1, "b": [1]}) == []
    assert differing_fields({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 0}) == ["b", "c"]
    assert differing_fields([1], [2]) == ["(the whole context)"]


def test_synchronous_modes__the_cli_option_offers_what_the_store_accepts() -> None:
    # Spelled twice so the option needs no SQLAlchemy at `flowloop --help`.
    from flowloop.cli.common import SYNCHRONOUS_MODES
    from flowloop.store.dialect import SYNCHRONOUS_MODES as STORE_MODES

    assert SYNCHRONOUS_MODES == STORE_MODES
