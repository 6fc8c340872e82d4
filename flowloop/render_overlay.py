"""Diagrams, the second layer: one run's journal drawn on a diagram model.

:meth:`RunOverlay.from_journal` folds a run's journal into what the run did (visits,
attempts, transitions taken, where it is, why it failed); :func:`apply_overlay` marks those
on a :class:`~flowloop.render_model.DiagramModel`. No graphviz: :mod:`flowloop.render`
draws the result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final

from flowloop import journal as j
from flowloop.errors import RenderError
from flowloop.family import HELD_BACK
from flowloop.lifecycle import HELD
from flowloop.render_model import DiagramEdge, DiagramModel, DiagramNode

ERROR_LINE_CHARS: Final = 80
"""Longest error line drawn under a failed state (the tooltip holds the whole line)."""


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
    held: bool = False
    """A map's child held back by its parent's ``max_parallel`` (its row's ``join_state``,
    not its journal's: the caller says so): drawn ``held``, not ``scheduled``."""

    @property
    def shown_status(self) -> str:
        """Its status as `flowloop status` and the dashboard show it (``held``)."""
        return HELD if self.held and self.status == "scheduled" else self.status

    @property
    def failed_state(self) -> str | None:
        return self.state if self.status == "failed" else None

    @classmethod
    def from_journal(cls, events: Sequence[j.JournalEvent], *, held: bool = False) -> RunOverlay:
        """Fold a run's journal (from seq 1); ``held``: the run is a map's child held back
        (flowloop.family.held_back). Raises RenderError if it cannot be folded."""
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
                event.kind in j.MOVES_ON
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
            held=held,
        )


def _composition_note(event: j.JournalEvent) -> str | None:
    """The overlay's line for a composition entry: children started or joined (with
    their counts), a compensation that ran."""
    data = event.data
    if event.kind == j.CHILDREN_STARTED and data.get("again"):
        return None  # waiting again for the children noted already
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
            now = f"now {overlay.shown_status}"
            if overlay.shown_status == HELD:  # and what releases it
                now += f": {HELD_BACK.partition(': ')[2]}"
            marked.append(replace(node, mark="current", notes=(counts, *extra, now)))
        elif visits or attempts:
            marked.append(replace(node, mark="visited", notes=(counts, *extra)))
        else:
            marked.append(replace(node, mark="faded"))
    where = "failed in" if overlay.status == "failed" else f"{overlay.shown_status} at"
    caption = f"run {overlay.run_id}: {where} {overlay.state}"
    if overlay.shown_status == HELD:
        caption += f" ({HELD_BACK})"
    if model.fingerprint and overlay.fingerprint != model.fingerprint:
        caption += (
            f" (recorded under another definition: v{overlay.version}, "
            f"fingerprint {overlay.fingerprint})"
        )
    edges = taken_edges(model.edges, overlay.taken)
    return replace(model, caption=caption, nodes=tuple(marked), edges=edges)


def taken_edges(
    edges: Sequence[DiagramEdge], taken: Mapping[tuple[str, str, str], int]
) -> tuple[DiagramEdge, ...]:
    """``edges`` with how often ``(source, event, dest)`` was taken (the others faded), and
    after them, dotted, the transitions taken that the definition no longer has."""
    declared = {(edge.source, edge.event, edge.dest) for edge in edges}
    marked = [
        replace(
            edge,
            count=taken.get((edge.source, edge.event, edge.dest), 0),
            mark="taken" if taken.get((edge.source, edge.event, edge.dest)) else "faded",
        )
        for edge in edges
    ]
    marked += [
        DiagramEdge(
            source=source, dest=dest, event=event, count=count, mark="taken", declared=False
        )
        for (source, event, dest), count in taken.items()
        if (source, event, dest) not in declared
    ]
    return tuple(marked)
