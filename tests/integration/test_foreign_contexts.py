"""A context given as an instance of another pydantic model, on SQLite and PostgreSQL:
judged like the mapping of its fields wherever a new run's context comes from —
`engine.start`, `engine.run`, `start_many`, and a call's or map's `context=` function
for its children. Before, its fields the workflow's model has not were dropped without a
word (a mapping with them was refused at start, and taken as it was by a child)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow
from flowloop.errors import InvalidContext


class Order(BaseModel):
    order_id: str
    amount: float = 0.0


class Refund(BaseModel):
    order_id: str
    refund_amount: float


class Ref(BaseModel):
    order_id: str


def charging() -> Workflow:
    wf = Workflow("foreign_charge", context=Order)
    wf.step(name="charge", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    return wf


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    with Engine(store_url, clock=FakeClock()) as e:
        yield e


REFUSED = r"no field\(s\) 'refund_amount' in Order \(fields: order_id, amount\)"


def test_start_run_and_start_many__another_models_extra_field_is_refused(
    engine: Engine,
) -> None:
    wf = charging()
    refund = Refund(order_id="A1", refund_amount=5.0)
    with pytest.raises(InvalidContext, match=REFUSED + "; the context given is a Refund"):
        engine.start(wf, refund)
    with pytest.raises(InvalidContext, match=REFUSED):
        engine.run(wf, refund)
    with pytest.raises(InvalidContext, match=r"context #2 for workflow .*'refund_amount'"):
        engine.start_many(wf, [Order(order_id="M1"), refund])
    assert engine.runs() == []
    # Every field of it the model has: taken, as the mapping of them is.
    run = engine.run(wf, Ref(order_id="B2"))
    assert (run.status, run.context) == ("succeeded", Order(order_id="B2"))


def parent_of(child: Workflow, make: object, *, mapped: bool) -> Workflow:
    wf = Workflow(f"foreign_parent_{'map' if mapped else 'call'}", context=Order)
    if mapped:
        wf.map(
            "each",
            child=child,
            items=lambda ctx: [1, 2],
            context=lambda ctx, item: make(ctx),  # type: ignore[operator]
            on={"done": "done", "failed": "done"},
            initial=True,
        )
    else:
        wf.call(
            "one",
            child=child,
            context=make,  # type: ignore[arg-type]
            on={"succeeded": "done"},
            initial=True,
        )
    wf.final("done")
    return wf


@pytest.mark.parametrize("mapped", [False, True], ids=["call", "map"])
def test_children__a_field_the_childs_model_has_not_fails_the_parent(
    engine: Engine, mapped: bool
) -> None:
    child = charging()
    makers = (
        lambda ctx: Refund(order_id=ctx.order_id, refund_amount=ctx.amount),
        lambda ctx: {"order_id": ctx.order_id, "amount_": ctx.amount},  # misspelt
    )
    for make, field in zip(makers, ("refund_amount", "amount_"), strict=True):
        info = engine.run(parent_of(child, make, mapped=mapped), Order(order_id="P", amount=3))
        assert (info.status, info.reason) == ("failed", "invalid_child_context")
        assert f"no field(s) '{field}' in Order" in (info.error or ""), info.error
        where = "map state 'each': item 0" if mapped else "call state 'one'"
        assert (info.error or "").startswith(where), info.error
    assert engine.runs(workflow=child.name) == []
    # The child's own model, or another whose fields it all has: taken as before.
    for make in (lambda ctx: Order(order_id=ctx.order_id), lambda ctx: Ref(order_id="R")):
        info = engine.run(parent_of(child, make, mapped=mapped), Order(order_id="Q"))
        assert (info.status, info.state) == ("succeeded", "done")
