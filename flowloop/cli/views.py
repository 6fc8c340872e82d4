"""How runs, journal entries and loops look on the terminal and in `--json` output.

Imported when a command runs (it needs rich and the engine's types), never by
`flowloop --help`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

from rich.markup import escape
from rich.table import Column, Table
from rich.text import Text

from flowloop import family
from flowloop import journal as j
from flowloop.admission import duration_text
from flowloop.cli import support
from flowloop.cli.common import out
from flowloop.clock import iso

if TYPE_CHECKING:
    from flowloop.dues import Due
    from flowloop.engine import RunInfo
    from flowloop.journal import JournalEvent
    from flowloop.store.loops import LoopEvent, LoopRow

STATUS_STYLE = {
    "waiting": "blue",
    "succeeded": "green",
    "failed": "red",
    "running": "cyan",
    "retrying": "yellow",
    "paused": "magenta",
    "stopped": "red",
    "held": "dark_orange",
}


def styled(status: str) -> str:
    style = STATUS_STYLE.get(status)
    return f"[{style}]{status}[/]" if style else status


def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def context_json(info: RunInfo) -> Any:
    context = info.context
    return context if isinstance(context, dict) else context.model_dump(mode="json")


def info_json(
    info: RunInfo, waits: support.WaitStates | None = None, *, held: bool = False
) -> dict[str, Any]:
    """A run for `--json`: times as ISO-8601 (``created_at``) and epoch (``created_at_epoch``);
    with ``waits``, ``display_status`` (``waiting``, ``held`` when ``held``: a map's child
    held back) and ``waiting`` (events, until; none for a held child, which waits its turn)."""
    waiting = waits.of(info) if waits is not None and not held else None
    shown = support.HELD if held else support.WAITING if waiting else info.status
    extra = (
        {}
        if waits is None
        else {"display_status": shown, "waiting": waiting.as_dict() if waiting else None}
    )
    data = {
        "id": info.id,
        "workflow": info.workflow,
        "version": info.version,
        "status": info.status,
        "state": info.state,
        "attempt": info.attempt,
        "key": info.key,
        "reason": info.reason,
        "error": info.error,
        "next_run_at": info.next_run_at,
        "created_at": info.created_at,
        "updated_at": info.updated_at,
        "context": context_json(info),
        **extra,
    }
    return support.with_times(data, "next_run_at", "created_at", "updated_at")


def event_json(event: JournalEvent) -> dict[str, Any]:
    """A journal entry for `--json`: every field, the context parsed."""
    data = {
        **dataclasses.asdict(event),
        "data": dict(event.data),
        "context": json.loads(event.context) if event.context else None,
    }
    return support.with_times(data, "at")


def loop_json(row: LoopRow) -> dict[str, Any]:
    return support.with_times(
        {
            "name": row.name,
            "schedule": row.schedule,
            "status": row.status,
            "last_result": row.last_result,
            "last_error": row.last_error,
            "next_fire_at": row.next_fire_at,
            "iterations": row.iterations,
            "skipped": row.skipped,
            "missed": row.missed,
            "consecutive_failures": row.consecutive_failures,
            "reason": row.reason,
            "control": row.control,
        },
        "next_fire_at",
    )


def describe_event(event: JournalEvent) -> str:
    composed = describe_entry(event)  # call/map, compensation, deadline entries
    if composed is not None:
        return composed
    if event.kind in ("step_succeeded", "event_received"):
        note = f": {event.data['note']}" if event.data.get("note") else ""  # Step.note
        if event.data.get(j.ASLEEP):  # (step.sleep before a wait or final state)
            note += f" (asleep until {iso(event.data['due'])})"
        return f"{event.state} --{event.event}--> {event.next_state}{note}"
    if event.kind == j.SLEEP_ENDED:  # the state entered when the sleep ended
        due = event.data.get("due")
        until = f" until {iso(due)}" if isinstance(due, (int, float)) else ""
        return "the run ends" if event.data.get("final") else f"waits in {event.state}{until}"
    if event.kind == "event_rejected":
        return f"{event.event}: {event.error_type or ''}: {event.error_message or ''}".strip(": ")
    if event.kind in ("step_failed", "step_interrupted", "run_failed"):
        error = f"{event.error_type or ''}: {event.error_message or ''}".strip(": ")
        retry_at = event.data.get("retry_at") if event.data else None
        if isinstance(retry_at, (int, float)) and event.kind != "run_failed":
            # What comes next: `flowloop run` is otherwise silent through a long backoff.
            wait = duration_text(max(0.0, retry_at - event.at))
            return f"{error}; attempt {(event.attempt or 0) + 1} at {iso(retry_at)} (in {wait})"
        return error
    if event.kind == "run_retried":
        return f"from {event.state} by {event.data.get('by')}" + (
            f", set {json.dumps(event.data['set'])}" if event.data.get("set") else ""
        )
    if event.kind == j.RUN_MIGRATED:
        return _migrated(event)
    return with_operator(str(event.data.get("reason", "")) if event.data else "", event.worker)


OPERATOR: Final = "operator:"
"""How an operator's entry names its writer (``worker``): ``operator:<user>``."""


