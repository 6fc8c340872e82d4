"""``flowloop status RUN`` of a run a worker holds names that worker and whether its lease
still runs, on SQLite and PostgreSQL. Before, a run whose worker was frozen (SIGSTOP),
cut off from the database or dead showed as a plain ``running`` — the same as a healthy
one — until another worker took it over (fault audit: the operator's view during a
fault did not say what was happening)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import pytest
from click.testing import CliRunner
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.cli import cli


class Ctx(BaseModel):
    n: int = 0


def flow() -> Workflow:
    wf = Workflow("held_run", context=Ctx)

    @wf.step(initial=True, next="done")
    def only(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


def status(url: str, run_id: str) -> str:
    result = CliRunner().invoke(cli, ["status", run_id, "--db", url])
    assert result.exit_code == 0, result.output
    return result.output


def claim(store: Any, run_id: str, lease: float) -> None:
    """A worker that never comes back claims the run (as one frozen right after it)."""
    poll(
        lambda: store.claim(
            worker="w-frozen",
            now=store.db_now(),
            limit=1,
            lease_seconds=lease,
            workflows=["held_run"],
            run_ids=[run_id],
        ),
        timeout=10,
        every=0.01,
        what="the run to be claimed",
    )


def test_status_names_the_worker_and_its_lease(store_url: str) -> None:
    wf = flow()
    with Engine(store_url, workflows=[wf]) as engine:
        run_id = engine.start(wf, Ctx()).id
        claim(engine.store, run_id, 300.0)
    shown = status(store_url, run_id)
    assert "worker    w-frozen (lease until 20" in shown, shown


def test_status_says_a_lease_ran_out_unrenewed(store_url: str) -> None:
    wf = flow()
    with Engine(store_url, workflows=[wf]) as engine:
        store: Any = engine.store
        run_id = engine.start(wf, Ctx()).id
        claim(store, run_id, 0.2)
        until = store.get_run(run_id).lease_expires_at
        poll(lambda: store.db_now() > until + 0.1, timeout=10, every=0.02, what="the lease end")
    shown = status(store_url, run_id)
    assert "worker    w-frozen (lease ran out " in shown, shown
    assert "not renewed" in shown, shown


def status_json(url: str, run_id: str) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["status", run_id, "--db", url, "--json"])
    assert result.exit_code == 0, result.output
    shown: dict[str, Any] = json.loads(result.output)
    return shown


def test_status_json_names_the_worker_and_its_lease(store_url: str) -> None:
    """`status RUN --json` says what the text's `worker` line says (it said neither)."""
    wf = flow()
    with Engine(store_url, workflows=[wf]) as engine:
        store: Any = engine.store
        run_id = engine.start(wf, Ctx()).id
        free = status_json(store_url, run_id)
        claim(store, run_id, 300.0)
        until = store.get_run(run_id).lease_expires_at
    assert (free["worker"], free["lease_expires_at"], free["lease_expired"]) == (
        None,
        None,
        False,
    )
    held = status_json(store_url, run_id)
    assert held["worker"] == "w-frozen" and held["lease_expired"] is False, held
    assert held["lease_expires_at_epoch"] == until
    assert datetime.fromisoformat(held["lease_expires_at"]).timestamp() == pytest.approx(until)


def test_status_json_says_a_lease_ran_out_unrenewed(store_url: str) -> None:
    wf = flow()
    with Engine(store_url, workflows=[wf]) as engine:
        store: Any = engine.store
        run_id = engine.start(wf, Ctx()).id
        claim(store, run_id, 0.2)
        until = store.get_run(run_id).lease_expires_at
        poll(lambda: store.db_now() > until + 0.1, timeout=10, every=0.02, what="the lease end")
    shown = status_json(store_url, run_id)
    assert (shown["worker"], shown["lease_expired"]) == ("w-frozen", True), shown
    assert shown["lease_expires_at_epoch"] == until
