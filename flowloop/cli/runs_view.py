"""Commands that read runs: `status`, `history`, `replay`."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click

from flowloop.cli.common import Failed, db_option, err, json_option, open_reader, out


@click.command()
@click.argument("run_id", required=False)
@click.option("--workflow", help="Only runs of this workflow.")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    help="Only runs with this status (as shown: `waiting`, `held`, `scheduled`, `failed` …).",
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
    shown lists the next ones). A run resting in a wait state shows as `waiting`, a map's
    child held back by its parent's max_parallel as `held`."""
    from flowloop import family
    from flowloop.cli import support
    from flowloop.cli.leases import lease_json, lease_line
    from flowloop.cli.views import NARROW_DROPS, family_lines, info_json, show_run, status_table
    from flowloop.clock import iso

    statuses = support.checked_statuses(statuses)
    with open_reader(db, synchronous) as reader:
        waits = support.WaitStates(reader)
        if run_id:
            info = reader.get(run_id)
            if as_json:
                store = reader.store
                held = family.held_back(store, info.id, live=not info.finished)
                kept = store.kept_count(info.id) if hasattr(store, "kept_count") else 0
                shown = {
                    # Shown held while it is scheduled (paused, it shows paused).
                    **info_json(info, waits, held=held and info.status == "scheduled"),
                    "held": held,
                    "kept_events": kept,
                    **lease_json(store, info),  # as the text's `worker` line
                }
                click.echo(json.dumps(shown))
                return
            due = support.run_due(reader, info)
            held = info.status == "scheduled" and family.held_back(
                reader.store, info.id, live=not info.finished
            )
            reason = support.asleep_reason(info, due)
            show_run(info, waits.of(info), reason, due, held=held)
            holder = lease_line(reader.store, info)
            if holder is not None:
                out.print(holder, markup=False)
            for line in family_lines(reader.store, info.id, live=not info.finished):
                out.print(line)
            return
        infos, truncated = support.list_runs(
            reader,
            waits,
            workflow=workflow,
            statuses=statuses,
            key=key,
            limit=limit,
            after=after_id,
        )
        unknown = None
        if not infos and workflow is not None and after_id is None:  # (a misspelt name?)
            unknown = support.unknown_workflow_hint(reader.store, workflow)
        breakers = list(getattr(reader.store, "breakers", list)())
        held_ids = support.held_of(reader, infos)  # one read for the page
        if as_json:
            listed = [info_json(i, waits, held=i.id in held_ids) for i in infos]
        else:
            rows = [(info, support.shown_status(info, waits, held_ids)) for info in infos]
            table = status_table(rows, {})
            if natural_width(table) > out.width:  # a narrow terminal: short ids that still work
                short = support.short_ids(reader, [i.id for i in infos])
                table = status_table(rows, short)
                for dropped in NARROW_DROPS:  # still too wide: the least needed columns go
                    if natural_width(table) <= out.width:
                        break
                    table = status_table(rows, short, dropped)
            pressure = support.backpressure_lines(reader, workflow)
    if unknown is not None:  # (on stderr: the listing, empty, is valid as it is)
        err.print(unknown, markup=False)
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
    if infos:
        out.print(table)
    else:  # an empty table said nothing of why (a misspelt workflow: a hint on stderr)
        asked = [f"workflow {workflow!r}"] if workflow else []
        asked += [f"status {', '.join(statuses)}"] if statuses else []
        asked += [f"key {key!r}"] if key else []
        asked += ["after that run"] if after_id else []
        out.print("no runs" + (f" with {', '.join(asked)}" if asked else ""), markup=False)
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


@click.command()
@click.argument("run_id")
@db_option
@json_option
def history(run_id: str, db: str | None, synchronous: str, as_json: bool) -> None:
    """The journal of RUN_ID: one line per boundary."""
    from rich.markup import escape
    from rich.table import Table

    from flowloop.cli import support
    from flowloop.cli.views import describe_event, event_json, family_lines, journal_row

    with open_reader(db, synchronous) as reader:
        events = reader.history(run_id)
        info = reader.get(run_id)
        waiting = support.WaitStates(reader).of(info)
        family = family_lines(reader.store, run_id, live=not info.finished)
    if as_json:
        click.echo(json.dumps([event_json(e) for e in events]))
        return
    table = Table("seq", "at", "event", "state", "attempt", "duration", "detail")
    for event in events:
        middle = (event.state or "", str(event.attempt or ""))
        table.add_row(*journal_row(event, middle, escape(describe_event(event)[:80])))
    out.print(table)
    if waiting is not None:
        out.print(f"run {info.id} is {escape(waiting.describe())}")
    for line in family:
        out.print(line)


@click.command()
@click.argument("run_id")
@click.option("--at", "at_seq", type=int, help="Show the context as of this seq.")
@db_option
@json_option
def replay(
    run_id: str, at_seq: int | None, db: str | None, synchronous: str, as_json: bool
) -> None:
    """Fold the journal of RUN_ID, print the context (at --at SEQ) and verify the fold
    equals the stored row (exit 1 when it does not)."""
    from rich.markup import escape

    from flowloop.cli.views import styled

    with open_reader(db, synchronous) as reader:
        result = reader.replay(run_id, at=at_seq)
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


def natural_width(table: Any) -> int:
    """How wide ``table`` is drawn with room to spare."""
    return int(out.measure(table, options=out.options.update_width(10_000)).maximum)
