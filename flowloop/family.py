"""A run's family as people are told it, by `flowloop status` and the dashboard alike:
whether a map's child is held back by its parent's ``max_parallel``, and a parent's
children counted per status, the held ones apart (``held``, not ``scheduled``).

Any store that reads families answers (SQLStore, and LiteStore that `flowloop status`
reads a SQLite file with); another one has no families to tell.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from flowloop.lifecycle import HELD

HELD_BACK: Final = "held back by its parent's max_parallel: starts when a sibling ends"
"""What a held child is told to be (its status stays ``scheduled``)."""


def held_back(store: Any, run_id: str, *, live: bool = True) -> bool:
    """Whether ``run_id`` is a map's child whose turn has not come yet (its parent's
    ``max_parallel``); ``live``: the run is live (a finished one waits for no turn)."""
    return live and hasattr(store, "is_held") and bool(store.is_held(run_id))


HELD_IDS_PER_QUERY: Final = 500
"""Ids asked about in one read: a listing's page may hold tens of thousands, and a driver
takes at most 65,535 parameters a statement (psycopg; SQLite's limit may be 999)."""


def held_among(store: Any, run_ids: Sequence[str]) -> set[str]:
    """Which of the listed ``run_ids`` are held back (one read per 500 of them; none on a
    store that reads no families): what a listing shows ``held``."""
    if not run_ids or not hasattr(store, "held_among"):
        return set()
    held: set[str] = set()
    for start in range(0, len(run_ids), HELD_IDS_PER_QUERY):
        held.update(store.held_among(run_ids[start : start + HELD_IDS_PER_QUERY]))
    return held


def child_counts(store: Any, parent_id: str) -> dict[str, int]:
    """How many of the parent's children are in each status, those held back as
    ``held`` (none on a store that reads no families)."""
    if not hasattr(store, "child_counts"):
        return {}
    return {str(status): int(n) for status, n in store.child_counts(parent_id).items()}


def child_status(status: str, join_state: str | None) -> str:
    """A child's status as :func:`child_counts` counts it: ``held`` for a scheduled child
    held back, else its own."""
    return HELD if join_state == HELD and status == "scheduled" else status
