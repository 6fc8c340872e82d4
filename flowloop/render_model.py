"""Diagrams, the first layer: a machine read into a small diagram model (no graphviz).

:func:`workflow_model` and :func:`machine_model` read a workflow (or any ``transitions``
machine) into a :class:`DiagramModel`: plain dataclasses, nodes and edges in declaration
order, each step's settings and tooltip; :func:`lifecycle_model` draws the run lifecycle
from its rules. :mod:`flowloop.render_overlay` marks one run on a model and
:mod:`flowloop.render` turns a model into graphviz (see that module for the whole picture).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from transitions import Machine

from flowloop import lifecycle
from flowloop.compose import ERROR_PREFIX
from flowloop.definition import Workflow
from flowloop.graph import longest_chain
from flowloop.journal import TIMEOUT_EVENT
from flowloop.specs import StepSpec, WaitSpec

LIFECYCLE: Final = "lifecycle"
"""The name (and file stem in ``diagrams/``) of the lifecycle machine's diagram."""
TOP_TO_BOTTOM_CHAIN: Final = 4
"""A workflow whose longest chain has this many transitions or more is drawn top to bottom
(left to right it would outgrow a page or a screen); shorter ones left to right."""
SETTINGS_LINE_CHARS: Final = 34
"""Longest line of step settings under a state's name before it is broken after a comma."""
CYCLE_MARK: Final = "\u21bb"  # ↻
TIMES: Final = "\u00d7"  # multiplication sign

NodeKind = Literal["step", "wait", "final", "state", "group", "call", "map", "parallel"]
"""``step``: a state with a step function; ``wait``: a state without one that advances on an
external event or a timeout; ``final``: a run that gets there has succeeded; ``state``: a
plain state of a machine that is not a workflow (the lifecycle); ``group``: stands for
several states (its settings name them), the source of transitions they all have;
``call`` / ``map`` / ``parallel``: a state that starts child runs (one, one per item, one
per branch) and waits for them."""
EdgeKind = Literal["normal", "error", "compensate"]
"""``error``: an ``on_error`` route (or the run deadline's); ``compensate``: into a state
whose entry runs the compensations."""
NodeMark = Literal["plain", "visited", "current", "failed", "faded"]
EdgeMark = Literal["plain", "taken", "faded"]

KIND_WORDS: Final[Mapping[NodeKind, str]] = {
    "step": "step",
    "wait": "wait state",
    "final": "final state",
    "state": "state",
    "group": "group of states",
    "call": "call state (starts one child run and waits for it)",
    "map": "map state (one child run per item; joins when all have ended)",
    "parallel": "parallel state (one child run per branch, all at once; joins)",
}
"""What each kind of state is, in words (tooltips)."""


@dataclass(frozen=True, kw_only=True)
class DiagramNode:
    """One state to draw."""

    name: str
    kind: NodeKind
    initial: bool = False
    cyclic: bool = False
    """On a cycle of the machine: where ``max_visits`` matters."""
    settings: str = ""
    """One compact line of step settings (``StepSpec.describe()``)."""
    tooltip: str = ""
    mark: NodeMark = "plain"
    notes: tuple[str, ...] = ()
    """Lines an overlay adds under the state (counts, the error)."""
    declared: bool = True
    """False for a state a run visited that the current definition no longer has."""
    url: str = ""
    """A link (relative URL) on the state, e.g. from a workflow loop to its workflow."""

    @property
    def title(self) -> str:
        return f"{self.name} {CYCLE_MARK}" if self.cyclic else self.name


@dataclass(frozen=True, kw_only=True)
class DiagramEdge:
    """One transition to draw: ``source --event--> dest``."""

    source: str
    dest: str
    event: str
    count: int = 0
    """With an overlay: how many times the run took this transition."""
    mark: EdgeMark = "plain"
    timer: bool = False
    """Taken when a wait state's timeout passes (drawn dashed)."""
    declared: bool = True
    """False for a transition a run took that the current definition no longer has."""
    secondary: bool = False
    """Drawn in grey, like events shared by many states: an operator's action, say."""
    tooltip: str = ""
    """What the transition means (added to the hover text)."""
    kind: EdgeKind = "normal"

    @property
    def label(self) -> str:
        return f"{self.event} {TIMES}{self.count}" if self.count else self.event


