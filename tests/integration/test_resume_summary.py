"""`flowloop resume`'s summary and the `Stats` of `run_until_idle` count every step attempt
that ran — the failed ones too — and the compensations, on SQLite and PostgreSQL: a run
whose charge failed three times and was then compensated said "0 step(s) run"."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from flowloop import Engine, FakeClock
from flowloop.cli import cli
from flowloop.loader import load_target

SHOP = """
    from pydantic import BaseModel

    from flowloop import Retry, Step, Workflow


    class Order(BaseModel):
        declined: bool = True


    shop = Workflow("shop", context=Order)


    def release(ctx: Order, step: Step) -> None: ...


    @shop.step(initial=True, next="charge", compensate=release)
    def reserve(ctx: Order) -> None: ...


    @shop.step(
        next="done",
        retry=Retry(attempts=3, backoff="fixed", base=0),
        on_error={"*": "cancelled"},
    )
    def charge(ctx: Order) -> None:
        if ctx.declined:
            raise ConnectionError("bank down")


    shop.final("done")
    shop.final("cancelled", compensate=True)
"""


@pytest.fixture
def shop(tmp_path: Path) -> Path:
    path = tmp_path / "shop.py"
    path.write_text(textwrap.dedent(SHOP))
    return path


def test_run_until_idle__counts_failed_attempts_and_compensations(
    store_url: str, shop: Path
) -> None:
    workflow = load_target(f"{shop}:shop")[0]
    with Engine(store_url, clock=FakeClock()) as engine:
        engine.start(workflow, {})
        engine.start(workflow, {"declined": False})
        stats = engine.run_until_idle()
    # reserve twice, charge 3 failed + 1 succeeded; one compensation (release).
    assert (stats.steps, stats.attempts, stats.compensations) == (3, 6, 1)


def test_cli_resume__summary_counts_every_attempt_that_ran(store_url: str, shop: Path) -> None:
    with Engine(store_url) as engine:
        run = engine.start(load_target(f"{shop}:shop")[0], {})
    result = CliRunner().invoke(cli, ["resume", "-w", str(shop), "--db", store_url])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[-1] == (
        "resumed: 0 interrupted run(s) recovered, 4 step attempt(s) run (3 failed), "
        "1 compensation(s) run, 9 commit(s)"
    )
    with Engine(store_url) as engine:
        assert engine.get(run.id).state == "cancelled"
        engine.start(load_target(f"{shop}:shop")[0], {"declined": False})
    as_json = CliRunner().invoke(cli, ["resume", "-w", str(shop), "--db", store_url, "--json"])
    assert as_json.exit_code == 0, as_json.output
    assert json.loads(as_json.output) == {
        "recovered": 0,
        "steps": 2,  # the attempts that succeeded, as before
        "attempts": 2,
        "compensations": 0,
        "commits": json.loads(as_json.output)["commits"],
    }
