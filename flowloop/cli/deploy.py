"""The CLI's deploy commands' output: ``flowloop check`` reports and ``flowloop migrate``
(the commands are in flowloop/cli/operators.py)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from flowloop.checking import LABELS, CheckReport
from flowloop.definition import Workflow
from flowloop.verdicts import KINDS

STYLES = {"continues": "green", "migrates": "cyan", "parks": "yellow", "fails": "red"}


def print_check_report(out: Console, workflow: Workflow, report: CheckReport) -> None:
    """What ``flowloop check`` prints for one workflow: the definition, what changed per
    stored definition, the count of each verdict, then each run that does not go on as is."""
    mark = "[green]ok[/]" if report.ok else "[red]strands runs[/]"
    out.print(
        f"{mark} {workflow.name} v{workflow.version} ({len(workflow.states)} states, "
        f"context v{workflow.context_version}, fingerprint {workflow.fingerprint})"
    )
    for fingerprint, changes in report.changes.items():
        what = "; ".join(changes) or "no change that matters"
        out.print(f"  since {fingerprint}: {escape(what)}")
    total = sum(report.counts.values())
    counts = ", ".join(f"{report.counts[kind]} {LABELS[kind]}" for kind in KINDS)
    out.print(f"  {total} live run(s): {counts} ({report.seconds:.2f} s)")
    for run in report.runs:
        reason = f": {escape(run.reason)}" if run.reason else ""
        out.print(
            f"  [{STYLES[run.kind]}]{LABELS[run.kind]}[/] run {run.run_id} "
            f"({run.status} at {escape(run.state)}){reason}"
        )


def print_moved(
    out: Console, moved: list[tuple[str, str | None]], to: int, *, as_json: bool
) -> int:
    """What ``flowloop migrate`` prints: each run moved, or why not. Returns how many
    could not move."""
    import json

    failed = sum(1 for _, problem in moved if problem is not None)
    if as_json:
        print(
            json.dumps(
                {
                    "to": to,
                    "moved": [run for run, problem in moved if problem is None],
                    "refused": [
                        {"run_id": run, "problem": problem}
                        for run, problem in moved
                        if problem is not None
                    ],
                }
            )
        )
        return failed
    for run, problem in moved:
        if problem is None:
            out.print(f"run {run} moved to v{to}")
        else:
            out.print(f"[red]not moved[/] run {run}: {escape(problem)}")
    if not moved:
        out.print(f"no live run below v{to}")
    return failed
