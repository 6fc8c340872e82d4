"""Entries written under a newer context version say the version of the context they hold.

A run created under context version 1 and driven by a definition of version 2 (its
upcaster carries the old context forward) is journaled by entries the fold reads the
run's ``context_version`` from. An entry that keeps the context as it was (an ``on_error``
route, a passed deadline) stamped the definition's version on the old text, and one that
wrote an upcast context (a compensation's success, a debounced start) kept the old
version: either way the next load ran the upcaster on the wrong text — a run stuck
``running`` with its worker's task dead (``upcaster 1->2 raised KeyError``), a valid run
parked ``context_mismatch``, or, with a lenient upcaster, the data silently rewritten.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from flowloop import Engine, Retry, Workflow
from flowloop.clock import FakeClock


class PriceV1(BaseModel):
    amount: int
    undone: list[str] = []


class PriceV2(BaseModel):
    cents: int
    undone: list[str] = []


def v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """Not idempotent, as most real upcasters: run twice, it raises KeyError."""
    data = dict(data)
    data["cents"] = data.pop("amount") * 100
    return data


V2: dict[str, Any] = {"context": PriceV2, "context_version": 2, "migrate": {1: v1_to_v2}}


def _replays(engine: Engine, run_id: str) -> None:
    replay = engine.replay(run_id)
    assert replay.differences == []
    last = None
    for event in engine.history(run_id):  # every seq folds to the context journaled then
        last = event.context if event.context is not None else last
        assert engine.replay(run_id, at=event.seq).record.context == last


def routed(context: type[BaseModel] = PriceV1, **versioning: Any) -> Workflow:
    wf = Workflow("routed", context=context, **versioning)

    def work(ctx: Any) -> None:
        raise RuntimeError("provider refused")

    wf.step(name="work", initial=True, next="done", retry=Retry(attempts=1),
            on_error={"*": "recover"})(work)  # fmt: skip
    wf.step(name="recover", next="done")(lambda ctx: None)
    wf.final("done")
    return wf


def test_an_on_error_route_keeps_the_version_of_the_context_it_keeps(store_url: str) -> None:
    with Engine(store_url, workflows=[routed()]) as engine:
        run_id = engine.start(engine.workflow("routed"), PriceV1(amount=5)).id
    with Engine(store_url, workflows=[routed(**V2)]) as engine:
        engine.run_until_idle()
        info = engine.get(run_id)
        assert (info.status, info.state) == ("succeeded", "done")
        assert info.context.cents == 500
        _replays(engine, run_id)


def expiring(context: type[BaseModel] = PriceV1, **versioning: Any) -> Workflow:
    wf = Workflow("expiring", context=context, deadline=timedelta(hours=1),
                  on_deadline="expired", **versioning)  # fmt: skip
    wf.wait("waiting", on={"go": "done"}, initial=True)
    wf.step(name="expired", next="done")(lambda ctx: None)
    wf.final("done")
    return wf


def test_a_passed_deadline_keeps_the_version_of_the_context_it_keeps(store_url: str) -> None:
    clock = FakeClock()
    with Engine(store_url, clock=clock, workflows=[expiring()]) as engine:
        run_id = engine.start(engine.workflow("expiring"), PriceV1(amount=5)).id
    clock.advance(2 * 3600)
    with Engine(store_url, clock=clock, workflows=[expiring(**V2)]) as engine:
        engine.run_until_idle()
        info = engine.get(run_id)
        assert (info.status, info.state) == ("succeeded", "done")
        assert info.context.cents == 500
        _replays(engine, run_id)


FAILING_UNDO: set[str] = set()


def saga(context: type[BaseModel] = PriceV1, **versioning: Any) -> Workflow:
    wf = Workflow("saga", context=context, **versioning)

    def undo(name: str) -> Any:
        def compensate(ctx: Any) -> None:
            if name in FAILING_UNDO:
                raise ValueError(f"{name}: provider down")
            ctx.undone.append(name)

        return compensate

    def fails(ctx: Any) -> None:
        raise RuntimeError("sold out")

    wf.step(name="a", initial=True, next="b", compensate=undo("a"))(lambda ctx: None)
    wf.step(name="b", next="c", compensate=undo("b"),
            compensate_retry=Retry(attempts=1))(lambda ctx: None)  # fmt: skip
    wf.step(name="c", next="done", retry=Retry(attempts=1),
            on_error={"*": "cancelled"})(fails)  # fmt: skip
    wf.final("done")
    wf.final("cancelled", compensate=True)
    return wf


def test_compensations_resumed_under_a_newer_context_version(store_url: str) -> None:
    FAILING_UNDO.add("b")
    try:
        with Engine(store_url, workflows=[saga()]) as engine:
            run = engine.run(engine.workflow("saga"), PriceV1(amount=5))
            assert run.status == "failed"  # the compensation of b failed for good
    finally:
        FAILING_UNDO.clear()
    with Engine(store_url, workflows=[saga(**V2)]) as engine:
        engine.retry(run.id)  # goes on with the compensations still owed, under v2
        engine.run_until_idle()
        info = engine.get(run.id)
        assert (info.status, info.reason) == ("succeeded", "compensated: b, a")
        assert (info.context.cents, info.context.undone) == (500, ["b", "a"])
        _replays(engine, run.id)


def debounced(context: type[BaseModel] = PriceV1, **versioning: Any) -> Workflow:
    wf = Workflow("debounced", context=context, **versioning)
    wf.step(name="push", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    return wf


def test_a_debounced_start_under_a_newer_context_version(store_url: str) -> None:
    clock = FakeClock()
    with Engine(store_url, clock=clock, workflows=[debounced()]) as engine:
        first = engine.start(engine.workflow("debounced"), PriceV1(amount=5), key="k",
                             debounce=60)  # fmt: skip
    with Engine(store_url, clock=clock, workflows=[debounced(**V2)]) as engine:
        later = engine.start(engine.workflow("debounced"), PriceV2(cents=700), key="k",
                             debounce=60)  # fmt: skip
        assert later.id == first.id  # one burst, one run, with the last context
        _replays(engine, first.id)
        clock.advance(120)
        engine.run_until_idle()
        info = engine.get(first.id)
        assert (info.status, info.context.cents) == ("succeeded", 700)
        _replays(engine, first.id)


class Item(BaseModel):
    amount: int


class ItemV2(BaseModel):
    cents: int


class Total(BaseModel):
    amounts: list[int]
    total_cents: int = 0


def item_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    return {"cents": data["amount"] * 100}


def held_item(context: type[BaseModel] = Item, **versioning: Any) -> Workflow:
    wf = Workflow("held_item", context=context, **versioning)
    wf.wait("hold", on={"go": "done"}, initial=True)
    wf.final("done")
    return wf


def totals(child: Workflow) -> Workflow:
    def add(ctx: Total, results: list[Any]) -> None:
        ctx.total_cents = sum(r.context.cents for r in results)

    wf = Workflow("totals", context=Total)
    wf.map("each", child=child, items=lambda ctx: ctx.amounts,
           context=lambda ctx, amount: child.context.model_validate(_item(child, amount)),
           on={"done": "done"}, reduce=add, initial=True)  # fmt: skip
    wf.final("done")
    return wf


def _item(child: Workflow, amount: int) -> dict[str, int]:
    return {"amount": amount} if child.context_version == 1 else {"cents": amount * 100}


def test_a_join_reads_a_child_that_ended_under_an_older_context_version(store_url: str) -> None:
    # Item 0 ends under child v1; item 1 after the deploy, under v2. The join read every
    # child's final context as the newest model, without its upcaster: the parent failed
    # (child_unreadable: cents: Field required) for a result that was there.
    old = held_item()
    with Engine(store_url, workflows=[totals(old), old]) as engine:
        parent = engine.start(engine.workflow("totals"), Total(amounts=[1, 2])).id
        engine.run_until_idle()
        first, second = sorted(engine.runs(workflow="held_item"), key=lambda r: r.id)
        engine.send(first.id, "go")
    new = held_item(ItemV2, context_version=2, migrate={1: item_v1_to_v2})
    with Engine(store_url, workflows=[totals(new), new]) as engine:
        engine.send(second.id, "go")
        engine.run_until_idle()
        info = engine.get(parent)
        assert (info.status, info.error) == ("succeeded", None)
        assert info.context.total_cents == 300
        _replays(engine, parent)
