"""All runs of a window drawn on their machine: a heat map of where runs go and get stuck.

Computed in SQL from the journal, one code path for SQLite and PostgreSQL:

- per transition: how many entries took it and how many distinct runs (steps' successes,
  events, joins of calls and maps, passed deadlines, ``on_error`` routes journaled in the
  window);
- per state: step attempts, failures and p95 duration (:func:`flowloop.stats.step_stats`);
- per state right now: live runs there (the ``(workflow, status)`` index of the runs).

:func:`apply_heat` marks those on a :class:`~flowloop.render.DiagramModel` (counts as notes,
failure rate as the fill colour), and :func:`heat_digraph` renders it with the same
renderer as ``flowloop diagram`` (colours set on top of :func:`~flowloop.render.to_digraph`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Final

import graphviz
from sqlalchemy import ColumnElement, func, select
from sqlalchemy import Engine as SQLEngine

from flowloop import journal as j
from flowloop import render
from flowloop.definition import Workflow
from flowloop.errors import FlowloopError
from flowloop.lifecycle import LIVE
from flowloop.stats import OUTCOME_KINDS, StateStats, attempt_counts
from flowloop.store.current import current_rows
from flowloop.store.reads import counts_and_seconds, reading
from flowloop.store.schema import journal, runs
from flowloop.store.windows import journal_since

TAKEN_KINDS: Final = j.MOVES_ON
"""As a run's own overlay counts them (flowloop/render_overlay.py)."""
HEAT_SCALE: Final = (
    (0.0, "#e8f3ea"),
    (0.05, "#fff4d6"),
    (0.2, "#fddcb5"),
    (0.5, "#f6a6a0"),
)
"""Fill colour of a state by the share of its step attempts that failed (at least …)."""
STUCK_PEN: Final = "3"


@dataclass(frozen=True, kw_only=True)
class StateHeat:
    attempts: int = 0
    failed: int = 0
    p95: float | None = None
    live: Mapping[str, int] = None  # type: ignore[assignment]
    """Runs in this state right now, per status (running, scheduled, paused …)."""

    @property
    def failure_rate(self) -> float:
        return self.failed / self.attempts if self.attempts else 0.0

    @property
    def live_total(self) -> int:
        return sum((self.live or {}).values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "attempts": self.attempts,
            "failed": self.failed,
            "failure_rate": round(self.failure_rate, 6),
            "p95": self.p95,
            "live": dict(self.live or {}),
        }


@dataclass(frozen=True, kw_only=True)
class Heat:
    """What all runs of one workflow did since ``since`` (UTC epoch seconds)."""

    workflow: str
    since: float | None
    edges: Mapping[tuple[str, str, str], tuple[int, int]]
    """(source, event, dest) → (times taken, distinct runs)."""
    states: Mapping[str, StateHeat]
    stats: tuple[StateStats, ...] = ()
    """Per state: attempts, successes, retries, p50/p95/p99 (as ``flowloop stats``)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "since": self.since,
            "edges": [
                {"source": s, "event": e, "dest": d, "taken": taken, "runs": n}
                for (s, e, d), (taken, n) in self.edges.items()
            ],
            "states": {name: heat.as_dict() for name, heat in self.states.items()},
        }


def _of_workflow(db: SQLEngine, workflow: str) -> ColumnElement[bool]:
    """Runs of ``workflow``, as each database plans it best next to a journal window."""
    if db.dialect.name == "sqlite":
        # Given ``runs.workflow = :w``, SQLite drives the join from the runs' workflow
        # index (every run of the workflow ever, then its journal: 0.5 s at 100k runs,
        # whatever the window); the expression, which no index serves, makes it start
        # from the window's runs (journal_since: ix_flowloop_runs_status_created and
        # ix_flowloop_runs_updated), read their entries by the journal's key and look up
        # each run by id. (With no window it scans the journal.)
        return func.coalesce(runs.c.workflow, "") == workflow
    # PostgreSQL misjudges that expression's selectivity (a nested loop over every run,
    # 0.8 s at 100k runs) and plans a hash join for the plain comparison (70 ms).
    return runs.c.workflow == workflow


def state_stats(db: SQLEngine, workflow: str, *, since: float | None) -> list[StateStats]:
    """:func:`flowloop.stats.step_stats` for one workflow (same counts and nearest-rank
    percentiles, no slowest runs), planned to read only the window's journal entries."""
    where = [journal.c.kind.in_(OUTCOME_KINDS), _of_workflow(db, workflow)]
    if since is not None:
        where.append(journal_since(since))
    joined = journal.join(runs, runs.c.id == journal.c.run_id)
    counts = attempt_counts(journal.c.state, where=where, joined=joined)
    count_rows, ranks = counts_and_seconds(
        db,
        counts,
        journal.c.duration,
        where=where,
        group=("state", journal.c.state),
        select_from=joined,
    )
    found = [
        StateStats.of(row, workflow=workflow, at=partial(ranks.at, row.state or ""))
        for row in count_rows
    ]
    return sorted(found, key=lambda s: s.state)


