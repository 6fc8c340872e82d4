"""`prune` on SQLite and PostgreSQL: old finished runs go with their journal and inbox rows;
live runs, newer runs and (with keep_failed) failed runs stay, whatever the batch size;
old loop journal entries go too."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from polling import wait_until_blocked_by
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Workflow
from flowloop.prune import _delete_runs, prune
from flowloop.store import SQLStore
from flowloop.store.loops import LoopEvent, LoopSpec, LoopStoreMixin
from flowloop.store.schema import inbox, joins, journal, loop_journal, runs

T0 = 1_800_000_000.0
DAY = 86400.0


class Job(BaseModel):
    fail: bool = False


def job() -> Workflow:
    wf = Workflow("job", context=Job)

    @wf.step(initial=True, next="done", retry=Retry(attempts=1))
    def work(ctx: Job) -> None:
        if ctx.fail:
            raise ValueError("no")

    wf.final("done")
    return wf


def approval() -> Workflow:
    wf = Workflow("approval", context=Job)

    @wf.step(initial=True, next="waiting")
    def ask(ctx: Job) -> None: ...

    wf.wait("waiting", on={"approved": "done"})
    wf.final("done")
    return wf


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[Engine]:
    with Engine(store_url, clock=clock) as e:
        yield e


def db_of(engine: Engine) -> sa.Engine:
    assert isinstance(engine.store, SQLStore)
    return engine.store.engine


def count(engine: Engine, table: sa.Table, where: sa.ColumnElement[bool] | None = None) -> int:
    query = sa.select(sa.func.count()).select_from(table)
    if where is not None:
        query = query.where(where)
    with db_of(engine).connect() as conn:
        return int(conn.execute(query).scalar_one())


def history(engine: Engine, clock: FakeClock) -> dict[str, str]:
    """Runs of every kind at T0, then 40 days later a new succeeded and a new failed one.
    Returns {label: run id}."""
    wf, wait_wf = job(), approval()
    ids = {
        "old ok 1": engine.run(wf, {}).id,
        "old ok 2": engine.run(wf, {}).id,
        "old failed": engine.run(wf, {"fail": True}).id,
        "old live scheduled": engine.start(wf, {}, run_at=T0 + 365 * DAY).id,
        "old live paused": engine.start(wf, {}, run_at=T0 + 365 * DAY).id,
        "old stopped": engine.start(wf, {}, run_at=T0 + 365 * DAY).id,
    }
    engine.pause(ids["old live paused"])
    engine.stop(ids["old stopped"])
    waited = engine.run(wait_wf, {})
    assert waited.state == "waiting"
    assert engine.send(waited.id, "approved").run.status == "succeeded"  # an inbox row
    ids["old ok with inbox"] = waited.id
    assert engine.get(ids["old failed"]).status == "failed"
    clock.advance(40 * DAY)
    ids["new ok"] = engine.run(wf, {}).id
    ids["new failed"] = engine.run(wf, {"fail": True}).id
    return ids


def present(engine: Engine, ids: dict[str, str]) -> set[str]:
    with db_of(engine).connect() as conn:
        found = set(conn.execute(sa.select(runs.c.id)).scalars())
    return {label for label, run_id in ids.items() if run_id in found}


LIVE_AND_NEW = {"old live scheduled", "old live paused", "new ok", "new failed"}


@pytest.mark.parametrize("batch", [500, 2])
def test_prune__old_finished_runs_go_live_and_new_ones_stay(
    engine: Engine, clock: FakeClock, batch: int
) -> None:
    ids = history(engine, clock)
    old = {"old ok 1", "old ok 2", "old failed", "old stopped", "old ok with inbox"}
    old_journal = count(engine, journal, journal.c.run_id.in_([ids[k] for k in old]))
    kept_journal = count(engine, journal, journal.c.run_id.in_([ids[k] for k in LIVE_AND_NEW]))
    assert count(engine, inbox) == 1

    result = prune(db_of(engine), cutoff=clock.now() - 30 * DAY, batch=batch)

    assert present(engine, ids) == LIVE_AND_NEW
    assert (result.runs, result.journal, result.inbox) == (5, old_journal, 1)
    assert count(engine, journal) == kept_journal
    assert count(engine, inbox) == 0
    assert result.batches == (1 if batch == 500 else 3)
    # What stays is whole: every kept run still replays to its row.
    for label in LIVE_AND_NEW:
        assert engine.replay(ids[label]).matches, label
    # Nothing left to do the second time.
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY).runs == 0


def test_prune__keep_failed_keeps_failed_runs_of_any_age(engine: Engine, clock: FakeClock) -> None:
    ids = history(engine, clock)
    result = prune(db_of(engine), cutoff=clock.now() - 30 * DAY, keep_failed=True)
    assert present(engine, ids) == LIVE_AND_NEW | {"old failed"}
    assert result.runs == 4
    assert [e.kind for e in engine.history(ids["old failed"])][-1] == "step_failed"


def test_prune__nothing_is_old_enough(engine: Engine, clock: FakeClock) -> None:
    ids = history(engine, clock)
    result = prune(db_of(engine), cutoff=clock.now() - 60 * DAY)
    assert (result.runs, result.journal, result.batches) == (0, 0, 0)
    assert present(engine, ids) == set(ids)


def test_prune__dry_run_counts_what_would_go_and_deletes_nothing(
    engine: Engine, clock: FakeClock
) -> None:
    ids = history(engine, clock)
    before = count(engine, journal)
    planned = prune(db_of(engine), cutoff=clock.now() - 30 * DAY, dry_run=True)
    assert present(engine, ids) == set(ids)
    assert count(engine, journal) == before
    done = prune(db_of(engine), cutoff=clock.now() - 30 * DAY)
    assert (planned.runs, planned.journal, planned.inbox) == (done.runs, done.journal, done.inbox)
    assert planned.dry_run and not done.dry_run


def test_prune__a_run_retried_meanwhile_is_not_deleted(engine: Engine, clock: FakeClock) -> None:
    """The DELETE re-checks status and age on the row: a run an operator retried after the
    batch picked it (now scheduled again) stays, with all its journal."""
    ids = history(engine, clock)
    picked = [ids["old failed"], ids["old ok 1"]]
    engine.register(job())
    engine.retry(ids["old failed"])
    journal_rows = count(engine, journal, journal.c.run_id == ids["old failed"])

    from flowloop.prune import PruneResult

    result = PruneResult(cutoff=clock.now() - 30 * DAY)
    with db_of(engine).begin() as conn:
        _delete_runs(conn, picked, ("succeeded", "failed", "stopped"), result.cutoff, result)
    assert result.runs == 1
    assert engine.get(ids["old failed"]).status == "scheduled"
    assert count(engine, journal, journal.c.run_id == ids["old failed"]) == journal_rows
    assert "old ok 1" not in present(engine, ids)


def test_prune__old_loop_journal_entries_go_failed_ones_kept_on_request(
    engine: Engine, clock: FakeClock
) -> None:
    store = engine.store
    assert isinstance(store, LoopStoreMixin)
    (row,) = store.sync_loops(
        [LoopSpec(name="feed", schedule="every 10s", first_slot=T0)], at=T0, worker="w"
    )

    def write(kind: str, at: float) -> None:
        current = store.get_loop("feed")
        assert current is not None
        assert store.write_loop(
            name="feed",
            owner=None,
            epoch=current.lease_epoch,
            follows_seq=current.last_seq,
            changes={"updated_at": at},
            events=[LoopEvent(loop="feed", kind=kind, at=at)],
        )

    for n in range(6):
        write("iteration_failed" if n in (2, 4) else "iteration_succeeded", T0 + n)
    clock.advance(40 * DAY)
    for n in range(3):
        write("iteration_succeeded", clock.now() + n)
    total = count(engine, loop_journal)

    kept_failed = prune(db_of(engine), cutoff=clock.now() - 30 * DAY, keep_failed=True, batch=1)
    old_before = total - 3
    assert kept_failed.loop_journal == old_before - 2
    kinds = [e.kind for e in engine.loop_history("feed")]
    assert kinds.count("iteration_failed") == 2

    everything = prune(db_of(engine), cutoff=clock.now() - 30 * DAY)
    assert everything.loop_journal == 2
    assert count(engine, loop_journal) == 3
    # The loop row itself is untouched and goes on numbering its journal.
    write("iteration_succeeded", clock.now() + 10)
    assert engine.loop_history("feed")[-1].seq == row.last_seq + 10

    assert prune(db_of(engine), cutoff=clock.now(), loop_history=False).loop_journal == 0


# -- join rows of call and map states (issue 12) --------------------------------------------


class Box(BaseModel):
    n: int = 0


class Parcel(BaseModel):
    boxes: list[int] = []
    packed: int = 0


def boxing() -> Workflow:
    wf = Workflow("boxing", context=Box)

    @wf.step(initial=True, next="boxed")
    def pack(ctx: Box) -> None: ...

    wf.final("boxed")
    return wf


def parcels(child: Workflow) -> Workflow:
    """A call and a map: two join rows per run."""
    wf = Workflow("parcels", context=Parcel)
    wf.call("first", child=child, context=lambda ctx: Box(), on={"succeeded": "rest"}, initial=True)
    wf.map(
        "rest",
        child=child,
        items=lambda ctx: ctx.boxes,
        context=lambda ctx, item: Box(n=item),
        max_parallel=2,
        on={"done": "packed", "failed": "packed"},
    )
    wf.final("packed")
    return wf


def test_prune__join_rows_go_with_their_parent(engine: Engine, clock: FakeClock) -> None:
    wf = parcels(boxing())
    old = engine.run(wf, {"boxes": [1, 2, 3]})
    clock.advance(40 * DAY)
    new = engine.run(wf, {"boxes": [4]})
    assert (old.status, new.status) == ("succeeded", "succeeded")
    assert count(engine, joins) == 4
    old_runs = count(engine, runs, runs.c.updated_at < clock.now() - 30 * DAY)
    assert old_runs == 1 + 1 + 3  # the parent, its call child, its three map children

    planned = prune(db_of(engine), cutoff=clock.now() - 30 * DAY, dry_run=True)
    assert (planned.runs, planned.joins) == (old_runs, 2)
    assert count(engine, joins) == 4
    result = prune(db_of(engine), cutoff=clock.now() - 30 * DAY, batch=2)

    assert (result.runs, result.joins) == (old_runs, 2)
    assert result.as_dict()["joins"] == 2
    assert set(sa_column(engine, joins.c.parent_id)) == {new.id}
    assert engine.replay(new.id).matches
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY).joins == 0


def test_prune__a_join_row_a_live_child_still_reports_to_stays_until_it_ended(
    engine: Engine, clock: FakeClock
) -> None:
    """A parent stopped while its child is held by a worker that then died: the child only
    gets a stop request. The parent stays while the child is live (a run kept keeps its
    parent), then goes with it. A parent gone before (an earlier flowloop's prune): the
    join row the child updates at its end stays; the prune after that end removes it."""
    wf = parcels(boxing())
    engine.register(wf)
    started = engine.start(wf, {"boxes": []})
    executor = engine._new_executor()
    try:
        import asyncio

        asyncio.run(executor.run(until_idle=True, run_ids=[started.id]))
    finally:
        executor.close()
    (child_id,) = sa_column(engine, runs.c.id, runs.c.parent_id == started.id)
    store = engine.store
    assert isinstance(store, SQLStore)
    assert store.claim(
        worker="gone", now=clock.now(), limit=1, lease_seconds=60, run_ids=[child_id]
    )
    engine.stop(started.id)
    assert engine.get(started.id).status == "stopped"
    assert engine.get(child_id).status != "stopped"
    clock.advance(40 * DAY)

    kept = prune(db_of(engine), cutoff=clock.now() - 30 * DAY)
    assert (kept.runs, kept.joins) == (0, 0)
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY, dry_run=True).runs == 0
    from flowloop.prune import PruneResult

    gone = PruneResult(cutoff=clock.now() - 30 * DAY)
    with db_of(engine).begin() as conn:  # as a prune that kept no parent did
        _delete_runs(conn, [started.id], ("succeeded", "failed", "stopped"), gone.cutoff, gone)
    assert (gone.runs, gone.joins) == (1, 0)
    assert count(engine, joins) == 1

    store.expire_leases(["gone"])  # as the database's clock would, a minute on
    engine.run_until_idle()  # the child is taken over, honours the stop request, reports
    assert engine.get(child_id).status == "stopped"
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY, dry_run=True).joins == 1
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY).joins == 1
    assert count(engine, joins) == 0


def sa_column(
    engine: Engine, column: sa.Column[str], where: sa.ColumnElement[bool] | None = None
) -> list[str]:
    query = sa.select(column)
    if where is not None:
        query = query.where(where)
    with db_of(engine).connect() as conn:
        return list(conn.execute(query).scalars())


def reducing(name: str, child: Workflow, reduce: Any) -> Workflow:
    """A map of ``child`` over ``ctx.boxes`` whose results ``reduce`` counts."""
    fan = Workflow(name, context=Parcel)
    fan.map(
        "rest",
        child=child,
        items=lambda ctx: ctx.boxes,
        context=lambda ctx, item: Box(n=item),
        reduce=reduce,
        on={"done": "packed"},
        initial=True,
    )
    fan.final("packed")
    return fan


def breaks_once(seen: list[int]) -> Any:
    """A reduce that counts the boxes packed, noting how many results it saw, and fails
    the first time (its parent fails, to be retried)."""

    def count_boxed(ctx: Parcel, results: list[Any]) -> None:
        seen.append(len(results))
        if len(seen) == 1:
            raise RuntimeError("the reduce broke once")
        ctx.packed = sum(1 for r in results if r.ok)

    return count_boxed


def test_prune__the_finished_children_of_a_live_parent_stay(
    engine: Engine, clock: FakeClock
) -> None:
    """A map with two children ended and one waiting: prune deleted the two (finished, old),
    and when the last one ended the map's reduce saw one result of three, silently."""
    box = Workflow("box_or_wait", context=Box)

    @box.step(initial=True, on={"now": "boxed", "later": "held"})
    def decide(ctx: Box) -> str:
        return "later" if ctx.n == 3 else "now"

    box.wait("held", on={"go": "boxed"})
    box.final("boxed")

    def count_boxed(ctx: Parcel, results: list[Any]) -> None:
        ctx.packed = sum(1 for r in results if r.ok)

    parent = engine.run(reducing("counted_parcels", box, count_boxed), {"boxes": [1, 2, 3]})
    assert parent.status == "scheduled"
    children = sa_column(engine, runs.c.id, runs.c.parent_id == parent.id)
    clock.advance(40 * DAY)
    dry = prune(db_of(engine), cutoff=clock.now() - 30 * DAY, dry_run=True)
    assert (dry.runs, dry.journal) == (0, 0)
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY).runs == 0
    assert set(sa_column(engine, runs.c.parent_id)) == {None, parent.id}
    (waiting,) = [c for c in children if engine.get(c).state == "held"]
    assert engine.send(waiting, "go").status == "applied"
    engine.run_until_idle(idle_horizon=0)
    done = engine.get(parent.id)
    assert (done.status, done.context.packed) == ("succeeded", 3)  # type: ignore[attr-defined]
    # Once the parent has finished, it and its children go together.
    clock.advance(40 * DAY)
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY).runs == 1 + 3