def with_operator(detail: str, worker: str | None) -> str:
    """An entry's detail, and who wrote it when an operator did (a pause, an unpause, a
    stop: ``by root``, as the dashboard shows it)."""
    if worker is None or not worker.startswith(OPERATOR):
        return detail
    by = f"by {worker.removeprefix(OPERATOR)}"
    return f"{detail}, {by}" if detail else by


def _migrated(event: JournalEvent) -> str:
    """``v1 → v2, review → triage, by root`` (the state moved to is the entry's own)."""
    data = event.data
    before, after = data.get("from_state"), event.state
    moved = (
        f"{before} → {after}" + (" (renamed)" if data.get("renamed") else "")
        if before is not None and before != after
        else f"in {after}"
    )
    by = f", by {data['by']}" if data.get("by") else ""
    # Steps it succeeded that the version left undoes and this one has no step for: were
    # it to compensate, it parks until a version undoes them (flowloop/owed.py).
    dropped = data.get("dropped")
    owed = [name for name, undoes in dropped.items() if undoes] if isinstance(dropped, dict) else []
    left = f", leaves {', '.join(owed)} with no step to undo it" if owed else ""
    return f"v{data.get('from', '?')} → v{data.get('to', '?')}, {moved}{by}{left}"


def journal_row(
    event: JournalEvent | LoopEvent, middle: tuple[str, str], detail: str
) -> tuple[str, ...]:
    """A row of a journal table (`history`, `loops NAME`): seq, time, kind, the two columns
    of that journal, the duration and the detail."""
    took = f"{event.duration * 1000:.1f} ms" if event.duration is not None else ""
    return (str(event.seq), iso(event.at), event.kind, *middle, took, detail)


NARROW_DROPS: Final = (("note",), ("note", "attempt"), ("note", "attempt", "updated"))
"""The columns a narrow terminal's runs table leaves out, least needed first: cut to a few
letters each, every column said nothing (the state and workflow as "ch…", "or…")."""


def status_table(
    rows: Sequence[tuple[RunInfo, str]], short: dict[str, str], leave_out: Sequence[str] = ()
) -> Table:
    """The runs table; ``short``: the short form of (some) ids (see flowloop.ids);
    ``leave_out``: columns not shown (a narrow terminal)."""
    shown_ids = [short.get(info.id, info.id) for info, _ in rows]
    # Never cut an id short with an ellipsis: a shown id must work as a RUN argument.
    run_column = Column("run", no_wrap=True, min_width=max(map(len, shown_ids), default=3))
    status_column = Column("status", no_wrap=True)
    columns = [run_column, Column("workflow"), status_column, Column("state")]
    columns += [Column("attempt"), Column("key"), Column("updated"), Column("note")]
    kept = [column.header not in leave_out for column in columns]
    table = Table(*(column for column, keep in zip(columns, kept, strict=True) if keep))
    # Cells as Text, not markup: nothing in them is parsed (a name is shown as it is), and
    # parsing every cell's markup was a quarter of drawing the table (issue 13).
    for info, shown in rows:
        cells = (
            Text(short.get(info.id, info.id)),
            Text(f"{info.workflow} v{info.version}"),
            Text(shown, style=STATUS_STYLE.get(shown, "")),
            Text(info.state),
            Text(str(info.attempt)),
            Text(info.key or ""),
            Text(iso(info.updated_at)),
            Text((info.error or info.reason or "")[:60]),
        )
        table.add_row(*(cell for cell, keep in zip(cells, kept, strict=True) if keep))
    return table


