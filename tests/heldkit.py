"""A map whose children wait for an event and run one at a time (``max_parallel=1``): the
first child waits, the others are held back by their parent. Shared by the tests of how
held children are listed, counted, indexed and drawn."""

from __future__ import annotations

from pydantic import BaseModel

from flowloop import Workflow


class Item(BaseModel):
    n: int = 0


class Fan(BaseModel):
    items: list[int] = []


def held_fan(prefix: str) -> tuple[Workflow, Workflow]:
    """The map ``{prefix}_fan`` and its child ``{prefix}_item`` (which waits for ``go``)."""
    item = Workflow(f"{prefix}_item", context=Item)
    item.wait("hold", on={"go": "done"}, initial=True)
    item.final("done")
    fan = Workflow(f"{prefix}_fan", context=Fan)
    fan.map(
        "each",
        child=item,
        items=lambda ctx: ctx.items,
        context=lambda ctx, n: Item(n=n),
        max_parallel=1,
        on={"done": "done"},
        initial=True,
    )
    fan.final("done")
    return fan, item
