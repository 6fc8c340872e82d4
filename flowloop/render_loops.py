"""Loop diagrams: a loop's machine, and a stored loop drawn on it.

A loop row moves through ``scheduled → running → scheduled …`` (one iteration per slot),
``paused`` and ``stopped`` — the lifecycle every loop follows — and this module draws it with
the loop's own settings in the labels: schedule and mode on ``scheduled``; timeout, attempts
and what one iteration runs on ``running``; ``max_failures`` on the edge that pauses it. A
workflow loop's ``running`` state links to its workflow's diagram.

:func:`loop_model` extracts (a :class:`~flowloop.render.DiagramModel`, no graphviz),
:meth:`LoopOverlay.from_store` folds a loop row and its journal into what the loop did, and
:func:`apply_loop_overlay` marks it on the model; :func:`flowloop.render.to_digraph` draws.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Final

import graphviz

from flowloop.loops import Loop
from flowloop.render import DiagramEdge, DiagramModel, DiagramNode, first_line, to_digraph
from flowloop.render_overlay import taken_edges
from flowloop.retry import human
from flowloop.store.loops import LoopEvent, LoopRow

LOOP_SUFFIX: Final = ".loop"
"""A loop's file stem in ``diagrams/`` is ``<name>.loop`` (apart from workflow names)."""

SCHEDULED: Final = "scheduled"
RUNNING: Final = "running"
PAUSED: Final = "paused"
STOPPED: Final = "stopped"
LOOP_STATES: Final = (SCHEDULED, RUNNING, PAUSED, STOPPED)

# Edge events: the words drawn on the loop machine's transitions.
FIRE: Final = "slot due"
LATE: Final = "late slot"
MISSED: Final = "missed"
COALESCED: Final = "coalesced"
RETRIED: Final = "attempt failed: retry"
SKIPPED: Final = "skipped for overlap"
SUCCEEDED: Final = "succeeded"
FAILED: Final = "failed"
INTERRUPTED: Final = "interrupted"
MAX_FAILURES: Final = "max_failures"
PAUSE: Final = "pause"
UNPAUSE: Final = "unpause"
STOP: Final = "stop"
END_AT: Final = "end_at"

_ENDINGS: Final = {
    "iteration_succeeded": SUCCEEDED,
    "iteration_failed": FAILED,
    "iteration_interrupted": INTERRUPTED,
}
"""Loop journal kinds that end an iteration, and the edge each one takes back to
``scheduled`` (unless a pause or stop follows at the same boundary)."""


def diagram_name(loop_name: str) -> str:
    """The file stem of a loop's diagram in ``diagrams/``."""
    return f"{loop_name}{LOOP_SUFFIX}"


def schedule_text(loop: Loop) -> str:
    """The schedule and mode in words: ``every 30s after each end (fixed_delay)``."""
    if loop.cron is not None:
        text = f"cron {loop.cron}"
    elif loop.mode == "fixed_delay":
        text = f"every {human(loop.every or 0)} after each end (fixed_delay)"
    else:
        text = f"every {human(loop.every or 0)} (fixed_rate)"
    if loop.jitter:
        text += f", jitter up to {human(loop.jitter)}"
    return text


def _lateness_text(loop: Loop) -> str:
    how = "coalesced" if loop.coalesce else "caught up one by one"
    if loop.misfire_grace is None:
        return how
    return f"{how}, missed past {human(loop.misfire_grace)}"


def _iteration_text(loop: Loop) -> str:
    """What one iteration runs, then its timeout and attempts (two lines)."""
    what = (
        f"runs workflow {loop.workflow.name}"
        if loop.workflow is not None
        else f"calls {getattr(loop.fn, '__name__', 'its function')}()"
    )
    limits = [loop.retry.describe()]
    if loop.timeout is not None:
        limits.insert(0, f"timeout {human(loop.timeout)}")
    return f"{what}\n{', '.join(limits)}"


