"""`flowloop history`'s detail column for the entries an operator writes: a migration
(versions, states, who) and a pause, unpause or stop (who), on both databases."""

from __future__ import annotations

from click.testing import CliRunner
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.cli import cli
from flowloop.operations import _user


class Ticket(BaseModel):
    n: int = 0


def ticket(version: int) -> Workflow:
    """v1 waits in ``review``; v2 renamed it ``triage``."""
    waits = "review" if version == 1 else "triage"
    migrates = {1: {"review": "triage"}} if version == 2 else None
    wf = Workflow("ticket_h", context=Ticket, version=version, migrates_from=migrates)

    @wf.step(initial=True, next=waits)
    def open_(ctx: Ticket) -> None: ...

    wf.wait(waits, on={"close": "done"})
    wf.final("done")
    return wf


def detail(url: str, run_id: str) -> dict[str, str]:
    """Each entry's kind and detail as `history` shows them (the first and last cells)."""
    shown = CliRunner().invoke(cli, ["history", run_id, "--db", url], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    rows: dict[str, str] = {}
    for line in shown.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) > 3:
            rows[cells[2]] = cells[-1]
    return rows


def test_history__operator_entries_say_who_and_a_migration_what_moved(store_url: str) -> None:
    """The detail column was blank for run_migrated and for an operator's pause, unpause
    and stop, though their entries keep who and what (ops audit)."""
    me = _user()
    with Engine(store_url, workflows=[ticket(1)]) as engine:
        moved = engine.start(ticket(1), Ticket()).id
        held = engine.start(ticket(1), Ticket(n=1)).id
        engine.run_until_idle()
        engine.pause(held)
        engine.unpause(held)
        engine.stop(held)
    with Engine(store_url, workflows=[ticket(1), ticket(2)]) as engine:
        engine.migrate(moved, to=2)
    rows = detail(store_url, moved)
    assert rows["run_migrated"] == f"v1 → v2, review → triage (renamed), by {me}"
    rows = detail(store_url, held)
    assert (rows["run_paused"], rows["run_unpaused"], rows["run_stopped"]) == (
        f"by {me}",
        f"by {me}",
        f"by {me}",
    )
