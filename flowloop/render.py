"""Diagrams: a machine → a small diagram model → graphviz.

Three layers, each usable on its own (and each re-exported here):

1. **extract** (:mod:`flowloop.render_model`) — :func:`workflow_model` and
   :func:`machine_model` read a workflow (or any ``transitions`` machine, such as the
   lifecycle) into a :class:`DiagramModel`: plain dataclasses, nodes and edges in
   declaration order, no graphviz;
2. **overlay** (:mod:`flowloop.render_overlay`) — :meth:`RunOverlay.from_journal` folds one
   run's journal into what the run did (visits, attempts, transitions taken, where it is,
   why it failed), and :func:`apply_overlay` marks those on a model;
3. **render** (this module) — :func:`to_digraph` turns a model into a ``graphviz.Digraph``;
   :func:`render_bytes` and :func:`save` give DOT text, or SVG/PNG through the ``dot``
   program.

DOT output is deterministic (declaration order, no timestamps, no ids from memory), so the
checked-in ``diagrams/`` can be reviewed in diffs and compared by a test.
"""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Final

import graphviz

from flowloop import journal as j
from flowloop.definition import Workflow
from flowloop.errors import FlowloopError, RenderError
from flowloop.loops import Loop
from flowloop.render_model import (
    CYCLE_MARK,
    KIND_WORDS,
    LIFECYCLE,
    SETTINGS_LINE_CHARS,
    TIMES,
    TOP_TO_BOTTOM_CHAIN,
    DiagramEdge,
    DiagramModel,
    DiagramNode,
    EdgeKind,
    EdgeMark,
    NodeKind,
    NodeMark,
    lifecycle_model,
    machine_model,
    workflow_model,
    wrap_settings,
)
from flowloop.render_overlay import ERROR_LINE_CHARS, RunOverlay, apply_overlay, first_line

__all__ = [
    "ACCENT",
    "ACCENT_FILL",
    "ALL_FORMATS",
    "COMPENSATE_COLOR",
    "CURRENT_FILL",
    "CYCLE_MARK",
    "DIAGRAMS_DIR",
    "ERROR_COLOR",
    "ERROR_LINE_CHARS",
    "FADED",
    "FAILED",
    "FAILED_FILL",
    "FORMATS",
    "LIFECYCLE",
    "REFRESH_COMMAND",
    "SECONDARY",
    "SETTINGS_LINE_CHARS",
    "START_NODE",
    "TIMES",
    "TOP_TO_BOTTOM_CHAIN",
    "DiagramEdge",
    "DiagramModel",
    "DiagramNode",
    "EdgeKind",
    "EdgeMark",
    "NodeKind",
    "NodeMark",
    "RunOverlay",
    "all_diagrams",
    "all_models",
    "apply_overlay",
    "edge_attrs",
    "first_line",
    "format_for",
    "lifecycle_digraph",
    "lifecycle_model",
    "machine_model",
    "node_attrs",
    "node_id",
    "render_bytes",
    "run_digraph",
    "save",
    "stale",
    "to_digraph",
    "workflow_digraph",
    "workflow_model",
    "wrap_settings",
    "write_all",
]

FORMATS: Final = ("dot", "svg", "png")
ALL_FORMATS: Final = ("dot", "svg")
"""What ``flowloop diagram --all`` writes for each machine."""
SUFFIXES: Final = {".dot": "dot", ".gv": "dot", ".svg": "svg", ".png": "png"}
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
ERROR_COLOR: Final = "#a51d2d"
COMPENSATE_COLOR: Final = "#613583"


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
    tooltip = node.tooltip or f"{node.name}: {KIND_WORDS[node.kind]}"
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


def run_digraph(
    workflow: Workflow, events: Sequence[j.JournalEvent], *, held: bool = False
) -> graphviz.Digraph:
    """``workflow`` with the run whose journal is ``events`` drawn on it; ``held``: the run
    is a map's child held back (drawn ``held``, with what releases it)."""
    overlay = RunOverlay.from_journal(events, held=held)
    return to_digraph(apply_overlay(workflow_model(workflow), overlay))


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


def chosen_format(path: Path, fmt: str | None) -> str:
    """The format to write ``path`` in: ``fmt`` if given, else its suffix's. Raises
    FlowloopError when the suffix names another format than ``fmt`` (PNG bytes in a
    ``.svg`` file open nowhere)."""
    if fmt is None:
        return format_for(path)
    named = SUFFIXES.get(path.suffix.lower())
    if named is not None and named != fmt:
        raise FlowloopError(
            f"{path}: the suffix says {named} but --format {fmt} was given; "
            f"name the file .{fmt} or drop --format"
        )
    return fmt


def _unwritable(path: Path, error: OSError) -> FlowloopError:
    """One line for a diagram path the system refused (a usage mistake: another path)."""
    if isinstance(error, IsADirectoryError):
        return FlowloopError(f"cannot write {path}: it is a directory; give a file name")
    if isinstance(error, FileExistsError | NotADirectoryError):
        # The error names the path it tried; the file in the way is one of its parents.
        in_the_way = next((p for p in (path, *path.parents) if p.is_file()), path.parent)
        reason = f"{in_the_way} is a file, not a directory"
    else:
        where = f"{error.filename}: " if error.filename and str(error.filename) != str(path) else ""
        reason = f"{where}{error.strerror or error}"
    return FlowloopError(f"cannot write {path}: {reason}; choose another path")


def make_dir(folder: Path) -> None:
    """Create ``folder`` (and its parents) for diagrams, or say in one line why not."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _unwritable(folder, error) from error


def write_file(path: Path, data: bytes) -> None:
    """Write one diagram file (its folder made as needed), or say in one line why not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    except OSError as error:
        raise _unwritable(path, error) from error


def save(graph: graphviz.Digraph, path: Path, fmt: str | None = None) -> Path:
    """Write the diagram to ``path`` (format from its suffix unless given; a suffix that
    names another format is refused). Nothing is written when rendering fails; a path that
    cannot be written raises FlowloopError in one line."""
    data = render_bytes(graph, chosen_format(path, fmt))
    write_file(path, data)
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
    make_dir(out)
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
        write_file(path, data)
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
