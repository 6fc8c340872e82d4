"""A map of 10,000 children on SQLite and PostgreSQL: every child runs exactly once, the
join counts every one, the reduce sees all of them (scale, not speed: bench/fanout.py
measures the time)."""

from __future__ import annotations

from collections import Counter

from pydantic import BaseModel

from flowloop import Engine, Step, Workflow
from flowloop.compose import ChildResult
from flowloop.store.joins import JoinStoreMixin

ITEMS = 10_000
EXECUTED: Counter[str] = Counter()


class Item(BaseModel):
    n: int
    doubled: int = 0


class Batch(BaseModel):
    count: int
    total: int = 0
    seen: int = 0


def workflows() -> Workflow:
    child = Workflow("scale_item", context=Item)

    @child.step(initial=True, next="done")
    async def double(ctx: Item, step: Step) -> None:
        EXECUTED[step.run_id] += 1
        ctx.doubled = ctx.n * 2

    child.final("done")
    parent = Workflow("scale_map", context=Batch)

    def reduce(ctx: Batch, results: list[ChildResult[Item]]) -> None:
        ctx.seen = len(results)
        ctx.total = sum(r.context.doubled for r in results)

    parent.map(
        "fan",
        child=child,
        items=lambda ctx: range(ctx.count),
        context=lambda ctx, i: Item(n=i),
        max_parallel=64,
        max_items=ITEMS,
        on={"done": "joined"},
        reduce=reduce,
        initial=True,
    )
    parent.final("joined")
    return parent


def test_map__ten_thousand_children_each_exactly_once(store_url: str) -> None:
    EXECUTED.clear()
    with Engine(store_url, max_concurrency=64) as engine:
        wf = workflows()
        engine.register(wf)
        started = engine.start(wf, Batch(count=ITEMS))
        engine.run_until_idle()
        info = engine.get(started.id)
        assert (info.status, info.state) == ("succeeded", "joined")
        assert info.context.seen == ITEMS  # type: ignore[union-attr]
        assert info.context.total == ITEMS * (ITEMS - 1)  # type: ignore[union-attr]
        assert len(EXECUTED) == ITEMS and set(EXECUTED.values()) == {1}
        store = engine.store
        assert isinstance(store, JoinStoreMixin)
        assert store.child_counts(started.id) == {"succeeded": ITEMS}
        join_id = store.children_of(started.id)[0].record.join
        join = store.get_join(join_id or "")
        assert join is not None
        assert (join.total, join.created, join.succeeded, join.failed) == (ITEMS, ITEMS, ITEMS, 0)
