"""A compensation's idempotency key names the visit of the step it undoes (SQLite and
PostgreSQL), however that visit began: by a transition, an operator's ``retry --from``, or
a migration — and a step a migration renamed is still undone.

``compose.compensations_due`` counted visits from transition entries alone: a visit begun
by a ``run_retried`` (or ``run_migrated``) entry was missed, so the two charges of a run
retried from its charging state were both refunded under the first one's key (one refunded
twice, the other never). It also looked a journaled step up by its old name after a
migration renamed it, and skipped its compensation.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow

CHARGED: list[str] = []
REFUNDED: list[str] = []


class Pay(BaseModel):
    check_no: int = 0


def _visit(step: Step) -> str:
    return step.idempotency_key.split(":", 1)[1]  # "<state>:<visit>[:undo]"


def refund(ctx: Pay, step: Step) -> None:
    REFUNDED.append(_visit(step))


def charge(ctx: Pay, step: Step) -> None:
    CHARGED.append(_visit(step))


def payments(
    version: int = 1,
    *,
    charge_as: str = "charge",
    migrates_from: dict[int, dict[str, str]] | None = None,
) -> Workflow:
    """``charge_as`` (compensated) -> ``hold`` (a wait) -> ``check``, which fails: its first
    time with no route, then into ``cancelled`` (compensating)."""
    wf = Workflow("pay_keys", context=Pay, version=version, migrates_from=migrates_from)
    wf.step(name=charge_as, initial=True, next="hold", compensate=refund)(charge)
    wf.wait("hold", on={"go": "check", "again": charge_as})

    @wf.step(next="done", retry=Retry(attempts=1), on_error={KeyError: "cancelled"})
    def check(ctx: Pay) -> None:
        raise (ValueError if ctx.check_no == 0 else KeyError)("no")

    wf.final("done")
    wf.final("cancelled", compensate=True)
    return wf


@pytest.fixture(autouse=True)
def _calls() -> Iterator[None]:
    CHARGED.clear()
    REFUNDED.clear()
    yield


def test_retry_from_a_past_state__each_charge_refunded_under_its_own_visit(
    store_url: str,
) -> None:
    with Engine(store_url, workflows=[payments()], clock=FakeClock()) as engine:
        run = engine.start(engine.workflow("pay_keys"), Pay())
        engine.run_until_idle()
        engine.send(run.id, "go")
        engine.run_until_idle()
        assert engine.get(run.id).status == "failed"
        engine.retry(run.id, from_state="charge", set_fields={"check_no": 1})
        engine.run_until_idle()
        engine.send(run.id, "go")
        engine.run_until_idle()
        info = engine.get(run.id)
    assert (info.status, info.reason) == ("succeeded", "compensated: charge, charge")
    assert CHARGED == ["charge:1", "charge:2"]
    assert REFUNDED == ["charge:2:undo", "charge:1:undo"]


def test_a_visit_a_migration_began__refunded_under_its_own_visit(store_url: str) -> None:
    """Migrated from ``hold`` (v1) into ``charge`` (v2 still has ``hold``: a move, not a
    rename): the charge that follows is visit 2, and so is its refund."""
    with Engine(store_url, workflows=[payments()], clock=FakeClock()) as engine:
        run = engine.start(engine.workflow("pay_keys"), Pay(check_no=1))
        engine.run_until_idle()
    v2 = payments(2, migrates_from={1: {"hold": "charge"}})
    with Engine(store_url, workflows=[payments(), v2], clock=FakeClock()) as engine:
        [moved] = engine.migrate_workflow("pay_keys", to=2, by="deployer")
        assert (moved.problem, moved.state) == (None, "charge")
        engine.run_until_idle()
        engine.send(run.id, "go")
        engine.run_until_idle()
        info = engine.get(run.id)
    assert (info.status, info.reason) == ("succeeded", "compensated: charge, charge")
    assert CHARGED == ["charge:1", "charge:2"]
    assert REFUNDED == ["charge:2:undo", "charge:1:undo"]


def test_a_step_a_migration_renamed__still_undone_under_the_key_it_ran_with(
    store_url: str,
) -> None:
    with Engine(store_url, workflows=[payments()], clock=FakeClock()) as engine:
        run = engine.start(engine.workflow("pay_keys"), Pay(check_no=1))
        engine.run_until_idle()
    v2 = payments(2, charge_as="bill", migrates_from={1: {"charge": "bill"}})
    with Engine(store_url, workflows=[v2], clock=FakeClock()) as engine:
        [moved] = engine.migrate_workflow("pay_keys", to=2, by="deployer")
        assert (moved.problem, moved.state) == (None, "hold")
        engine.send(run.id, "go")
        engine.run_until_idle()
        info = engine.get(run.id)
    assert (info.status, info.reason) == ("succeeded", "compensated: bill")
    assert CHARGED == ["charge:1"]
    assert REFUNDED == ["charge:1:undo"]