@dataclass(frozen=True, kw_only=True)
class DiagramModel:
    """A machine as a drawing: nodes and edges in declaration order."""

    name: str
    title: str
    caption: str = ""
    comment: str = ""
    """A ``//`` line at the top of the DOT text."""
    nodes: tuple[DiagramNode, ...] = ()
    edges: tuple[DiagramEdge, ...] = ()
    fingerprint: str = ""
    rankdir: Literal["LR", "TB"] = "LR"

    @property
    def initial(self) -> str | None:
        return next((node.name for node in self.nodes if node.initial), None)

    def node(self, name: str) -> DiagramNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


def workflow_model(workflow: Workflow) -> DiagramModel:
    """A workflow's states and declared transitions, with each step's settings."""
    workflow.validate()
    cyclic = workflow.on_cycle()
    nodes: list[DiagramNode] = []
    for state in workflow.states:
        initial, on_cycle = state == workflow.initial, state in cyclic
        spec = workflow.steps.get(state)
        wait = workflow.waits.get(state)
        if spec is not None:
            nodes.append(
                DiagramNode(
                    name=state,
                    kind="step",
                    initial=initial,
                    cyclic=on_cycle,
                    settings=_settings(spec.describe(), spec.max_visits, cyclic=on_cycle),
                    tooltip=_step_tooltip(spec, cyclic=on_cycle),
                )
            )
        elif wait is not None:
            nodes.append(
                DiagramNode(
                    name=state,
                    kind="wait",
                    initial=initial,
                    cyclic=on_cycle,
                    settings=_settings(wait.describe(), wait.max_visits, cyclic=on_cycle),
                    tooltip=_wait_tooltip(wait, cyclic=on_cycle),
                )
            )
        elif state in workflow.composites:
            composite = workflow.composites[state]
            node_kind: NodeKind = (
                "call"
                if composite.kind == "call"
                else "map"
                if composite.kind == "map"
                else "parallel"
            )
            nodes.append(
                DiagramNode(
                    name=state,
                    kind=node_kind,
                    initial=initial,
                    cyclic=on_cycle,
                    settings=composite.describe(),
                    tooltip=f"{state}: {KIND_WORDS[node_kind]}\n{composite.describe()}",
                )
            )
        else:
            kind: NodeKind = "final" if workflow.is_final(state) else "state"
            undo = workflow.compensates(state)
            nodes.append(
                DiagramNode(
                    name=state,
                    kind=kind,
                    initial=initial,
                    settings="compensates" if undo else "",
                    tooltip=f"{state}: final state; entering it undoes the steps that "
                    "succeeded (compensate=), newest first"
                    if undo
                    else "",
                )
            )
    timed = {(name, TIMEOUT_EVENT) for name, wait in workflow.waits.items() if wait.on_timeout}
    edges = tuple(
        DiagramEdge(
            source=t.source,
            dest=t.dest,
            event=t.event,
            timer=(t.source, t.event) in timed,
            kind=_edge_kind(workflow, t.event, t.dest),
        )
        for t in workflow.transitions()
    )
    return DiagramModel(
        name=workflow.name,
        title=f"{workflow.name} v{workflow.version}",
        caption=workflow.description,
        comment=(
            f"workflow {workflow.name} v{workflow.version}, fingerprint {workflow.fingerprint}; "
            f"drawn by `flowloop diagram`"
        ),
        nodes=tuple(nodes),
        edges=edges,
        fingerprint=workflow.fingerprint,
        rankdir=_rankdir(workflow),
    )


def _rankdir(workflow: Workflow) -> Literal["LR", "TB"]:
    successors: dict[str, set[str]] = {}
    for transition in workflow.transitions():
        successors.setdefault(transition.source, set()).add(transition.dest)
    long = longest_chain(successors, workflow.initial) >= TOP_TO_BOTTOM_CHAIN
    return "TB" if long else "LR"


def _edge_kind(workflow: Workflow, event: str, dest: str) -> EdgeKind:
    if workflow.compensates(dest):
        return "compensate"
    return "error" if event.startswith(ERROR_PREFIX) else "normal"


def machine_model(
    machine: Machine,
    *,
    name: str,
    title: str,
    caption: str = "",
    rankdir: Literal["LR", "TB"] = "LR",
) -> DiagramModel:
    """Any ``transitions`` machine: its states (``final`` ones as finals) and transitions,
    in the order they were declared."""
    nodes = tuple(
        DiagramNode(
            name=state_name,
            kind="final" if getattr(state, "final", False) else "state",
            initial=state_name == machine.initial,
        )
        for state_name, state in machine.states.items()
    )
    edges = tuple(
        DiagramEdge(source=source, dest=transition.dest, event=event.name)
        for event in machine.events.values()
        for source, transitions in event.transitions.items()
        for transition in transitions
        if transition.dest is not None  # internal transitions change no state
    )
    return DiagramModel(
        name=name,
        title=title,
        caption=caption,
        comment=f"{title}; drawn by `flowloop diagram`",
        nodes=nodes,
        edges=edges,
        rankdir=rankdir,
    )


