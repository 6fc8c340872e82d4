"""A context model whose fields have aliases (SQLite and PostgreSQL).

Contexts are stored as the model dumps them, by field name; they were loaded back by alias
only, so a field with an alias (and no ``populate_by_name``) came back as its default: the
order id given at the start was gone by the first step (review, older). Contexts are loaded
by name and by alias now."""

from __future__ import annotations

from pydantic import BaseModel, Field

from flowloop import Engine, Step, Workflow


class Order(BaseModel):
    order_id: str = Field("", alias="orderId")
    amount: float = 0


class Label(BaseModel):
    order_id: str = Field("", alias="orderId")


def flows(seen: list[str]) -> tuple[Workflow, Workflow]:
    label = Workflow("alias_label", context=Label)

    @label.step(initial=True, next="printed")
    def print_label(ctx: Label) -> None:
        seen.append(f"label {ctx.order_id}")

    label.final("printed")
    order = Workflow("alias_order", context=Order)

    @order.step(initial=True, next="labelled")
    def charge(ctx: Order, step: Step) -> None:
        seen.append(f"charge {ctx.order_id}")
        ctx.amount += 1

    order.call(
        "labelled",
        child=label,
        context=lambda ctx: Label(orderId=ctx.order_id),
        on={"succeeded": "done"},
    )
    order.final("done")
    return order, label


def test_a_field_with_an_alias_keeps_its_value_from_start_to_end(store_url: str) -> None:
    seen: list[str] = []
    order, label = flows(seen)
    with Engine(store_url, workflows=[order, label]) as engine:
        for given in ({"orderId": "A1"}, '{"orderId": "A2"}', Order(orderId="A3")):
            info = engine.run(order, given)
            assert info.status == "succeeded", info
            assert info.context.order_id in ("A1", "A2", "A3")  # type: ignore[union-attr]
            assert engine.replay(info.id).matches
        assert seen == [
            "charge A1",
            "label A1",
            "charge A2",
            "label A2",
            "charge A3",
            "label A3",
        ]
