"""A run whose deadline comes before what it waits for — a ``step.sleep``'s end, a retry's
next attempt — is due at its deadline (journal.apply), and the CLI says so, on SQLite and
PostgreSQL: ``flowloop status RUN``'s "next run" line says the deadline passes then and the
state it moves to (it gave the time alone, read as the sleep's end or the retry's), and
``flowloop run`` says when the sleep ends or the attempt comes, then that the deadline
passes first (it said "is asleep until <the deadline>", "retries dial at <the deadline>",
and of a waiting run "times out at <the deadline>"). A sleep before a compensating state,
which the deadline cuts off as any sleep (flowloop.events: slept_past_deadline), is told so
too (it said "sleeps in refunded until <the deadline>", nothing of the deadline).
The dashboard says the same: tests/ui/test_next_move.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import BaseModel

from flowloop import FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.cli import cli
from flowloop.clock import iso
from flowloop.testing import TestEngine

HOUR = 3600.0
DEADLINE = 600.0
WORDS = "its deadline passes: moves to expired"

FLOWS = """
from pydantic import BaseModel
from flowloop import Retry, Step, Workflow

class C(BaseModel):
    n: int = 0

nap = Workflow("cli_nap_dl", context=C, deadline=600, on_deadline="expired")

@nap.step(initial=True, next="hold")
def doze(ctx: C, step: Step):
    return step.sleep(3600)

nap.wait("hold", on={"go": "done"})
nap.final("done", "expired")

flaky = Workflow("cli_flaky_dl", context=C, deadline=600, on_deadline="expired")

@flaky.step(initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=3600))
def dial(ctx: C):
    raise ConnectionError("the line is busy")

flaky.final("done", "expired")

refund = Workflow("cli_refund_dl", context=C, deadline=600, on_deadline="expired")

def undo(ctx: C, step: Step) -> None:
    ctx.n -= 1

@refund.step(initial=True, next="refunded", compensate=undo)
def charge(ctx: C, step: Step):
    ctx.n += 1
    return step.sleep(3600)

refund.final("refunded", compensate=True)
refund.final("expired")

approval = Workflow("cli_approval_dl", context=C, deadline=600, on_deadline="expired")
approval.wait("approve", on={"yes": "done"}, timeout=3600, on_timeout="done", initial=True)
approval.final("done", "expired")
"""


class C(BaseModel):
    n: int = 0


def deadlined() -> tuple[Workflow, Workflow]:
    nap = Workflow("cli_nap_dl", context=C, deadline=DEADLINE, on_deadline="expired")

    @nap.step(initial=True, next="hold")
    def doze(ctx: C, step: Step) -> object:
        return step.sleep(HOUR)

    nap.wait("hold", on={"go": "done"})
    nap.final("done", "expired")
    flaky = Workflow("cli_flaky_dl", context=C, deadline=DEADLINE, on_deadline="expired")

    @flaky.step(initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=HOUR))
    def dial(ctx: C) -> None:
        raise ConnectionError("the line is busy")

    flaky.final("done", "expired")
    return nap, flaky


def own_time(events: list[j.JournalEvent]) -> float:
    """The sleep's end or the retry's time, as the run's latest entry wrote it."""
    last = events[-1].data
    return float(last["due"] if last.get(j.ASLEEP) else last["retry_at"])


def test_cli_status__says_the_next_run_is_the_deadline_and_where_it_moves_the_run(
    store_url: str,
) -> None:
    nap, flaky = deadlined()
    with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=[nap, flaky]) as e:
        runs = [e.start(nap, C()).id, e.start(flaky, C()).id]
        e.run_until_idle(idle_horizon=0)
        infos = [e.get(run_id) for run_id in runs]
        owns = [own_time(e.history(run_id)) for run_id in runs]
    shown = []
    for info, own in zip(infos, owns, strict=True):
        assert info.next_run_at is not None and own == info.next_run_at - DEADLINE + HOUR
        said = CliRunner().invoke(cli, ["status", info.id, "--db", store_url])
        assert said.exit_code == 0, said.output
        lines = said.stdout.splitlines()
        assert f"next run  {iso(info.next_run_at)} ({WORDS})" in lines, lines
        shown.append(lines)
    # The sleep's own end (not the deadline's time), as it said already.
    assert f"status    scheduled (asleep until {iso(owns[0])}, then enters hold)" in shown[0]