def loop_model(loop: Loop, *, workflow_diagram: str | None = None) -> DiagramModel:
    """The machine of one loop: its statuses, and each transition a loop of these settings
    can take. ``workflow_diagram`` is where its workflow's diagram is (a relative URL), for
    the link on ``running`` (default ``<workflow>.svg``, beside this diagram)."""
    link = ""
    if loop.workflow is not None:
        link = workflow_diagram or f"{loop.workflow.name}.svg"
    nodes = (
        DiagramNode(
            name=SCHEDULED,
            kind="state",
            initial=True,
            settings=f"{schedule_text(loop)}\nlate slots: {_lateness_text(loop)}",
            tooltip=(
                f"{SCHEDULED}: waiting for the next slot ({schedule_text(loop)}); "
                f"late slots: {_lateness_text(loop)}"
            ),
        ),
        DiagramNode(
            name=RUNNING,
            kind="state",
            settings=_iteration_text(loop),
            tooltip=(
                f"{RUNNING}: one iteration ({_iteration_text(loop).replace(chr(10), '; ')})"
                + (f"\nits workflow's diagram: {link}" if link else "")
            ),
            url=link,
        ),
        DiagramNode(
            name=PAUSED,
            kind="state",
            settings=(
                f"after {loop.max_failures} failures in a row"
                if loop.max_failures is not None
                else ""
            ),
            tooltip=f"{PAUSED}: no slot fires until an operator unpauses it",
        ),
        DiagramNode(
            name=STOPPED,
            kind="state",
            tooltip=f"{STOPPED}: ended; `flowloop unpause` starts it again from now",
        ),
    )
    edges = _loop_edges(
        late=loop.misfire_grace is not None or loop.coalesce,
        retried=loop.retry.attempts > 1,
        skipped=loop.mode == "fixed_rate",
        max_failures=loop.max_failures is not None,
        end_at=loop.end_at is not None,
    )
    what = (
        f"runs workflow {loop.workflow.name} (drawn in {link})"
        if loop.workflow is not None
        else f"calls {getattr(loop.fn, '__name__', 'its function')}()"
    )
    return DiagramModel(
        name=diagram_name(loop.name),
        title=f"loop {loop.name}",
        caption=f"each iteration {what}; grey: an operator's actions",
        comment=f"loop {loop.name}, {loop.schedule}; drawn by `flowloop diagram`",
        nodes=nodes,
        edges=edges,
        rankdir="TB",
    )


def _loop_edges(
    *, late: bool, retried: bool, skipped: bool, max_failures: bool, end_at: bool
) -> tuple[DiagramEdge, ...]:
    """The transitions of a loop's machine, those its settings make possible included."""
    edges: list[DiagramEdge] = [DiagramEdge(source=SCHEDULED, dest=RUNNING, event=FIRE)]
    if late:
        # Coalesced and missed slots: one self-loop (two would pile their labels up); the
        # overlay's notes count them apart.
        edges.append(DiagramEdge(source=SCHEDULED, dest=SCHEDULED, event=LATE))
    if retried:
        edges.append(DiagramEdge(source=RUNNING, dest=RUNNING, event=RETRIED))
    if skipped:
        edges.append(DiagramEdge(source=RUNNING, dest=RUNNING, event=SKIPPED))
    edges += [
        DiagramEdge(source=RUNNING, dest=SCHEDULED, event=SUCCEEDED),
        DiagramEdge(source=RUNNING, dest=SCHEDULED, event=FAILED),
        DiagramEdge(source=RUNNING, dest=SCHEDULED, event=INTERRUPTED),
    ]
    if max_failures:
        edges.append(DiagramEdge(source=RUNNING, dest=PAUSED, event=MAX_FAILURES))
    operator = [
        (SCHEDULED, PAUSE, PAUSED),
        (RUNNING, PAUSE, PAUSED),
        (PAUSED, UNPAUSE, SCHEDULED),
        (SCHEDULED, STOP, STOPPED),
        (RUNNING, STOP, STOPPED),
        (PAUSED, STOP, STOPPED),
        (STOPPED, UNPAUSE, SCHEDULED),
    ]
    if end_at:
        operator.append((SCHEDULED, END_AT, STOPPED))
    edges += [
        DiagramEdge(source=source, dest=dest, event=event, secondary=True)
        for source, event, dest in operator
    ]
    return tuple(edges)


