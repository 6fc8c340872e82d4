"""Commands that start and drive runs: `run`, `start`, `resume`, `retry`, `send`."""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from flowloop.cli.common import (
    Failed,
    database,
    db_option,
    defined_in,
    err,
    json_option,
    load_workflow_paths,
    open_engine,
    out,
    parse_assignments,
    parse_context,
    prepared,
    real_console,
    settings,
    sql_engine,
    workflows_option,
)
from flowloop.errors import EXIT_FAILURE, FlowloopError, InvalidContext, UnknownRun

if TYPE_CHECKING:
    from flowloop.committer import Stats
    from flowloop.definition import Workflow
    from flowloop.engine import Engine
    from flowloop.runinfo import RunInfo


@click.command()
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
    from flowloop.cli import hints, support
    from flowloop.cli.progress import printed_not_logged, progress_printer
    from flowloop.cli.views import info_json
    from flowloop.clock import iso
    from flowloop.config import apply_overrides
    from flowloop.interrupt import (
        EXIT_SIGNALLED,
        Interrupted,
        interrupted_line,
        leave,
        run_interruptibly,
    )
    from flowloop.loader import load_target, split_target

    workflow, _ = load_target(target)
    apply_overrides(settings(), {workflow.name: workflow}, {})
    context = checked_context(workflow, context_text)
    # What the commands it prints take to find this file and this database.
    where = hints.where(hints.file_paths(split_target(target)[0]), db)
    with open_engine(db, synchronous) as engine:
        note = support.refuse_or_note_existing(engine, workflow, context, key)
        if note is not None and not as_json:
            out.print(note, markup=False)
        shown_ends: set[str] = set()
        if not as_json:
            engine.listeners.append(progress_printer(shown_ends=shown_ends))
        with printed_not_logged(not as_json):
            info = run_interruptibly(engine, workflow, context, key=key, notice=err.print)
        waits = support.WaitStates(engine)
        due = None if isinstance(info, Interrupted) else support.run_due(engine, info)
    if isinstance(info, Interrupted):
        # --json still prints the run: as Ctrl-C handed it back (None: never created), and
        # how many SIGINTs came (1: its step finished, 2 or more: cut off).
        if as_json:
            run_json = info_json(info.run, waits) if info.run is not None else None
            interrupted = {"signals": info.signals}
            shown = {"run": run_json, "existing": note is not None, "interrupted": interrupted}
            click.echo(support.dumps(shown))
        resume_with, retry_with = f"flowloop resume{where}", f"flowloop retry {{run}}{where}"
        line = interrupted_line(info, resume=resume_with, retry=retry_with)
        leave(line, EXIT_SIGNALLED + info.first)
    if as_json:
        click.echo(support.dumps({"run": info_json(info, waits), "existing": note is not None}))
        _refuse_failed(info)
        return
    if waits.of(info) is not None and info.state in workflow.waits:  # (not asleep before it)
        wait = workflow.waits[info.state]
        until = f"; times out at {iso(info.next_run_at)}" if info.next_run_at else ""
        if due is not None and due.deadline_first:  # (not its timeout: sooner)
            until = "; " + due.deadline_words(f" at {iso(due.at)}")
        out.print(
            f"run {info.id} waits in {info.state} for {' or '.join(wait.on)}{until} "
            f"(`{hints.send_command(info.id, where)}`)",
            markup=False,
        )
        return
    _refuse_failed(info, shown_ends)
    if not info.finished:
        out.print(support.not_ended_line(info, due, where), markup=False)


def checked_context(workflow: Workflow, text: str | None) -> dict[str, Any]:
    """``--context`` of a new run of ``workflow``, validated before the database is opened:
    a context refused left a new, empty database file behind. A JSON value other than an
    object is refused as ``123`` is (a JSON string was read as JSON text again: ``'"x"'``
    said "Invalid JSON", ``'"{}"'`` was taken as an object)."""
    value = parse_context(text)
    if not isinstance(value, dict):
        got = type(value).__name__
        raise InvalidContext(workflow.name, f"expected an object of fields, got {got}")
    workflow.parse_new_context(value)
    return value


def _refuse_failed(info: RunInfo, shown_ends: Collection[str] = ()) -> None:
    """A run that ended otherwise than succeeded: exit 1 (one not ended has not failed),
    saying so unless the progress printer's last line of the run did (``shown_ends``)."""
    if not info.finished or info.status == "succeeded":
        return
    if info.id in shown_ends:
        sys.exit(EXIT_FAILURE)
    raise Failed(f"run {info.id} ended {info.status}: {info.error or info.reason or ''}")


