"""Diagrams: a machine → a small diagram model → graphviz.

Three layers, each usable on its own:

1. **extract** — :func:`workflow_model` and :func:`machine_model` read a workflow (or any
   ``transitions`` machine, such as the lifecycle) into a :class:`DiagramModel`: plain
   dataclasses, nodes and edges in declaration order, no graphviz;
2. **overlay** — :meth:`RunOverlay.from_journal` folds one run's journal into what the run
   did (visits, attempts, transitions taken, where it is, why it failed), and
   :func:`apply_overlay` marks those on a model;
3. **render** — :func:`to_digraph` turns a model into a ``graphviz.Digraph``;
   :func:`render_bytes` and :func:`save` give DOT text, or SVG/PNG through the ``dot``
   program.

DOT output is deterministic (declaration order, no timestamps, no ids from memory), so the
checked-in ``diagrams/`` can be reviewed in diffs and compared by a test.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final, Literal

import graphviz
from transitions import Machine

from flowloop import journal as j
from flowloop import lifecycle
from flowloop.compose import ERROR_PREFIX
from flowloop.definition import TIMEOUT_EVENT, StepSpec, WaitSpec, Workflow
from flowloop.errors import FlowloopError, RenderError
from flowloop.graph import longest_chain
from flowloop.loops import Loop

FORMATS: Final = ("dot", "svg", "png")
ALL_FORMATS: Final = ("dot", "svg")
"""What ``flowloop diagram --all`` writes for each machine."""
SUFFIXES: Final = {".dot": "dot", ".gv": "dot", ".svg": "svg", ".png": "png"}
LIFECYCLE: Final = "lifecycle"
"""The name (and file stem in ``diagrams/``) of the lifecycle machine's diagram."""
DIAGRAMS_DIR: Final = "diagrams"
"""Where ``flowloop diagram --all`` writes (relative to the working directory)."""
REFRESH_COMMAND: Final = "flowloop diagram --all"
INSTALL_HINT: Final = (
    "install Graphviz's `dot` program (Debian/Ubuntu: `apt-get install graphviz`; "
    "elsewhere see https://graphviz.org/download/), or use --format dot"
)
START_NODE: Final = "(start)"
"""The point the initial arrow comes from: parentheses keep it apart from state names."""
SHARED_EVENT_SOURCES: Final = 3
"""An event leading to one state from this many states or more is drawn in grey."""
TOP_TO_BOTTOM_CHAIN: Final = 4
"""A workflow whose longest chain has this many transitions or more is drawn top to bottom
(left to right it would outgrow a page or a screen); shorter ones left to right."""
SETTINGS_LINE_CHARS: Final = 34
"""Longest line of step settings under a state's name before it is broken after a comma."""
ERROR_LINE_CHARS: Final = 80
"""Longest error line drawn under a failed state (the tooltip holds the whole line)."""

# Look: one font, black ink, an accent for what a run did, red for failure, grey for the rest.
FONT: Final = "Helvetica"
INK: Final = "#333333"
MUTED: Final = "#555555"
SUB_TEXT_POINTS: Final = 10
"""Settings and counts under a state's name: 2 points below the name, still readable."""
SECONDARY: Final = "#8a8a8a"
ACCENT: Final = "#1a5fb4"
ACCENT_FILL: Final = "#e3edf9"
CURRENT_FILL: Final = "#b9d3f2"
FAILED: Final = "#c01c28"
FAILED_FILL: Final = "#fbe3e4"
FADED: Final = "#b8b8b8"
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
ERROR_COLOR: Final = "#a51d2d"
COMPENSATE_COLOR: Final = "#613583"
NodeMark = Literal["plain", "visited", "current", "failed", "faded"]
EdgeMark = Literal["plain", "taken", "faded"]


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


# -- extract -------------------------------------------------------------------------------


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
                    tooltip=f"{state}: {_KIND_WORDS[node_kind]}\n{composite.describe()}",
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
        retry_text = (
            f"{retry.attempts} attempts, {retry.backoff} backoff "
            f"{retry.base_seconds:g}s..{retry.cap_seconds:g}s"
        )
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


