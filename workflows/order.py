"""An order: reserve stock → (a person approves a large order) → charge the card (with
retries) → ship; or cancel when out of stock, rejected, not approved within 2 days, or
declined.

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


class Approval(BaseModel):
    """The payload of the ``approve`` and ``reject`` events."""

    by: str
    note: str = ""


order = Workflow("order", context=Order, version=2, key="order_id")


@order.step(
    initial=True,
    on={"reserved": "charge", "needs_approval": "awaiting_approval", "out_of_stock": "cancelled"},
)
def reserve(ctx: Order, step: Step) -> str:
    missing = [item.sku for item in ctx.items if item.sku in OUT_OF_STOCK or item.sku not in PRICES]
    if missing:
        ctx.cancel_reason = f"out of stock: {', '.join(missing)}"
        return "out_of_stock"
    ctx.amount = round(sum(PRICES[item.sku] * item.qty for item in ctx.items), 2)
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
    on={"charged": "ship", "declined": "cancelled"},
    timeout=10,
    retry=Retry(attempts=5, backoff="exponential", base=0.2, cap=5, on=(ConnectionError,)),
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


@order.step(next="delivered", idempotent=False)
def ship(ctx: Order, step: Step) -> None:
    # Not idempotent: a crash mid-shipment must not ship twice; an operator decides.
    ctx.tracking = "TRK" + hashlib.sha256(step.idempotency_key.encode()).hexdigest()[:10].upper()


order.final("delivered", "cancelled")
