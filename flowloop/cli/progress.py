"""What `flowloop run`, `resume` and `retry` print while they drive runs: each committed
boundary, and progress lines with a rate and an ETA for runs that count their work."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from flowloop.cli.common import out
from flowloop.cli.views import describe_event, styled
from flowloop.logs import text_handlers

if TYPE_CHECKING:
    from flowloop.engine import Engine
    from flowloop.journal import JournalEvent, RunRecord
    from flowloop.runinfo import RunInfo


def progress_printer(
    prefix: str = "", *, every: float = 1.0, shown_ends: set[str] | None = None
) -> Callable[[RunRecord, Sequence[JournalEvent]], None]:
    """Prints each committed boundary of a run as it happens.

    A run whose context counts its work — numeric ``<what>_done`` fields (``rows_done``,
    ``batches_done`` …, with ``<what>_total`` when known) and ``rejects`` / ``errors``, at the
    top level or in a ``progress`` dict, plus the ``file`` or ``item`` being worked on — also
    gets progress lines with a rate (of ``rows_done``, else the first ``_done`` counter) and
    an ETA. Its steps that loop back to their own state (batch after batch) print no line
    each: a progress line comes at most every ``every`` seconds, when such a loop ends and
    when the run ends. A ``summary`` text in the final context is printed last.

    A run's last line says how it ended, with the error or reason of one that failed or was
    stopped; its id goes into ``shown_ends`` (so the command need not say it again).
    """
    ended = ("succeeded", "failed", "stopped", "paused")

    first_seen: dict[str, tuple[float, float]] = {}  # run -> (monotonic, rate counter)
    last_line: dict[str, tuple[float, float]] = {}  # run -> (monotonic, rate counter) shown

    def counters(context: str) -> tuple[dict[str, Any], list[str]] | None:
        """The progress fields of a context and its ``_done`` keys (the rate's first)."""
        try:
            data = json.loads(context)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        source = data["progress"] if isinstance(data.get("progress"), dict) else data
        done = [
            key
            for key, value in source.items()
            if key.endswith("_done") and number(value) is not None
        ]
        if not done:
            return None
        done.sort(key=lambda key: key != "rows_done")
        return {**source, "summary": data.get("summary")}, done

    def number(value: object) -> float | None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return None

    def shown(value: float) -> str:
        return f"{value:,.0f}" if value.is_integer() else f"{value:,.1f}"

    def progress_line(record: RunRecord, source: dict[str, Any], done: list[str]) -> str:
        parts = []
        item = source.get("file") or source.get("item")
        if isinstance(item, str):
            parts.append(escape(item))
        for key in done:
            what, value = key[: -len("_done")], number(source[key]) or 0.0
            total = number(source.get(f"{what}_total"))
            text = f"{what} {shown(value)}"
            if total:
                text += f"/{shown(total)}"
                if key == done[0]:
                    text += f" ({100 * value / total:.1f}%)"
            parts.append(text)
        for key in ("rejects", "errors"):
            count = number(source.get(key))
            if count is not None:
                parts.append(f"{key} {shown(count)}")
        t0, first = first_seen[record.id]
        elapsed = time.monotonic() - t0
        unit, value = done[0][: -len("_done")], number(source[done[0]]) or 0.0
        # A rate over a few ms means little while running; the final line always has one.
        if value > first and elapsed > 0 and (elapsed >= 0.05 or record.status in ended):
            rate = (value - first) / elapsed
            parts.append(f"{rate:,.0f} {unit}/s")
            total = number(source.get(f"{unit}_total"))
            eta = int((total - value) / rate) if total is not None and total > value else 0
            if eta >= 1 and record.status != "succeeded":
                parts.append(f"ETA {eta // 60}:{eta % 60:02d}")
        return f"{prefix}[cyan]progress[/]  {escape(record.state):<12} " + "  ".join(parts)

    def show(record: RunRecord, events: Sequence[JournalEvent]) -> None:
        # A child run's lines (a call or map state's) are indented and name its workflow,
        # so they do not read as the lines of the run that was asked for.
        child = record.join is not None
        lead = f"{prefix}  {escape(record.workflow)} " if child else prefix
        found = counters(record.context)
        now = time.monotonic()
        due = False
        value = (number(found[0][found[1][0]]) or 0.0) if found is not None else 0.0
        if found is not None and record.id not in first_seen:
            first_seen[record.id] = last_line[record.id] = (now, value)
        for event in events:
            if event.kind == "step_started":
                continue
            looping = event.kind == "step_succeeded" and event.state == event.next_state
            if found is not None and looping:
                due = due or now - last_line[record.id][0] >= every
                continue
            took = f" {event.duration * 1000:.1f} ms" if event.duration is not None else ""
            out.print(
                f"{lead}[dim]seq {event.seq:>3}[/] {event.kind:<16} "
                f"{escape(describe_event(event))}{took}"
            )
            # A step that moved the count on (the last batch of a file): show where it got to.
            due = due or (found is not None and value != last_line[record.id][1])
        finished = record.status in ended
        if found is not None and (due or finished):
            out.print(progress_line(record, *found))
            last_line[record.id] = (now, value)
        if finished:
            summary = found[0].get("summary") if found is not None else None
            if isinstance(summary, str) and summary:
                out.print(f"{prefix}{escape(summary)}")
            run = f"run {record.id}"
            if child:
                run = f"  child {run} ({escape(record.workflow)})"
            tail = f": {escape(why)}" if (why := _why(record)) else ""
            out.print(f"{prefix}{run} {styled(record.status)} in state {record.state}{tail}")
            if shown_ends is not None:
                shown_ends.add(record.id)
            first_seen.pop(record.id, None)
            last_line.pop(record.id, None)

    return show


SHOWN_EVENTS = frozenset({"step_finished", "run_failed", "compensation_failed", "deadline_passed"})
"""The ``event`` of the engine's log lines that a progress printer shows as lines of its own
(a failed attempt or compensation, a run that failed, a deadline passed): the same error
logged again says nothing new."""


class _ShownByPrinter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "event", None) not in SHOWN_EVENTS or not hasattr(record, "run")