# -- overlay -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RunOverlay:
    """What one run did, folded from its journal."""

    run_id: str
    workflow: str
    version: int
    fingerprint: str
    status: str
    state: str
    """The state the run is in now."""
    visits: Mapping[str, int]
    """Times the run entered each state."""
    attempts: Mapping[str, int]
    """Times a step of each state was started (retries and crashes included)."""
    taken: Mapping[tuple[str, str, str], int]
    """Times each ``(source, event, dest)`` transition was taken, in the order first taken."""
    error: str | None = None
    """The error's first line, when the run failed."""
    interrupted: Mapping[str, int] = field(default_factory=dict)
    """Attempts of each state cut off by a crash (``step_interrupted``)."""
    notes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Extra lines per state: its children's counts, its compensation having run."""

    @property
    def failed_state(self) -> str | None:
        return self.state if self.status == "failed" else None

    @classmethod
    def from_journal(cls, events: Sequence[j.JournalEvent]) -> RunOverlay:
        """Fold a run's journal (from seq 1). Raises RenderError if it cannot be folded."""
        try:
            record = j.fold(events)
        except j.FoldError as error:
            raise RenderError(f"cannot draw this run: {error}") from error
        attempts: Counter[str] = Counter()
        interrupted: Counter[str] = Counter()
        taken: Counter[tuple[str, str, str]] = Counter()
        notes: dict[str, list[str]] = {}
        for event in events:
            if event.kind == j.STEP_STARTED and event.state is not None:
                attempts[event.state] += 1
            elif event.kind == j.STEP_INTERRUPTED and event.state is not None:
                interrupted[event.state] += 1
            elif (
                event.kind in (*j.TRANSITIONS, j.STEP_FAILED, j.STEP_INTERRUPTED)
                and event.state is not None
                and event.event is not None
                and event.next_state is not None
            ):
                taken[(event.state, event.event, event.next_state)] += 1
            if event.state is not None:
                note = _composition_note(event)
                if note:
                    notes.setdefault(event.state, []).append(note)
        failure = None
        if record.status == "failed":
            failure = first_line(record.error or record.reason or "failed")
        return cls(
            run_id=record.id,
            workflow=record.workflow,
            version=record.version,
            fingerprint=record.fingerprint,
            status=record.status,
            state=record.state,
            visits=dict(record.visits),
            attempts=dict(attempts),
            taken=dict(taken),
            error=failure,
            interrupted=dict(interrupted),
            notes={state: tuple(lines) for state, lines in notes.items()},
        )


def _composition_note(event: j.JournalEvent) -> str | None:
    """The overlay's line for a composition entry: children started or joined (with
    their counts), a compensation that ran."""
    data = event.data
    if event.kind == j.CHILDREN_STARTED:
        return f"{data.get('children', 0)} child run(s) of {data.get('child_workflow', '?')}"
    if event.kind == j.CHILDREN_JOINED:
        counts = ", ".join(
            f"{data[k]} {k}" for k in ("succeeded", "failed", "stopped") if data.get(k)
        )
        return f"children: {counts or 'none'}"
    if event.kind == j.COMPENSATION_SUCCEEDED:
        return "undone (compensated)"
    if event.kind == j.COMPENSATION_FAILED and not event.retryable:
        return "compensation failed"
    return None


def first_line(text: str, limit: int = ERROR_LINE_CHARS) -> str:
    """The first non-empty line of ``text``, cut to ``limit`` characters."""
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "\u2026"


def _counts(visits: int, attempts: int, interrupted: int = 0) -> str:
    text = f"{visits} visit{'s' if visits != 1 else ''}"
    if attempts > visits or interrupted:
        text += f", {attempts} attempts"
    if interrupted:
        text += f" ({interrupted} interrupted)"
    return text


def apply_overlay(model: DiagramModel, overlay: RunOverlay) -> DiagramModel:
    """``model`` with one run drawn on it: visited states and taken transitions with their
    counts, the current state emphasised, the failed state red with its error's first line,
    everything the run never reached faded. States and transitions the run used that the
    definition no longer has are added, dotted."""
    known = {node.name for node in model.nodes}
    nodes = [*model.nodes] + [
        DiagramNode(
            name=name, kind="state", declared=False, tooltip=f"{name}: not in this definition"
        )
        for name in overlay.visits  # every state a transition led to counts as visited
        if name not in known
    ]
    marked: list[DiagramNode] = []
    for node in nodes:
        visits = overlay.visits.get(node.name, 0)
        attempts = overlay.attempts.get(node.name, 0)
        counts = _counts(visits, attempts, overlay.interrupted.get(node.name, 0))
        extra = overlay.notes.get(node.name, ())
        if node.name == overlay.failed_state:
            marked.append(
                replace(node, mark="failed", notes=(counts, *extra, f"failed: {overlay.error}"))
            )
        elif node.name == overlay.state:
            marked.append(
                replace(node, mark="current", notes=(counts, *extra, f"now {overlay.status}"))
            )
        elif visits or attempts:
            marked.append(replace(node, mark="visited", notes=(counts, *extra)))
        else:
            marked.append(replace(node, mark="faded"))
    declared = {(edge.source, edge.event, edge.dest) for edge in model.edges}
    edges = [
        replace(
            edge,
            count=overlay.taken.get((edge.source, edge.event, edge.dest), 0),
            mark="taken" if overlay.taken.get((edge.source, edge.event, edge.dest)) else "faded",
        )
        for edge in model.edges
    ]
    edges += [
        DiagramEdge(
            source=source,
            dest=dest,
            event=event,
            count=overlay.taken[(source, event, dest)],
            mark="taken",
            declared=False,
        )
        for (source, event, dest) in overlay.taken
        if (source, event, dest) not in declared
    ]
    where = "failed in" if overlay.status == "failed" else f"{overlay.status} at"
    caption = f"run {overlay.run_id}: {where} {overlay.state}"
    if model.fingerprint and overlay.fingerprint != model.fingerprint:
        caption += (
            f" (recorded under another definition: v{overlay.version}, "
            f"fingerprint {overlay.fingerprint})"
        )
    return replace(model, caption=caption, nodes=tuple(marked), edges=tuple(edges))


