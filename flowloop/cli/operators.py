"""Commands of the people who operate flowloop: `pause`, `unpause`, `stop` (a loop or a run),
`worker`, and the deploy pair `check` and `migrate`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Final

import click

from flowloop.cli.common import (
    DEFAULT_WORKFLOWS,
    Failed,
    command_settings,
    database,
    db_option,
    err,
    json_option,
    load_workflow_paths,
    open_engine,
    out,
    prepared,
    workflows_option,
)
from flowloop.errors import FlowloopError

if TYPE_CHECKING:
    from flowloop.store.loops import LoopRow


def loop_request(control: str | None, *, held: bool = False) -> str:
    """What a loop's pending request does to the iteration running now (shown after its
    status): a pause lets it finish, a stop cancels it — but a loop ``held`` by its function
    abandoned still running (cancelled already) stops or pauses once the function ends."""
    if control is None:
        return ""
    if held:
        return f" ({control} requested; held by its function still running: once it ends)"
    if control == "stop":
        return " (stop requested; its worker cancels the running iteration)"
    return f" ({control} requested; after the running iteration)"


def is_held(row: LoopRow) -> bool:
    """The loop is running, held by its function abandoned still running (its note)."""
    return row.status == "running" and (row.reason or "").startswith("held:")


def control_command(name: str, doc: str) -> click.Command:
    """`flowloop NAME TARGET`: the engine's ``NAME`` (pause, unpause, stop) on a loop or a run."""

    @click.command(name=name, help=doc)
    @click.argument("target")
    @db_option
    @json_option
    def command(target: str, db: str | None, synchronous: str, as_json: bool) -> None:
        from flowloop.cli import support
        from flowloop.cli.views import info_json, loop_json, styled
        from flowloop.errors import UnknownRun

        with open_engine(db, synchronous, read=True) as engine:
            # A loop's name first: a name is never taken for a run id prefix.
            if any(row.name == target for row in engine.loops()):
                row = getattr(engine, f"{name}_loop")(target)
                if as_json:
                    click.echo(json.dumps({"loop": loop_json(row)}))
                    return
                asked = loop_request(row.control, held=is_held(row))
                out.print(f"loop {row.name} {styled(row.status)}{asked}")
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
        pending = RUNNING_REQUEST.get(name, "") if info.status == "running" else ""
        out.print(f"run {info.id} {styled(info.status)}{pending}")

    return command


RUNNING_REQUEST: Final = {
    "pause": " (pause requested; its worker pauses it at the next step boundary)",
    "stop": " (stop requested; its worker cancels the step in progress)",
}
"""What ``pause``/``stop`` of a running run add: its worker honours them (an ``unpause``
that withdrew a pending pause says nothing more: the run goes on)."""


pause = control_command(
    "pause", "Pause a loop or run (TARGET: loop name or run id); what is in progress finishes."
)
unpause = control_command(
    "unpause",
    "Resume a paused loop or run, or a stopped loop (TARGET: loop name or run id); a stopped "
    "run is run again by `flowloop retry`.",
)
stop = control_command(
    "stop",
    "Stop a loop or run (TARGET: loop name or run id); cancels work in progress. A stopped "
    "run stays stopped until `flowloop retry`, a stopped loop until `flowloop unpause`.",
)


@click.command()
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
    from flowloop.cli.startup import StoppedWaiting, when_reachable
    from flowloop.engine import Engine
    from flowloop.metrics import Metrics
    from flowloop.store.dialect import safe_url
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
        where = ", ".join(paths) or DEFAULT_WORKFLOWS
        if not paths and not Path(DEFAULT_WORKFLOWS).is_dir():
            where = f"no -w given and no ./{DEFAULT_WORKFLOWS} here"
        else:
            where = f"no workflows or loops in {where}"
        raise FlowloopError(f"nothing to run: {where}; pass -w FILE_OR_DIR that defines them")
    url = database(config.db)

    def opened() -> Engine:
        engine = Engine(
            url,
            synchronous=synchronous,
            max_concurrency=config.concurrency,
            lease_seconds=config.lease,
        )
        try:
            return prepared(engine, loaded)
        except BaseException:
            engine.close()
            raise

    try:
        engine = when_reachable(opened, url)
    except StoppedWaiting as stopped:
        err.print(str(stopped), markup=False)
        sys.exit(stopped.exit_code)
    with engine:
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


@click.command()
@click.argument("target")
@db_option
@json_option
@click.option("--all-runs", is_flag=True, help="List every live run, not only those that change.")
@click.option(
    "--validate",
    is_flag=True,
    help="Run every live run's context through its model's validators too, also where the "
    "definition's fingerprint is unchanged (slower; finds a changed validator).",
)
def check(
    target: str, db: str | None, synchronous: str, as_json: bool, all_runs: bool, validate: bool
) -> None:
    """Validate the workflows in FILE[:NAME] and tell, run by run, what they do to live
    runs: continues as is, continues after migration, would be parked, would fail. Exit 0
    only when nothing would be parked or fail."""
    from flowloop.checking import CheckReport, check_workflows
    from flowloop.cli.deploy import print_check_report
    from flowloop.definition import Workflow
    from flowloop.loader import load_paths
    from flowloop.store.sql import SQLStore

    path, _, name = target.partition(":")
    loaded = load_paths([path])
    versions = [w for w in loaded.all_versions() if not name or w.name == name]
    if not versions and name:
        # FILE:VARIABLE, as run and diagram take it (DIR:VARIABLE: in any of its files).
        held = [getattr(module, name, None) for module in loaded.modules]
        versions = [w for w in held if isinstance(w, Workflow)][:1]
    if not versions:
        defined = ", ".join(sorted(loaded.workflows)) or "none"
        raise FlowloopError(
            f"nothing to check: no workflow {name!r} in {path} (it defines: {defined})"
            if name
            else f"nothing to check: {path} defines no workflow; pass the file that does"
        )
    missing = _no_database_yet(db)
    if missing is not None:
        # A new project: the definitions are checked (loading them did), no runs to judge.
        newest: dict[str, Workflow] = {}  # (one report per workflow, as with a database)
        for w in versions:
            if w.name not in newest or w.version > newest[w.name].version:
                newest[w.name] = w
        reports = [
            (w, CheckReport(workflow=w.name, version=w.version, fingerprint=w.fingerprint))
            for w in newest.values()
        ]
        err.print(
            f"no database at {missing}: no live runs to judge (--db names one)",
            markup=False,
        )
    else:
        with open_engine(db, synchronous, read=True) as engine:
            assert isinstance(engine.store, SQLStore)
            reports = check_workflows(engine.store, versions, every=all_runs, validate=validate)
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


def _no_database_yet(db: str | None) -> Path | None:
    """./flowloop.db when it does not exist and no --db, $FLOWLOOP_DB or configured
    database names another: a new project. (A database named and missing is refused as a
    typo, as every reading command does.)"""
    from flowloop.cli.support import sqlite_path
    from flowloop.store.urls import DEFAULT_URL, normalize_url

    url = database(db)
    if db or url != normalize_url(DEFAULT_URL):
        return None
    path = sqlite_path(url)
    return path if path is not None and not path.exists() else None


@click.command()
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
    from flowloop.cli.deploy import print_moved

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
