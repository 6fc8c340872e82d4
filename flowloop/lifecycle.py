"""The lifecycle machine shared by every run and every loop.

::

    idle → scheduled → running → succeeded
                         │  ↘ retrying → running
                         │  ↘ failed
     (any non-final) → paused → scheduled
     (any non-final) → stopped
    failed / stopped → scheduled  (an operator's retry)

It is declared with ``transitions`` (so it is drawn like every other machine) and turned
into a lookup table once, at import: checking a status change costs a dict lookup.
"""

from __future__ import annotations

from typing import Final, Literal

from transitions import Machine

Status = Literal[
    "idle", "scheduled", "running", "retrying", "succeeded", "failed", "paused", "stopped"
]
STATUSES: Final[tuple[Status, ...]] = (
    "idle",
    "scheduled",
    "running",
    "retrying",
    "succeeded",
    "failed",
    "paused",
    "stopped",
)
FINISHED: Final[frozenset[str]] = frozenset({"succeeded", "failed", "stopped"})
"""Statuses a run leaves only by an operator's retry."""
LIVE: Final[frozenset[str]] = frozenset({"idle", "scheduled", "running", "retrying", "paused"})
CLAIMABLE: Final[frozenset[str]] = frozenset({"scheduled", "retrying"})

_NON_FINAL = ["idle", "scheduled", "running", "retrying", "paused"]

TRANSITIONS: Final[list[dict[str, object]]] = [
    {"trigger": "schedule", "source": "idle", "dest": "scheduled"},
    {"trigger": "start", "source": ["scheduled", "retrying"], "dest": "running"},
    # A waiting run (scheduled, no step) can finish when an event leads it to a final state.
    {"trigger": "succeed", "source": ["running", "scheduled"], "dest": "succeeded"},
    {"trigger": "retry", "source": "running", "dest": "retrying"},
    {"trigger": "fail", "source": ["running", "scheduled", "retrying"], "dest": "failed"},
    {"trigger": "release", "source": "running", "dest": "scheduled"},
    {"trigger": "pause", "source": ["idle", "scheduled", "running", "retrying"], "dest": "paused"},
    {"trigger": "unpause", "source": "paused", "dest": "scheduled"},
    {"trigger": "stop", "source": _NON_FINAL, "dest": "stopped"},
    {"trigger": "rerun", "source": ["failed", "stopped"], "dest": "scheduled"},
]


def build_machine() -> Machine:
    """The lifecycle as a ``transitions`` machine (for diagrams and the table below)."""
    return Machine(
        model=None,
        states=[{"name": s, "final": s in ("succeeded",)} for s in STATUSES],
        transitions=TRANSITIONS,
        initial="idle",
        auto_transitions=False,
    )


def _table(machine: Machine) -> frozenset[tuple[str, str]]:
    pairs: set[tuple[str, str]] = set()
    for event in machine.events.values():
        for source, transitions in event.transitions.items():
            for transition in transitions:
                if transition.dest is not None:  # internal transitions have no dest
                    pairs.add((source, transition.dest))
    return frozenset(pairs)


ALLOWED: Final[frozenset[tuple[str, str]]] = _table(build_machine())


def allowed(source: str, dest: str) -> bool:
    """Whether a run may go from status ``source`` to ``dest`` (staying put is allowed)."""
    return source == dest or (source, dest) in ALLOWED
