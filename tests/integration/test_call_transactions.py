"""What a call costs the database: the transactions ``Engine.run`` of a workflow with a
call opens, on a real SQLite file and a real PostgreSQL schema.

A call is a child run: its creation, its step, its end told to the parent's join, the
parent's join. Around those, the driving loop claims, reads and recovers; each of those is
a transaction, and on this path they were most of a call's cost (bench/fanout.py).
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, Step, Workflow, parking
from flowloop.store import dialect
from flowloop.store.schema import joins, journal, runs

CALL_TRANSACTIONS = {"sqlite": 17, "postgresql": 18}
"""The transactions of one call by ``Engine.run`` (prep, the call, the join), as
:func:`_count_transactions` counts them: 20 on SQLite and 21 on PostgreSQL before the loop
stopped claiming again at once after a claim found fewer due runs than it could take, and
answered from the record the fan-out committed (and, not counted there, two looks for
stranded waits at every call, now one per kept executor). PostgreSQL's recovery also reads
the database's clock (flowloop/dbclock.py)."""


class Item(BaseModel):
    n: int
    doubled: int = 0


def _calling(
    work: Callable[..., Awaitable[None]],
    context: Callable[[Item], Item] = lambda ctx: ctx,
    result: Callable[[Item, Any], None] | None = None,
) -> tuple[Workflow, Workflow]:
    """caller: prep, then a call of callee (its one step ``work``) with ``context(ctx)``,
    ``result`` folding the child's context into the parent's."""
    child = Workflow("callee", context=Item)
    child.step(initial=True, next="done")(work)
    child.final("done")
    parent = Workflow("caller", context=Item)

    @parent.step(initial=True, next="sub")
    async def prep(ctx: Item) -> None: ...

    parent.call("sub", child=child, context=context, on={"succeeded": "done"}, result=result)
    parent.final("done")
    return parent, child


def _caller() -> tuple[Workflow, Workflow]:
    """The call that doubles ``n`` in its child."""

    async def work(ctx: Item) -> None:
        ctx.doubled = ctx.n * 2

    return _calling(work, result=lambda ctx, c: setattr(ctx, "doubled", c.doubled))


def _count_transactions(engine: Engine) -> list[int]:
    """Count the transactions the store opens: SQLAlchemy's (read and write), and the
    boundary writes' and creations' own on the driver (a batch, SQLite's BEGIN IMMEDIATE
    transaction, or the usual boundary sent alone). Not
    counted: the lease threads' renewals, off the run's path."""
    counter = [0]
    store: Any = engine.store
    for name in ("_write", "_read", "_driver", "_immediate", "_execute_alone"):
        original = getattr(store, name)

        def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            counter[0] += 1
            return _original(*args, **kwargs)

        setattr(store, name, counted)
    return counter


def _record_claims(engine: Engine) -> list[int]:
    """How many runs each of the store's claims returned."""
    sizes: list[int] = []
    store: Any = engine.store
    original = store.claim

    def claim(**kwargs: Any) -> Any:
        rows = original(**kwargs)
        sizes.append(len(rows))
        return rows

    store.claim = claim
    return sizes


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    # Polls far apart: the loop moves on wakes (a run's end, children due), never on a
    # poll, so the claims counted below do not depend on how fast this machine is.
    parent, child = _caller()
    with Engine(store_url, workflows=[parent, child], poll_seconds=600.0) as engine:
        yield engine


@pytest.mark.timeout(120)  # a lost wake would wait for the next poll (600 s)
def test_a_call_by_engine_run__claims_again_only_when_woken(engine: Engine) -> None:
    """Each claim takes every run then due (the child, later the parent); the loop claims
    again when something ends, not at once to find nothing. One claim finds nothing: the
    one after the parent's end, before ``Engine.run`` decides the family is idle."""
    parent = engine.workflows["caller"]
    engine.run(parent, Item(n=1))  # the executor and the schema, as every later call finds
    sizes = _record_claims(engine)
    info = engine.run(parent, Item(n=21))
    assert (info.state, info.context) == ("done", Item(n=21, doubled=42))
    assert sizes == [1, 1, 0], sizes  # the child, the parent at its join, the idle check


class Keyed(BaseModel):
    customer: str