def _why(record: RunRecord) -> str | None:
    """What ended a run that did not succeed: a failed run's error, a stopped run's reason
    (not an error an earlier attempt left on the record, nor "stopped" again)."""
    if record.status == "failed":
        return record.error or record.reason
    if record.status == "stopped" and record.reason != "stopped":
        return record.reason
    return None


@contextlib.contextmanager
def printed_not_logged(printing: bool = True) -> Iterator[None]:
    """While a progress printer shows the runs a command drives (``printing``), the engine's
    log lines of their failures are left out of flowloop's own text log on stderr — unless
    logging was asked for at ``info`` or below (then the log is what was asked for, and is
    kept whole). A JSON log (a pipeline's) and a program's own handlers keep every line."""
    root = logging.getLogger()
    if not printing or root.getEffectiveLevel() <= logging.INFO:
        yield
        return
    shown = _ShownByPrinter()
    handlers = text_handlers(root)
    for handler in handlers:
        handler.addFilter(shown)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(shown)


def idle_notice(engine: Engine, say: Callable[[str], None]) -> Callable[[float], None]:
    """For `flowloop resume`, told the seconds each time it waits for a run due later
    (:attr:`Executor.idle_waits`): a line saying which run it waits for, what for and
    when, once per wait — it waited silently up to five minutes (a retry's backoff)."""
    from flowloop.clock import iso

    shown: set[tuple[str, float]] = set()

    def told(seconds: float) -> None:
        if seconds <= 0:
            return  # (due now: it polls)
        info = next_due_run(engine)
        if info is None or info.next_run_at is None:
            return
        mark = (info.id, info.next_run_at)
        if mark in shown:
            return  # (woken, and waiting again for the same)
        shown.add(mark)
        say(
            f"waiting for run {info.id} ({due_for(engine, info)} at {iso(info.next_run_at)}, "
            f"in {math.ceil(seconds)}s); Ctrl-C leaves it to a worker"
        )

    return told


def next_due_run(engine: Engine) -> RunInfo | None:
    """The claimable run of the engine's workflows that is due first (None: none)."""
    import sqlalchemy as sa

    from flowloop.cli.common import sql_engine
    from flowloop.lifecycle import CLAIMABLE
    from flowloop.store.reads import reading
    from flowloop.store.schema import runs

    query = (
        sa.select(runs.c.id)
        .where(
            runs.c.status.in_(sorted(CLAIMABLE)),
            runs.c.next_run_at.is_not(None),
            runs.c.workflow.in_(sorted(engine.workflows)),
        )
        .order_by(runs.c.next_run_at)
        .limit(1)
    )
    with reading(sql_engine(engine)) as conn:
        run_id = conn.execute(query).scalar_one_or_none()
    return None if run_id is None else engine.get(run_id)


def due_for(engine: Engine, info: RunInfo) -> str:
    """What a run due later is due for, in words: ``retry of charge``."""
    from flowloop.cli import support
    from flowloop.journal import ASLEEP

    due = support.run_due(engine, info)
    if due is not None and due.deadline_first:
        return due.deadline_words()
    if info.status == "retrying":
        return f"retry of {info.state}"
    if info.reason == ASLEEP:
        return f"end of its sleep before {info.state}"
    if support.WaitStates(engine).of(info) is not None:
        return f"timeout of {info.state}"
    return f"{info.state}, due"
