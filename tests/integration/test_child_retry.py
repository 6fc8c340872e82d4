"""An operator's retry of a map's child, on SQLite and PostgreSQL: while its map still
waits for children the child runs again as one of ``max_parallel`` and its map waits for
its new end; past the bound the retry is refused; once its map has every result it runs
on its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import FakeClock, Retry, Workflow
from flowloop.errors import FlowloopError, NoFreeSlot
from flowloop.store.schema import joins, runs
from flowloop.testing import TestEngine


class Item(BaseModel):
    n: int = 0
    fail: bool = False


class Fan(BaseModel):
    items: list[int] = []
    fail: list[int] = []
    seen: list[str] = []


def item() -> Workflow:
    """A child that fails at once when told to, else waits for "go"."""
    wf = Workflow("retried_item", context=Item)

    @wf.step(initial=True, next="hold", retry=Retry(attempts=1))
    def work(ctx: Item) -> None:
        if ctx.fail:
            raise ValueError("told to fail")

    wf.wait("hold", on={"go": "done"})
    wf.final("done")
    return wf


def fan(max_parallel: int) -> Workflow:
    """A map of :func:`item` whose reduce notes each child's outcome in item order."""
    wf = Workflow(f"retried_fan_{max_parallel}", context=Fan)

    def note(ctx: Fan, results: list[Any]) -> None:
        ctx.seen = [r.status for r in results]

    wf.map(
        "each",
        child=item(),
        items=lambda ctx: ctx.items,
        context=lambda ctx, n: Item(n=n, fail=n in ctx.fail),
        max_parallel=max_parallel,
        tolerate_failures=3,
        reduce=note,
        on={"done": "done"},
        initial=True,
    )
    wf.final("done")
    return wf


@pytest.fixture
def engine(store_url: str) -> Iterator[TestEngine]:
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[fan(1), fan(2), fan(3), item()]) as e:
        yield e


def children(engine: TestEngine, parent: str) -> list[Any]:
    """The parent's children in item order."""
    store: Any = engine.store
    return [engine.get(child.id) for child in store.children_of(parent)]


def running(engine: TestEngine, parent: str) -> list[int]:
    """The items of the children that hold a slot: released, not ended."""
    return [
        c.context.n
        for c in children(engine, parent)
        if c.status == "scheduled" and c.state == "hold" and not engine.is_held(c.id)
    ]


def counts(engine: TestEngine, parent: str) -> tuple[int, int, int, int]:
    store: Any = engine.store
    with store.engine.connect() as conn:
        row = conn.execute(
            sa.select(joins.c.succeeded, joins.c.failed, joins.c.stopped, joins.c.ended_held).where(
                joins.c.parent_id == parent
            )
        ).one()
    return tuple(row)  # type: ignore[return-value]


def go(engine: TestEngine, run_id: str) -> None:
    assert engine.send(run_id, "go").status == "applied"
    engine.run_until_idle(idle_horizon=0)


def test_a_retry_past_max_parallel_is_refused(engine: TestEngine) -> None:
    """``max_parallel=1``: the failed first child, retried while the second ran, ran beside
    it (its end was counted already, so the map's bound let it by)."""
    parent = engine.start(engine.workflow("retried_fan_1"), Fan(items=[0, 1, 2], fail=[0])).id
    engine.run_until_idle(idle_horizon=0)
    first, second, third = children(engine, parent)
    assert (first.status, running(engine, parent)) == ("failed", [1])
    with pytest.raises(NoFreeSlot, match=f"child of run {parent}, which runs 1 children"):
        engine.retry(first.id, set_fields={"fail": False})
    assert engine.get(first.id).status == "failed"  # nothing written
    go(engine, second.id)
    go(engine, third.id)
    done = engine.get(parent)
    assert (done.status, done.context.seen) == ("succeeded", ["failed", "succeeded", "succeeded"])  # type: ignore[attr-defined]


def test_a_child_retried_while_its_map_waits_is_waited_for(engine: TestEngine) -> None:
    """A slot free: the retried child runs, and its map waits for its new end. Before, its
    first end stayed counted: the map folded once the others ended, the retried child
    still waiting, and its reduce saw it as it was then."""
    parent = engine.start(engine.workflow("retried_fan_3"), Fan(items=[0, 1, 2], fail=[0])).id
    engine.run_until_idle(idle_horizon=0)
    first, second, third = children(engine, parent)
    assert (first.status, running(engine, parent), counts(engine, parent)) == (
        "failed",
        [1, 2],
        (0, 1, 0, 0),
    )
    engine.retry(first.id, set_fields={"fail": False})
    engine.run_until_idle(idle_horizon=0)
    assert (running(engine, parent), counts(engine, parent)) == ([0, 1, 2], (0, 0, 0, 0))
    go(engine, second.id)
    go(engine, third.id)
    assert (engine.get(parent).status, engine.get(parent).state) == ("scheduled", "each")
    go(engine, first.id)
    done = engine.get(parent)
    assert (done.status, done.context.seen) == ("succeeded", ["succeeded"] * 3)  # type: ignore[attr-defined]
    assert counts(engine, parent) == (3, 0, 0, 0)