def stored_loop_model(row: LoopRow) -> DiagramModel:
    """The machine of a stored loop whose definition is not loaded: its statuses and every
    transition a loop can take (its settings are unknown: none drawn but its schedule)."""
    nodes = tuple(
        DiagramNode(
            name=name,
            kind="state",
            initial=name == SCHEDULED,
            settings=row.schedule if name == SCHEDULED else "",
            tooltip=f"{name}",
        )
        for name in LOOP_STATES
    )
    return DiagramModel(
        name=diagram_name(row.name),
        title=f"loop {row.name}",
        caption="its definition is not loaded: every transition a loop can take; grey: an"
        " operator's actions",
        comment=f"loop {row.name}, {row.schedule}",
        nodes=nodes,
        edges=_loop_edges(late=True, retried=True, skipped=True, max_failures=True, end_at=True),
        rankdir="TB",
    )


# -- overlay -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LoopOverlay:
    """What one stored loop did, from its row and its journal."""

    name: str
    status: str
    counts: Mapping[str, int]
    """Iterations ``succeeded``, ``failed``, ``interrupted``; attempts ``retried``; slots
    ``skipped`` for overlap, ``coalesced`` and ``missed`` (from the journal kept)."""
    taken: Mapping[tuple[str, str, str], int]
    """Times each ``(source, event, dest)`` transition was taken."""
    last_error: str | None = None
    next_fire_at: float | None = None
    reason: str | None = None

    @classmethod
    def from_store(cls, row: LoopRow, events: Sequence[LoopEvent]) -> LoopOverlay:
        """Fold a loop's journal (oldest first) with its row. Each iteration ending is a
        transition back to ``scheduled`` unless a pause or stop follows it in the same
        boundary (written with it: the same time), which is then the transition taken
        from ``running``."""
        counts: Counter[str] = Counter()
        taken: Counter[tuple[str, str, str]] = Counter()
        status = SCHEDULED
        # An iteration ended, where it led not known yet; "": an ending without an edge
        # of its own back to scheduled (stopped, cancelled at shutdown, idle).
        ending: str | None = None
        ended_at = 0.0

        def settle() -> None:
            nonlocal ending, status
            if ending is not None:
                if ending:
                    taken[(RUNNING, ending, SCHEDULED)] += 1
                status, ending = SCHEDULED, None

        for event in events:
            kind = event.kind
            if kind in ("loop_paused", "loop_stopped"):
                if event.at != ended_at:
                    settle()  # a later write (an operator's, the loop idle): from scheduled
                dest = PAUSED if kind == "loop_paused" else STOPPED
                reason = str(event.data.get("reason", ""))
                source = RUNNING if ending is not None else status
                if "max_failures" in reason:
                    label = MAX_FAILURES
                elif "end_at" in reason:
                    label = END_AT
                else:
                    label = PAUSE if dest == PAUSED else STOP
                taken[(source, label, dest)] += 1
                status, ending = dest, None
                continue
            if kind == "skipped_overlap":  # journaled with the iteration's ending
                counts["skipped"] += event.count
                taken[(RUNNING, SKIPPED, RUNNING)] += 1
                continue
            settle()
            if kind == "iteration_started":
                taken[(SCHEDULED, FIRE, RUNNING)] += 1
                status = RUNNING
            elif kind in _ENDINGS:
                counts[_ENDINGS[kind]] += 1
                if event.attempt > 1:
                    counts["retried"] += event.attempt - 1
                    taken[(RUNNING, RETRIED, RUNNING)] += event.attempt - 1
                ending, ended_at = _ENDINGS[kind], event.at
            elif kind.startswith("iteration_"):  # stopped, cancelled at shutdown, idle
                # (A stop that cut the iteration off is journaled with it: from running.)
                ending, ended_at = "", event.at
            elif kind in (MISSED, COALESCED):
                counts[kind] += event.count
                taken[(SCHEDULED, LATE, SCHEDULED)] += 1
            elif kind == "loop_unpaused":
                taken[(status, UNPAUSE, SCHEDULED)] += 1
                status = SCHEDULED
        settle()
        return cls(
            name=row.name,
            status=row.status,
            counts=dict(counts),
            taken=dict(taken),
            last_error=first_line(row.last_error) if row.last_error else None,
            next_fire_at=row.next_fire_at,
            reason=row.reason,
        )


