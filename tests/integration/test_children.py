"""Child runs (call) and fan-out/join (map) on SQLite and PostgreSQL: outcomes routed,
results merged, children created once, max_parallel held without polling, tolerate,
invalid items refused before any child exists, stop cascading to children."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Step, Workflow, children
from flowloop import journal as j
from flowloop.compose import ChildResult
from flowloop.store.joins import JoinStoreMixin


class Pack(BaseModel):
    order_id: str
    boxes: int = 0
    fail: bool = False


class Order(BaseModel):
    order_id: str
    boxes: int = 0
    fail_pack: bool = False
    outcome: str = ""


class FileJob(BaseModel):
    path: str
    rows: int = 0


class Etl(BaseModel):
    files: list[str] = []
    total_rows: int = 0
    failed: list[int] = []
    report: str = ""


def packing() -> Workflow:
    wf = Workflow("packing", context=Pack)

    @wf.step(initial=True, next="packed")
    def pack(ctx: Pack, step: Step) -> None:
        if ctx.fail:
            raise RuntimeError("no boxes left")
        ctx.boxes = 3

    wf.final("packed")
    return wf


def order(child: Workflow) -> Workflow:
    wf = Workflow("order_c", context=Order)

    @wf.step(initial=True, next="pack")
    def reserve(ctx: Order) -> None: ...

    wf.call(
        "pack",
        child=child,
        context=lambda ctx: Pack(order_id=ctx.order_id, fail=ctx.fail_pack),
        on={"succeeded": "ship", "failed": "refund"},
        result=lambda ctx, packed: setattr(ctx, "boxes", packed.boxes),
    )

    @wf.step(next="shipped")
    def ship(ctx: Order) -> None:
        ctx.outcome = f"shipped {ctx.boxes} boxes"

    @wf.step(next="refunded")
    def refund(ctx: Order) -> None:
        ctx.outcome = "refunded"

    wf.final("shipped", "refunded")
    return wf


def load_one() -> Workflow:
    wf = Workflow("load_one", context=FileJob)

    @wf.step(initial=True, next="loaded")
    async def load(ctx: FileJob) -> None:
        if ctx.path.startswith("bad"):
            raise ValueError(f"cannot parse {ctx.path}")
        ctx.rows = len(ctx.path)

    wf.final("loaded")
    return wf


def etl(child: Workflow, *, tolerate: float = 0, max_parallel: int = 3) -> Workflow:
    wf = Workflow("etl_c", context=Etl)

    def reduce(ctx: Etl, results: list[ChildResult[FileJob]]) -> None:
        ctx.total_rows = sum(r.context.rows for r in results if r.ok)
        ctx.failed = [r.index for r in results if not r.ok]

    wf.map(
        "load_files",
        child=child,
        items=lambda ctx: ctx.files,
        context=lambda ctx, item: FileJob(path=item),
        max_parallel=max_parallel,
        tolerate_failures=tolerate,
        on={"done": "report", "failed": "alert"},
        reduce=reduce,
        initial=True,
    )

    @wf.step(next="reported")
    def report(ctx: Etl) -> None:
        ctx.report = f"{ctx.total_rows} rows"

    @wf.step(next="alerted")
    def alert(ctx: Etl) -> None:
        ctx.report = f"failed: {ctx.failed}"

    wf.final("reported", "alerted")
    return wf


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    with Engine(store_url, clock=FakeClock()) as engine:
        yield engine


def drive_only(engine: Engine, *run_ids: str) -> None:
    """Drive just these runs until none of them is due (their children are left alone)."""
    executor = engine._new_executor()
    try:
        asyncio.run(executor.run(until_idle=True, run_ids=list(run_ids)))
    finally:
        executor.close()


def joins(engine: Engine) -> JoinStoreMixin:
    assert isinstance(engine.store, JoinStoreMixin)
    return engine.store


# -- call -------------------------------------------------------------------------------------


def test_call__child_succeeds_and_its_result_is_merged(engine: Engine) -> None:
    wf = order(packing())
    info = engine.run(wf, Order(order_id="A1"))
    assert (info.status, info.state) == ("succeeded", "shipped")
    assert info.context.outcome == "shipped 3 boxes"  # type: ignore[union-attr]
    [child] = joins(engine).children_of(info.id)
    assert (child.record.workflow, child.record.status) == ("packing", "succeeded")
    kinds = [e.kind for e in engine.history(info.id)]
    assert j.CHILDREN_STARTED in kinds and j.CHILDREN_JOINED in kinds
    joined = next(e for e in engine.history(info.id) if e.kind == j.CHILDREN_JOINED)
    assert (joined.event, joined.next_state) == ("succeeded", "ship")
    assert engine.replay(info.id).differences == []
    assert engine.replay(child.id).differences == []


def test_call__child_failure_takes_failed(engine: Engine) -> None:
    info = engine.run(order(packing()), Order(order_id="A2", fail_pack=True))
    assert (info.status, info.state) == ("succeeded", "refunded")
    [child] = joins(engine).children_of(info.id)
    assert child.record.status == "failed"


def test_call__the_parent_waits_without_a_worker_until_the_child_ends(engine: Engine) -> None:
    wf = order(packing())
    engine.register(wf)
    started = engine.start(wf, Order(order_id="A3"))
    # Drive the parent alone: it creates its child and waits for it, holding nothing.
    drive_only(engine, started.id)
    info = engine.get(started.id)
    assert (info.status, info.state, info.owner, info.next_run_at) == (
        "scheduled",
        "pack",
        None,
        None,
    )
    [child] = joins(engine).children_of(started.id)
    assert child.record.status == "scheduled"
    # Creating the child again (a crash before the parent journaled) finds the same one.
    drive_only(engine, started.id)
    assert len(joins(engine).children_of(started.id)) == 1
    engine.run_until_idle()
    assert engine.get(started.id).state == "shipped"


def test_call__stopping_the_parent_stops_its_child(engine: Engine) -> None:
    wf = order(packing())
    engine.register(wf)
    started = engine.start(wf, Order(order_id="A4"))
    drive_only(engine, started.id)
    [child] = joins(engine).children_of(started.id)
    engine.stop(started.id)
    assert engine.get(started.id).status == "stopped"
    assert engine.get(child.id).status == "stopped"
    assert joins(engine).child_counts(started.id) == {"stopped": 1}


# -- map --------------------------------------------------------------------------------------


def test_map__children_beyond_max_parallel_are_held_until_one_ends(engine: Engine) -> None:
    wf = etl(load_one(), max_parallel=3)
    engine.register(wf)
    started = engine.start(wf, Etl(files=[f"f{i}.csv" for i in range(6)]))
    drive_only(engine, started.id)
    kids = joins(engine).children_of(started.id)
    assert [k.record.next_run_at is not None for k in kids] == [True] * 3 + [False] * 3
    drive_only(engine, kids[1].id)  # one ends: exactly the next one (index 3) is released
    kids = joins(engine).children_of(started.id)
    assert [k.record.status for k in kids][:2] == ["scheduled", "succeeded"]
    assert [k.record.next_run_at is not None for k in kids] == [
        True,
        False,
        True,
        True,
        False,
        False,
    ]
    assert engine.get(started.id).next_run_at is None  # not every child ended: still waits
    engine.run_until_idle()
    assert engine.get(started.id).state == "reported"


def test_map__every_child_once_and_reduced(engine: Engine) -> None:
    files = [f"file{i:02d}.csv" for i in range(20)]
    info = engine.run(etl(load_one(), max_parallel=3), Etl(files=files))
    assert (info.status, info.state) == ("succeeded", "reported")
    assert info.context.total_rows == sum(len(f) for f in files)  # type: ignore[union-attr]
    kids = joins(engine).children_of(info.id)
    assert len(kids) == 20 and {k.record.status for k in kids} == {"succeeded"}
    assert len({k.id for k in kids}) == 20
    join = joins(engine).get_join(kids[0].record.join or "")
    assert join is not None and (join.total, join.created, join.succeeded) == (20, 20, 20)
    assert engine.replay(info.id).differences == []


def test_map__failures_beyond_the_tolerance_take_failed(engine: Engine) -> None:
    files = ["a.csv", "bad1.csv", "b.csv", "bad2.csv"]
    info = engine.run(etl(load_one(), tolerate=1), Etl(files=files))
    assert (info.state, info.context.failed) == ("alerted", [1, 3])  # type: ignore[union-attr]


def test_map__failures_within_a_fraction_take_done(engine: Engine) -> None:
    files = [f"f{i}.csv" for i in range(9)] + ["bad.csv"]
    info = engine.run(etl(load_one(), tolerate=0.1), Etl(files=files))
    assert (info.state, info.context.failed) == ("reported", [9])  # type: ignore[union-attr]


def test_map__no_items_joins_at_once(engine: Engine) -> None:
    info = engine.run(etl(load_one()), Etl(files=[]))
    assert (info.state, info.context.total_rows) == ("reported", 0)  # type: ignore[union-attr]


def test_map__an_invalid_item_fails_the_run_before_any_child(engine: Engine) -> None:
    wf = Workflow("etl_bad", context=Etl)
    wf.map(
        "load_files",
        child=load_one(),
        items=lambda ctx: ctx.files,
        context=lambda ctx, item: {"path": None if item == "x" else item},
        on={"done": "ok"},
        initial=True,
    )
    wf.final("ok")
    info = engine.run(wf, Etl(files=["a", "b", "x"]))
    assert info.status == "failed"
    assert info.reason == "invalid_child_context"
    assert "item 2" in (info.error or "") and "path" in (info.error or "")
    assert joins(engine).children_of(info.id) == []


# -- parallel ---------------------------------------------------------------------------------


class Check(BaseModel):
    order_id: str
    ok: bool = True
    verdict: str = ""


class Review(BaseModel):
    order_id: str
    risky: bool = False
    verdicts: dict[str, str] = {}


def checker(name: str) -> Workflow:
    wf = Workflow(f"check_{name}", context=Check)

    @wf.step(initial=True, next="checked")
    def check(ctx: Check) -> None:
        if not ctx.ok:
            raise RuntimeError(f"{name}: flagged")
        ctx.verdict = f"{name} ok"

    wf.final("checked")
    return wf


def review() -> Workflow:
    wf = Workflow("review_p", context=Review)

    def collect(ctx: Review, results: list[ChildResult[Check]]) -> None:
        ctx.verdicts = {str(r.branch): r.context.verdict or str(r.status) for r in results}

    wf.parallel(
        "checks",
        branches={
            "fraud": (checker("fraud"), lambda ctx: Check(order_id=ctx.order_id, ok=not ctx.risky)),
            "stock": (checker("stock"), lambda ctx: {"order_id": ctx.order_id}),
        },
        on={"done": "approved", "failed": "held"},
        reduce=collect,
        initial=True,
    )
    wf.final("approved", "held")
    return wf


def test_parallel__branches_of_different_workflows_join(engine: Engine) -> None:
    info = engine.run(review(), Review(order_id="R1"))
    assert (info.state, info.context.verdicts) == (  # type: ignore[union-attr]
        "approved",
        {"fraud": "fraud ok", "stock": "stock ok"},
    )
    kids = joins(engine).children_of(info.id)
    assert sorted(k.record.workflow for k in kids) == ["check_fraud", "check_stock"]


def test_parallel__a_failed_branch_takes_failed(engine: Engine) -> None:
    info = engine.run(review(), Review(order_id="R2", risky=True))
    assert (info.state, info.context.verdicts) == (  # type: ignore[union-attr]
        "held",
        {"fraud": "failed", "stock": "stock ok"},
    )


def test_call__pause_cascades_and_unpause_resumes_the_children(engine: Engine) -> None:
    wf = order(packing())
    engine.register(wf)
    started = engine.start(wf, Order(order_id="A5"))
    drive_only(engine, started.id)
    [child] = joins(engine).children_of(started.id)
    engine.pause(started.id)
    assert engine.get(child.id).status == "paused"
    engine.run_until_idle()  # nothing runs while paused
    assert engine.get(child.id).status == "paused"
    engine.unpause(started.id)
    assert engine.get(child.id).status == "scheduled"
    engine.run_until_idle()
    assert engine.get(started.id).state == "shipped"


def _orders_in_their_call(engine: Engine, count: int) -> list[tuple[Any, Any]]:
    """``count`` orders waiting in their call state, each with its child created and not
    run yet: (the order, its child) each."""
    wf = order(packing())
    engine.register(wf)
    started = [engine.start(wf, Order(order_id=f"P{n}")) for n in range(count)]
    drive_only(engine, *[run.id for run in started])
    return [(run, *joins(engine).children_of(run.id)) for run in started]


def test_call__unpausing_the_parent_leaves_a_child_paused_by_an_operator_paused(
    engine: Engine,
) -> None:
    """An operator pauses the child first, then the parent; unpausing the parent unpauses
    only what its own pause paused (before, the child's own pause was withdrawn too)."""
    (cascaded, kid), (own, own_kid) = _orders_in_their_call(engine, 2)
    engine.pause(own_kid.id)
    engine.pause(own.id)
    engine.pause(cascaded.id)
    assert [engine.get(k.id).reason for k in (kid, own_kid)] == ["parent paused", "paused"]
    engine.unpause(own.id)
    engine.unpause(cascaded.id)
    assert engine.get(kid.id).status == "scheduled"
    assert engine.get(own_kid.id).status == "paused"
    engine.run_until_idle()
    assert engine.get(cascaded.id).state == "shipped"
    assert engine.get(own.id).state == "pack"  # waits for the child its operator paused
    engine.unpause(own_kid.id)
    engine.run_until_idle()
    assert engine.get(own.id).state == "shipped"


def test_call__an_operators_pause_of_a_child_its_parent_paused_stays(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent pauses first (its child with it), then an operator pauses the child: the
    pause becomes the child's own, also when the operator's pause lands after unpausing
    the parent has listed the children it paused (before, the unpause lifted it)."""
    (first, kid), (racing, racing_kid) = _orders_in_their_call(engine, 2)
    engine.pause(first.id)
    engine.pause(racing.id)
    assert engine.get(kid.id).reason == "parent paused"
    engine.pause(kid.id)
    assert engine.get(kid.id).reason == "paused"
    engine.unpause(first.id)
    assert engine.get(kid.id).status == "paused"
    real = children.paused_children

    def an_operator_pauses_after_the_listing(store: object, run_id: str) -> list[str]:
        listed = real(store, run_id)
        if run_id == racing.id:
            engine.pause(racing_kid.id)
        return listed

    monkeypatch.setattr(children, "paused_children", an_operator_pauses_after_the_listing)
    engine.unpause(racing.id)
    assert engine.get(racing_kid.id).status == "paused"
    assert engine.get(racing.id).status == "scheduled"


def test_call__a_parent_unpaused_while_its_pause_reaches_its_children_unpauses_them(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's unpause of the parent lands after the parent's pause and before its
    children's: the pause looks at the parent again and takes its children's back."""
    [(started, kid)] = _orders_in_their_call(engine, 1)
    real = children.cascade

    def unpaused_meanwhile(store: object, run_id: str, action: str, operate: Any) -> int:
        if run_id == started.id and action == "parent pause":
            engine.unpause(started.id)
        return real(store, run_id, action, operate)

    monkeypatch.setattr(children, "cascade", unpaused_meanwhile)
    engine.pause(started.id)
    assert engine.get(started.id).status == "scheduled"
    assert engine.get(kid.id).status == "scheduled"


def test_call__a_parents_pause_refused_leaves_its_children_unpaused(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent's pause is asked for before its children's: when a stop lands on the
    parent meanwhile and its pause is refused, the children are as they were (before, they
    had been paused first and stayed paused)."""
    from flowloop.errors import InvalidTransition
    from flowloop.operations import Operations

    [(started, kid)] = _orders_in_their_call(engine, 1)
    store = engine.store
    real_request = store.request_control

    def a_stop_lands_first(run_id: str, action: str | None, **kwargs: Any) -> bool:
        if run_id == started.id:
            assert real_request(run_id, "stop")  # another operator's stop, meanwhile
        return real_request(run_id, action, **kwargs)

    # The parent moved meanwhile too (a worker owns it): its pause goes to the row.
    monkeypatch.setattr(Operations, "_operate", lambda self, stored, kind, **fields: False)
    monkeypatch.setattr(store, "request_control", a_stop_lands_first)
    with pytest.raises(InvalidTransition, match="stopping"):
        engine.pause(started.id)
    row = store.get_run(kid.id)
    assert row is not None and (row.record.status, row.control) == ("scheduled", None)


def test_call__the_child_runs_on_another_worker_than_its_parent(store_url: str) -> None:
    child = packing()
    parent = order(child)
    with Engine(store_url, clock=FakeClock(), worker_id="parent-worker") as engine:
        engine.register(parent)
        started = engine.start(parent, Order(order_id="A6"))

        def worker(name: str, workflows: dict[str, Workflow]) -> None:
            from flowloop.executor import Executor

            executor = Executor(engine.store, workflows, clock=engine.clock, worker_id=name)
            try:
                asyncio.run(executor.run(until_idle=True))
            finally:
                executor.close()

        worker("parents", {parent.name: parent})  # fans out, then waits
        worker("children", {child.name: child})  # only this one may run packing
        worker("parents", {parent.name: parent})  # joins and ships
        info = engine.get(started.id)
        assert (info.state, info.context.boxes) == ("shipped", 3)  # type: ignore[union-attr]
        [kid] = joins(engine).children_of(started.id)
        workers = {e.worker for e in engine.history(kid.id) if e.kind == j.STEP_STARTED}
        assert workers == {"children"}
        assert {e.worker for e in engine.history(started.id) if e.kind == j.CHILDREN_JOINED} == {
            "parents"
        }


def test_map__pausing_and_unpausing_keeps_held_children_held(engine: Engine) -> None:
    wf = etl(load_one(), max_parallel=2)
    engine.register(wf)
    started = engine.start(wf, Etl(files=[f"f{i}.csv" for i in range(5)]))
    drive_only(engine, started.id)
    engine.pause(started.id)
    engine.unpause(started.id)
    kids = joins(engine).children_of(started.id)
    assert [k.record.status for k in kids] == ["scheduled"] * 5
    assert [k.record.next_run_at is not None for k in kids] == [True, True, False, False, False]
    engine.run_until_idle()
    assert engine.get(started.id).state == "reported"


def test_map__a_fan_out_cut_off_between_batches_resumes_without_a_second_child(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flowloop import children as runtime
    from flowloop.store.joins import JoinStoreMixin as Joins

    real = Joins.create_children
    calls: list[int] = []

    def crash_after_first_batch(self: Joins, join_id: str, first: int, build: object) -> int:
        calls.append(first)
        if len(calls) == 2:  # the first batch is committed; its worker dies here
            raise RuntimeError("killed between two batches")
        return real(self, join_id, first, build)  # type: ignore[arg-type]

    monkeypatch.setattr(Joins, "create_children", crash_after_first_batch)
    files = [f"f{i:04d}.csv" for i in range(2 * runtime.CREATE_BATCH + 7)]
    # A short lease: the dead drive's claim runs out and the run is taken over.
    with Engine(store_url, clock=FakeClock(), lease_seconds=1.0) as engine:
        wf = etl(load_one(), max_parallel=50)
        engine.register(wf)
        started = engine.start(wf, Etl(files=files))
        with pytest.raises(RuntimeError, match="killed between two batches"):
            engine.run_until_idle()  # (the dead drive's error is the call's)
        engine.run_until_idle()  # as a new worker: its lease runs out, the run is taken over
        info = engine.get(started.id)
        assert info.state == "reported"
        assert info.context.total_rows == sum(len(f) for f in files)  # type: ignore[union-attr]
        kids = joins(engine).children_of(started.id)
        assert len(kids) == len(files) == len({k.id for k in kids})
        join = joins(engine).get_join(kids[0].record.join or "")
        assert join is not None and (join.created, join.succeeded) == (len(files), len(files))
    # Resumed at the first missing batch: the committed one was not created again.
    assert calls == [0, runtime.CREATE_BATCH, runtime.CREATE_BATCH, 2 * runtime.CREATE_BATCH]


def test_map__a_crash_before_its_children_started_entry_says_started_not_again(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large map's children are made in batches before its ``children_started``: killed
    in between, the next claim finds them all made and writes that entry. It is the first
    (``again`` is for a claim that waits anew, after an unpause), so history says the
    children started and the diagram notes them."""
    from flowloop import children as runtime
    from flowloop.render_overlay import RunOverlay
    from flowloop.store.joins import JoinStoreMixin as Joins

    real = Joins.wait_join
    calls: list[str] = []

    def crash_once(self: Joins, boundary: object, join_id: str) -> bool:
        calls.append(join_id)
        if len(calls) == 1:  # every child is made; its worker dies here
            raise RuntimeError("killed before children_started")
        return real(self, boundary, join_id)  # type: ignore[arg-type]

    monkeypatch.setattr(Joins, "wait_join", crash_once)
    item = Workflow("parked_item", context=FileJob)  # children that wait: none ends
    item.wait("parked", on={"go": "done"}, initial=True)
    item.final("done")
    fan = Workflow("fan", context=Etl)
    fan.map(
        "load_files",
        child=item,
        items=lambda ctx: ctx.files,
        context=lambda ctx, name: FileJob(path=name),
        max_parallel=runtime.CREATE_BATCH + 1,
        on={"done": "reported"},
        initial=True,
    )
    fan.final("reported")
    files = [f"f{i:04d}.csv" for i in range(runtime.CREATE_BATCH + 1)]
    with Engine(store_url, clock=FakeClock(), lease_seconds=1.0) as engine:
        engine.register(fan, item)
        started = engine.start(fan, Etl(files=files))
        with pytest.raises(RuntimeError, match="killed before children_started"):
            engine.run_until_idle()  # (the dead drive's error is the call's)
        engine.run_until_idle()  # as a new worker: its lease runs out, the run is taken over
        info = engine.get(started.id)
        history = engine.history(started.id)
    assert (info.status, info.state) == ("scheduled", "load_files")  # waits for them
    entries = [e for e in history if e.kind == j.CHILDREN_STARTED]
    assert len(calls) == 2 and [e.data.get("again", False) for e in entries] == [False]
    notes = RunOverlay.from_journal(history).notes["load_files"]
    assert notes == (f"{len(files)} child run(s) of parked_item",)