def test_prune__the_children_of_a_failed_parent_kept_stay_with_it(
    engine: Engine, clock: FakeClock
) -> None:
    """``--keep-failed`` kept a failed map parent and deleted its children: retried, its
    reduce saw no result and the parent succeeded with nothing packed (review)."""
    box = Workflow("kept_box", context=Box)
    box.step(name="pack", initial=True, next="boxed")(lambda ctx: None)
    box.final("boxed")
    seen: list[int] = []
    count_boxed = breaks_once(seen)

    parent = engine.run(reducing("kept_fan", box, count_boxed), {"boxes": [1, 2, 3]})
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(parent.id).status == "failed"
    clock.advance(40 * DAY)
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY, keep_failed=True).runs == 0
    engine.retry(parent.id)
    engine.run_until_idle(idle_horizon=0)
    done = engine.get(parent.id)
    assert (done.status, done.context.packed, seen) == ("succeeded", 3, [3, 3])  # type: ignore[attr-defined]
    clock.advance(40 * DAY)
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY, keep_failed=True).runs == 1 + 3


def test_prune__a_failed_child_kept_keeps_its_parent_at_any_depth(
    engine: Engine, clock: FakeClock
) -> None:
    """``--keep-failed`` kept a failed map child and deleted its parent (the map tolerated
    the failure and succeeded): `flowloop status CHILD` named a parent that no longer
    existed and the dashboard linked to a 404 (ops audit). A run kept keeps its parent, and
    theirs; without --keep-failed the family goes together."""
    box = Workflow("tolerant_box", context=Box)

    @box.step(initial=True, next="boxed", retry=Retry(attempts=1))
    def pack(ctx: Box) -> None:
        if ctx.n < 0:
            raise ValueError("cannot pack")

    box.final("boxed")
    middle = Workflow("tolerant_middle", context=Parcel)
    middle.map(
        "rest",
        child=box,
        items=lambda ctx: ctx.boxes,
        context=lambda ctx, item: Box(n=item),
        on={"done": "packed", "failed": "packed"},
        tolerate_failures=1,
        initial=True,
    )
    middle.final("packed")
    top = Workflow("tolerant_top", context=Groups)
    top.map(
        "each",
        child=middle,
        items=lambda ctx: ctx.groups,
        context=lambda ctx, group: Parcel(boxes=group),
        on={"done": "done", "failed": "done"},
        initial=True,
    )
    top.final("done")
    engine.register(top, middle, box)
    root = engine.start(top, Groups(groups=[[1, -1], [2]])).id
    plain = engine.run(middle, Parcel(boxes=[3])).id  # nothing failed: it goes
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(root).status == "succeeded"
    (failed,) = [r.id for r in engine.runs(workflow="tolerant_box") if r.status == "failed"]
    chain = [failed]
    while (parent := engine.store.parent_of(chain[-1])) is not None:  # type: ignore[attr-defined]
        chain.append(parent)
    assert len(chain) == 3 and chain[-1] == root
    total = count(engine, runs)
    clock.advance(40 * DAY)

    cutoff = clock.now() - 30 * DAY
    planned = prune(db_of(engine), cutoff=cutoff, keep_failed=True, dry_run=True)
    result = prune(db_of(engine), cutoff=cutoff, keep_failed=True, batch=1)
    assert result.runs == planned.runs == 2  # the plain map and its child
    kept = set(sa_column(engine, runs.c.id))
    assert set(chain) <= kept and plain not in kept and len(kept) == total - 2
    # Each kept run's parent is there: none names a run that is gone.
    assert set(sa_column(engine, runs.c.parent_id)) - {None} <= kept
    assert prune(db_of(engine), cutoff=cutoff).runs == total - 2


