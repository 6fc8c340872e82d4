"""The lifecycle machine shared by every run and every loop.

:data:`RULES` is the one source: each trigger with its source statuses, destination and
meaning. It is declared with ``transitions`` from there (so it is drawn like every other
machine), rendered as the README's text block by :func:`text`, and turned into a lookup
table once, at import: checking a status change costs a dict lookup.
"""

from __future__ import annotations

from dataclasses import dataclass
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

# An operator's requests to a run's owner (the run row's ``control``), honoured at the run's
# next boundary. A parent's pause cascades to its children as PARENT_PAUSE: unpausing the
# parent withdraws that one, and leaves a pause an operator put on the child itself.
PAUSE: Final = "pause"
STOP: Final = "stop"
PARENT_PAUSE: Final = "parent pause"
PAUSES: Final[frozenset[str]] = frozenset({PAUSE, PARENT_PAUSE})
CONTROLS: Final[frozenset[str]] = frozenset({PAUSE, PARENT_PAUSE, STOP})
PARENT_PAUSED: Final = "parent paused"
"""The reason of a run paused by its parent's pause (its ``run_paused`` entry's)."""
HELD: Final = "held"
"""A map's child waiting for its turn (``max_parallel``): its ``join_state``, and how a
listing of a parent's children counts the scheduled ones."""

ANY_LIVE: Final = "(any live status)"
"""A rule's source meaning every live status (but the rule's own destination)."""


@dataclass(frozen=True)
class Rule:
    """One trigger of the lifecycle: from which statuses to which, and what it means."""

    trigger: str
    sources: tuple[str, ...] | str
    """Statuses, or :data:`ANY_LIVE`."""
    dest: str
    meaning: str

    def expanded(self) -> tuple[str, ...]:
        """The source statuses, :data:`ANY_LIVE` spelt out (staying put is no change)."""
        if self.sources == ANY_LIVE:
            return tuple(s for s in STATUSES if s in LIVE and s != self.dest)
        return tuple(self.sources)


RULES: Final[tuple[Rule, ...]] = (
    Rule("schedule", ("idle",), "scheduled", "a run is queued"),
    Rule("start", ("scheduled", "retrying"), "running", "a worker claims it and runs a step"),
    Rule(
        "succeed",
        ("running", "scheduled", "retrying"),
        "succeeded",
        "a final state is reached (a waiting run: by an event; one backing off: by its deadline)",
    ),
    Rule("retry", ("running",), "retrying", "a step failed; it is tried again after a backoff"),
    Rule(
        "fail", ("running", "scheduled", "retrying"), "failed", "out of attempts, or not retryable"
    ),
    Rule(
        "release",
        ("running", "retrying"),
        "scheduled",
        "back to the queue: a wait, a timer, a shutdown, a deadline passed in a backoff",
    ),
    Rule("pause", ANY_LIVE, "paused", "at once, or at the running step's end"),
    Rule("unpause", ("paused",), "scheduled", "it goes on where it was"),
    Rule("stop", ANY_LIVE, "stopped", "a running step is cancelled"),
    Rule("rerun", ("failed", "stopped"), "scheduled", "an operator's retry"),
)
"""The lifecycle, one source for the machine, its diagram and the README's text."""

TRANSITIONS: Final[list[dict[str, object]]] = [
    {"trigger": rule.trigger, "source": list(rule.expanded()), "dest": rule.dest} for rule in RULES
]


def text() -> str:
    """The lifecycle as a text block (the README shows exactly this), one line per rule:
    ``sources → dest   trigger: meaning``."""
    arrows = [
        f"{rule.sources if isinstance(rule.sources, str) else ', '.join(rule.sources)}"
        f" → {rule.dest}"
        for rule in RULES
    ]
    width = max(len(arrow) for arrow in arrows)
    lines = [
        f"{arrow.ljust(width)}   {rule.trigger}: {rule.meaning}"
        for arrow, rule in zip(arrows, RULES, strict=True)
    ]
    live = ", ".join(s for s in STATUSES if s in LIVE)
    lines.append(f"{ANY_LIVE} = {live}")
    return "\n".join(lines) + "\n"


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
