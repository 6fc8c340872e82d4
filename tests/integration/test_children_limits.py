"""Child runs under per-key limits (issue 15 meets issue 12), on SQLite and PostgreSQL: a
child of a workflow that declares ``concurrency_key`` holds its key exactly like a run
started by ``engine.start``, so ``key_limit`` counts children and other runs together; a
key function that fails for one item fails the map before any child exists."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow
from flowloop.store import SQLStore
from flowloop.store.schema import runs


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    with Engine(store_url, clock=FakeClock()) as engine:
        yield engine


class Charge(BaseModel):
    customer: str
    n: int = 0


class Batch(BaseModel):
    customers: list[str] = []


def billing() -> Workflow:
    wf = Workflow("billing", context=Charge, concurrency_key=lambda c: c.customer, key_limit=1)
    wf.step(name="charge", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    return wf


def batch(child: Workflow) -> Workflow:
    wf = Workflow("batch", context=Batch)
    wf.map(
        "charge_all",
        child=child,
        items=lambda ctx: ctx.customers,
        context=lambda ctx, item: Charge(customer=item),
        max_parallel=10,  # every child due at once: only the key limit holds them back
        on={"done": "charged", "failed": "charged"},
        initial=True,
    )
    wf.final("charged")
    return wf


def sql(engine: Engine) -> SQLStore:
    assert isinstance(engine.store, SQLStore)
    return engine.store


def fan_out(engine: Engine, parent: Workflow, customers: list[str]) -> str:
    """Start a batch and drive the parent alone: its children exist, none has run."""
    engine.register(parent)
    started = engine.start(parent, Batch(customers=customers))
    executor = engine._new_executor()
    try:
        asyncio.run(executor.run(until_idle=True, run_ids=[started.id]))
    finally:
        executor.close()
    return started.id


def claim(engine: Engine, worker: str) -> list[str]:
    store = sql(engine)
    rows = store.claim(
        worker=worker, now=engine.clock.now() + 1, limit=20, lease_seconds=30, workflows=["billing"]
    )
    return [row.id for row in rows]


def limit_keys(engine: Engine, where: sa.ColumnElement[bool]) -> list[str | None]:
    with sql(engine).engine.connect() as conn:
        return list(conn.execute(sa.select(runs.c.limit_key).where(where)).scalars())


def test_children__a_keyed_child_workflow_respects_the_per_key_limit(engine: Engine) -> None:
    child = billing()
    parent_id = fan_out(engine, batch(child), ["k0", "k0", "k1", "k1", "k0", "k2"])
    # The children hold their customer as key, as a run started directly does.
    assert Counter(limit_keys(engine, runs.c.parent_id == parent_id)) == Counter(
        {"k0": 3, "k1": 2, "k2": 1}
    )
    direct = engine.start(child, Charge(customer="k1"))
    assert limit_keys(engine, runs.c.id == direct.id) == ["k1"]

    # One run per key (k1: two children and the direct run, counted together), then none.
    got = claim(engine, "w1")
    customers = [engine.get(run_id).context.customer for run_id in got]  # type: ignore[union-attr]
    assert sorted(customers) == ["k0", "k1", "k2"]
    assert claim(engine, "w2") == []
    sql(engine).release(worker="w1", run_ids=got)

    engine.run_until_idle()
    assert engine.get(parent_id).status == "succeeded"
    assert engine.get(direct.id).status == "succeeded"


def test_children__a_concurrency_key_failing_for_one_item_fails_the_map_before_any_child(
    engine: Engine,
) -> None:
    def key(ctx: Charge) -> str:
        if ctx.customer == "bad":
            raise KeyError("customer")
        return ctx.customer

    child = Workflow("billing", context=Charge, concurrency_key=key, key_limit=1)
    child.step(name="charge", initial=True, next="done")(lambda ctx: None)
    child.final("done")
    parent_id = fan_out(engine, batch(child), ["k0", "k1", "bad"])
    info = engine.get(parent_id)
    assert (info.status, info.reason) == ("failed", "invalid_child_context")
    assert info.error is not None
    assert "map state 'charge_all': item 2" in info.error
    assert "concurrency_key raised KeyError" in info.error
    assert limit_keys(engine, runs.c.parent_id == parent_id) == []