def heat(db: SQLEngine, workflow: str, *, since: float | None) -> Heat:
    """The heat of ``workflow`` over the journal since ``since`` (``None``: all history)."""
    where = [journal.c.kind.in_(TAKEN_KINDS), _of_workflow(db, workflow)]
    if since is not None:
        where.append(journal_since(since))
    edges_query = (
        select(
            journal.c.state,
            journal.c.event,
            journal.c.next_state,
            func.count(),
            func.count(journal.c.run_id.distinct()),
        )
        .select_from(journal.join(runs, runs.c.id == journal.c.run_id))
        .where(*where)
        .group_by(journal.c.state, journal.c.event, journal.c.next_state)
    )
    waiting = sorted(LIVE - {"running"})
    live_query = (
        select(runs.c.state, runs.c.status, func.count())
        .where(runs.c.workflow == workflow, runs.c.status.in_(waiting))
        .group_by(runs.c.state, runs.c.status)
    )
    # A running run's row is a snapshot: its state is its latest journal entry's.
    running_query = select(runs.c.id, runs.c.status, runs.c.state, runs.c.last_seq).where(
        runs.c.workflow == workflow, runs.c.status == "running"
    )
    with reading(db) as conn:
        edges = {
            (source, event, dest): (int(taken), int(distinct))
            for source, event, dest, taken, distinct in conn.execute(edges_query)
            if None not in (source, event, dest)
        }
        live: dict[str, dict[str, int]] = {}
        for state, status, n in conn.execute(live_query):
            live.setdefault(state, {})[status] = int(n)
        running = [row._mapping for row in conn.execute(running_query)]
        for current in current_rows(conn, running):
            held = live.setdefault(current["state"], {})
            held["running"] = held.get("running", 0) + 1
    stats = state_stats(db, workflow, since=since)
    states: dict[str, StateHeat] = {}
    for row in stats:
        states[row.state] = StateHeat(
            attempts=row.count, failed=row.failed, p95=row.p95, live=live.get(row.state, {})
        )
    for state, counts in live.items():
        states.setdefault(state, StateHeat(live=counts))
    return Heat(workflow=workflow, since=since, edges=edges, states=states, stats=tuple(stats))


def heat_color(rate: float) -> str:
    color = HEAT_SCALE[0][1]
    for threshold, fill in HEAT_SCALE:
        if rate >= threshold:
            color = fill
    return color


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


def _notes(state: StateHeat) -> tuple[str, ...]:
    notes = []
    if state.attempts:
        plural = "s" if state.attempts != 1 else ""
        notes.append(f"{state.attempts} attempt{plural}, {state.failure_rate:.0%} failed")
    if state.p95 is not None:
        notes.append(f"p95 {_seconds(state.p95)}")
    if state.live_total:
        parts = ", ".join(f"{n} {status}" for status, n in sorted((state.live or {}).items()))
        notes.append(f"now: {parts}")
    return tuple(notes)


