"""The ``flowloop`` command. A FlowloopError becomes one line on stderr and an exit code
(2: bad input, 1: a failure); only a bug shows a traceback."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Column, Table

from flowloop import children, loop_requests
from flowloop import cli_support as support
from flowloop.clock import iso
from flowloop.config import Settings, apply_overrides, load_settings, parse_duration
from flowloop.engine import Engine, RunInfo, default_url
from flowloop.errors import EXIT_FAILURE, FlowloopError, UnknownRun
from flowloop.interrupt import Interrupted, interrupted_line, leave, run_interruptibly
from flowloop.journal import JournalEvent, RunRecord
from flowloop.lastresort import last_resort
from flowloop.loader import Loaded, load_paths, load_target, split_target
from flowloop.logs import FORMATS, LEVELS, setup_logging
from flowloop.store.dialect import SYNCHRONOUS_MODES, safe_url
from flowloop.store.loops import LoopRow
from flowloop.store.sql import SQLStore

if TYPE_CHECKING:
    import graphviz

F = TypeVar("F", bound=Callable[..., Any])

# Wide enough for run ids when piped (rich falls back to 80 columns without a terminal),
# unless $COLUMNS says how wide.
WIDE = sys.stdout.isatty() or bool(os.environ.get("COLUMNS"))
out = Console(highlight=False, soft_wrap=True, width=None if WIDE else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)

DEFAULT_WORKFLOWS = "workflows"


class Failed(FlowloopError):
    """A command ran but what it checked or drove did not succeed."""

    exit_code = EXIT_FAILURE


def db_option(fn: F) -> F:
    fn = click.option(
        "--synchronous",
        type=click.Choice(SYNCHRONOUS_MODES, case_sensitive=False),
        default="NORMAL",
        show_default=True,
        help="SQLite durability: NORMAL survives crashes, FULL also power loss.",
    )(fn)
    return click.option(
        "--db",
        envvar="FLOWLOOP_DB",
        default=None,
        help="Database URL or SQLite file [env FLOWLOOP_DB, else db in flowloop.toml; "
        "default ./flowloop.db].",
    )(fn)


def _trace(engine: Engine) -> None:
    try:
        from flowloop import tracing  # lazy: OpenTelemetry only when asked for
    except ImportError as error:
        raise FlowloopError(
            f"--trace needs OpenTelemetry ({error.name} is missing): pip install 'flowloop[otel]'"
        ) from None
    tracing.instrument_from_env(engine)


def workflows_option(fn: F) -> F:
    return click.option(
        "-w",
        "--workflows",
        "workflow_paths",
        multiple=True,
        help="Files or directories that define the workflows [default: ./workflows].",
    )(fn)


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(fn)


def settings() -> Settings:
    """The settings the ``flowloop`` group loaded: file < FLOWLOOP_* < global flags."""
    ctx = click.get_current_context(silent=True)
    found = ctx.find_object(Settings) if ctx is not None else None
    return found if found is not None else load_settings()


def command_settings(**flags: Any) -> Settings:
    """The settings again, with this command's own flags on top (validated the same way)."""
    ctx = click.get_current_context()
    given = dict(ctx.meta.get(GLOBAL_FLAGS, {}))
    return load_settings({**given, **flags}, config_file=ctx.meta.get(CONFIG_PATH))


def database(db: str | None) -> str:
    """--db (or $FLOWLOOP_DB), else ``db`` in the configuration file, else ./flowloop.db."""
    return db or settings().db or default_url()


def open_engine(
    db: str | None,
    synchronous: str = "NORMAL",
    loaded: Loaded | None = None,
    *,
    read: bool = False,
) -> Engine:
    """The engine on --db; ``read``: for a command that only reads, so a database that does
    not exist is refused (exit 2), not created."""
    url = database(db)
    store = support.read_store(url, synchronous) if read else None
    engine = Engine(url, synchronous=synchronous, store=store)
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.meta.get(TRACE):
        _trace(engine)
    if loaded is not None:  # every version loaded: runs stay on theirs (issue 16)
        engine.register(*loaded.all_versions())
    return engine


def load_workflow_paths(paths: Sequence[str]) -> Loaded:
    """The workflows and loops in ``paths``, with the configuration's overrides applied."""
    if paths:
        loaded = load_paths(paths)
    elif Path(DEFAULT_WORKFLOWS).is_dir():
        loaded = load_paths([DEFAULT_WORKFLOWS])
    else:
        return Loaded()
    loaded.loops = apply_overrides(settings(), loaded.workflows, loaded.loops)
    return loaded


