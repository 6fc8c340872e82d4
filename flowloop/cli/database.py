"""Commands on the database: `db upgrade`, `db current` and `db revision` (the schema),
`stats` (figures from the journals) and `prune` (old finished runs)."""

from __future__ import annotations

import json

import click

from flowloop.cli.common import (
    HelpGroup,
    database,
    db_option,
    json_option,
    open_engine,
    out,
    seconds_option,
    sql_engine,
)
from flowloop.errors import FlowloopError


@click.group(cls=HelpGroup)
def db() -> None:
    """The database schema: `flowloop db upgrade` applies pending migrations."""


@db.command()
@db_option
@json_option
def upgrade(db: str | None, synchronous: str, as_json: bool) -> None:
    """Bring the database schema up to this flowloop's version (creates it if new)."""
    from flowloop.store.sql import SQLStore

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
@db_option
@json_option
def current(db: str | None, synchronous: str, as_json: bool) -> None:
    """Show the database's schema revision and this flowloop's, changing nothing (exit 1
    when `flowloop db upgrade` has work to do)."""
    from flowloop.cli import support
    from flowloop.store import migrate
    from flowloop.store.sql import SQLStore
    from flowloop.store.urls import normalize_url

    url = database(db)
    support.require_database(url)
    store = SQLStore(normalize_url(url), synchronous=synchronous, check_schema=False)
    try:
        with store.engine.connect() as conn:
            found = migrate.current(conn)
    finally:
        store.close()
    head = migrate.head()
    if as_json:
        click.echo(json.dumps({"revision": found, "head": head, "current": found == head}))
    elif found == head:
        out.print(f"schema at revision {found}, this flowloop's: nothing to upgrade")
    elif found is not None and not migrate.known(found):
        out.print(
            f"schema at revision {found}, newer than this flowloop's {head}: upgrade flowloop"
        )
    else:
        shown = found or "none (no flowloop schema)"
        out.print(f"schema at revision {shown}; this flowloop's is {head}: `flowloop db upgrade`")
    if found != head:
        raise SystemExit(1)


@db.command()
@click.option("-m", "--message", required=True, help="What changed in flowloop/store/schema.py.")
def revision(message: str) -> None:
    """(Developers) autogenerate a migration for changes to the schema module."""
    import tempfile

    from flowloop.store.sql import SQLStore

    with tempfile.TemporaryDirectory() as folder:
        store = SQLStore(f"{folder}/head.db", check_schema=False)
        try:
            store.upgrade_schema()
            store.new_revision(message)
        finally:
            store.close()


@click.command(name="stats")
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
    from rich.table import Table

    from flowloop.cli import support
    from flowloop.cli.views import seconds_text
    from flowloop.clock import iso
    from flowloop.stats import loop_stats, run_stats, step_stats

    window = None if since.strip().lower() == "all" else seconds_option(since, "--since", unit=True)
    with open_engine(db, synchronous, read=True) as engine:
        start = None if window is None else engine.clock.now() - window
        db_engine = sql_engine(engine)
        unknown = support.unknown_workflow(db_engine, workflow)
        if unknown:  # a misspelt name is a mistake, not a quiet workflow (exit 2)
            raise FlowloopError(unknown.removeprefix("; "))
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


@click.command(name="prune")
@click.option(
    "--older-than",
    required=True,
    help="Delete finished runs last updated longer ago than this (30d, 12h, …).",
)
@click.option(
    "--keep-failed",
    is_flag=True,
    help=(
        "Keep failed runs (and failed loop iterations) whatever their age, and the parents "
        "of the failed children."
    ),
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
    """Delete old finished runs with their journal and inbox (live runs are never touched),
    and old loop and breaker journal entries."""
    from flowloop.cli import support
    from flowloop.clock import iso
    from flowloop.prune import prune, vacuum

    age = seconds_option(older_than, "--older-than", unit=True)
    with open_engine(db, synchronous, read=True) as engine:
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
        f"{result.joins:,} join row(s), "
        f"{result.loop_journal:,} loop journal entr{'y' if result.loop_journal == 1 else 'ies'}, "
        f"{result.breaker_journal:,} breaker journal "
        f"entr{'y' if result.breaker_journal == 1 else 'ies'}"
        + ("" if dry_run else f" in {result.batches} batch(es)"),
        markup=False,
    )
    if vacuumed is not None:
        out.print(vacuumed, markup=False)