@click.command()
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
    from flowloop.cli import support
    from flowloop.cli.views import info_json, styled
    from flowloop.loader import load_target

    if contexts_file is not None:
        if context_text is not None or key is not None:
            raise FlowloopError(
                "--contexts takes each run's context (and key) from its line; drop --context/--key"
            )
        start_many(target, contexts_file, priority, db, synchronous, as_json)
        return
    workflow, _ = load_target(target)
    context = checked_context(workflow, context_text)
    with open_engine(db, synchronous) as engine:
        note = support.refuse_or_note_existing(engine, workflow, context, key)
        info = engine.start(workflow, context, key=key, priority=priority)
        # (As status --json: a run that starts in a wait state says it waits, and for what.)
        shown = info_json(info, support.WaitStates(engine))
    if as_json:
        click.echo(json.dumps(shown | {"existing": note is not None}))
    elif note is not None:
        out.print(note, markup=False)
    else:
        out.print(f"run {info.id} {styled(info.status)} ({info.workflow} at {info.state})")


def read_json_lines(name: str) -> tuple[list[Any], list[str]]:
    """The JSON objects of a JSON Lines file (``-``: stdin), blank lines skipped; with
    where each is (``FILE line N``), for messages."""
    if name == "-":
        data, source = sys.stdin.buffer.read(), "stdin"
    else:
        if not name:  # (Path("") is the current directory: it said "a directory")
            raise FlowloopError("--contexts '': no file given; give a .jsonl file (or - for stdin)")
        path = Path(name)
        if path.is_dir():  # (as --context @DIR: "no such file" of a folder that is there)
            raise FlowloopError(f"--contexts {name}: a directory, not a file; give a .jsonl file")
        if not path.is_file():
            raise FlowloopError(f"--contexts {name}: no such file")
        data, source = path.read_bytes(), str(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FlowloopError(f"{source} is not UTF-8 text: {error.reason}") from None
    values, places = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        places.append(f"{source} line {number}")
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
    return values, places


def start_many(
    target: str, contexts_file: str, priority: int, db: str | None, synchronous: str, as_json: bool
) -> None:
    from rich.progress import Progress

    from flowloop.cli import support
    from flowloop.cli.views import info_json
    from flowloop.loader import load_target

    workflow, _ = load_target(target)
    contexts, places = read_json_lines(contexts_file)
    # A progress bar on a terminal only: a piped stderr gets nothing but errors.
    bar = Progress(console=real_console(err), transient=True, disable=not err.is_terminal)
    with open_engine(db, synchronous) as engine, bar:
        task = bar.add_task(f"starting {workflow.name} runs", total=len(contexts))
        try:
            infos = engine.start_many(
                workflow,
                contexts,
                priority=priority,
                progress=lambda done, _total: bar.update(task, completed=done),
            )
        except InvalidContext as error:
            if error.position is None:
                raise
            # Named by its line, as a line that is not JSON is (blank lines are not counted).
            raise FlowloopError(
                f"{places[error.position - 1]}: the context for workflow {workflow.name!r} "
                f"is invalid: {error.problems}"
            ) from None
        # A line whose key a run holds with another context changes nothing: said, exit 2.
        otherwise = support.started_otherwise(engine, workflow, contexts, infos)
        waits = support.WaitStates(engine)
        shown_runs = [info_json(info, waits) for info in infos] if as_json else []
    if as_json:
        click.echo(json.dumps(shown_runs))
    else:
        same = len(infos) - infos.created - len(otherwise)
        out.print(
            f"{len(infos)} run(s) of {workflow.name}: {infos.created} new, {same} already "
            f"there (same key)" + (f", {len(otherwise)} not started" if otherwise else "")
        )
    if otherwise:
        named = [
            f"{places[position]} (key {info.key!r}, run {info.id}: differs in {', '.join(fields)})"
            for position, info, fields in otherwise[:3]
        ]
        more = f" and {len(otherwise) - 3} more" if len(otherwise) > 3 else ""
        raise FlowloopError(
            f"{'; '.join(named)}{more}: a run holds the key, started with another context — "
            "not changed (use another key, or see it with `flowloop status RUN`); the other "
            "lines' runs are started"
        )


@click.command()
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
    """Recover runs interrupted by a crash and drive every due run to the end. Ctrl-C (or
    SIGTERM) lets the steps in flight finish and hands their runs back; a second cuts them
    off."""
    from flowloop.cli import hints
    from flowloop.cli.progress import idle_notice, printed_not_logged, progress_printer
    from flowloop.cli.startup import StoppedWaiting, when_reachable
    from flowloop.engine import Engine
    from flowloop.interrupt import EXIT_SIGNALLED, leave, resume_interruptibly

    loaded = load_workflow_paths(workflow_paths)
    if not loaded.workflows:
        raise FlowloopError("no workflows loaded: pass -w FILE_OR_DIR (default ./workflows)")
    url = database(db)

    def opened() -> Engine:
        engine = Engine(url, synchronous=synchronous, max_concurrency=concurrency)
        try:
            return prepared(engine, loaded)  # (traced with --trace: a resumed run joins its trace)
        except BaseException:
            engine.close()
            raise

    try:
        engine = when_reachable(opened, url)  # (started during an outage: it waits)
    except StoppedWaiting as stopped:
        err.print(str(stopped), markup=False)
        sys.exit(stopped.exit_code)
    with engine:
        if not as_json:
            engine.listeners.append(progress_printer())
        failed: dict[str, None] = {}  # (in order, each once)
        engine.listeners.append(
            lambda record, _: failed.setdefault(record.id) if record.status == "failed" else None
        )
        with printed_not_logged(not as_json):
            idle = (
                None if as_json else idle_notice(engine, lambda line: err.print(line, markup=False))
            )
            stats, signals = resume_interruptibly(engine, notice=err.print, idle=idle)
    done = {
        "recovered": stats.recovered,
        "steps": stats.steps,  # (the attempts that succeeded, as ever)
        "attempts": stats.attempts,
        "compensations": stats.compensations,
        "commits": stats.commits,
    }
    if as_json:
        click.echo(
            json.dumps({**done, "interrupted": {"signals": len(signals)}} if signals else done)
        )
    else:
        out.print(resumed_line(stats))
    if signals:
        how = "after the steps in flight finished" if len(signals) == 1 else "cutting steps off"
        if len(signals) == 1 and not signals.in_flight:
            how = "with no step in flight"  # (waiting for a run due later: none ran)
        where = hints.where(workflow_paths, db)
        line = f"interrupted {how}; continue with `flowloop resume{where}`"
        if failed:
            # (A step cut off that is not idempotent fails its run: resume runs it no more.)
            last = list(failed)[-1]
            line += (
                f"; {len(failed)} run(s) failed, e.g. {last} (`flowloop status {last}`): a "
                f"step cut off may have done part of its work; `flowloop retry RUN{where}` "
                "runs one again"
            )
        leave(line, EXIT_SIGNALLED + signals[0])  # (not waiting for a cut-off step's thread)


def resumed_line(stats: Stats) -> str:
    """``resume``'s summary: every step attempt that ran, those that failed among them (it
    once counted only the successes: a run whose three attempts failed "ran 0 steps"), and
    the compensations when some ran."""
    failed = stats.attempts - stats.steps
    attempts = f"{stats.attempts} step attempt(s) run" + (f" ({failed} failed)" if failed else "")
    undone = f", {stats.compensations} compensation(s) run" if stats.compensations else ""
    return (
        f"resumed: {stats.recovered} interrupted run(s) recovered, {attempts}{undone}, "
        f"{stats.commits} commit(s)"
    )


@click.command()
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
    from flowloop.cli import hints, support
    from flowloop.cli.progress import printed_not_logged, progress_printer
    from flowloop.cli.views import info_json, styled
    from flowloop.interrupt import (
        EXIT_SIGNALLED,
        Interrupted,
        drive_interruptibly,
        interrupted_line,
        leave,
    )

    loaded = load_workflow_paths(workflow_paths)
    cut: Interrupted | None = None
    shown_ends: set[str] = set()
    with open_engine(db, synchronous, loaded, read=True) as engine:
        with defined_in(workflow_paths):
            info = engine.retry(
                run_id, from_state=from_state, set_fields=parse_assignments(assignments)
            )
        if not as_json:
            out.print(f"run {info.id} {styled(info.status)} at {info.state}")
        if drive:
            if not as_json:
                engine.listeners.append(progress_printer(shown_ends=shown_ends))
            # That run and its children only; Ctrl-C as `flowloop run` takes it.
            with printed_not_logged(not as_json):
                driven = drive_interruptibly(engine, info.id, notice=err.print)
            cut = driven if isinstance(driven, Interrupted) else None
            info = driven.run or info if isinstance(driven, Interrupted) else driven
        waits = support.WaitStates(engine)
        if as_json:
            click.echo(json.dumps({"run": info_json(info, waits)}))
        waiting = waits.of(info)
        due = support.run_due(engine, info) if drive and not as_json else None
    where = hints.where(workflow_paths, db)
    if cut is not None:
        resume, retry_again = f"flowloop resume{where}", f"flowloop retry {{run}}{where}"
        leave(interrupted_line(cut, resume=resume, retry=retry_again), EXIT_SIGNALLED + cut.first)
    if drive:
        _refuse_failed(info, shown_ends)
    if as_json or info.finished:
        return
    if waiting is not None:
        send_it = hints.send_command(info.id, where)
        out.print(f"run {info.id} {waiting.describe()} (`{send_it}`)", markup=False)
    elif drive:
        out.print(support.not_ended_line(info, due, where), markup=False)


def _refuse_a_key_as_run_id(
    engine: Engine, target: str, event: str, where: str, given: str = ""
) -> None:
    """TARGET names no run but is the business key of some: say to give --workflow (a user
    sent to key W1 as the README's samples do, and was told a prefix needs 4 characters).
    ``given``: the options of this send to repeat (``--data …``), so that the command
    works as printed (without its --data, the event's payload failed to validate)."""
    keyed = sorted({info.workflow for info in engine.runs(key=target, limit=20)})
    if keyed:
        raise FlowloopError(
            f"no run {target!r}; it is the key of run(s) of {', '.join(keyed)}: "
            f"flowloop send {shlex.quote(target)} {shlex.quote(event)} --workflow {keyed[0]}"
            f"{given}{where}"
        )


def _send_options(data_text: str | None, dedupe_key: str | None, buffer: bool) -> str:
    """`` --data … --dedupe-key … --buffer`` as given to this send, quoted for the shell."""
    options = [("--data", data_text), ("--dedupe-key", dedupe_key)]
    shown = "".join(f" {flag} {shlex.quote(value)}" for flag, value in options if value is not None)
    return shown + (" --buffer" if buffer else "")


@click.command()
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
    from rich.markup import escape

    from flowloop.cli import hints, support
    from flowloop.cli.views import info_json, styled
    from flowloop.events import UnknownPayloadField

    loaded = load_workflow_paths(workflow_paths)
    payload = parse_context(data_text, "--data") if data_text is not None else None
    with open_engine(db, synchronous, loaded, read=True) as engine:
        run_id = target
        if workflow is not None:
            found = engine.find(workflow, key=target)
            if found is None:
                raise FlowloopError(
                    f"no run of workflow {workflow!r} has key {target!r}"
                    + support.unknown_workflow(sql_engine(engine), workflow)
                )
            run_id = found.id
        with defined_in(workflow_paths):
            try:
                result = engine.send(run_id, event, payload, dedupe_key=dedupe_key, buffer=buffer)
            except UnknownRun:
                if workflow is None:
                    where = hints.where(workflow_paths, db)
                    given = _send_options(data_text, dedupe_key, buffer)
                    _refuse_a_key_as_run_id(engine, target, event, where, given)
                raise
            except UnknownPayloadField as error:  # (the engine's rule, said of the option)
                raise FlowloopError(f"--data: {error}") from None
        waits = support.WaitStates(engine)
        waiting = waits.of(result.run)
        held = result.status == "buffered" and engine.is_held(result.run.id)
    info = result.run
    if as_json:
        shown_json = {"result": result.status, "held": held, "run": info_json(info, waits)}
        click.echo(json.dumps(shown_json))
        return
    if held:  # ("waiting in hold for go" would say the event was not taken for no reason)
        out.print(
            f"{event}: {result.status}; run {info.id} is held back by its map's max_parallel "
            f"at {info.state}: it takes the event when its turn comes",
            markup=False,
        )
        return
    shown = styled(support.WAITING if waiting else info.status)
    out.print(
        f"{event}: {result.status}; run {info.id} {shown} at {info.state}"
        + escape(support.what_continues(info, waiting, hints.where(workflow_paths, db)))
    )