class Groups(BaseModel):
    groups: list[list[int]] = []


def test_prune__a_family_goes_together_at_any_depth(engine: Engine, clock: FakeClock) -> None:
    """A failed middle map kept because its own parent is live had its children pruned (it
    looked prunable itself): retried, its reduce saw none and it succeeded with nothing
    (review). A run goes with its topmost finished ancestor's family, or not at all."""
    box = Workflow("deep_box", context=Box)

    @box.step(initial=True, next="boxed", retry=Retry(attempts=5, backoff="fixed", base=1e8))
    def pack(ctx: Box) -> None:
        if ctx.n < 0:
            raise ValueError("not yet")  # a retry far away: the top map stays live

    box.final("boxed")
    seen: list[int] = []
    count_boxed = breaks_once(seen)

    middle = reducing("deep_middle", box, count_boxed)
    top = Workflow("deep_top", context=Groups)
    top.map(
        "each",
        child=middle,
        items=lambda ctx: ctx.groups,
        context=lambda ctx, group: Parcel(boxes=group),
        on={"done": "done", "failed": "done"},
        tolerate_failures=2,
        initial=True,
    )
    top.final("done")
    engine.register(top, middle, box)
    root = engine.start(top, Groups(groups=[[1, 2, 3], [-1]])).id
    engine.run_until_idle(idle_horizon=0)
    failed = next(m for m in engine.runs(workflow="deep_middle") if m.status == "failed")
    clock.advance(40 * DAY)
    planned = prune(db_of(engine), cutoff=clock.now() - 30 * DAY, dry_run=True)
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY).runs == planned.runs == 0
    engine.retry(failed.id)
    engine.run_until_idle(idle_horizon=0)
    done = engine.get(failed.id)
    assert (done.status, done.context.packed, seen) == ("succeeded", 3, [3, 3])  # type: ignore[attr-defined]
    assert engine.get(root).status == "scheduled"  # its other group still retries


