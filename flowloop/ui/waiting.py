"""Runs resting in a wait state, shown as ``waiting`` as `flowloop status` shows them, and a
map's children held back by its ``max_parallel``, shown ``held`` (their ``join_state``).

The store keeps such a run ``scheduled`` (due at its timeout, or never); whether its state
is a wait is its definition's to say. Each definition is stored before any run of it starts
(``Engine.register``), so the stored structures name every run's wait states, and the
filters below are plain conditions on ``(status, fingerprint, state)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from sqlalchemy import Connection, and_, false, func, not_, or_, select, text

from flowloop.journal import ASLEEP
from flowloop.lifecycle import HELD, STATUSES
from flowloop.store.entries import definition_structure, stored_waits
from flowloop.store.schema import HELD_WHERE, definitions, runs

WAITING: Final = "waiting"
SHOWN_STATUSES: Final[tuple[str, ...]] = tuple(
    shown
    for status in STATUSES
    for shown in ((status, WAITING, HELD) if status == "scheduled" else (status,))
)
"""The statuses the dashboard shows and filters by: the stored ones, ``waiting`` and
``held`` (a map's child held back by its parent's ``max_parallel``: its ``join_state``)."""

WaitStates = Mapping[str, Mapping[str, tuple[str, ...]]]
"""The wait states of each stored definition, by its fingerprint, with the events each
takes (its timeout's aside)."""


def wait_states(
    conn: Connection, fingerprint: str | None = None
) -> dict[str, dict[str, tuple[str, ...]]]:
    """Every stored definition's wait states, or ``fingerprint``'s (definitions without one
    left out)."""
    query = select(definitions.c.fingerprint, definitions.c.structure)
    if fingerprint is not None:
        query = query.where(definitions.c.fingerprint == fingerprint)
    found: dict[str, dict[str, tuple[str, ...]]] = {}
    for stored, structure in conn.execute(query):
        waits = stored_waits(definition_structure(structure, stored))
        if waits:
            found[stored] = waits
    return found


def is_waiting(waits: WaitStates) -> Any:
    """The condition that a run rests in a wait state (false when no definition has one)."""
    pairs = [
        and_(runs.c.fingerprint == fingerprint, runs.c.state.in_(sorted(states)))
        for fingerprint, states in sorted(waits.items())
    ]
    if not pairs:
        return false()
    # (A run asleep before its wait state, step.sleep, is not there yet: shown scheduled.)
    awake = or_(runs.c.reason.is_(None), runs.c.reason != ASLEEP)
    return and_(runs.c.status == "scheduled", or_(*pairs), awake)


def is_held() -> Any:
    """The condition that a run is a map's child held back for its turn (as
    flowloop.family.child_status tells it)."""
    return and_(runs.c.status == "scheduled", text(HELD_WHERE))


def held_counts(*where: Any) -> Any:
    """How many of the runs ``where`` selects are held back, per workflow and status (the
    scheduled ones are shown ``held``): read from ``ix_flowloop_runs_held`` alone, its own
    condition spelled alike and no status term (see flowloop/store/schema.py)."""
    by = (runs.c.workflow, runs.c.status)
    return select(*by, func.count()).where(*where, text(HELD_WHERE)).group_by(*by)


def not_held() -> Any:
    """The runs :func:`is_held` leaves out."""
    return or_(runs.c.status != "scheduled", runs.c.join_state.is_(None), runs.c.join_state != HELD)


def status_condition(status: str, waits: WaitStates) -> Any:
    """Runs shown with ``status``: ``scheduled`` no longer holds the waiting and held ones
    (a held child is shown held even when its first state is a wait: its turn comes first)."""
    if status == HELD:
        return is_held()
    if status == WAITING:
        return and_(is_waiting(waits), not_held())
    if status == "scheduled":
        return and_(runs.c.status == "scheduled", not_(is_waiting(waits)), not_held())
    return runs.c.status == status


def shown_status(row: Mapping[str, Any], waits: WaitStates) -> str:
    """A run row's status as shown: ``held`` for a map's child held back (when the row has
    its ``join_state``), ``waiting`` for a scheduled run in a wait state (not asleep
    before it)."""
    status = str(row["status"])
    if status == "scheduled" and row.get("join_state") == HELD:
        return HELD
    if (
        status == "scheduled"
        and row["state"] in waits.get(str(row["fingerprint"]), {})
        and row.get("reason") != ASLEEP
    ):
        return WAITING
    return status


def waits_for(row: Mapping[str, Any], waits: WaitStates) -> tuple[str, ...] | None:
    """The events a waiting run's state takes (None unless it is shown waiting)."""
    if shown_status(row, waits) != WAITING:
        return None
    return waits[str(row["fingerprint"])][str(row["state"])]


def split_counts(counts: Mapping[str, int], waiting: int, held: int = 0) -> dict[str, int]:
    """Runs per stored status made runs per shown status (``waiting`` and ``held`` out of
    ``scheduled``)."""
    shown: dict[str, int] = {status: counts.get(status, 0) for status in STATUSES}
    # (Two reads: never below 0.)
    shown["scheduled"] = max(0, shown["scheduled"] - waiting - held)
    shown[WAITING] = waiting
    shown[HELD] = held
    return {status: shown[status] for status in SHOWN_STATUSES}
