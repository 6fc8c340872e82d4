"""Compensation (sagas) on SQLite and PostgreSQL: entering a compensating state undoes the
steps that succeeded, newest first, each journaled before and after; a failing one
retries on its own policy, then parks the run for an operator, whose retry continues with
what is still owed (never re-running a compensation whose success is committed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j


class Order(BaseModel):
    ship_fails: bool = False
    refund_fails: int = 0
    log: list[str] = []


CALLS: list[str] = []


def saga() -> Workflow:
    wf = Workflow("saga_order", context=Order)

    def release_stock(ctx: Order, step: Step) -> None:
        CALLS.append(f"release:{step.idempotency_key.split(':', 1)[1]}")
        ctx.log.append("released")

    def refund(ctx: Order, step: Step) -> None:
        CALLS.append("refund")
        if ctx.refund_fails > 0 and step.attempt <= ctx.refund_fails:
            raise ConnectionError(f"bank down (attempt {step.attempt})")
        ctx.log.append("refunded")

    @wf.step(initial=True, next="charge", compensate=release_stock)
    def reserve(ctx: Order) -> None:
        ctx.log.append("reserved")

    @wf.step(
        next="ship",
        compensate=refund,
        compensate_retry=Retry(attempts=2, backoff="fixed", base=0),
    )
    def charge(ctx: Order) -> None:
        ctx.log.append("charged")

    @wf.step(next="notify", retry=Retry(attempts=1), on_error={"*": "cancelled"})
    def ship(ctx: Order) -> None:
        if ctx.ship_fails:
            raise RuntimeError("carrier refused the parcel")
        ctx.log.append("shipped")

    @wf.step(next="delivered")
    def notify(ctx: Order) -> None: ...

    wf.final("delivered")
    wf.final("cancelled", compensate=True)
    return wf


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    CALLS.clear()
    with Engine(store_url, clock=FakeClock()) as engine:
        yield engine


def test_saga__no_failure_no_compensation(engine: Engine) -> None:
    info = engine.run(saga(), Order())
    assert (info.status, info.state) == ("succeeded", "delivered")
    assert CALLS == []


def test_saga__compensations_run_newest_first_each_journaled(engine: Engine) -> None:
    info = engine.run(saga(), Order(ship_fails=True))
    assert (info.status, info.state) == ("succeeded", "cancelled")
    assert info.reason == "compensated: charge, reserve"
    assert info.context.log == ["reserved", "charged", "refunded", "released"]  # type: ignore[union-attr]
    assert CALLS == ["refund", "release:reserve:1:undo"]
    kinds = [(e.kind, e.state) for e in engine.history(info.id)]
    assert kinds[-5:] == [
        (j.COMPENSATION_STARTED, "charge"),
        (j.COMPENSATION_SUCCEEDED, "charge"),
        (j.COMPENSATION_STARTED, "reserve"),
        (j.COMPENSATION_SUCCEEDED, "reserve"),
        (j.RUN_COMPENSATED, "cancelled"),
    ]
    assert engine.replay(info.id).differences == []
    started = [e.attempt for e in engine.history(info.id) if e.kind == j.COMPENSATION_STARTED]
    assert started == [1, 1]  # each compensation's first attempt


def test_saga__a_compensation_retries_on_its_own_policy(engine: Engine) -> None:
    info = engine.run(saga(), Order(ship_fails=True, refund_fails=1))
    assert (info.status, info.state) == ("succeeded", "cancelled")
    assert CALLS == ["refund", "refund", "release:reserve:1:undo"]
    failed = [e for e in engine.history(info.id) if e.kind == j.COMPENSATION_FAILED]
    assert [(e.state, e.retryable) for e in failed] == [("charge", True)]


def test_saga__a_compensation_failing_for_good_parks_the_run_then_retry_goes_on(
    engine: Engine,
) -> None:
    wf = saga()
    info = engine.run(wf, Order(ship_fails=True, refund_fails=5))
    assert (info.status, info.state) == ("failed", "cancelled")
    assert (info.reason or "").startswith("compensation_failed: charge: ConnectionError")
    assert CALLS == ["refund", "refund"]
    # The operator fixes the bank; its retry goes on with what is owed.
    engine.retry(info.id, set_fields={"refund_fails": 0})
    engine.run_until_idle()
    info = engine.get(info.id)
    assert (info.status, info.reason) == ("succeeded", "compensated: charge, reserve")
    assert CALLS == ["refund", "refund", "refund", "release:reserve:1:undo"]
    assert engine.replay(info.id).differences == []