def retried_between_deletes(
    monkeypatch: pytest.MonkeyPatch, engine: Engine, run_id: str
) -> list[str]:
    """prune's deletes, with an operator's retry of ``run_id`` landing right after the
    first of them has committed (when the run is still there). Returns what the retry found."""
    import flowloop.prune as pruning

    found: list[str] = []
    original = pruning._delete_batch

    def deleting(*args: Any) -> None:
        original(*args)
        if not found:
            try:
                found.append(engine.retry(run_id).status)
            except Exception as error:  # deleted already: nobody can retry it any more
                found.append(type(error).__name__)

    monkeypatch.setattr(pruning, "_delete_batch", deleting)
    return found


def test_prune__a_parent_retried_between_two_deletes_keeps_its_children(
    engine: Engine, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prune deleted a family deepest first, one transaction per batch, the DELETE checking
    each run's own row only: a failed map retried after its first child went lost the
    others too, and its reduce saw none of the three results. A family goes top down now:
    once the parent is gone nobody can retry it, and a run retried first keeps its own."""
    box = Workflow("raced_box", context=Box)
    box.step(name="pack", initial=True, next="boxed")(lambda ctx: None)
    box.final("boxed")
    seen: list[int] = []
    parent = engine.run(reducing("raced_fan", box, breaks_once(seen)), {"boxes": [1, 2, 3]})
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(parent.id).status == "failed"
    clock.advance(40 * DAY)
    found = retried_between_deletes(monkeypatch, engine, parent.id)
    prune(db_of(engine), cutoff=clock.now() - 30 * DAY, batch=1)
    engine.run_until_idle(idle_horizon=0)
    left = sa_column(engine, runs.c.id)
    if found == ["scheduled"]:  # the retry won: the whole family stayed
        done = engine.get(parent.id)
        assert (done.status, done.context.packed, seen) == ("succeeded", 3, [3, 3])  # type: ignore[attr-defined]
    else:  # prune won: nothing of the family is left
        assert (found, left) == (["UnknownRun"], [])


def test_prune__a_run_retried_after_its_parent_went_keeps_its_children(
    engine: Engine, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed middle map whose finished parent prune deleted first, retried before its
    children's batch: they stay with it (the DELETE checks each run's parent), and its
    reduce sees all three results."""
    box = Workflow("orphan_box", context=Box)
    box.step(name="pack", initial=True, next="boxed")(lambda ctx: None)
    box.final("boxed")
    seen: list[int] = []
    middle = reducing("orphan_middle", box, breaks_once(seen))
    top = Workflow("orphan_top", context=Groups)
    top.map(
        "each",
        child=middle,
        items=lambda ctx: ctx.groups,
        context=lambda ctx, group: Parcel(boxes=group),
        on={"done": "done", "failed": "done"},
        tolerate_failures=1,
        initial=True,
    )
    top.final("done")
    engine.register(top, middle, box)
    root = engine.start(top, Groups(groups=[[1, 2, 3]])).id
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(root).status == "succeeded"
    (failed,) = engine.runs(workflow="orphan_middle")
    assert failed.status == "failed"
    clock.advance(40 * DAY)
    found = retried_between_deletes(monkeypatch, engine, failed.id)
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY, batch=1).runs == 1
    assert found == ["scheduled"]
    assert len(sa_column(engine, runs.c.id, runs.c.parent_id == failed.id)) == 3
    engine.run_until_idle(idle_horizon=0)
    done = engine.get(failed.id)
    assert (done.status, done.context.packed, seen) == ("succeeded", 3, [3, 3])  # type: ignore[attr-defined]
    clock.advance(40 * DAY)  # finished now, its parent gone: it goes with its children
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY).runs == 1 + 3


