"""Commands on loops: `loops` (list, or one loop's journal), `trigger`, `backfill`."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

import click
from click.core import ParameterSource

from flowloop import loop_requests
from flowloop.cli.common import db_option, err, json_option, open_engine, out, seconds_option
from flowloop.errors import FlowloopError

if TYPE_CHECKING:
    from flowloop.store.loops import LoopRow

UNTAKEN_HINT_SECONDS: Final = 10.0
"""`backfill --wait`: after this long (or half its --timeout) with nothing taken, ask
whether a worker runs the loop (else it waits, silent, until its timeout)."""


@click.command(name="loops")
@click.argument("name", required=False)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="Journal lines for NAME.",
)
@db_option
@json_option
def loops_command(
    name: str | None, limit: int, db: str | None, synchronous: str, as_json: bool
) -> None:
    """List loops (name, schedule, status, last result, next fire …), or one loop's journal."""
    from rich.markup import escape
    from rich.table import Table

    from flowloop.cli import support
    from flowloop.cli.views import journal_row, loop_json, styled, with_operator
    from flowloop.clock import iso

    with open_engine(db, synchronous, read=True) as engine:
        rows = [engine.loop(name)] if name else engine.loops()
        events = engine.loop_history(name, limit=limit) if name else []
    if as_json:
        journal = [
            support.with_times(vars(e) | {"data": dict(e.data)}, "at", "slot") for e in events
        ]
        click.echo(json.dumps({"loops": [loop_json(r) for r in rows], "journal": journal}))
        return
    if not rows:  # (an empty table said nothing of why, where `status` says "no runs")
        out.print(
            "no loops in this database: a worker registers the loops of the files it runs "
            "(`flowloop worker FILE_OR_DIR`)",
            markup=False,
        )
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
            escape(_note(row)),
        )
    out.print(table)
    if events:
        journal_table = Table("seq", "at", "event", "slot", "count", "duration", "detail")
        for event in events:
            reason = event.error_message or str(event.data.get("reason", "")) or ""
            detail = escape(with_operator(reason, event.worker))
            middle = (iso(event.slot), str(event.count or ""))
            journal_table.add_row(*journal_row(event, middle, detail))
        out.print(journal_table)


def _note(row: LoopRow) -> str:
    """The loop's last error, or why it is where it is (a running loop held by its
    abandoned function says so first), or its pending request."""
    if row.status == "running" and (row.reason or "").startswith("held:"):
        return f"{row.reason}; {row.control} requested" if row.control else str(row.reason)
    return row.last_error or row.reason or (f"{row.control} requested" if row.control else "")


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


WITHDRAW_HELP: Final = (
    "Withdraw the loop's pending trigger, or the rest of its backfill, instead (an "
    "iteration running now finishes)."
)


def _withdraw(name: str, db: str | None, synchronous: str, as_json: bool) -> None:
    from flowloop.cli.views import loop_json

    with open_engine(db, synchronous, read=True) as engine:
        asked = engine.loop(name).control
        row = engine.withdraw_loop_request(name)
    if as_json:
        click.echo(json.dumps({"loop": loop_json(row)}))
        return
    out.print(f"loop {row.name}: {asked} withdrawn; the schedule goes on", markup=False)


@click.command(name="trigger")
@click.argument("name")
@click.option("--withdraw", is_flag=True, help=WITHDRAW_HELP)
@db_option
@json_option
def trigger_command(
    name: str, withdraw: bool, db: str | None, synchronous: str, as_json: bool
) -> None:
    """Run one iteration of loop NAME now (journaled as manual; its worker runs it, never
    while another iteration of NAME runs; the schedule is unchanged)."""
    from flowloop.cli.views import loop_json

    if withdraw:
        _withdraw(name, db, synchronous, as_json)
        return
    with open_engine(db, synchronous, read=True) as engine:
        row = engine.trigger_loop(name)
    if as_json:
        click.echo(json.dumps({"loop": loop_json(row)}))
        return
    out.print(f"loop {row.name}: trigger requested; its worker runs it (`flowloop loops {name}`)")


def _given_options(*options: tuple[str, str]) -> list[str]:
    """Which of the (flag, parameter) ``options`` the command line gave (defaults aside)."""
    ctx = click.get_current_context()
    return [
        flag
        for flag, parameter in options
        if ctx.get_parameter_source(parameter) is ParameterSource.COMMANDLINE
    ]


@click.command(name="backfill")
@click.argument("name")
@click.option("--from", "start", help="First slot time (ISO 8601; UTC if bare).")
@click.option("--to", "end", help="Last slot time (ISO 8601; UTC if bare).")
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
@click.option("--withdraw", is_flag=True, help=WITHDRAW_HELP)
@db_option
@json_option
def backfill_command(
    name: str,
    start: str | None,
    end: str | None,
    limit: int,
    wait: bool,
    timeout_text: str,
    withdraw: bool,
    db: str | None,
    synchronous: str,
    as_json: bool,
) -> None:
    """Run the slots of loop NAME between --from and --to that never ran (missed while
    no worker ran, given up past the misfire grace), oldest first, one at a time."""
    from flowloop.cli.views import loop_json
    from flowloop.clock import iso

    if withdraw:
        given = _given_options(
            ("--from", "start"),
            ("--to", "end"),
            ("--max", "limit"),
            ("--wait", "wait"),
            ("--timeout", "timeout_text"),
        )
        if given:
            raise FlowloopError(
                f"--withdraw takes back the pending request: drop {'/'.join(given)}"
            )
        _withdraw(name, db, synchronous, as_json)
        return
    if start is None or end is None:
        raise FlowloopError("backfill needs --from and --to (or --withdraw)")

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
        begun = time.monotonic()
        deadline = begun + timeout
        hint_at: float | None = begun + min(UNTAKEN_HINT_SECONDS, timeout / 2)
        taken, said = False, ""
        while not finished:
            for event in engine.loop_history(name, limit=1000):
                if event.seq <= seen:
                    continue
                seen, taken = event.seq, True
                if event.kind == "backfill_finished":
                    finished, said = True, str(event.data.get("reason") or "")
                elif event.data.get("reason") == "backfill" and not as_json:
                    out.print(f"  slot {iso(event.slot)} started")
                elif event.kind.startswith("iteration_") and not as_json:
                    out.print(f"  slot {iso(event.slot)} {event.kind.removeprefix('iteration_')}")
            if not finished:
                if not taken and hint_at is not None and time.monotonic() > hint_at:
                    hint_at = None  # (said once: a worker may just be slow to poll)
                    err.print(
                        f"nothing has taken the backfill yet: is a worker running loop {name!r}? "
                        f"(`flowloop worker FILE`; the request stays until one does)",
                        markup=False,
                    )
                if time.monotonic() > deadline and not taken:
                    raise FlowloopError(
                        f"nothing took the backfill of loop {name!r} in {timeout_text}; the "
                        "request stays for a worker running the loop (`flowloop backfill "
                        f"{name} --withdraw` withdraws it)"
                    )
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
        out.print(
            f"loop {row.name}: backfill finished" + (f": {said}" if said else ""), markup=False
        )