@pytest.mark.parametrize("workflow", ["cli_nap_dl", "cli_flaky_dl"])
def test_cli_run__says_the_sleep_or_retry_time_and_that_the_deadline_comes_first(
    store_url: str, tmp_path: Path, workflow: str
) -> None:
    flows = tmp_path / "deadlined.py"
    flows.write_text(FLOWS)
    said = CliRunner().invoke(
        cli, ["run", f"{flows}:{workflow}", "--db", store_url], env={"COLUMNS": "300"}
    )
    assert said.exit_code == 0, said.output
    with TestEngine(store_url) as engine:
        info = engine.runs(workflow=workflow)[0]
        own = own_time(engine.history(info.id))
    assert info.next_run_at is not None
    first = f"; its deadline passes first, at {iso(info.next_run_at)}: moves to expired;"
    waits = (
        f"is asleep until {iso(own)} before entering hold"
        if workflow == "cli_nap_dl"
        else f"retries dial at {iso(own)}"
    )
    last = said.stdout.strip().splitlines()[-1]
    assert last.startswith(f"run {info.id} {waits}{first}"), last


def test_cli_run__says_a_waiting_runs_deadline_is_no_timeout(
    store_url: str, tmp_path: Path
) -> None:
    """It said "waits in approve for yes; times out at <the deadline>"."""
    flows = tmp_path / "deadlined.py"
    flows.write_text(FLOWS)
    said = CliRunner().invoke(
        cli, ["run", f"{flows}:cli_approval_dl", "--db", store_url], env={"COLUMNS": "300"}
    )
    assert said.exit_code == 0, said.output
    with TestEngine(store_url) as engine:
        info = engine.runs(workflow="cli_approval_dl")[0]
    assert info.next_run_at is not None
    last = said.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"run {info.id} waits in approve for yes; its deadline passes at "
        f"{iso(info.next_run_at)}: moves to expired"
    ), last


def test_cli__a_sleep_before_a_compensating_state_is_cut_off_by_the_deadline_and_says_so(
    store_url: str, tmp_path: Path
) -> None:
    """The deadline moves a run asleep before its compensating state to on_deadline (no
    compensation run): ``flowloop run`` and ``flowloop status`` say so, with the sleep's end."""
    flows = tmp_path / "deadlined.py"
    flows.write_text(FLOWS)
    said = CliRunner().invoke(
        cli, ["run", f"{flows}:cli_refund_dl", "--db", store_url], env={"COLUMNS": "300"}
    )
    assert said.exit_code == 0, said.output
    with TestEngine(store_url) as engine:
        info = engine.runs(workflow="cli_refund_dl")[0]
        entry = engine.history(info.id)[-1]
    assert info.state == "refunded" and info.next_run_at is not None
    own = float(entry.data["due"])
    assert own > info.next_run_at  # (the sleep ends after the deadline)
    last = said.stdout.strip().splitlines()[-1]
    assert last.startswith(
        f"run {info.id} sleeps in refunded until {iso(own)}; its deadline passes first, at "
        f"{iso(info.next_run_at)}: moves to expired;"
    ), last
    status = CliRunner().invoke(cli, ["status", info.id, "--db", store_url])
    assert status.exit_code == 0, status.output
    lines = status.stdout.splitlines()
    assert (
        f"next run  {iso(info.next_run_at)} ({WORDS}, before it goes on at refunded at {iso(own)})"
    ) in lines, lines