CROWD = 60
"""Runs of one key ahead of another key's in claim order: more than a counted claim's
window of candidates (4 x 4 places + 32, flowloop/store/limits.py) at
``max_concurrency=4``."""


@pytest.mark.timeout(120)  # a claim left for the next poll (600 s) fails here
def test_a_limited_claim_cut_short_by_its_window__claims_again_at_once(store_url: str) -> None:
    """A counted claim ranks a window of the due runs: crowded by one key at its limit, it
    takes one run where four would fit. The loop claims again at once (the key now left
    out of the window), rather than wait for a run's end or a poll: the crowded key's first
    run waits for the other key's to start."""
    other_started: dict[str, asyncio.Event] = {}

    def started() -> asyncio.Event:
        return other_started.setdefault("b", asyncio.Event())

    fair = Workflow("fair", context=Keyed, concurrency_key=lambda c: c.customer, key_limit=1)

    @fair.step(initial=True, next="done")
    async def only(ctx: Keyed) -> None:
        if ctx.customer == "b":
            started().set()
        else:
            await asyncio.wait_for(started().wait(), 60)

    fair.final("done")
    with Engine(store_url, workflows=[fair], poll_seconds=600.0, max_concurrency=4) as engine:
        # Ahead in claim order (their priority): the window holds only runs of "a".
        engine.start_many(fair, [Keyed(customer="a") for _ in range(CROWD)], priority=1)
        engine.start(fair, Keyed(customer="b"))
        engine.run_until_idle()
        assert len(engine.runs(workflow="fair", status="succeeded", limit=CROWD + 1)) == CROWD + 1


@pytest.mark.timeout(120)  # a lost wake would wait for the next poll (600 s)
def test_a_call_by_engine_run__within_its_transactions(engine: Engine) -> None:
    parent = engine.workflows["caller"]
    engine.run(parent, Item(n=1))
    counter = _count_transactions(engine)
    info = engine.run(parent, Item(n=2))
    opened = counter[0]
    assert (info.state, info.status, info.context) == ("done", "succeeded", Item(n=2, doubled=4))
    store: Any = engine.store
    assert opened <= CALL_TRANSACTIONS[store.engine.dialect.name], opened