# -- render --------------------------------------------------------------------------------


def _html(text: str) -> str:
    return html.escape(text, quote=False)


def _small(text: str, color: str) -> str:
    return f'<FONT POINT-SIZE="{SUB_TEXT_POINTS}" COLOR="{color}">{_html(text)}</FONT>'


def _node_label(node: DiagramNode) -> str | None:
    """An HTML-like label when there is more than the name to show (else the name)."""
    lines = []
    if node.settings:  # one sub-line per line of the settings
        color = FADED if node.mark == "faded" else MUTED
        lines += [_small(part, color) for part in node.settings.splitlines()]
    note_color = {"failed": FAILED, "faded": FADED}.get(node.mark, ACCENT)
    lines += [_small(note, note_color) for note in node.notes]
    if not lines and not node.cyclic:
        return None
    title = _html(node.title)
    if node.mark in ("current", "failed"):
        title = f"<B>{title}</B>"
    return "<" + "<BR/>".join([title, *lines]) + ">"


_SHAPES: Final[Mapping[NodeKind, dict[str, str]]] = {
    "step": {},
    "state": {},
    "wait": {"style": "rounded,dashed,filled"},
    # A double border, not a double circle: a circle grows with its name in both directions.
    "final": {"peripheries": "2"},
    "group": {"style": "rounded,dashed", "color": SECONDARY, "fontcolor": MUTED},
    # Child runs: a component box for one child, stacked boxes for many.
    "call": {"shape": "component", "style": "filled"},
    "map": {"shape": "box3d", "style": "filled"},
    "parallel": {"shape": "box3d", "style": "filled,bold"},
}

_KIND_WORDS: Final[Mapping[NodeKind, str]] = {
    "step": "step",
    "wait": "wait state",
    "final": "final state",
    "state": "state",
    "group": "group of states",
    "call": "call state (starts one child run and waits for it)",
    "map": "map state (one child run per item; joins when all have ended)",
    "parallel": "parallel state (one child run per branch, all at once; joins)",
}

_NODE_MARKS: Final[Mapping[NodeMark, dict[str, str]]] = {
    "plain": {},
    "visited": {"color": ACCENT, "fillcolor": ACCENT_FILL, "penwidth": "1.5"},
    "current": {"color": ACCENT, "fillcolor": CURRENT_FILL, "penwidth": "3"},
    "failed": {"color": FAILED, "fillcolor": FAILED_FILL, "fontcolor": FAILED, "penwidth": "3"},
    "faded": {"color": FADED, "fontcolor": FADED},
}

_EDGE_MARKS: Final[Mapping[EdgeMark, dict[str, str]]] = {
    "plain": {},
    "taken": {"color": ACCENT, "fontcolor": ACCENT, "penwidth": "2"},
    "faded": {"color": FADED, "fontcolor": FADED},
}


def node_attrs(node: DiagramNode) -> dict[str, str]:
    """The graphviz attributes of one state (its label, shape, marks and tooltip)."""
    attrs: dict[str, str] = {}
    label = _node_label(node)
    if label is not None:
        attrs["label"] = label
    attrs.update(_SHAPES[node.kind])
    if not node.declared:
        attrs["style"] = "rounded,dotted,filled"
    attrs.update(_NODE_MARKS[node.mark])
    tooltip = node.tooltip or f"{node.name}: {_KIND_WORDS[node.kind]}"
    if node.notes:
        tooltip += "\n" + "\n".join(node.notes)
    attrs["tooltip"] = _esc_lines(tooltip)
    if node.url:
        attrs["URL"] = graphviz.escape(node.url)
    return attrs


