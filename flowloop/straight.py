"""A ``next=`` step's usual success, decided once per state of a workflow.

A ``next=`` step that returns ``None`` leads from its state to the one state its ``next=``
names. Whether that target is a plain step — a step (no wait, call, map or final state),
not compensating, that no gate can hold — and the ``data`` entering it writes (the context
stamp) depend on the definition alone, which is frozen once validated
(``Workflow.validate``). :func:`plain_next` answers it once per state, so that a step's
success does not ask the definition again what ``Workflow.event_for``,
``Workflow.next_state``, :func:`~flowloop.events.entering`, the target's ``max_visits``
and the static half of ``Stepping._straight_on`` said last time (a dozen calls a step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowloop.definition import NEXT_EVENT, StepSpec, Workflow
from flowloop.errors import InvalidEvent
from flowloop.events import entering
from flowloop.gates import gated


@dataclass(frozen=True, slots=True)
class PlainNext:
    """Where a ``next=`` step returning ``None`` goes, when that is a plain step."""

    target: str
    data: Mapping[str, Any]
    """What :func:`~flowloop.events.entering` gives for ``target`` without a delay (at any
    time: a plain step's entry names no due time). Copied for each entry."""
    limit: int | None
    """``target``'s ``max_visits``."""


def plain_step(workflow: Workflow, target: str) -> bool:
    """Whether ``target`` is a step of ``workflow`` that no gate can hold: the definition's
    half of ``Stepping._straight_on``."""
    spec = workflow.steps.get(target)
    return (
        spec is not None
        and not gated(workflow, spec)
        # (A definition gives a state one kind; these hold should one slip through.)
        and target not in workflow.waits
        and target not in workflow.composites
    )


def plain_next(workflow: Workflow, spec: StepSpec) -> PlainNext | None:
    """:class:`PlainNext` for a success of ``spec`` (a step of ``workflow``) that returned
    ``None``; ``None`` when that success is any other boundary (an ``on=`` step, a target
    that is not a plain step): the general path decides it every time."""
    workflow.validate()
    if spec.returns_event:
        return None
    try:
        target = workflow.next_state(spec.name, NEXT_EVENT)
    except InvalidEvent:
        return None
    if (
        not plain_step(workflow, target)
        or workflow.compensates(target)
        or workflow.is_final(target)
    ):
        return None
    data = entering(workflow, target, 0.0)
    if data.keys() & {"due", "final", "compensate"}:  # (not a plain step's entry after all)
        return None
    return PlainNext(target=target, data=data, limit=workflow.max_visits(target))


class PlainNexts(dict[tuple[Workflow, str], PlainNext | None]):
    """:func:`plain_next` by (workflow, state), each found once (the executor's)."""

    def __missing__(self, key: tuple[Workflow, str]) -> PlainNext | None:
        workflow, state = key
        found = self[key] = plain_next(workflow, workflow.steps[state])
        return found
