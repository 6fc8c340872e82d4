"""`flowloop diagram`: a workflow or loop, the lifecycle, one stored run or loop, or every
diagram at once; DOT, SVG or PNG. Graphviz is imported only when the command runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from flowloop.cli.common import (
    database,
    db_option,
    defined_in,
    err,
    json_option,
    load_workflow_paths,
    looked_in,
    open_engine,
    out,
    settings,
    workflows_option,
)
from flowloop.errors import FlowloopError

if TYPE_CHECKING:
    import graphviz


@click.command()
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
    from flowloop.cli import support
    from flowloop.loader import load_target

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
        if not loaded.workflows and not loaded.loops:
            # (It drew the lifecycle machine alone and exited 0 without a word.)
            err.print(
                f"no workflow or loop to draw ({looked_in(workflow_paths)}); the lifecycle "
                "machine alone is drawn — pass -w FILE_OR_DIR",
                markup=False,
            )
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
        with (
            open_engine(db, synchronous, loaded, read=True, saves=False) as engine,
            defined_in(workflow_paths),
        ):
            graph = engine.diagram(run_id)
    elif loop_name is not None:
        graph = _stored_loop_diagram(loop_name, workflow_paths, db, synchronous)
    else:
        assert target is not None
        if draw_runs:  # all runs of the window on it: flowloop/heat.py
            from flowloop.heat import workflow_heat_digraph

            support.require_database(database(db))  # a read: a typo in --db creates nothing
            from flowloop.config import apply_overrides

            workflow = load_target(target)[0]
            apply_overrides(settings(), {workflow.name: workflow}, {})  # (drawn as it runs)
            graph = workflow_heat_digraph(workflow, database(db), since=since)
        else:
            graph = _machine_diagram(target)
    fmt = render.chosen_format(out_path, fmt) if out_path is not None else fmt or "dot"
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
    from flowloop.config import apply_overrides
    from flowloop.loader import load_machine
    from flowloop.loops import Loop

    machine = load_machine(target)[0]
    # Drawn as it runs: flowloop.toml's timeouts and retries, as a worker applies them.
    if isinstance(machine, Loop):
        loop = apply_overrides(settings(), {}, {machine.name: machine})[machine.name]
        return render_loops.loop_digraph(loop)
    apply_overrides(settings(), {machine.name: machine}, {})
    return machine.diagram()


def _stored_loop_diagram(
    name: str, workflow_paths: tuple[str, ...], db: str | None, synchronous: str
) -> graphviz.Digraph:
    from flowloop import render_loops

    loaded = load_workflow_paths(workflow_paths)
    with open_engine(db, synchronous, loaded, read=True, saves=False) as engine:
        row = engine.loop(name)
        limit = render_loops.OVERLAY_JOURNAL_LIMIT
        events = engine.loop_history(name, limit=limit)
    loop = loaded.loops.get(name)
    if loop is None:
        where = looked_in(workflow_paths)
        raise FlowloopError(f"loop {name!r}: {where}; pass -w FILE_OR_DIR that defines it")
    return render_loops.stored_loop_digraph(loop, row, events, capped=len(events) >= limit)