def apply_heat(model: render.DiagramModel, found: Heat, *, window: str = "") -> render.DiagramModel:
    """``model`` with the heat drawn on it: per state its attempts, failure rate, p95 and
    live runs as notes; per transition the runs that took it; what nothing used faded."""
    nodes = []
    for node in model.nodes:
        state = found.states.get(node.name)
        if state is None or not (state.attempts or state.live_total):
            # No step attempts (a wait, a call or map state, a final one): visited when a
            # run came in or went on from it (an initial map state is only left).
            used = any(node.name in (source, dest) for (source, _, dest) in found.edges)
            nodes.append(replace(node, mark="visited" if used else "faded"))
            continue
        nodes.append(replace(node, mark="visited", notes=_notes(state)))
    edges = []
    for edge in model.edges:
        taken, distinct = found.edges.get((edge.source, edge.event, edge.dest), (0, 0))
        edges.append(replace(edge, count=distinct, mark="taken" if taken else "faded"))
    runs_total = sum(s.live_total for s in found.states.values())
    scope = f"runs of the last {window}" if window else "all runs"
    caption = f"{scope}: runs per transition, failure rate as colour; {runs_total} live now"
    return replace(model, caption=caption, nodes=tuple(nodes), edges=tuple(edges))


def heat_digraph(model: render.DiagramModel, found: Heat, *, window: str = "") -> graphviz.Digraph:
    """The heat map as a ``graphviz.Digraph``: :func:`render.to_digraph` of
    :func:`apply_heat`, with each active state filled by its failure rate and states where
    runs are now drawn thick."""
    marked = apply_heat(model, found, window=window)
    graph = render.to_digraph(marked)
    for node in marked.nodes:
        state = found.states.get(node.name)
        if state is None or not (state.attempts or state.live_total):
            continue
        attrs = {"fillcolor": heat_color(state.failure_rate)}
        if state.live_total:
            attrs["penwidth"] = STUCK_PEN
        # A second statement for the node: DOT merges it into the first (later wins).
        graph.node(render.node_id(node.name), **attrs)
    return graph


def structure_model(structure: Mapping[str, Any], *, version: int) -> render.DiagramModel:
    """A diagram model from a stored definition's structure (``Workflow.structure()``):
    what the dashboard draws for a workflow whose code it was not given."""
    name = str(structure.get("name", "?"))
    finals = [str(s) for s in structure.get("finals", [])]
    states: Mapping[str, Any] = structure.get("states", {})
    initial = structure.get("initial")
    nodes = [
        render.DiagramNode(
            name=state,
            kind="wait" if spec.get("kind") == "wait" else "step",
            initial=state == initial,
        )
        for state, spec in states.items()
    ]
    nodes += [render.DiagramNode(name=state, kind="final") for state in finals]
    edges = [
        render.DiagramEdge(source=state, dest=str(dest), event=str(event))
        for state, spec in states.items()
        for event, dest in dict(spec.get("on", {})).items()
    ]
    return render.DiagramModel(
        name=name,
        title=f"{name} v{version}",
        caption="drawn from the definition stored in the database",
        nodes=tuple(nodes),
        edges=tuple(edges),
    )


def workflow_heat_digraph(workflow: Workflow, url: str, *, since: str) -> graphviz.Digraph:
    """``flowloop diagram FILE --runs --since 24h``: ``workflow`` with all its runs of the
    window (``since``: a duration or ``all``) from the database at ``url``, opened only to
    read. Raises FlowloopError for a bad ``since``, StoreError for a database without
    flowloop's schema."""
    from flowloop.config import parse_duration
    from flowloop.store.sql import SQLStore

    window = since.strip()
    seconds: float | None = None
    if window.lower() != "all":
        try:
            seconds = parse_duration(window)
        except ValueError as error:
            raise FlowloopError(f"--since {error}") from None
    store = SQLStore(url, create=False)
    try:
        start = None if seconds is None else store.db_now() - seconds
        found = heat(store.engine, workflow.name, since=start)
    finally:
        store.close()
    shown = "" if seconds is None else window
    return heat_digraph(render.workflow_model(workflow), found, window=shown)