def edge_attrs(edge: DiagramEdge) -> dict[str, str]:
    """The graphviz attributes of one transition (its event label, counts and marks)."""
    attrs = {"label": graphviz.escape(edge.label)}
    if edge.kind == "error":
        attrs.update(color=ERROR_COLOR, fontcolor=ERROR_COLOR, style="dashed")
    elif edge.kind == "compensate":
        attrs.update(color=COMPENSATE_COLOR, fontcolor=COMPENSATE_COLOR, style="bold")
    attrs.update(_EDGE_MARKS[edge.mark])
    if edge.timer:
        attrs["style"] = "dashed"
    if not edge.declared:
        attrs["style"] = "dotted"
    how = "when its timeout passes" if edge.timer else f"on {edge.event}"
    taken = f" (taken {edge.count}x)" if edge.count else ""
    meaning = f": {edge.tooltip}" if edge.tooltip else ""
    attrs["tooltip"] = _esc_lines(f"{edge.source} -> {edge.dest} {how}{taken}{meaning}")
    return attrs


def _esc_lines(text: str) -> str:
    # Tooltips are escStrings: literal backslashes are escaped, lines joined by DOT's \n.
    joined = "\\n".join(graphviz.escape(line) for line in text.splitlines())
    result: str = graphviz.nohtml(joined)  # a str subclass: never read as an HTML label
    return result


def _graph_label(model: DiagramModel) -> str:
    lines = [f'<FONT POINT-SIZE="16"><B>{_html(model.title)}</B></FONT>']
    if model.caption:
        lines.append(f'<FONT POINT-SIZE="10" COLOR="{MUTED}">{_html(model.caption)}</FONT>')
    return "<" + "<BR/>".join(lines) + ">"


def to_digraph(model: DiagramModel) -> graphviz.Digraph:
    """The model as a ``graphviz.Digraph``: initial state marked by an arrow from a point,
    final states with a double border, every transition labelled with its event."""
    graph = graphviz.Digraph(name=model.name, comment=model.comment or None)
    graph.attr(
        "graph",
        label=_graph_label(model),
        labelloc="t",
        rankdir=model.rankdir,
        fontname=FONT,
        nodesep="0.4",
        ranksep="0.45",
        pad="0.2",
    )
    graph.attr(
        "node",
        shape="box",
        style="rounded,filled",
        fillcolor="white",
        color=INK,
        fontcolor=INK,
        fontname=FONT,
        fontsize="12",
    )
    graph.attr("edge", color=INK, fontcolor=INK, fontname=FONT, fontsize="10", arrowsize="0.8")
    initial = model.initial
    if initial is not None:
        graph.node(
            START_NODE,
            label="",
            shape="point",
            width="0.15",
            color=INK,
            fillcolor=INK,
            tooltip="start",
        )
        graph.edge(
            START_NODE, node_id(initial), tooltip=graphviz.escape(f"initial state: {initial}")
        )
    for node in model.nodes:
        graph.node(node_id(node.name), **node_attrs(node))
    shared = _shared_events(model.edges)
    for edge in model.edges:
        attrs = edge_attrs(edge)
        if edge.mark == "plain" and (edge.secondary or (edge.event, edge.dest) in shared):
            attrs.update(color=SECONDARY, fontcolor=SECONDARY)
        graph.edge(node_id(edge.source), node_id(edge.dest), **attrs)
    return graph


def node_id(name: str) -> str:
    """A state name as a DOT node id: always quoted as text. graphviz leaves a string that
    starts with ``<`` and ends with ``>`` unquoted (an HTML-like id), so a stored state
    named ``</svg><script>…</script>`` would break the DOT (or inject into the SVG)."""
    quoted: str = graphviz.nohtml(name)
    return quoted


def _shared_events(edges: Sequence[DiagramEdge]) -> set[tuple[str, str]]:
    """``(event, dest)`` pairs that lead to one state from many (``stop`` from every live
    status): drawn in grey so the main path stands out."""
    sources = Counter((edge.event, edge.dest) for edge in edges)
    return {key for key, count in sources.items() if count >= SHARED_EVENT_SOURCES}


def workflow_digraph(workflow: Workflow) -> graphviz.Digraph:
    return to_digraph(workflow_model(workflow))