def utc(epoch: float) -> str:
    """A stored time for people, in UTC to the second: ``2026-12-01 09:30:00Z``."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _running_notes(counts: Mapping[str, int]) -> tuple[str, ...]:
    ended = sum(counts.get(key, 0) for key in (SUCCEEDED, FAILED, INTERRUPTED))
    lines = [
        f"{ended} iteration{'s' if ended != 1 else ''}: "
        f"{counts.get(SUCCEEDED, 0)} succeeded, {counts.get(FAILED, 0)} failed"
        + (f", {counts[INTERRUPTED]} interrupted" if counts.get(INTERRUPTED) else "")
    ]
    extra = [
        f"{counts[key]} {word}"
        for key, word in (("retried", "retried"), ("skipped", "skipped for overlap"))
        if counts.get(key)
    ]
    if extra:
        lines.append(", ".join(extra))
    return tuple(lines)


def _scheduled_notes(overlay: LoopOverlay) -> tuple[str, ...]:
    lines = []
    late = [
        f"{overlay.counts[key]} slot{'s' if overlay.counts[key] != 1 else ''} {key}"
        for key in (COALESCED, MISSED)
        if overlay.counts.get(key)
    ]
    if late:
        lines.append(", ".join(late))
    if overlay.next_fire_at is not None:
        lines.append(f"next fire {utc(overlay.next_fire_at)}")
    return tuple(lines)


def apply_loop_overlay(model: DiagramModel, overlay: LoopOverlay) -> DiagramModel:
    """``model`` with a stored loop drawn on it: the current status emphasised, counts on
    ``running`` and ``scheduled``, each transition taken with its count, the last error
    in red on ``running`` (when the last iteration did not succeed), the rest faded."""
    visited = {source for source, _, _ in overlay.taken} | {dest for *_, dest in overlay.taken}
    visited.add(overlay.status)
    failed_last = overlay.last_error is not None
    nodes = []
    for node in model.nodes:
        notes: tuple[str, ...] = ()
        if node.name == RUNNING:
            notes = _running_notes(overlay.counts)
            if overlay.last_error:
                notes += (f"last error: {overlay.last_error}",)
        elif node.name == SCHEDULED:
            notes = _scheduled_notes(overlay)
        if node.name == overlay.status:
            notes += (f"now {overlay.status}" + (f": {overlay.reason}" if overlay.reason else ""),)
            nodes.append(replace(node, mark="current", notes=notes))
        elif node.name == RUNNING and failed_last:
            nodes.append(replace(node, mark="failed", notes=notes))
        elif node.name in visited:
            nodes.append(replace(node, mark="visited", notes=notes))
        else:
            nodes.append(replace(node, mark="faded", notes=notes))
    caption = f"loop {overlay.name}: now {overlay.status}"
    if overlay.next_fire_at is not None:
        caption += f", next fire {utc(overlay.next_fire_at)}"
    edges = taken_edges(model.edges, overlay.taken)
    return replace(model, caption=caption, nodes=tuple(nodes), edges=edges)


OVERLAY_JOURNAL_LIMIT: Final = 10_000
"""The most recent loop journal entries an overlay folds (its counts say when capped)."""


def loop_digraph(loop: Loop) -> graphviz.Digraph:
    """A loop's machine, drawn."""
    return to_digraph(loop_model(loop))


def stored_loop_digraph(
    loop: Loop | None,
    row: LoopRow,
    events: Sequence[LoopEvent],
    *,
    capped: bool = False,
    workflow_diagram: str | None = None,
) -> graphviz.Digraph:
    """``loop``'s machine (``None``: not loaded, :func:`stored_loop_model`) with the stored
    loop (``row`` and its journal ``events``, oldest first) drawn on it. ``capped``:
    ``events`` are only the latest entries of the journal. ``workflow_diagram``: where
    ``running`` links to (:func:`loop_model`)."""
    machine = (
        loop_model(loop, workflow_diagram=workflow_diagram)
        if loop is not None
        else stored_loop_model(row)
    )
    model = apply_loop_overlay(machine, LoopOverlay.from_store(row, events))
    if capped:
        model = replace(
            model, caption=f"{model.caption} (counts from the last {len(events):,} entries)"
        )
    return to_digraph(model)
