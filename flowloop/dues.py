"""When a live run moves on by itself, as `flowloop status`, `flowloop run` and the
dashboard tell it.

A run with a deadline is due by it at the latest (:func:`flowloop.journal.apply` clamps its
``next_run_at``), so that time alone may be the deadline's and not what the run is waiting
for: a ``step.sleep``'s end, a retry's next attempt, a wait's timeout. Those are read from
the run's journal, as if it had no deadline; when the deadline comes first (the run's
``next_run_at`` is its deadline), the run moves to its ``on_deadline`` state then instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from flowloop import journal as j
from flowloop.lifecycle import CLAIMABLE

DEADLINE_PASSES: Final = "its deadline passes"
"""What a run whose deadline comes first is told to wait for (then: "moves to STATE")."""


@dataclass(frozen=True, kw_only=True)
class Due:
    """When a scheduled or retrying run is due next, and what for."""

    at: float
    """Its ``next_run_at``: its own time, or its deadline's when that comes first."""
    own: float | None
    """The time its own entries set (a sleep's end, a retry's attempt, a wait's timeout),
    as if it had no deadline; ``None``: none (a wait without a timeout), or unreadable."""
    moves_to: str | None
    """The deadline comes first (at ``at``): the state it moves the run to (``""``: its
    definition does not say); ``None``: the run's own time comes first."""

    @property
    def deadline_first(self) -> bool:
        return self.moves_to is not None

    @property
    def own_at(self) -> float | None:
        """The time the run itself waits for: :attr:`at`, or when its deadline comes first,
        :attr:`own` (``None``: it waits for none, as a parent for its children)."""
        return self.own if self.deadline_first else self.at

    def deadline_words(self, when: str = "") -> str:
        """``its deadline passes{when}: moves to expired``, for a run whose deadline comes
        first (``when``: said of the time, `` first, at …``)."""
        then = f": moves to {self.moves_to}" if self.moves_to else ""
        return f"{DEADLINE_PASSES}{when}{then}"


def own_and_deadline(events: Sequence[j.JournalEvent]) -> tuple[float | None, float | None]:
    """From a run's journal: its next due time as its own entries set it (the journal
    folded as if the run had no deadline) and its deadline (``None``: it has none, or it
    was spent). ``(None, None)`` for a journal that cannot be folded."""
    if not events:
        return None, None
    try:
        deadline = j.create(events[0]).deadline
        # Without a deadline, apply leaves each due time as its entry set it.
        record = j.create_without_deadline(events[0])
        for event in events[1:]:
            record = j.apply(record, event)
            if event.kind == j.DEADLINE_PASSED:
                deadline = None
    except (j.FoldError, KeyError, TypeError, ValueError):
        return None, None
    own = record.next_run_at
    return (float(own) if isinstance(own, (int, float)) else None), deadline


def due(
    *,
    status: str,
    state: str,
    next_run_at: float | None,
    events: Sequence[j.JournalEvent],
    structure: Callable[[], Mapping[str, Any] | None],
) -> Due | None:
    """When the run described (its row's ``status``, ``state`` and
    ``next_run_at``, its journal ``events``) is due next, and whether its deadline comes
    first; ``None`` for a run not due (not scheduled or retrying, or without a time).
    ``structure`` reads the structure of the run's stored definition (its ``on_deadline``
    and compensating states), called only when the run is due at its deadline."""
    if status not in CLAIMABLE or next_run_at is None:
        return None
    own, deadline = own_and_deadline(events)
    moves_to = None
    if deadline is not None and next_run_at >= deadline:
        stored = structure() or {}
        if _cut_off(state, deadline, events, stored):
            found = stored.get("on_deadline")
            moves_to = found if isinstance(found, str) else ""
    return Due(at=next_run_at, own=own, moves_to=moves_to)


def _cut_off(
    state: str, deadline: float, events: Sequence[j.JournalEvent], structure: Mapping[str, Any]
) -> bool:
    """Whether a deadline moves a run in ``state`` on, by the engine's rule
    (flowloop.children: claimed): not one running its compensations (a compensating
    state), unless it is still asleep before it (its entry due no sooner than the
    deadline, no compensation begun since: flowloop.events: asleep_past). Such a sleep is
    not journaled as ``asleep`` (the entry says ``compensate``), so the run's reason does
    not tell it."""
    from flowloop.events import asleep_past

    compensating = structure.get("compensate") or ()
    return state not in compensating or asleep_past(state, deadline, events)