def show_run(
    info: RunInfo,
    waiting: support.Waiting | None = None,
    reason: str | None = None,
    due: Due | None = None,
    *,
    held: bool = False,
) -> None:
    """``reason``: said instead of the run's (a sleep's end, support.asleep_reason);
    ``due``: when the run is due next (support.run_due): its "next run" line says whether
    that is its deadline's time, and where the run goes then; ``held``: a map's child held
    back, shown ``held`` (its ``held`` line, family_lines, says what releases it)."""
    out.print(f"run       {info.id}")
    out.print(f"workflow  {info.workflow} v{info.version}")
    waiting = None if held else waiting
    shown = support.HELD if held else support.WAITING if waiting is not None else info.status
    # (The reason, when it says more than the status: "stopped (deadline)", not "(stopped)".)
    reason = reason or (info.reason if info.reason not in (None, info.status) else None)
    out.print(f"status    {styled(shown)}" + (f" ({escape(reason)})" if reason else ""))
    if waiting is not None:
        out.print(f"waits     {escape(waiting.describe())} (stored status {info.status})")
    out.print(f"state     {info.state} (attempt {info.attempt})")
    if info.key:
        out.print(f"key       {escape(info.key)}")
    if info.error:
        out.print(f"error     {escape(info.error)}")
    if info.next_run_at is not None and info.status in ("scheduled", "retrying"):
        first = (
            f" ({escape(due.deadline_words() + support.goes_on_after(info, due))})"
            if due is not None and due.deadline_first
            else ""
        )
        out.print(f"next run  {iso(info.next_run_at)}{first}")
    out.print(f"updated   {iso(info.updated_at)} (seq {info.last_seq})")
    out.print(f"context   {escape(json.dumps(context_json(info)))}")


# -- composition (flowloop/children.py): a run's family, its entries in words -----------------


def family_lines(store: Any, run_id: str, *, live: bool = True) -> list[str]:
    """What ``flowloop status RUN`` / ``history RUN`` add for composition: the run's parent
    (and whether it is held back by it), the events kept for it, and how many of its
    children are in each status, those held back as ``held`` (nothing when it has none);
    ``live``: the run is live (a finished one takes no event kept for it, nor waits a turn)."""
    if not hasattr(store, "child_counts"):  # SQLStore and LiteStore read families
        return []
    lines = []
    parent = store.parent_of(run_id)
    if parent is not None:
        lines.append(f"parent    {parent}")
        if family.held_back(store, run_id, live=live):  # (as the dashboard's run page says)
            lines.append(f"held      {family.HELD_BACK.removeprefix('held ')}")
    kept = store.kept_count(run_id) if live else 0
    if kept:
        lines.append(f"kept      {kept} event(s) sent to it, not taken yet")
    counts = family.child_counts(store, run_id)
    if counts:
        total = sum(counts.values())
        parts = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        lines.append(f"children  {total} ({parts})")
    return lines


def describe_entry(event: JournalEvent) -> str | None:
    """One line for a composition journal entry (``None`` for the others)."""
    data = event.data
    if event.kind == j.CHILDREN_STARTED:
        waits = "waits again for " if data.get("again") else ""
        return f"{waits}{data.get('children', 0)} child run(s) of {data.get('child_workflow', '?')}"
    if event.kind in (j.CHILDREN_JOINED, j.DEADLINE_PASSED) or (
        event.kind in (j.STEP_FAILED, j.STEP_INTERRUPTED) and event.next_state
    ):
        counts = ", ".join(
            f"{data[k]} {k}" for k in ("succeeded", "failed", "stopped") if data.get(k)
        )
        why = f" ({counts})" if counts else f" ({event.error_type})" if event.error_type else ""
        return f"{event.state} --{event.event}--> {event.next_state}{why}"
    if event.kind in (j.COMPENSATION_STARTED, j.COMPENSATION_SUCCEEDED):
        return f"undo {event.state}"
    if event.kind == j.COMPENSATION_FAILED:
        return f"undo {event.state}: {event.error_type}: {event.error_message}"
    return None