def test_prune__postgres_a_retry_committed_while_prune_waits_keeps_the_children(
    pg_url: str, clock: FakeClock
) -> None:
    """PostgreSQL: a DELETE's subqueries read the snapshot its statement started with. A
    retry of the parent in flight when prune's DELETE came locked the parent's row; the
    DELETE waited for it, then kept the parent (its row checked again) but deleted the
    children it had judged against the parent as it was. prune locks the runs and their
    parents before it deletes, so the retry committed meanwhile is seen."""
    import threading

    with Engine(pg_url, clock=clock) as engine:
        box = Workflow("locked_box", context=Box)
        box.step(name="pack", initial=True, next="boxed")(lambda ctx: None)
        box.final("boxed")
        parent = engine.run(reducing("locked_fan", box, breaks_once([])), {"boxes": [1, 2, 3]})
        engine.run_until_idle(idle_horizon=0)
        assert engine.get(parent.id).status == "failed"
        clock.advance(40 * DAY)
        db = db_of(engine)
        errors: list[BaseException] = []

        def pruning() -> None:
            try:
                prune(db, cutoff=clock.now() - 30 * DAY)
            except BaseException as error:  # reported by the test's thread
                errors.append(error)

        worker = threading.Thread(target=pruning)
        # Connections of their own: the engine's pool stays the engine's.
        others = sa.create_engine(pg_url)
        with others.connect() as retrying:
            # The write of a retry, held open: the parent is live once it commits.
            pid = int(retrying.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
            retrying.execute(
                sa.update(runs)
                .where(runs.c.id == parent.id)
                .values(status="scheduled", updated_at=clock.now())
            )
            worker.start()
            # Until prune waits on the parent's row.
            assert wait_until_blocked_by(pg_url, pid, still_going=worker.is_alive) == 1
            retrying.commit()
        others.dispose()
        worker.join(timeout=30)
        assert not worker.is_alive() and errors == []
        assert len(sa_column(engine, runs.c.id, runs.c.parent_id == parent.id)) == 3
        assert sa_column(engine, runs.c.status, runs.c.id == parent.id) == ["scheduled"]


def test_prune__a_run_retried_before_its_family_goes_keeps_every_generation_below_it(
    engine: Engine, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The DELETE judged a run by its parent's status: a failed top map retried just before
    prune's transaction kept itself and its middle map (their parent live), but the middle
    map's children went, their parent being finished and old (review)."""
    import flowloop.prune as pruning

    box = Workflow("gen_box", context=Box)
    box.step(name="pack", initial=True, next="boxed")(lambda ctx: None)
    box.final("boxed")
    middle = reducing("gen_middle", box, lambda ctx, results: None)
    top = Workflow("gen_top", context=Groups)
    seen: list[int] = []

    def breaks_once_top(ctx: Groups, results: list[Any]) -> None:
        seen.append(len(results))
        if len(seen) == 1:
            raise RuntimeError("the top reduce broke once")

    top.map(
        "each",
        child=middle,
        items=lambda ctx: ctx.groups,
        context=lambda ctx, group: Parcel(boxes=group),
        reduce=breaks_once_top,
        on={"done": "done"},
        initial=True,
    )
    top.final("done")
    engine.register(top, middle, box)
    root = engine.start(top, Groups(groups=[[1, 2, 3]])).id
    engine.run_until_idle(idle_horizon=0)
    assert engine.get(root).status == "failed"
    before = len(sa_column(engine, runs.c.id))
    clock.advance(40 * DAY)
    original = pruning._delete_batch
    retried: list[str] = []

    def retry_first(*args: Any) -> None:
        if not retried:
            retried.append(engine.retry(root).status)
        original(*args)

    monkeypatch.setattr(pruning, "_delete_batch", retry_first)
    assert prune(db_of(engine), cutoff=clock.now() - 30 * DAY).runs == 0
    assert before == 5  # the top map, its middle map and three boxes
    assert (retried, len(sa_column(engine, runs.c.id))) == (["scheduled"], 5)
    engine.run_until_idle(idle_horizon=0)
    assert (engine.get(root).status, seen) == ("succeeded", [1, 1])


def test_prune__postgres_racing_a_childs_retry_does_not_deadlock(
    pg_url: str, clock: FakeClock
) -> None:
    """An operator's retry of a child takes its join's row, then the child's; prune took the
    runs' rows, then the join's (to delete it): each waited for the other, and PostgreSQL
    aborted one of them (review). prune takes the join rows first too now."""
    import threading

    from flowloop.store.joins import JoinStoreMixin

    with Engine(pg_url, clock=clock) as engine:
        item = Workflow("raced_item", context=Box)

        @item.step(initial=True, next="boxed", retry=Retry(attempts=1))
        def pack(ctx: Box) -> None:
            if ctx.n == 0:
                raise ValueError("no")

        item.final("boxed")
        fan = Workflow("raced_parcels", context=Parcel)
        fan.map(
            "rest",
            child=item,
            items=lambda ctx: ctx.boxes,
            context=lambda ctx, n: Box(n=n),
            tolerate_failures=1,
            on={"done": "packed"},
            initial=True,
        )
        fan.final("packed")
        engine.register(fan, item)
        parent = engine.start(fan, Parcel(boxes=[0, 1])).id
        engine.run_until_idle(idle_horizon=0)
        assert engine.get(parent).status == "succeeded"
        (failed,) = [
            c
            for c in sa_column(engine, runs.c.id, runs.c.parent_id == parent)
            if engine.get(c).status == "failed"
        ]
        clock.advance(40 * DAY)
        took_join, go_on = threading.Event(), threading.Event()
        pid: list[int] = []
        original = JoinStoreMixin._lock_joins
        outcome: dict[str, str] = {}

        def holding(self: Any, conn: sa.Connection, ends: Any) -> None:
            original(self, conn, ends)
            if threading.current_thread().name == "retry":
                pid.append(conn.connection.dbapi_connection.info.backend_pid)  # type: ignore[union-attr]
                took_join.set()
                go_on.wait(30)

        def retrying() -> None:
            try:
                outcome["retry"] = engine.retry(failed).status
            except BaseException as error:  # reported by the test's thread
                outcome["retry"] = type(error).__name__

        def pruning() -> None:
            try:
                outcome["prune"] = str(prune(db_of(engine), cutoff=clock.now() - 30 * DAY).runs)
            except BaseException as error:  # reported by the test's thread
                outcome["prune"] = type(error).__name__

        JoinStoreMixin._lock_joins = holding  # type: ignore[method-assign]
        retry = threading.Thread(target=retrying, name="retry")
        remover = threading.Thread(target=pruning, name="prune")
        try:
            retry.start()
            assert took_join.wait(30)
            remover.start()
            # Until prune waits on the retry (or has ended without waiting).
            wait_until_blocked_by(pg_url, pid[0], still_going=remover.is_alive)
            go_on.set()
            retry.join(30)
            remover.join(30)
        finally:
            go_on.set()
            JoinStoreMixin._lock_joins = original  # type: ignore[method-assign]
        # The parent and its other child went; the retried one runs on (its parent had gone on).
        assert outcome == {"retry": "scheduled", "prune": "2"}, outcome
        assert sa_column(engine, runs.c.id) == [failed]
