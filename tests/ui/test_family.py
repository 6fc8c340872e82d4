"""A run page shows the run's parent and children (call / map states, issue 12): a parent
lists its child runs with their status, a child links back to its parent."""

from __future__ import annotations

import httpx
from pydantic import BaseModel
from uikit import serve

from flowloop import Engine, Workflow
from flowloop.store.sql import SQLStore
from flowloop.ui.app import create_app


class Pack(BaseModel):
    order_id: str
    parcel: str = ""


class Shipment(BaseModel):
    order_id: str
    parcel: str = ""


def shipment_with_packing() -> Workflow:
    packing = Workflow("packing_ui", context=Pack)

    @packing.step(initial=True, next="packed")
    def pack(ctx: Pack) -> None:
        ctx.parcel = f"P-{ctx.order_id}"

    packing.final("packed")
    shipment = Workflow("shipment_ui", context=Shipment)
    shipment.call(
        "pack",
        child=packing,
        context=lambda ctx: Pack(order_id=ctx.order_id),
        on={"succeeded": "shipped", "failed": "cancelled", "stopped": "cancelled"},
        result=lambda ctx, packed: setattr(ctx, "parcel", packed.parcel),
        initial=True,
    )
    shipment.final("shipped", "cancelled")
    return shipment


def test_run_page__shows_parent_and_children(store_url: str) -> None:
    shipment = shipment_with_packing()
    with Engine(store_url) as engine:
        parent = engine.run(shipment, Shipment(order_id="A7"))
        assert parent.state == "shipped"
        store = engine.store
        assert isinstance(store, SQLStore)
        (child,) = store.children_of(parent.id)
        with serve(create_app(store, workflows={"shipment_ui": shipment})) as base:
            page = httpx.get(f"{base}/runs/{parent.id}").text
            assert "Parent and children" in page and "1 child run(s)" in page
            assert f'href="/runs/{child.id}"' in page and "packing_ui" in page
            child_page = httpx.get(f"{base}/runs/{child.id}").text
            assert f'href="/runs/{parent.id}"' in child_page
            plain = httpx.get(f"{base}/runs/{child.id}").text
            assert "child run(s)" not in plain  # the child has none
