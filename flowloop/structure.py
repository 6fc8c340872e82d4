"""A definition's structure: its states as plain data, the checks they must pass, and the
fingerprint that tells two definitions apart.

:class:`Draft` holds what a :class:`~flowloop.definition.Workflow` declared (steps, wait
states, call and map states, finals); :meth:`Draft.check` is the validation (every target
exists, exactly one initial state, every state reachable and able to reach a final one,
final states without a step); :meth:`Draft.structure` the plain data a stored run's
compatibility is judged on (:func:`compatible`), and :func:`fingerprint_of` the short hash of
it with the context's version and schema that the store keeps runs' definitions under.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowloop import compose, graph
from flowloop.compose import Composite
from flowloop.errors import DefinitionError
from flowloop.specs import StepSpec, WaitSpec

if TYPE_CHECKING:
    from flowloop.definition import Workflow

FINGERPRINT_LENGTH = 16


@dataclass
class Draft:
    """The states a workflow declared, in declaration order."""

    steps: dict[str, StepSpec] = field(default_factory=dict)
    waits: dict[str, WaitSpec] = field(default_factory=dict)
    finals: list[str] = field(default_factory=list)
    initial: list[str] = field(default_factory=list)
    composites: dict[str, Composite] = field(default_factory=dict)
    compensating: list[str] = field(default_factory=list)

    @property
    def states(self) -> list[str]:
        """Every state in declaration order: steps, wait, call and map states, finals."""
        return [*self.steps, *self.waits, *self.composites, *self.finals]

    def outgoing(self) -> dict[str, dict[str, str]]:
        """Every non-final state's transitions ``{event: target}`` in declaration order."""
        out = {
            name: {**spec.on, **{compose.error_event(k): t for k, t in spec.on_error}}
            for name, spec in self.steps.items()
        }
        out.update({name: spec.transitions for name, spec in self.waits.items()})
        out.update({name: dict(spec.on) for name, spec in self.composites.items()})
        return out

    def check(self, workflow: str, *, on_deadline: str | None) -> None:
        """DefinitionError, naming ``workflow``, when the declared states do not make a
        machine every run can finish: every problem found at once, not the first alone (a
        definition with three mistakes took three tries to learn them)."""
        problems = self.problems(on_deadline=on_deadline)
        if len(problems) == 1:
            raise DefinitionError(workflow, problems[0])
        if problems:
            listed = "; ".join(f"({n}) {problem}" for n, problem in enumerate(problems, 1))
            raise DefinitionError(workflow, f"{len(problems)} problems: {listed}")

    def problems(self, *, on_deadline: str | None) -> list[str]:
        """What keeps the declared states from making a machine every run can finish."""
        steps, waits, composites = self.steps, self.waits, self.composites
        finals = set(self.finals)
        problems = []
        if not finals:
            problems.append("declares no final state; add workflow.final(...)")
        on_final = sorted(finals & (steps.keys() | waits.keys() | composites.keys()))
        if on_final:
            problems.append(
                f"final state(s) {', '.join(map(repr, on_final))} must not have a step or wait"
            )
        if self.compensating and not any(s.compensate for s in steps.values()):
            problems.append(
                f"final state(s) {', '.join(map(repr, self.compensating))} compensate, but "
                "no step declares compensate="
            )
        # Mistakes in the graph's own ends and edges: with any of them, states left unreached
        # or stuck are not mistakes of their own, and are checked once those are fixed.
        misdrawn = []
        if len(self.initial) != 1:
            found = ", ".join(map(repr, self.initial)) or "none"
            misdrawn.append(f"needs exactly one initial state (initial=True), found {found}")
        known = steps.keys() | waits.keys() | composites.keys() | finals
        if on_deadline is not None and on_deadline not in known:
            misdrawn.append(f"on_deadline goes to unknown state {on_deadline!r}")
        outgoing = self.outgoing()
        for state, targets in outgoing.items():
            unknown = sorted({dest for dest in targets.values() if dest not in known})
            if unknown:
                misdrawn.append(
                    f"state {state!r} goes to unknown state(s) {', '.join(map(repr, unknown))}"
                )
        if misdrawn:
            return problems + misdrawn
        edges = {state: set(outgoing.get(state, {}).values()) for state in known}
        if on_deadline is not None:  # every waiting or working state may time out there
            for state in known - finals:
                edges[state].add(on_deadline)
        unreachable = sorted(known - graph.reachable(edges, self.initial))
        if unreachable:
            problems.append(f"state(s) {', '.join(map(repr, unreachable))} cannot be reached")
        stuck = sorted(known - graph.can_reach(edges, finals)) if finals else []
        if stuck:
            problems.append(f"state(s) {', '.join(map(repr, stuck))} can never reach a final state")
        return problems

    def structure(self, name: str, *, on_deadline: str | None) -> dict[str, Any]:
        """The definition as plain data: what a stored run's compatibility is judged on."""
        return {
            "name": name,
            "initial": self.initial[0] if self.initial else None,
            "finals": sorted(self.finals),
            "states": {
                **{
                    spec.name: {"kind": "step", "on": dict(sorted(spec.on.items()))}
                    for spec in self.steps.values()
                },
                **{
                    spec.name: {"kind": "wait", "on": dict(sorted(spec.transitions.items()))}
                    for spec in self.waits.values()
                },
                **{
                    spec.name: {
                        "kind": spec.kind,
                        "on": dict(sorted(spec.on.items())),
                        "child": ",".join(wf.name for wf in spec.workflows()),
                    }
                    for spec in self.composites.values()
                },
            },
            **({"compensate": sorted(self.compensating)} if self.compensating else {}),
            **({"on_deadline": on_deadline} if on_deadline else {}),
        }