def lifecycle_digraph() -> graphviz.Digraph:
    return to_digraph(lifecycle_model())


def run_digraph(workflow: Workflow, events: Sequence[j.JournalEvent]) -> graphviz.Digraph:
    """``workflow`` with the run whose journal is ``events`` drawn on it."""
    return to_digraph(apply_overlay(workflow_model(workflow), RunOverlay.from_journal(events)))


# -- output --------------------------------------------------------------------------------


def format_for(path: Path) -> str:
    """The output format a file name asks for (``.dot``/``.gv``, ``.svg``, ``.png``).

    Raises FlowloopError (a usage mistake, exit 2) for any other suffix."""
    fmt = SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise FlowloopError(
            f"{path}: cannot tell the format from the suffix; use .dot, .svg or .png, or --format"
        )
    return fmt


def render_bytes(graph: graphviz.Digraph, fmt: str) -> bytes:
    """The diagram as DOT text (no program needed) or as SVG/PNG from the ``dot`` program.

    Raises RenderError, in one line saying how to install it, when ``dot`` is missing, and
    FlowloopError for an unknown format.
    """
    if fmt == "dot":
        source: str = graph.source
        return source.encode()
    if fmt not in FORMATS:
        raise FlowloopError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    try:
        data: bytes = graph.pipe(format=fmt)
    except graphviz.ExecutableNotFound as error:
        raise RenderError(
            f"cannot render {fmt}: the `dot` program is not installed; {INSTALL_HINT}"
        ) from error
    except graphviz.CalledProcessError as error:
        stderr = error.stderr.decode(errors="replace") if error.stderr else str(error)
        raise RenderError(f"dot failed to render {fmt}: {first_line(stderr, 200)}") from error
    return data


def save(graph: graphviz.Digraph, path: Path, fmt: str | None = None) -> Path:
    """Write the diagram to ``path`` (format from its suffix unless given). Nothing is
    written when rendering fails."""
    data = render_bytes(graph, fmt or format_for(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def all_models(
    workflows: Iterable[Workflow], loops: Iterable[Loop] = ()
) -> dict[str, DiagramModel]:
    """The lifecycle, every workflow and every loop (``<name>.loop``), by file stem, in a
    stable order."""
    from flowloop import render_loops  # it builds on this module

    models: dict[str, DiagramModel] = {LIFECYCLE: lifecycle_model()}
    for workflow in sorted(workflows, key=lambda w: w.name):
        if workflow.name in models:
            raise RenderError(
                f"workflow {workflow.name!r} would overwrite the {LIFECYCLE} diagram; rename it"
            )
        models[workflow.name] = workflow_model(workflow)
    for loop in sorted(loops, key=lambda loop: loop.name):
        stem = render_loops.diagram_name(loop.name)
        if stem in models:
            raise RenderError(f"loop {loop.name!r} would overwrite the {stem} diagram; rename it")
        models[stem] = render_loops.loop_model(loop)
    return models


def all_diagrams(
    workflows: Iterable[Workflow], loops: Iterable[Loop] = ()
) -> dict[str, graphviz.Digraph]:
    """What ``flowloop diagram --all`` draws: :func:`all_models`, rendered."""
    return {name: to_digraph(model) for name, model in all_models(workflows, loops).items()}


def write_all(
    diagrams: Mapping[str, graphviz.Digraph],
    out: Path,
    formats: Sequence[str] = ALL_FORMATS,
) -> list[Path]:
    """Write each diagram as ``out/<name>.<format>``. DOT files are written first and need
    no program; the other formats are all rendered before any is written, so a missing
    ``dot`` leaves no half-written set behind."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if "dot" in formats:
        for name, graph in diagrams.items():
            written.append(save(graph, out / f"{name}.dot", "dot"))
    rendered: dict[Path, bytes] = {}
    try:
        for fmt in (f for f in formats if f != "dot"):
            for name, graph in diagrams.items():
                rendered[out / f"{name}.{fmt}"] = render_bytes(graph, fmt)
    except RenderError as error:
        if written:
            raise RenderError(f"{error} (the .dot files in {out} were written)") from error
        raise
    for path, data in rendered.items():
        path.write_bytes(data)
        written.append(path)
    return written


def stale(out: Path, names: Iterable[str], formats: Sequence[str] = ALL_FORMATS) -> list[Path]:
    """Diagram files in ``out`` that no machine renders any more."""
    wanted = set(names)
    if not out.is_dir():
        return []
    return sorted(
        path
        for path in out.iterdir()
        if path.suffix.lstrip(".") in formats and path.stem not in wanted
    )