def lifecycle_model() -> DiagramModel:
    """The lifecycle every run follows, drawn from ``flowloop.lifecycle.RULES`` (the same
    table the README's text block is printed from): a rule from any live status is one
    edge from the "(any live status)" group, as in the text."""
    nodes = [
        DiagramNode(
            name=status,
            kind="final" if status == "succeeded" else "state",
            initial=status == "idle",
        )
        for status in lifecycle.STATUSES
    ]
    live = ", ".join(s for s in lifecycle.STATUSES if s in lifecycle.LIVE)
    nodes.append(
        DiagramNode(
            name=lifecycle.ANY_LIVE,
            kind="group",
            settings=live,
            tooltip=f"{lifecycle.ANY_LIVE}: {live}",
        )
    )
    edges = tuple(
        DiagramEdge(
            source=source,
            dest=rule.dest,
            event=rule.trigger,
            tooltip=rule.meaning,
            secondary=isinstance(rule.sources, str),
        )
        for rule in lifecycle.RULES
        for source in ((rule.sources,) if isinstance(rule.sources, str) else rule.sources)
    )
    return DiagramModel(
        name=LIFECYCLE,
        title="run lifecycle",
        caption=(
            "grey: a rule of many statuses; rerun: an operator's retry of a failed or stopped run"
        ),
        comment="run lifecycle; drawn by `flowloop diagram`",
        nodes=tuple(nodes),
        edges=edges,
        rankdir="TB",
    )


def _settings(described: str, max_visits: int | None, *, cyclic: bool) -> str:
    text = described
    if max_visits is not None and "visits" not in text:
        text += f", max {max_visits} visits"
    if cyclic and max_visits is None:
        # A cycle without a visit limit can spin forever: make that visible in review.
        text += ", no max_visits"
    return wrap_settings(text)


def wrap_settings(text: str, width: int = SETTINGS_LINE_CHARS) -> str:
    """Comma-separated settings in lines of about ``width`` characters (broken only after
    a comma), so a state's box stays narrow."""
    lines: list[str] = []
    for part in text.split(", "):
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += f", {part}"
        else:
            lines.append(part)
    return ",\n".join(lines)


def _wait_tooltip(wait: WaitSpec, *, cyclic: bool) -> str:
    lines = [
        f"{wait.name}: wait state (no step; advances on an event sent to the run)"
        + (", on a cycle" if cyclic else ""),
        "events: "
        + ", ".join(
            f"{event}" + (f" ({wait.payloads[event].__name__})" if event in wait.payloads else "")
            for event in wait.on
        ),
    ]
    if wait.timeout is not None:
        lines.append(f"timeout: {wait.timeout:g}s, then {wait.on_timeout}")
    lines.append(f"max_visits: {wait.max_visits if wait.max_visits is not None else 'unlimited'}")
    return "\n".join(lines)


def _step_tooltip(spec: StepSpec, *, cyclic: bool) -> str:
    retry = spec.retry
    if retry.attempts == 1:
        retry_text = "none (1 attempt)"
    else:
        # A fixed backoff (or one retry, or a cap at the base) waits one time, not a range.
        first, cap = min(retry.base_seconds, retry.cap_seconds), retry.cap_seconds
        one = retry.backoff == "fixed" or retry.attempts == 2 or first >= cap
        waits = f"{first:g}s" if one else f"{first:g}s..{cap:g}s"
        retry_text = f"{retry.attempts} attempts, {retry.backoff} backoff {waits}"
        if retry.jitter:
            retry_text += f" ±{retry.jitter:.0%}"
        retry_text += " on " + ", ".join(error.__name__ for error in retry.on)
        if retry.giving_up_on:
            retry_text += ", never on " + ", ".join(e.__name__ for e in retry.giving_up_on)
    lines = [
        f"{spec.name}: {'async ' if spec.is_async else ''}step{', on a cycle' if cyclic else ''}",
        f"retry: {retry_text}",
        f"timeout: {f'{spec.timeout:g}s' if spec.timeout is not None else 'none'}",
        f"idempotent: {'yes' if spec.idempotent else 'no (an interrupted step is not re-run)'}",
        f"max_visits: {spec.max_visits if spec.max_visits is not None else 'unlimited'}",
    ]
    return "\n".join(lines)