def test_stranded_waits__looked_for_once_per_kept_executor_and_definitions(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine keeps its executor between calls: the look for waiting runs the loaded
    definitions cannot take is made once, and again only when the definitions change."""
    looks: list[set[str]] = []
    real = parking.park_stranded_waits

    def counted(store: Any, workflows: Any, **kwargs: Any) -> int:
        looks.append(set(workflows))
        return real(store, workflows, **kwargs)

    monkeypatch.setattr(parking, "park_stranded_waits", counted)
    parent = engine.workflows["caller"]
    for n in range(3):
        assert engine.run(parent, Item(n=n)).state == "done"
    assert looks == [{"caller", "callee"}]
    other = Workflow("other", context=Item)

    @other.step(initial=True, next="done")
    async def only(ctx: Item) -> None: ...

    other.final("done")
    engine.register(other)
    assert engine.run(parent, Item(n=3)).state == "done"
    assert looks == [{"caller", "callee"}, {"caller", "callee", "other"}]
    engine.run_until_idle()  # a new executor, as a worker's start: it looks
    assert len(looks) == 3


def test_stranded_waits__the_look_does_not_wait_for_the_write_lock(sqlite_url: str) -> None:
    """It reads (``BEGIN``): another process holding SQLite's write lock does not hold
    back a worker starting, nor fail its start once the busy timeout has passed."""
    parent, child = _caller()
    with Engine(sqlite_url, workflows=[parent, child]) as engine:
        engine.run(parent, Item(n=1))
        store: Any = engine.store
        store.set_write_lease(30.0)  # drops the held write connection (the old timeout)
        dialect.set_busy_timeout(store.engine, 200)  # the pool's connections from now on
        path = Path(sqlite_url.removeprefix("sqlite:///"))
        holder = sqlite3.connect(path, isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")
            parked = parking.park_stranded_waits(
                store, engine.workflows, worker="w", now=engine.clock.now()
            )
        finally:
            holder.execute("ROLLBACK")
            holder.close()
    assert parked == 0


# -- refused: a fan-out and a child's end are written whole or not at all -------------------
# (One boundary a transaction, without a savepoint: a refusal rolls all of it back.)


def _steal(engine: Engine, workflow: str) -> str:
    """Another worker takes over the running run of ``workflow``, as after a lease that
    ran out: the next fenced write of its first owner is refused. Returns its id."""
    store: Any = engine.store
    store.expire_leases([engine.worker_id])
    taken = store.claim_interrupted(worker="thief", limit=10, lease_seconds=600.0)
    assert [stored.record.workflow for stored in taken] == [workflow]
    return str(taken[0].id)


def _assert_untold(store: Any, parent_id: str, child_id: str) -> None:
    """Nothing of the child's end reached its join: not counted, not marked, the parent
    not made due."""
    with store.engine.connect() as conn:
        counted = conn.execute(
            sa.select(joins.c.succeeded + joins.c.failed + joins.c.stopped)
        ).scalar_one()
        told = conn.execute(sa.select(runs.c.join_state).where(runs.c.id == child_id)).scalar_one()
    assert (counted, told) == (0, "open")
    assert store.get_run(parent_id).record.next_run_at is None


def test_refused__a_calls_fan_out_writes_nothing(store_url: str) -> None:
    """The parent's lease is lost while it builds its child's context: the join, the child
    and the parent's ``children_started`` are one transaction, refused as one."""
    stolen: list[str] = []

    async def work(ctx: Item) -> None: ...

    def child_context(ctx: Item) -> Item:
        stolen.append(_steal(running, "caller"))
        return ctx

    parent, child = _calling(work, child_context)
    with Engine(store_url, workflows=[parent, child], poll_seconds=600.0) as running:
        info = running.run(parent, Item(n=1))
        assert stolen == [info.id]
        store: Any = running.store
        assert (store.get_run(info.id).owner, store.live_descendants(info.id)) == ("thief", [])
        kinds = [event.kind for event in running.history(info.id)]
        assert "children_started" not in kinds, kinds
        with store.engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(joins)).scalar() == 0


def test_refused__a_childs_end_is_not_told_to_its_join(store_url: str) -> None:
    """The child's lease is lost in its last step: its end is refused, and with it the
    join's count and the parent's due time, written in the same transaction."""
    stolen: list[str] = []

    async def work(ctx: Item) -> None:
        stolen.append(_steal(running, "callee"))

    parent, child = _calling(work)
    with Engine(store_url, workflows=[parent, child], poll_seconds=600.0) as running:
        info = running.run(parent, Item(n=1))
        assert (info.state, info.status) == ("sub", "scheduled")
        store: Any = running.store
        [child_id] = store.live_descendants(info.id)
        assert stolen == [child_id]
        ended = store.get_run(child_id)
        assert (ended.record.status, ended.owner) == ("running", "thief")
        _assert_untold(store, info.id, child_id)


def test_refused__a_childs_end_whose_seq_is_taken_writes_nothing(store_url: str) -> None:
    """Another writer appended the entry the child's end would write: the end's fenced
    append finds the journal past where it starts and writes nothing, and nothing of the
    transaction is kept: the join is not told. The next call goes through."""
    taken: list[str] = []

    async def work(ctx: Item, step: Step) -> None:
        if taken:  # the first child only
            return
        taken.append(step.run_id)
        store: Any = running.store
        with store.engine.begin() as conn:
            conn.execute(
                sa.insert(journal).values(
                    run_id=step.run_id, seq=step.seq + 1, kind="step_succeeded", at=1.0
                )
            )

    parent, child = _calling(work)
    with Engine(store_url, workflows=[parent, child], poll_seconds=600.0) as running:
        info = running.run(parent, Item(n=1))
        assert (info.state, info.status) == ("sub", "scheduled")
        store: Any = running.store
        assert store.live_descendants(info.id) == taken
        _assert_untold(store, info.id, taken[0])
        # The store still writes: the next call goes through to its end.
        assert running.run(parent, Item(n=2)).status == "succeeded"


# -- a family's runs, looked up by their ids -------------------------------------------------