def fingerprint_of(record: Mapping[str, Any]) -> str:
    """The short hash of a definition record (structure and context): equal records, equal
    fingerprints, whatever the order of their keys."""
    text = json.dumps(record, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_LENGTH]


def check_migrates_from(
    workflow: str, version: int, states: list[str], migrates_from: Mapping[int, Mapping[str, str]]
) -> None:
    """``migrates_from`` names older versions only, and maps their states onto ``states``."""
    own = set(states)
    for old, mapping in migrates_from.items():
        if old >= version:
            raise DefinitionError(
                workflow,
                f"migrates_from={{{old}: ...}}: version {old} is not older than "
                f"this definition's version {version}",
            )
        unknown = sorted(dest for dest in mapping.values() if dest not in own)
        if unknown:
            raise DefinitionError(
                workflow,
                f"migrates_from={{{old}: ...}} maps to unknown state(s) "
                f"{', '.join(map(repr, unknown))}",
            )


def compatible(old: Mapping[str, Any], new: Workflow, state: str) -> str | None:
    """Why a run in ``state`` under the ``old`` structure cannot continue under ``new``
    (``None`` when it can): its state and that state's transitions must still exist."""
    new_structure = new.structure()
    if state in old.get("finals", []):
        return None
    old_state = old.get("states", {}).get(state)
    new_state = new_structure["states"].get(state)
    if new_state is None:
        return f"state {state!r} no longer exists in {new.name} v{new.version}"
    if old_state is None:
        return None
    if old_state.get("kind", "step") != new_state.get("kind", "step"):
        return (
            f"state {state!r} changed from a {old_state.get('kind')} to a {new_state.get('kind')}"
        )
    missing = {
        event: dest
        for event, dest in old_state.get("on", {}).items()
        if new_state.get("on", {}).get(event) != dest
    }
    if missing:
        gone = ", ".join(f"{event}->{dest}" for event, dest in sorted(missing.items()))
        return f"transitions of state {state!r} changed ({gone} no longer exist)"
    return None
