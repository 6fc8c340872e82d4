"""An order: reserve stock → (a person approves a large order) → charge the card (with
retries) → pack it (a child run of ``packing``) → ship; or cancel when out of stock,
rejected, not approved within 2 days, or declined. When the payment keeps failing or the
packing fails, the order is *rolled back*: the compensations run, newest first — refund the
charge, release the stock — each journaled like a step.

Run it:
    flowloop run workflows/order.py \
        --context '{"order_id": "A1", "items": [{"sku": "book", "qty": 2}]}'
A large order waits:  flowloop send RUN approve --data '{"by": "ann"}'
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

from pydantic import BaseModel, Field

from flowloop import Retry, Step, Workflow

PRICES = {"book": 12.5, "pen": 1.2, "lamp": 39.0, "desk": 240.0, "chair": 180.0}
OUT_OF_STOCK = {"desk"}
APPROVAL_ABOVE = 500.0
"""Orders above this amount wait for a person's approval."""


class Item(BaseModel):
    sku: str
    qty: int = Field(gt=0)


class Order(BaseModel):
    order_id: str
    items: list[Item] = Field(min_length=1)
    amount: float = 0.0
    charge_id: str | None = None
    tracking: str | None = None
    cancel_reason: str | None = None
    approved_by: str | None = None
    flaky_payment: bool = True
    """Simulate a payment provider that drops the first connection (shows a retry)."""
    parcel: str | None = None
    reserved: bool = False
    refund_id: str | None = None
    pack_fails: bool = False
    """Simulate a packing station that cannot pack the order (shows the rollback)."""


class Pack(BaseModel):
    """The context of a packing run (a child of an order)."""

    order_id: str
    items: list[Item]
    fail: bool = False
    parcel: str | None = None


packing = Workflow("packing", context=Pack)


@packing.step(initial=True, next="packed", retry=Retry(attempts=2, backoff="fixed", base=0))
def pack_items(ctx: Pack, step: Step) -> None:
    if ctx.fail:
        raise RuntimeError("packing station: no box fits")
    boxes = sum(item.qty for item in ctx.items)
    ctx.parcel = f"P-{ctx.order_id}-{boxes}"


packing.final("packed")


class Approval(BaseModel):
    """The payload of the ``approve`` and ``reject`` events."""

    by: str
    note: str = ""


order = Workflow("order", context=Order, version=3, key="order_id")


def release_stock(ctx: Order, step: Step) -> None:
    """Compensation of ``reserve``: give the stock back (a no-op when none was held)."""
    ctx.reserved = False


def refund_charge(ctx: Order, step: Step) -> None:
    """Compensation of ``charge``: refund it, once (the key is stable across crashes)."""
    if ctx.charge_id is not None:
        ctx.refund_id = "re_" + hashlib.sha256(step.idempotency_key.encode()).hexdigest()[:12]


@order.step(
    initial=True,
    on={"reserved": "charge", "needs_approval": "awaiting_approval", "out_of_stock": "cancelled"},
    compensate=release_stock,
)
def reserve(ctx: Order, step: Step) -> str:
    missing = [item.sku for item in ctx.items if item.sku in OUT_OF_STOCK or item.sku not in PRICES]
    if missing:
        ctx.cancel_reason = f"out of stock: {', '.join(missing)}"
        return "out_of_stock"
    ctx.amount = round(sum(PRICES[item.sku] * item.qty for item in ctx.items), 2)
    ctx.reserved = True
    return "needs_approval" if ctx.amount > APPROVAL_ABOVE else "reserved"


def approved(ctx: Order, approval: Approval) -> None:
    ctx.approved_by = approval.by


def rejected(ctx: Order, approval: Approval) -> None:
    ctx.cancel_reason = f"rejected by {approval.by}: {approval.note}".rstrip(": ")


# No step runs here: the run holds no worker until `approve`/`reject` arrives or 2 days pass.
order.wait(
    "awaiting_approval",
    on={"approve": "charge", "reject": "cancelled"},
    payloads={"approve": Approval, "reject": Approval},
    handlers={"approve": approved, "reject": rejected},
    timeout=timedelta(days=2),
    on_timeout="cancelled",
)


@order.step(
    on={"charged": "pack", "declined": "cancelled"},
    timeout=10,
    retry=Retry(attempts=5, backoff="exponential", base=0.2, cap=5, on=(ConnectionError,)),
    on_error={"*": "rolled_back"},  # the provider stays down: undo what was done
    compensate=refund_charge,
)
async def charge(ctx: Order, step: Step) -> str:
    if ctx.flaky_payment and step.attempt == 1:
        raise ConnectionError("payment provider closed the connection")
    if ctx.amount > 1000:
        ctx.cancel_reason = "card declined"
        return "declined"
    # The idempotency key is stable across retries and crashes: the provider charges once.
    ctx.charge_id = "ch_" + hashlib.sha256(step.idempotency_key.encode()).hexdigest()[:12]
    return "charged"


def packed(ctx: Order, pack: Pack) -> None:
    ctx.parcel = pack.parcel


# A child run of `packing`: the order waits (no worker, no thread) until it ends.
order.call(
    "pack",
    child=packing,
    context=lambda ctx: Pack(order_id=ctx.order_id, items=ctx.items, fail=ctx.pack_fails),
    on={"succeeded": "ship", "failed": "rolled_back", "stopped": "rolled_back"},
    result=packed,
)


@order.step(next="delivered", idempotent=False)
def ship(ctx: Order, step: Step) -> None:
    # Not idempotent: a crash mid-shipment must not ship twice; an operator decides.
    ctx.tracking = "TRK" + hashlib.sha256(step.idempotency_key.encode()).hexdigest()[:10].upper()


order.final("delivered", "cancelled")
order.final("rolled_back", compensate=True)