def _plans(sqlite_url: str, store: Any, act: Callable[[], object]) -> list[tuple[str, list[str]]]:
    """The plans (``EXPLAIN QUERY PLAN``) of the scoped and the limited statements ``act``
    sends: (the statement's first word, its plan's lines)."""
    sent: dict[str, Any] = {}

    def seen(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "json_each" in statement or "held AS" in statement:
            sent[statement] = parameters

    sa.event.listen(store.engine, "before_cursor_execute", seen)
    try:
        act()
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", seen)
    raw = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))
    try:
        return [
            (statement.split()[0], [row[3] for row in raw.execute(explain, parameters)])
            for statement, parameters in sent.items()
            for explain in [f"EXPLAIN QUERY PLAN {statement}"]
        ]
    finally:
        raw.close()


def _indexes(plan: list[str]) -> set[str]:
    return {word for line in plan for word in line.split() if word.startswith("ix_flowloop")}


def test_scoped_claims_on_sqlite__look_a_small_family_up_by_id(sqlite_url: str) -> None:
    """``Engine.run`` scopes its claims and idle checks to its run's family. SQLite planned
    them on the workflows' index and tested each claimable run of those workflows against
    the family's ids: with 50,000 runs of the child workflow scheduled for later a call
    took 79-112 ms instead of 5-7. Up to ``IDS_LOOKED_UP`` ids, they search the runs by
    id, the limited claim's candidates too (their plans: no statistics needed, the planner
    chose by the statement's shape); past it, the workflow's index (a big map's family is
    looked up faster so). A limited claim, scoped or not, counts the runs held now by the
    owner index, not by reading every run of its workflow, finished ones included (after
    20,000 of them a limited run cost 0.30-0.36 ms instead of 0.14-0.15). The plans are
    SQLite 3.40's choices without statistics: another version may choose otherwise."""
    parent, child = _caller()
    keyed_child = Workflow("keyed_callee", context=Item, concurrency_key=lambda c: str(c.n))

    @keyed_child.step(initial=True, next="done")
    async def work(ctx: Item) -> None: ...

    keyed_child.final("done")
    keyed = Workflow("keyed_caller", context=Item)

    @keyed.step(initial=True, next="sub")
    async def prep(ctx: Item) -> None: ...

    keyed.call("sub", child=keyed_child, context=lambda ctx: ctx, on={"succeeded": "done"})
    keyed.final("done")
    with Engine(sqlite_url, workflows=[parent, child, keyed, keyed_child]) as engine:
        store: Any = engine.store

        def calls() -> None:
            assert engine.run(parent, Item(n=1)).state == "done"
            assert engine.run(keyed, Item(n=2)).state == "done"

        small = _plans(sqlite_url, store, calls)
        many = [f"{n:032x}" for n in range(dialect.IDS_LOOKED_UP + 1)]

        def big_scope() -> None:
            for name in ("callee", "keyed_callee"):
                store.claim(worker="w", now=0.0, limit=5, lease_seconds=30.0,
                            workflows=[name], run_ids=many)  # fmt: skip
            store.next_due(workflows=["callee"], run_ids=many)

        big = _plans(sqlite_url, store, big_scope)
        unscoped = _plans(
            sqlite_url,
            store,
            lambda: store.claim(
                worker="w", now=0.0, limit=5, lease_seconds=30.0, workflows=["keyed_callee"]
            ),
        )
    assert sorted(kind for kind, _ in small) == ["SELECT", "UPDATE", "WITH"], small
    for kind, plan in small:
        assert any("sqlite_autoindex_flowloop_runs_1 (id=?)" in line for line in plan), plan
        assert _indexes(plan) <= {"ix_flowloop_runs_owner"}, (kind, plan)
    assert sorted(kind for kind, _ in big) == ["SELECT", "UPDATE", "WITH"], big
    for kind, plan in big:
        assert "ix_flowloop_runs_workflow" in _indexes(plan), (kind, plan)
    for kind, plan in [*small, *big, *unscoped]:
        if kind == "WITH":  # a limited claim
            assert "ix_flowloop_runs_owner" in _indexes(plan), plan
            assert "ix_flowloop_runs_workflow_created" not in _indexes(plan), plan
    assert [kind for kind, _ in unscoped] == ["WITH"], unscoped