def seconds_option(value: str, option: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as error:
        raise FlowloopError(f"{option} {error}") from None


def sql_engine(engine: Engine) -> Any:
    """The SQLAlchemy engine under ``engine`` (stats and prune are SQL)."""
    if not isinstance(engine.store, SQLStore):
        raise FlowloopError("this command needs the SQL store")
    return engine.store.engine


def seconds_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def parse_context(text: str | None, option: str = "--context") -> Any:
    if text is None:
        return {}
    source = option
    if text.startswith("@"):
        path = Path(text[1:])
        if not path.is_file():
            raise FlowloopError(f"{option} {text}: no such file")
        source, text = str(path), path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise FlowloopError(f"{source} is not valid JSON: {error}") from None


def parse_assignments(pairs: Sequence[str]) -> dict[str, Any]:
    """``field=value`` pairs; a value that parses as JSON is taken as JSON, else as text."""
    values: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise FlowloopError(f"--set {pair!r}: expected FIELD=VALUE")
        try:
            values[name] = json.loads(raw)
        except json.JSONDecodeError:
            values[name] = raw
    return values


def context_json(info: RunInfo) -> Any:
    context = info.context
    return context if isinstance(context, dict) else context.model_dump(mode="json")


def info_json(info: RunInfo, waits: support.WaitStates | None = None) -> dict[str, Any]:
    """A run for `--json`: times as ISO-8601 (``created_at``) and epoch (``created_at_epoch``);
    with ``waits``, ``display_status`` (``waiting``) and ``waiting`` (events, until)."""
    waiting = waits.of(info) if waits is not None else None
    extra = (
        {}
        if waits is None
        else {
            "display_status": support.WAITING if waiting else info.status,
            "waiting": waiting.as_dict() if waiting else None,
        }
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


STATUS_STYLE = {
    "waiting": "blue",
    "succeeded": "green",
    "failed": "red",
    "running": "cyan",
    "retrying": "yellow",
    "paused": "magenta",
    "stopped": "red",
}


def styled(status: str) -> str:
    style = STATUS_STYLE.get(status)
    return f"[{style}]{status}[/]" if style else status


def describe_event(event: JournalEvent) -> str:
    composed = children.describe_entry(event)  # call/map, compensation, deadline entries
    if composed is not None:
        return composed
    if event.kind in ("step_succeeded", "event_received"):
        note = f": {event.data['note']}" if event.data.get("note") else ""  # Step.note
        return f"{event.state} --{event.event}--> {event.next_state}{note}"
    if event.kind == "event_rejected":
        return f"{event.event}: {event.error_type or ''}: {event.error_message or ''}".strip(": ")
    if event.kind in ("step_failed", "step_interrupted", "run_failed"):
        return f"{event.error_type or ''}: {event.error_message or ''}".strip(": ")
    if event.kind == "run_retried":
        return f"from {event.state} by {event.data.get('by')}" + (
            f", set {json.dumps(event.data['set'])}" if event.data.get("set") else ""
        )
    return str(event.data.get("reason", "")) if event.data else ""


def progress_printer(
    prefix: str = "", *, every: float = 1.0
) -> Callable[[RunRecord, Sequence[JournalEvent]], None]:
    """Prints each committed boundary of a run as it happens.

    A run whose context counts its work — numeric ``<what>_done`` fields (``rows_done``,
    ``batches_done`` …, with ``<what>_total`` when known) and ``rejects`` / ``errors``, at the
    top level or in a ``progress`` dict, plus the ``file`` or ``item`` being worked on — also
    gets progress lines with a rate (of ``rows_done``, else the first ``_done`` counter) and
    an ETA. Its steps that loop back to their own state (batch after batch) print no line
    each: a progress line comes at most every ``every`` seconds, when such a loop ends and
    when the run ends. A ``summary`` text in the final context is printed last.
    """
    import time

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
                f"{prefix}[dim]seq {event.seq:>3}[/] {event.kind:<16} "
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
            out.print(f"{prefix}run {record.id} {styled(record.status)} in state {record.state}")
            first_seen.pop(record.id, None)
            last_line.pop(record.id, None)

    return show


# -- commands ----------------------------------------------------------------------------------


GLOBAL_FLAGS = "flowloop.flags"
CONFIG_PATH = "flowloop.config"
TRACE = "flowloop.trace"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flowloop", prog_name="flowloop")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Configuration file [env FLOWLOOP_CONFIG; default ./flowloop.toml, "
    "else [tool.flowloop] in ./pyproject.toml].",
)
@click.option(
    "--log-format",
    type=click.Choice(FORMATS),
    default=None,
    help="Log lines as text or JSON objects, one per line [default: text].",
)
@click.option(
    "--log-level",
    type=click.Choice(LEVELS, case_sensitive=False),
    default=None,
    help="[default: info for worker, warning otherwise]",
)
@click.option(
    "--trace",
    is_flag=True,
    help="Trace runs with OpenTelemetry (needs flowloop[otel]; exporter from "
    "OTEL_TRACES_EXPORTER: console (stderr, default), otlp or none).",
)
@click.pass_context
def cli(
    ctx: click.Context,
    config_path: str | None,
    log_format: str | None,
    log_level: str | None,
    trace: bool,
) -> None:
    """flowloop: explicit state-machine workflows, journaled step by step.

    Settings come from flowloop.toml (or [tool.flowloop] in pyproject.toml), then
    FLOWLOOP_* environment variables, then flags; later ones win."""
    flags = {"log_format": log_format, "log_level": log_level}
    ctx.meta[GLOBAL_FLAGS] = flags
    ctx.meta[CONFIG_PATH] = config_path
    ctx.meta[TRACE] = trace
    ctx.obj = config = load_settings(flags, config_file=config_path)
    default_level = "info" if ctx.invoked_subcommand == "worker" else "warning"
    setup_logging(config.log_format, config.log_level or default_level)


@cli.command()
@click.argument("target")
@click.option("--context", "context_text", help="Context as JSON, or @file.json.")
@click.option("--key", help="Business key (a second run with it returns the first).")
@db_option
@json_option
def run(
    target: str,
    context_text: str | None,
    key: str | None,
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Start a run of FILE[:WORKFLOW] and drive it to the end, showing each step.

    A business key that has a run already: the same context goes on with that run (a line
    says so); a different context is refused (exit 2), nothing started."""
    workflow, _ = load_target(target)
    apply_overrides(settings(), {workflow.name: workflow}, {})
    context = parse_context(context_text)
    with open_engine(db, synchronous) as engine:
        note = support.refuse_or_note_existing(engine, workflow, context, key)
        if note is not None and not as_json:
            out.print(note, markup=False)
        if not as_json:
            engine.listeners.append(progress_printer())
        info = run_interruptibly(engine, workflow, context, key=key, notice=err.print)
        waits = support.WaitStates(engine)
    if isinstance(info, Interrupted):
        where = f"-w {split_target(target)[0]} --db {database(db)}"
        resume_with, retry_with = f"flowloop resume {where}", f"flowloop retry {{run}} {where}"
        leave(interrupted_line(info, resume=resume_with, retry=retry_with))
    if as_json:
        click.echo(support.dumps({"run": info_json(info, waits), "existing": note is not None}))
        if info.status != "succeeded" and waits.of(info) is None:
            raise Failed(f"run {info.id} ended {info.status}: {info.error or info.reason or ''}")
        return
    if info.status == "scheduled" and info.state in workflow.waits:
        wait = workflow.waits[info.state]
        until = f"; times out at {iso(info.next_run_at)}" if info.next_run_at else ""
        out.print(
            f"run {info.id} waits in {info.state} for {' or '.join(wait.on)}{until} "
            f"(`flowloop send {info.id} EVENT`)"
        )
        return
    if info.status != "succeeded":
        raise Failed(f"run {info.id} ended {info.status}: {info.error or info.reason or ''}")


@cli.command()
@click.argument("target")
@click.option("--context", "context_text", help="Context as JSON, or @file.json.")
@click.option(
    "--contexts",
    "contexts_file",
    help="Many runs: a JSON Lines file (one context per line; - reads stdin).",
)
@click.option("--key", help="Business key.")
@click.option("--priority", type=int, default=0, show_default=True)
@db_option
@json_option
def start(
    target: str,
    context_text: str | None,
    contexts_file: str | None,
    key: str | None,
    priority: int,
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Enqueue a run of FILE[:WORKFLOW] for a worker (or `flowloop resume`); with
    --contexts, one run per line, a thousand per transaction."""
    if contexts_file is not None:
        if context_text is not None or key is not None:
            raise FlowloopError(
                "--contexts takes each run's context (and key) from its line; drop --context/--key"
            )
        start_many(target, contexts_file, priority, db, synchronous, as_json)
        return
    workflow, _ = load_target(target)
    context = parse_context(context_text)
    with open_engine(db, synchronous) as engine:
        note = support.refuse_or_note_existing(engine, workflow, context, key)
        info = engine.start(workflow, context, key=key, priority=priority)
    if as_json:
        click.echo(json.dumps(info_json(info) | {"existing": note is not None}))
    elif note is not None:
        out.print(note, markup=False)
    else:
        out.print(f"run {info.id} {styled(info.status)} ({info.workflow} at {info.state})")


def read_json_lines(name: str) -> list[Any]:
    """The JSON objects of a JSON Lines file (``-``: stdin), blank lines skipped."""
    if name == "-":
        data, source = sys.stdin.buffer.read(), "stdin"
    else:
        path = Path(name)
        if not path.is_file():
            raise FlowloopError(f"--contexts {name}: no such file")
        data, source = path.read_bytes(), str(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FlowloopError(f"{source} is not UTF-8 text: {error.reason}") from None
    values = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise FlowloopError(f"{source} line {number} is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise FlowloopError(
                f"{source} line {number}: a context must be a JSON object, not "
                f"{type(value).__name__} (one object per line)"
            )
        values.append(value)
    return values


def start_many(
    target: str, contexts_file: str, priority: int, db: str | None, synchronous: str, as_json: bool
) -> None:
    workflow, _ = load_target(target)
    contexts = read_json_lines(contexts_file)
    # A progress bar on a terminal only: a piped stderr gets nothing but errors.
    bar = Progress(console=err, transient=True, disable=not err.is_terminal)
    with open_engine(db, synchronous) as engine, bar:
        task = bar.add_task(f"starting {workflow.name} runs", total=len(contexts))
        infos = engine.start_many(
            workflow,
            contexts,
            priority=priority,
            progress=lambda done, _total: bar.update(task, completed=done),
        )
    if as_json:
        click.echo(json.dumps([info_json(info) for info in infos]))
        return
    out.print(
        f"{len(infos)} run(s) of {workflow.name}: {infos.created} new, "
        f"{len(infos) - infos.created} already there (same key)"
    )


@cli.command()
@click.argument("run_id", required=False)
@click.option("--workflow", help="Only runs of this workflow.")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    help="Only runs with this status (as shown: `waiting`, `scheduled`, `failed` …).",
)
@click.option("--key", help="Only runs with this business key.")
@click.option("--limit", type=click.IntRange(1), default=50, show_default=True)
@click.option("--after", "after_id", metavar="RUN_ID", help="The runs listed after this one.")
@db_option
@json_option
def status(
    run_id: str | None,
    workflow: str | None,
    statuses: tuple[str, ...],
    key: str | None,
    limit: int,
    after_id: str | None,
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Show one run, or list runs (newest first, --limit at a time: --after the last one
    shown lists the next ones). A run resting in a wait state shows as `waiting`."""
    with open_engine(db, synchronous, read=True) as engine:
        waits = support.WaitStates(engine)
        if run_id:
            info = engine.get(run_id)
            if as_json:
                click.echo(json.dumps(info_json(info, waits)))
                return
            show_run(info, waits.of(info))
            for line in children.family_lines(engine.store, info.id):
                out.print(line)
            return
        infos, truncated = support.list_runs(
            engine,
            waits,
            workflow=workflow,
            statuses=statuses,
            key=key,
            limit=limit,
            after=after_id,
        )
        breakers = list(getattr(engine.store, "breakers", list)())
        if as_json:
            listed = [info_json(i, waits) for i in infos]
        else:
            rows = [(info, waits.status(info)) for info in infos]
            table = status_table(rows, {})
            natural = out.measure(table, options=out.options.update_width(10_000)).maximum
            if natural > out.width:  # a narrow terminal: short ids that still work
                table = status_table(rows, support.short_ids(engine, [i.id for i in infos]))
            pressure = support.backpressure_lines(engine, workflow)
    if as_json:
        page = {
            "runs": listed,
            "limit": limit,
            "truncated": truncated,
            "next_after": infos[-1].id if truncated else None,
            "breakers": [dataclasses.asdict(b) for b in breakers],
        }
        click.echo(json.dumps(page))
        return
    out.print(table)
    for b in breakers:  # circuit breakers shared by the workers (flowloop.flowcontrol)
        until = f" until {iso(b.until)}" if b.until is not None and b.status != "closed" else ""
        out.print(
            f"breaker {b.name}: {b.status}{until} (opened {b.opened} time(s), "
            f"{b.failures} recent failure(s))",
            markup=False,
        )
    for line in pressure:
        out.print(line, markup=False)
    if truncated:
        out.print(
            f"(the newest {limit} shown; more: `flowloop status --after {infos[-1].id}` "
            "or --limit N)",
            markup=False,
        )


def status_table(rows: Sequence[tuple[RunInfo, str]], short: dict[str, str]) -> Table:
    """The runs table; ``short``: the short form of (some) ids (see flowloop.ids)."""
    shown_ids = [short.get(info.id, info.id) for info, _ in rows]
    # Never cut an id short with an ellipsis: a shown id must work as a RUN argument.
    run_column = Column("run", no_wrap=True, min_width=max(map(len, shown_ids), default=3))
    status_column = Column("status", no_wrap=True)
    table = Table(
        run_column, "workflow", status_column, "state", "attempt", "key", "updated", "note"
    )
    for info, shown in rows:
        table.add_row(
            short.get(info.id, info.id),
            f"{info.workflow} v{info.version}",
            styled(shown),
            info.state,
            str(info.attempt),
            escape(info.key or ""),
            iso(info.updated_at),
            escape((info.error or info.reason or "")[:60]),
        )
    return table


def show_run(info: RunInfo, waiting: support.Waiting | None = None) -> None:
    out.print(f"run       {info.id}")
    out.print(f"workflow  {info.workflow} v{info.version}")
    shown = support.WAITING if waiting is not None else info.status
    out.print(f"status    {styled(shown)}" + (f" ({escape(info.reason)})" if info.reason else ""))
    if waiting is not None:
        out.print(f"waits     {escape(waiting.describe())} (stored status {info.status})")
    out.print(f"state     {info.state} (attempt {info.attempt})")
    if info.key:
        out.print(f"key       {escape(info.key)}")
    if info.error:
        out.print(f"error     {escape(info.error)}")
    if info.next_run_at is not None and info.status in ("scheduled", "retrying"):
        out.print(f"next run  {iso(info.next_run_at)}")
    out.print(f"updated   {iso(info.updated_at)} (seq {info.last_seq})")
    out.print(f"context   {escape(json.dumps(context_json(info)))}")


@cli.command()
@click.argument("run_id")
@db_option
@json_option
def history(run_id: str, db: str | None, synchronous: str, as_json: bool) -> None:
    """The journal of RUN_ID: one line per boundary."""
    with open_engine(db, synchronous, read=True) as engine:
        events = engine.history(run_id)
        info = engine.get(run_id)
        waiting = support.WaitStates(engine).of(info)
        family = children.family_lines(engine.store, run_id)
    if as_json:
        click.echo(json.dumps([event_json(e) for e in events]))
        return
    table = Table("seq", "at", "event", "state", "attempt", "duration", "detail")
    for event in events:
        table.add_row(
            str(event.seq),
            iso(event.at),
            event.kind,
            event.state or "",
            str(event.attempt or ""),
            f"{event.duration * 1000:.1f} ms" if event.duration is not None else "",
            escape(describe_event(event)[:80]),
        )
    out.print(table)
    if waiting is not None:
        out.print(f"run {info.id} is {escape(waiting.describe())}")
    for line in family:
        out.print(line)


@cli.command()
@click.argument("run_id")
@click.option("--at", "at_seq", type=int, help="Show the context as of this seq.")
@db_option
@json_option
def replay(
    run_id: str, at_seq: int | None, db: str | None, synchronous: str, as_json: bool
) -> None:
    """Fold the journal of RUN_ID, print the context (at --at SEQ) and verify the fold
    equals the stored row (exit 1 when it does not)."""
    with open_engine(db, synchronous, read=True) as engine:
        result = engine.replay(run_id, at=at_seq)
    record = result.record
    if as_json:
        click.echo(
            json.dumps(
                {
                    "run_id": result.run_id,
                    "seq": result.seq,
                    "status": record.status,
                    "state": record.state,
                    "context": json.loads(record.context),
                    "matches": result.matches,
                    "differences": result.differences,
                }
            )
        )
    else:
        out.print(f"seq {result.seq}: status {styled(record.status)}, state {record.state}")
        out.print(f"context {escape(record.context)}")
        if result.matches:
            out.print(f"[green]journal fold ({len(result.events)} events) equals the stored row[/]")
    if not result.matches:
        raise Failed("journal fold differs from the stored row: " + "; ".join(result.differences))


@cli.command()
@workflows_option
@click.option("--concurrency", type=int, default=16, show_default=True)
@db_option
@json_option
def resume(
    workflow_paths: tuple[str, ...],
    concurrency: int,
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Recover runs interrupted by a crash and drive every due run to the end."""
    loaded = load_workflow_paths(workflow_paths)
    if not loaded.workflows:
        raise FlowloopError("no workflows loaded: pass -w FILE_OR_DIR (default ./workflows)")
    with Engine(database(db), synchronous=synchronous, max_concurrency=concurrency) as engine:
        engine.register(*loaded.workflows.values())
        if not as_json:
            engine.listeners.append(progress_printer())
        stats = engine.resume()
    if as_json:
        done = {"recovered": stats.recovered, "steps": stats.steps, "commits": stats.commits}
        click.echo(json.dumps(done))
        return
    out.print(
        f"resumed: {stats.recovered} interrupted run(s) recovered, {stats.steps} step(s) "
        f"run, {stats.commits} commit(s)"
    )


@cli.command()
@click.argument("run_id")
@click.option("--from", "from_state", help="Restart at this past state with its recorded context.")
@click.option("--set", "assignments", multiple=True, help="FIELD=VALUE edit of the context.")
@click.option(
    "--run/--no-run", "drive", default=True, show_default=True, help="Drive the run to its end now."
)
@workflows_option
@db_option
@json_option
def retry(
    run_id: str,
    from_state: str | None,
    assignments: tuple[str, ...],
    drive: bool,
    workflow_paths: tuple[str, ...],
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Run a failed or stopped run again."""
    loaded = load_workflow_paths(workflow_paths)
    with open_engine(db, synchronous, loaded) as engine:
        info = engine.retry(
            run_id, from_state=from_state, set_fields=parse_assignments(assignments)
        )
        if not as_json:
            out.print(f"run {info.id} {styled(info.status)} at {info.state}")
        if drive:
            if not as_json:
                engine.listeners.append(progress_printer())
            engine.run_until_idle()
            info = engine.get(info.id)
        waits = support.WaitStates(engine)
        if as_json:
            click.echo(json.dumps({"run": info_json(info, waits)}))
        if drive and info.status != "succeeded" and waits.of(info) is None:
            raise Failed(f"run {info.id} ended {info.status}: {info.error or info.reason or ''}")


def _control_command(name: str, doc: str) -> None:
    @cli.command(name=name, help=doc)
    @click.argument("target")
    @db_option
    @json_option
    def command(target: str, db: str | None, synchronous: str, as_json: bool) -> None:
        with open_engine(db, synchronous, read=True) as engine:
            # A loop's name first: a name is never taken for a run id prefix.
            if any(row.name == target for row in engine.loops()):
                row = getattr(engine, f"{name}_loop")(target)
                if as_json:
                    click.echo(json.dumps({"loop": loop_json(row)}))
                    return
                pending = (
                    f" ({row.control} requested; after the running iteration)"
                    if row.control
                    else ""
                )
                out.print(f"loop {row.name} {styled(row.status)}{pending}")
                return
            try:
                info = getattr(engine, name)(target)
            except UnknownRun as error:
                raise UnknownRun(
                    target,
                    "and no loop of that name: list runs with `flowloop status`, loops with "
                    "`flowloop loops` (a loop is listed once a worker has started it)",
                ) from error
            if as_json:
                click.echo(json.dumps({"run": info_json(info, support.WaitStates(engine))}))
                return
        pending = (
            " (requested; its worker acts at the next step boundary)"
            if info.status == "running"
            else ""
        )
        out.print(f"run {info.id} {styled(info.status)}{pending}")


_control_command(
    "pause", "Pause a loop or run (TARGET: loop name or run id); what is in progress finishes."
)
_control_command("unpause", "Resume a paused loop or run (TARGET: loop name or run id).")
_control_command(
    "stop", "Stop a loop or run for good (TARGET: loop name or run id); cancels work in progress."
)


@cli.command()
@click.argument("paths", nargs=-1)
@workflows_option
@click.option(
    "--concurrency", type=int, default=None, help="Steps and loop iterations at once [default: 16]."
)
@click.option(
    "--grace",
    default=None,
    help="Time in-flight work gets to finish on SIGTERM/SIGINT (30, 30s, 2m) [default: 30s].",
)
@click.option("--lease", default=None, help="Lease length (30, 30s, 1m) [default: 30s].")
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="Serve Prometheus metrics on this port (0: any free port) [default: off].",
)
@click.option(
    "--metrics-host", default=None, help="Address for --metrics-port [default: 127.0.0.1]."
)
@db_option
@click.option(
    "--json", "as_json", is_flag=True, help="Print the start-up line as a JSON object on stdout."
)
def worker(
    paths: tuple[str, ...],
    workflow_paths: tuple[str, ...],
    concurrency: int | None,
    grace: str | None,
    lease: str | None,
    metrics_port: int | None,
    metrics_host: str | None,
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Execute due runs and loop iterations from PATHS or -w (default ./workflows) until
    stopped."""
    from flowloop.metrics import Metrics
    from flowloop.worker import Worker

    paths = paths + workflow_paths

    config = command_settings(
        db=db,
        concurrency=concurrency,
        grace=grace,
        lease=lease,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
    )
    loaded = load_workflow_paths(paths)
    if not loaded.workflows and not loaded.loops:
        raise FlowloopError(
            "nothing to run: no workflows or loops in " + (", ".join(paths) or DEFAULT_WORKFLOWS)
        )
    with Engine(
        database(config.db),
        synchronous=synchronous,
        max_concurrency=config.concurrency,
        lease_seconds=config.lease,
    ) as engine:
        engine.register(*loaded.workflows.values())
        if click.get_current_context().meta.get(TRACE):
            _trace(engine)
        metrics, serving = None, None
        if as_json and config.metrics_port is not None:
            # Served before the worker starts, so the start-up line can name the port.
            metrics = Metrics()
            port = metrics.serve(config.metrics_port, config.metrics_host)
            serving = f"http://{config.metrics_host}:{port}/metrics"
        running = Worker(
            engine,
            list(loaded.loops.values()),
            concurrency=config.concurrency,
            grace=config.grace,
            alerts=config.make_alerts(),
            metrics=metrics,
            metrics_port=None if as_json else config.metrics_port,
            metrics_host=config.metrics_host,
        )
        if as_json:
            started = {
                "event": "worker_started",
                "worker": engine.worker_id,
                "db": safe_url(engine.url),
                "workflows": sorted(loaded.workflows),
                "loops": sorted(loaded.loops),
                "concurrency": running.concurrency,
                "metrics": serving,
            }
            click.echo(json.dumps(started))
            sys.stdout.flush()
        running.run_forever()


@cli.command(name="loops")
@click.argument("name", required=False)
@click.option("--limit", type=int, default=20, show_default=True, help="Journal lines for NAME.")
@db_option
@json_option
def loops_command(
    name: str | None, limit: int, db: str | None, synchronous: str, as_json: bool
) -> None:
    """List loops (name, schedule, status, last result, next fire …), or one loop's journal."""
    with open_engine(db, synchronous, read=True) as engine:
        rows = [engine.loop(name)] if name else engine.loops()
        events = engine.loop_history(name, limit=limit) if name else []
    if as_json:
        journal = [
            support.with_times(vars(e) | {"data": dict(e.data)}, "at", "slot") for e in events
        ]
        click.echo(json.dumps({"loops": [loop_json(r) for r in rows], "journal": journal}))
        return
    table = Table(
        "loop",
        "schedule",
        "status",
        "last result",
        "next fire",
        "iterations",
        "skipped",
        "missed",
        "failures",
        "note",
    )
    for row in rows:
        table.add_row(
            row.name,
            row.schedule,
            styled(row.status),
            row.last_result or "-",
            iso(row.next_fire_at),
            str(row.iterations),
            str(row.skipped),
            str(row.missed),
            str(row.consecutive_failures),
            # Whole (wrapped, not cut): a loop's last error is what the operator needs.
            escape(
                row.last_error or row.reason or (f"{row.control} requested" if row.control else "")
            ),
        )
    out.print(table)
    if events:
        journal_table = Table("seq", "at", "event", "slot", "count", "duration", "detail")
        for event in events:
            journal_table.add_row(
                str(event.seq),
                iso(event.at),
                event.kind,
                iso(event.slot),
                str(event.count or ""),
                f"{event.duration * 1000:.1f} ms" if event.duration is not None else "",
                escape(event.error_message or str(event.data.get("reason", "")) or ""),
            )
        out.print(journal_table)


def _when(text: str, option: str) -> float:
    """An ISO 8601 time for --from/--to; without an offset it is UTC."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise FlowloopError(
            f"{option}={text!r} is not an ISO 8601 time (e.g. 2026-03-29T02:30 in UTC, or "
            "2026-03-29T02:30+02:00)"
        ) from None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


@cli.command(name="trigger")
@click.argument("name")
@db_option
@json_option
def trigger_command(name: str, db: str | None, synchronous: str, as_json: bool) -> None:
    """Run one iteration of loop NAME now (journaled as manual; its worker runs it, never
    while another iteration of NAME runs; the schedule is unchanged)."""
    with open_engine(db, synchronous, read=True) as engine:
        row = engine.trigger_loop(name)
    if as_json:
        click.echo(json.dumps({"loop": loop_json(row)}))
        return
    out.print(f"loop {row.name}: trigger requested; its worker runs it (`flowloop loops {name}`)")


@cli.command(name="backfill")
@click.argument("name")
@click.option("--from", "start", required=True, help="First slot time (ISO 8601; UTC if bare).")
@click.option("--to", "end", required=True, help="Last slot time (ISO 8601; UTC if bare).")
@click.option(
    "--max",
    "limit",
    type=int,
    default=loop_requests.DEFAULT_BACKFILL_MAX,
    show_default=True,
    help="Run at most this many slots.",
)
@click.option("--wait", is_flag=True, help="Show progress until the backfill has finished.")
@click.option("--timeout", "timeout_text", default="10m", show_default=True, help="For --wait.")
@db_option
@json_option
def backfill_command(
    name: str,
    start: str,
    end: str,
    limit: int,
    wait: bool,
    timeout_text: str,
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Run the slots of loop NAME between --from and --to that never ran (missed while
    no worker ran, given up past the misfire grace), oldest first, one at a time."""
    request = loop_requests.BackfillRequest(_when(start, "--from"), _when(end, "--to"), limit)
    timeout = seconds_option(timeout_text, "--timeout")
    with open_engine(db, synchronous, read=True) as engine:
        row = engine.backfill_loop(name, request)
        if not as_json:
            out.print(
                f"loop {row.name}: backfill of {iso(request.start)} .. {iso(request.end)} "
                f"requested (at most {limit} slots); its worker runs it"
            )
        seen = row.last_seq
        finished = not wait
        deadline = time.monotonic() + timeout
        while not finished:
            for event in engine.loop_history(name, limit=1000):
                if event.seq <= seen:
                    continue
                seen = event.seq
                if event.kind == "backfill_finished":
                    finished = True
                elif event.data.get("reason") == "backfill" and not as_json:
                    out.print(f"  slot {iso(event.slot)} started")
                elif event.kind.startswith("iteration_") and not as_json:
                    out.print(f"  slot {iso(event.slot)} {event.kind.removeprefix('iteration_')}")
            if not finished:
                if time.monotonic() > deadline:
                    raise FlowloopError(
                        f"backfill of loop {name!r} still running after {timeout_text}; it goes "
                        f"on (`flowloop loops {name}`)"
                    )
                time.sleep(engine.poll_seconds)
        row = engine.loop(name)
    if as_json:
        click.echo(json.dumps({"loop": loop_json(row)}))
    elif wait:
        out.print(f"loop {row.name}: backfill finished")


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


@cli.command()
@click.argument("target")
@click.argument("event")
@click.option("--data", "data_text", help="Payload as JSON, or @file.json.")
@click.option("--workflow", help="TARGET is a business key of this workflow, not a run id.")
@click.option("--dedupe-key", help="Sending twice with this key has effect once.")
@click.option("--buffer", is_flag=True, help="Keep the event until the run can take it.")
@workflows_option
@db_option
@json_option
def send(
    target: str,
    event: str,
    data_text: str | None,
    workflow: str | None,
    dedupe_key: str | None,
    buffer: bool,
    workflow_paths: tuple[str, ...],
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Send EVENT to a waiting run (TARGET: run id, or a business key with --workflow)."""
    from flowloop.errors import UnknownWorkflow

    loaded = load_workflow_paths(workflow_paths)
    payload = parse_context(data_text, "--data") if data_text is not None else None
    with open_engine(db, synchronous, loaded, read=True) as engine:
        run_id = target
        if workflow is not None:
            found = engine.find(workflow, key=target)
            if found is None:
                raise FlowloopError(f"no run of workflow {workflow!r} has key {target!r}")
            run_id = found.id
        try:
            result = engine.send(run_id, event, payload, dedupe_key=dedupe_key, buffer=buffer)
        except UnknownWorkflow as error:
            where = ", ".join(workflow_paths) or (
                f"./{DEFAULT_WORKFLOWS}" if Path(DEFAULT_WORKFLOWS).is_dir() else "no ./workflows"
            )
            raise FlowloopError(
                f"{error}, loaded from {where}; pass -w FILE_OR_DIR that defines it"
            ) from error
        waits = support.WaitStates(engine)
        waiting = waits.of(result.run)
    info = result.run
    if as_json:
        click.echo(json.dumps({"result": result.status, "run": info_json(info, waits)}))
        return
    shown = styled(support.WAITING if waiting else info.status)
    out.print(
        f"{event}: {result.status}; run {info.id} {shown} at {info.state}"
        + escape(support.what_continues(info, waiting))
    )


@cli.group()
def db() -> None:
    """The database schema: `flowloop db upgrade` applies pending migrations."""


@db.command()
@db_option
@json_option
def upgrade(db: str | None, synchronous: str, as_json: bool) -> None:
    """Bring the database schema up to this flowloop's version (creates it if new)."""
    store = SQLStore(database(db), synchronous=synchronous, check_schema=False)
    try:
        before, after = store.upgrade_schema()
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps({"from": before, "to": after, "changed": before != after}))
    elif before == after:
        out.print(f"schema already at revision {after}")
    else:
        out.print(f"schema upgraded from {before or 'nothing'} to {after}")


@db.command()
@click.option("-m", "--message", required=True, help="What changed in flowloop/store/schema.py.")
def revision(message: str) -> None:
    """(Developers) autogenerate a migration for changes to the schema module."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        store = SQLStore(f"{folder}/head.db", check_schema=False)
        try:
            store.upgrade_schema()
            store.new_revision(message)
        finally:
            store.close()


@cli.command()
@click.argument("target")
@db_option
@json_option
@click.option("--all-runs", is_flag=True, help="List every live run, not only those that change.")
def check(target: str, db: str | None, synchronous: str, as_json: bool, all_runs: bool) -> None:
    """Validate the workflows in FILE and tell, run by run, what they do to live runs:
    continues as is, continues after migration, would be parked, would fail. Exit 0 only
    when nothing would be parked or fail."""
    from flowloop.checking import check_workflows
    from flowloop.cli_deploy import print_check_report

    path = target.split(":")[0]
    loaded = load_paths([path])
    with open_engine(db, synchronous, read=True) as engine:
        assert isinstance(engine.store, SQLStore)
        reports = check_workflows(engine.store, loaded.all_versions(), every=all_runs)
    bad = [run for _, report in reports for run in report.runs if run.kind in ("parks", "fails")]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "ok": not bad,
                    "workflows": [
                        {**report.as_dict(), "name": workflow.name, "states": len(workflow.states)}
                        for workflow, report in reports
                    ],
                    "stranded": [run.as_dict() for run in bad],
                }
            )
        )
    else:
        for workflow, report in reports:
            print_check_report(out, workflow, report)
    if bad:
        raise Failed(f"{len(bad)} live run(s) would be parked or fail under this definition")


@cli.command()
@click.argument("target", required=False)
@click.option(
    "--lifecycle",
    "draw_lifecycle",
    is_flag=True,
    help="Draw the lifecycle machine every run and loop follows.",
)
@click.option(
    "--run",
    "run_id",
    metavar="RUN_ID",
    help="Draw one run from the store on its workflow (its workflow from -w).",
)
@click.option(
    "--loop",
    "loop_name",
    metavar="NAME",
    help="Draw one stored loop (status, counts, last error, next fire) on its machine.",
)
@click.option(
    "--all",
    "draw_all",
    is_flag=True,
    help="Draw every workflow and loop in -w and the lifecycle into --out as .dot and .svg.",
)
@click.option(
    "-o",
    "--out",
    "out_path",
    type=click.Path(path_type=Path),
    help="File to write [default: stdout]; with --all the directory [default: diagrams].",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["dot", "svg", "png"]),
    help="Output format [default: from the -o suffix, else dot].",
)
@click.option(
    "--runs",
    "draw_runs",
    is_flag=True,
    help="With FILE: all runs of --since from the store drawn on it (a heat map).",
)
@click.option("--since", default="24h", show_default=True, help="Window of --runs, or 'all'.")
@workflows_option
@db_option
@json_option
def diagram(
    target: str | None,
    draw_lifecycle: bool,
    run_id: str | None,
    loop_name: str | None,
    draw_all: bool,
    out_path: Path | None,
    fmt: str | None,
    draw_runs: bool,
    since: str,
    workflow_paths: tuple[str, ...],
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Draw FILE[:WORKFLOW_OR_LOOP], the lifecycle, one run (--run), one stored loop
    (--loop) or everything (--all).

    DOT needs nothing else; SVG and PNG need Graphviz's `dot` program."""
    from flowloop import render  # lazy: only this command needs graphviz
    from flowloop.errors import UnknownWorkflow

    given = [
        name
        for name, value in (
            ("FILE[:NAME]", target),
            ("--lifecycle", draw_lifecycle),
            ("--run", run_id),
            ("--loop", loop_name),
            ("--all", draw_all),
        )
        if value
    ]
    if len(given) != 1:
        raise FlowloopError(
            "diagram: give exactly one of FILE[:NAME], --lifecycle, --run RUN_ID, --loop NAME "
            "or --all" + (f" (got {', '.join(given)})" if given else "")
        )
    if draw_runs and target is None:
        raise FlowloopError("diagram: --runs draws FILE[:WORKFLOW] with its runs; give FILE")
    if draw_all:
        if fmt is not None:
            raise FlowloopError("diagram --all writes .dot and .svg; --format is for one diagram")
        out_dir = out_path or Path(render.DIAGRAMS_DIR)
        loaded = load_workflow_paths(workflow_paths)
        diagrams = render.all_diagrams(loaded.workflows.values(), loaded.loops.values())
        written = render.write_all(diagrams, out_dir)
        stale = render.stale(out_dir, diagrams)
        if as_json:
            listed = {"wrote": [str(p) for p in written], "stale": [str(p) for p in stale]}
            click.echo(json.dumps(listed))
            return
        for path in written:
            out.print(f"wrote {path}", markup=False)
        for path in stale:
            err.print(f"stale: {path} is drawn from no workflow any more; delete it", markup=False)
        return
    if draw_lifecycle:
        graph = render.lifecycle_digraph()
    elif run_id is not None:
        loaded = load_workflow_paths(workflow_paths)
        with open_engine(db, synchronous, loaded, read=True) as engine:
            try:
                graph = engine.diagram(run_id)
            except UnknownWorkflow as error:
                raise FlowloopError(f"{error}; pass -w FILE_OR_DIR that defines it") from error
    elif loop_name is not None:
        graph = _stored_loop_diagram(loop_name, workflow_paths, db, synchronous)
    else:
        assert target is not None
        if draw_runs:  # all runs of the window on it: flowloop/heat.py
            from flowloop.heat import workflow_heat_digraph

            support.require_database(database(db))  # a read: a typo in --db creates nothing
            graph = workflow_heat_digraph(load_target(target)[0], database(db), since=since)
        else:
            graph = _machine_diagram(target)
    fmt = fmt or (render.format_for(out_path) if out_path is not None else "dot")
    if out_path is None:
        if fmt == "png":
            raise FlowloopError("diagram: PNG is binary; write it to a file with -o FILE.png")
        content = render.render_bytes(graph, fmt)
        if as_json:
            click.echo(json.dumps({"format": fmt, "content": content.decode("utf-8")}))
            return
        sys.stdout.buffer.write(content)
        sys.stdout.flush()
        return
    render.save(graph, out_path, fmt)
    if as_json:
        click.echo(json.dumps({"wrote": str(out_path), "format": fmt}))
        return
    out.print(f"wrote {out_path}", markup=False)


def _machine_diagram(target: str) -> graphviz.Digraph:
    from flowloop import render_loops
    from flowloop.loader import load_machine
    from flowloop.loops import Loop

    machine = load_machine(target)[0]
    if isinstance(machine, Loop):
        return render_loops.loop_digraph(machine)
    return machine.diagram()


def _stored_loop_diagram(
    name: str, workflow_paths: tuple[str, ...], db: str | None, synchronous: str
) -> graphviz.Digraph:
    from flowloop import render_loops

    loaded = load_workflow_paths(workflow_paths)
    with open_engine(db, synchronous, loaded, read=True) as engine:
        row = engine.loop(name)
        limit = render_loops.OVERLAY_JOURNAL_LIMIT
        events = engine.loop_history(name, limit=limit)
    loop = loaded.loops.get(name)
    if loop is None:
        raise FlowloopError(
            f"loop {name!r} is not defined in -w; pass -w FILE_OR_DIR that defines it"
        )
    return render_loops.stored_loop_digraph(loop, row, events, capped=len(events) >= limit)


@cli.command(name="stats")
@click.argument("workflow", required=False)
@click.option(
    "--since",
    default="24h",
    show_default=True,
    help="How far back: a duration (30m, 24h, 7d) or 'all' (slow on a long history).",
)
@click.option(
    "--slowest",
    type=click.IntRange(0, 100),
    default=3,
    show_default=True,
    help="Slowest run ids shown per state.",
)
@db_option
@json_option
def stats_command(
    workflow: str | None,
    since: str,
    slowest: int,
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Per workflow: runs finished, their success rate and whole-run latency p50/p95/p99;
    per workflow and state: step attempts, their success rate, retries, p50/p95/p99
    duration and the slowest runs; per loop: iterations by outcome and p50/p95 duration.
    Computed from the journals."""
    from flowloop.stats import loop_stats, run_stats, step_stats

    window = None if since.strip().lower() == "all" else seconds_option(since, "--since")
    with open_engine(db, synchronous, read=True) as engine:
        start = None if window is None else engine.clock.now() - window
        db_engine = sql_engine(engine)
        found = step_stats(db_engine, workflow=workflow, since=start, slowest=slowest)
        whole = run_stats(db_engine, workflow=workflow, since=start)
        looped = [] if workflow else loop_stats(db_engine, since=start)
    if as_json:
        page = {
            "since": start,
            "runs": [row.as_dict() for row in whole],
            "states": [row.as_dict() for row in found],
            "loops": [row.as_dict() for row in looped],
        }
        click.echo(json.dumps(support.with_times(page, "since")))
        return
    scope = "all history" if start is None else f"since {iso(start)} ({since})"
    if not (found or whole or looped):
        out.print(
            f"nothing journaled {'in ' if start is None else ''}{scope}"
            + (f" for workflow {workflow}" if workflow else ""),
            markup=False,
        )
        return
    if whole:
        runs_table = Table(
            "workflow",
            "finished",
            "succeeded",
            "failed",
            "stopped",
            "run success",
            "latency p50",
            "p95",
            "p99",
            title=f"runs finished {scope} (latency: run_created to the end, succeeded runs)",
            title_justify="left",
        )
        for column in runs_table.columns[1:]:
            column.justify = "right"
        for run_row in whole:
            runs_table.add_row(
                run_row.workflow,
                str(run_row.finished),
                str(run_row.succeeded),
                str(run_row.failed),
                str(run_row.stopped),
                f"{run_row.success_rate:.1%}",
                seconds_text(run_row.p50),
                seconds_text(run_row.p95),
                seconds_text(run_row.p99),
            )
        out.print(runs_table)
    if found:
        table = Table(
            "workflow",
            "state",
            "attempts",
            "attempts ok",
            "retries",
            "p50",
            "p95",
            "p99",
            "slowest runs",
            title=f"step attempts, {scope}",
            title_justify="left",
        )
        for column in table.columns[2:8]:
            column.justify = "right"
        for row in found:
            table.add_row(
                row.workflow,
                row.state,
                str(row.count),
                f"{row.success_rate:.1%}",
                str(row.retries),
                seconds_text(row.p50),
                seconds_text(row.p95),
                seconds_text(row.p99),
                " ".join(run_id for run_id, _ in row.slowest),
            )
        out.print(table)
    if looped:
        loops_table = Table(
            "loop",
            "iterations",
            "by outcome",
            "slots not run",
            "p50",
            "p95",
            title=f"loop iterations ended {scope}",
            title_justify="left",
        )
        for loop_row in looped:
            loops_table.add_row(
                loop_row.loop,
                str(loop_row.iterations),
                ", ".join(f"{k} {v}" for k, v in loop_row.outcomes.items()) or "-",
                ", ".join(f"{k} {v}" for k, v in loop_row.slots_not_run.items()) or "-",
                seconds_text(loop_row.p50),
                seconds_text(loop_row.p95),
            )
        out.print(loops_table)


@cli.command(name="prune")
@click.option(
    "--older-than",
    required=True,
    help="Delete finished runs last updated longer ago than this (30d, 12h, …).",
)
@click.option(
    "--keep-failed",
    is_flag=True,
    help="Keep failed runs (and failed loop iterations) whatever their age.",
)
@click.option(
    "--loops/--no-loops",
    "loop_history",
    default=True,
    show_default=True,
    help="Also delete loop journal entries older than the cutoff.",
)
@click.option(
    "--batch",
    type=click.IntRange(1),
    default=500,
    show_default=True,
    help="Runs deleted per transaction.",
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option(
    "--vacuum",
    "run_vacuum",
    is_flag=True,
    help="Then VACUUM: PostgreSQL reuses the freed space, a SQLite file shrinks.",
)
@db_option
@json_option
def prune_command(
    older_than: str,
    keep_failed: bool,
    loop_history: bool,
    batch: int,
    dry_run: bool,
    run_vacuum: bool,
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Delete old finished runs with their journal and inbox (live runs are never touched)."""
    from flowloop.prune import prune, vacuum

    age = seconds_option(older_than, "--older-than")
    with open_engine(db, synchronous) as engine:
        result = prune(
            sql_engine(engine),
            cutoff=engine.clock.now() - age,
            keep_failed=keep_failed,
            loop_history=loop_history,
            batch=batch,
            dry_run=dry_run,
        )
        vacuumed = vacuum(sql_engine(engine)) if run_vacuum and not dry_run else None
    if as_json:
        click.echo(
            json.dumps(
                support.with_times({**result.as_dict(), "vacuumed": vacuumed is not None}, "cutoff")
            )
        )
        return
    kept = " (failed runs kept)" if keep_failed else ""
    verb = "would delete" if dry_run else "deleted"
    out.print(
        f"{verb} {result.runs:,} run(s) finished before {iso(result.cutoff)}{kept}: "
        f"{result.journal:,} journal row(s), {result.inbox:,} inbox row(s), "
        f"{result.loop_journal:,} loop journal entr{'y' if result.loop_journal == 1 else 'ies'}"
        + ("" if dry_run else f" in {result.batches} batch(es)"),
        markup=False,
    )
    if vacuumed is not None:
        out.print(vacuumed, markup=False)


@cli.command()
@click.argument("run_id", required=False)
@click.option("--workflow", "workflow_name", help="Move every live run of this workflow.")
@click.option("--to", "to_version", type=int, required=True, help="The version to move to.")
@workflows_option
@db_option
@json_option
def migrate(
    run_id: str | None,
    workflow_name: str | None,
    to_version: int,
    workflow_paths: tuple[str, ...],
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Move RUN (or every live run of --workflow) to version --to of its workflow, as that
    version's migrates_from= maps the states; journaled with who, from and to. A run parked
    for a mismatch goes on; one that cannot move is listed and left as it is."""
    from flowloop.cli_deploy import print_moved

    if (run_id is None) == (workflow_name is None):
        raise click.UsageError("give a RUN id or --workflow NAME (not both)")
    loaded = load_workflow_paths(workflow_paths)
    with open_engine(db, synchronous, loaded, read=True) as engine:
        if run_id is not None:
            info = engine.migrate(run_id, to=to_version)
            moved: list[tuple[str, str | None]] = [(info.id, None)]
        else:
            assert workflow_name is not None
            results = engine.migrate_workflow(workflow_name, to=to_version)
            moved = [(m.run_id, m.problem) for m in results]
    failed = print_moved(out, moved, to_version, as_json=as_json)
    if failed:
        raise Failed(f"{failed} run(s) could not be moved to v{to_version}")


# The dashboard: its module imports only click; starlette loads when `flowloop ui` runs.
from flowloop.ui.command import ui_command  # noqa: E402

cli.add_command(ui_command)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        cli.main(args=list(argv) if argv is not None else None, standalone_mode=False)
    except FlowloopError as error:
        err.print(f"error: {error}", markup=False)
        sys.exit(error.exit_code)
    except click.exceptions.Abort:
        err.print("interrupted; the journal holds every committed step (`flowloop resume`)")
        sys.exit(130)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted; the journal holds every committed step (`flowloop resume`)")
        sys.exit(130)
    except Exception as error:
        # The last line of defence: storage and encoding errors that no command turned
        # into a FlowloopError still get one line, never a traceback.
        line, code = last_resort(error)
        if line is None:
            raise
        err.print(f"error: {line}", markup=False)
        sys.exit(code)


if __name__ == "__main__":
    main()