def test_a_held_child_stopped_then_retried_runs_when_a_slot_is_free(engine: TestEngine) -> None:
    """A child stopped before its turn took no slot; retried once a slot is free, it runs
    and its map waits for it, its end counted neither as stopped nor as ended held."""
    parent = engine.start(engine.workflow("retried_fan_2"), Fan(items=[0, 1, 2])).id
    engine.run_until_idle(idle_horizon=0)
    first, second, third = children(engine, parent)
    assert engine.is_held(third.id)
    assert engine.stop(third.id).status == "stopped"
    assert counts(engine, parent) == (0, 0, 1, 1)
    with pytest.raises(NoFreeSlot):
        engine.retry(third.id)
    go(engine, first.id)  # a slot is free now; no child held is left to take it
    assert running(engine, parent) == [1]
    engine.retry(third.id)
    engine.run_until_idle(idle_horizon=0)
    assert (running(engine, parent), counts(engine, parent)) == ([1, 2], (1, 0, 0, 0))
    go(engine, second.id)
    assert engine.get(parent).status == "scheduled"  # the retried child still runs
    go(engine, third.id)
    done = engine.get(parent)
    assert (done.status, done.context.seen) == ("succeeded", ["succeeded"] * 3)  # type: ignore[attr-defined]
    assert counts(engine, parent) == (3, 0, 0, 0)


def test_a_child_retried_after_its_map_finished_runs_on_its_own(engine: TestEngine) -> None:
    """The map has every result and went on: the retried child runs, its map stays as it
    ended, and the join's counts do not change."""
    parent = engine.start(engine.workflow("retried_fan_1"), Fan(items=[0, 1], fail=[0, 1])).id
    engine.run_until_idle(idle_horizon=0)
    done = engine.get(parent)
    assert (done.status, done.context.seen) == ("succeeded", ["failed", "failed"])  # type: ignore[attr-defined]
    first = children(engine, parent)[0]
    engine.retry(first.id, set_fields={"fail": False})
    engine.run_until_idle(idle_horizon=0)
    go(engine, first.id)
    assert engine.get(first.id).status == "succeeded"
    assert (engine.get(parent).status, counts(engine, parent)) == ("succeeded", (0, 2, 0, 0))
    store: Any = engine.store
    with store.engine.connect() as conn:
        state = conn.execute(sa.select(runs.c.join_state).where(runs.c.id == first.id)).scalar()
    assert state == "failed"


def test_children_retried_under_a_stopped_parent_are_joined_by_its_retry(
    engine: TestEngine,
) -> None:
    """A stopped map's children retried, then the map: it joined them at once as they were
    then (running), its reduce saw three ``scheduled`` children and it went on, leaving
    them running under a finished parent (audit). The parent is still in its map state, so
    their ends are taken back: its retry waits for their new ones."""
    parent = engine.start(engine.workflow("retried_fan_3"), Fan(items=[0, 1, 2])).id
    engine.run_until_idle(idle_horizon=0)
    assert engine.stop(parent).status == "stopped"
    kids = children(engine, parent)
    assert {c.status for c in kids} == {"stopped"}
    for child in kids:
        engine.retry(child.id)
    engine.retry(parent)
    engine.run_until_idle(idle_horizon=0)
    assert (engine.get(parent).status, engine.get(parent).state) == ("scheduled", "each")
    assert running(engine, parent) == [0, 1, 2]
    for child in kids:
        go(engine, child.id)
    done = engine.get(parent)
    assert (done.status, done.context.seen) == ("succeeded", ["succeeded"] * 3)  # type: ignore[attr-defined]


def test_a_child_retry_is_refused_while_its_parent_takes_the_results(
    engine: TestEngine, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's retry landing while a worker holds the parent with every result in (it
    is folding them, its reduce running): accepted, its end taken back from a join the
    parent had read complete — the reduce saw the old result, the parent went on, and the
    child's new end completed a join nobody read (review). Refused now, nothing written;
    retried once the parent has gone on, the child runs on its own."""
    from flowloop.store.joins import JoinStoreMixin

    parent = engine.start(engine.workflow("retried_fan_3"), Fan(items=[0, 1, 2], fail=[0])).id
    engine.run_until_idle(idle_horizon=0)
    first, second, third = children(engine, parent)
    go(engine, second.id)
    original = JoinStoreMixin.join_results
    refused: list[str] = []

    def results_after_a_retry(self: Any, join_id: str) -> Any:
        if not refused:
            with TestEngine(store_url, workflows=[item()]) as operator:
                try:
                    operator.retry(first.id, set_fields={"fail": False})
                except FlowloopError as error:
                    refused.append(str(error))
                else:
                    refused.append("accepted")
        return original(self, join_id)

    monkeypatch.setattr(JoinStoreMixin, "join_results", results_after_a_retry)
    go(engine, third.id)  # the join is complete: the parent is due, claimed, and folds
    monkeypatch.undo()
    assert refused == [
        f"run {first.id}'s parent {parent} is taking its children's results now: "
        "retry it once its worker has let it go (a dead worker's lease runs out)"
    ]
    done = engine.get(parent)
    assert (done.status, done.context.seen) == ("succeeded", ["failed", "succeeded", "succeeded"])  # type: ignore[attr-defined]
    assert counts(engine, parent) == (2, 1, 0, 0)
    engine.retry(first.id, set_fields={"fail": False})  # on its own now
    engine.run_until_idle(idle_horizon=0)
    go(engine, first.id)
    assert (engine.get(first.id).status, counts(engine, parent)) == ("succeeded", (2, 1, 0, 0))
