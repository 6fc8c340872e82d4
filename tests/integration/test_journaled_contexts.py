"""Long contexts kept in the journal only (issue 13), on SQLite and PostgreSQL: a run row
holds a context up to ``ROW_CONTEXT_MAX`` characters; a longer one is the journal's (whole
at creation, then splices) and every reader takes it back from there — the store's reads,
claims of interrupted runs, a join's children, the dashboard, a scan of live runs, replay —
and migration 0015's downgrade writes it back into the rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from storekit import new_run, start_step, succeed_and_start, to_revision

from flowloop import Engine, Step, Workflow
from flowloop import journal as j
from flowloop.store import SQLStore
from flowloop.store.base import Boundary, Fence, RunFilter, StoredRun
from flowloop.store.entries import JOURNALED, ROW_CONTEXT_MAX, SNAPSHOT_EVERY, SPLICE_KEY
from flowloop.store.scan import live_runs
from flowloop.store.schema import journal, runs
from flowloop.ui import queries

BLOB = "b" * (ROW_CONTEXT_MAX + 1_000)
"""A context field long enough that the context is kept in the journal only."""

FLOW = textwrap.dedent(
    f"""
    import os, signal
    from pydantic import BaseModel
    from flowloop import Workflow

    class Long(BaseModel):
        n: int = 0
        blob: str = "b" * {len(BLOB)}

    long = Workflow("long", context=Long)
    STEPS = 6

    def make(i: int):
        async def step(ctx: Long) -> None:
            if i == 3 and os.environ.get("KILL_IN_STEP_3"):
                os.kill(os.getpid(), signal.SIGKILL)  # inside the step: nothing after
            ctx.n += 1

        return step

    for i in range(STEPS):
        step = make(i)
        long.step(name=f"s{{i}}", initial=i == 0, next=f"s{{i + 1}}" if i < STEPS - 1 else "done")(
            step
        )
    long.final("done")
    """
)


def _load(tmp_path: Path) -> Workflow:
    path = tmp_path / "long_flow.py"
    path.write_text(FLOW)
    namespace: dict[str, Any] = {}
    exec(compile(FLOW, str(path), "exec"), namespace)
    workflow: Workflow = namespace["long"]
    return workflow


def _raw_context(url: str, run_id: str) -> str:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return str(
                conn.execute(sa.select(runs.c.context).where(runs.c.id == run_id)).scalar_one()
            )
    finally:
        engine.dispose()


def test_a_long_context_lives_in_the_journal_and_every_read_has_it(
    store_url: str, tmp_path: Path
) -> None:
    """The row of a run with a long context holds none, at creation and at its end; the
    store, the dashboard, replay and history all show the whole context; a short one stays
    in the row."""
    workflow = _load(tmp_path)
    with Engine(store_url, workflows=[workflow]) as engine:
        started = engine.start(workflow, workflow.context())
        assert _raw_context(store_url, started.id) == JOURNALED
        assert getattr(started.context, "blob", None) == BLOB  # start() returns it whole
        info = engine.run(workflow, workflow.context())
        assert info.status == "succeeded"
        assert _raw_context(store_url, info.id) == JOURNALED
        stored = engine.store.get_run(info.id)
        assert stored is not None
        assert json.loads(stored.record.context) == {"n": 6, "blob": BLOB}
        assert engine.replay(info.id).differences == []
        assert json.loads(engine.replay(info.id, at=1).record.context)["n"] == 0
        assert isinstance(engine.store, SQLStore)
        row = queries.run_row(engine.store.engine, info.id)
        assert row["context"] == {"n": 6, "blob": BLOB}
        short = engine.run(workflow, workflow.context(blob="short"))
        assert json.loads(_raw_context(store_url, short.id)) == {"n": 6, "blob": "short"}


def test_a_run_killed_in_a_step_resumes_with_its_whole_context(
    store_url: str, tmp_path: Path
) -> None:
    """A real worker SIGKILLed inside step 3 of a run whose context is the journal's: the
    resumed run re-runs that step and ends with each of the six steps counted once, its
    context read back from the journal's whole creation entry and splices."""
    workflow = _load(tmp_path)
    code = (
        "import sys, runpy; sys.path.insert(0, sys.argv[2]);"
        "from flowloop import Engine;"
        "flow = runpy.run_path(sys.argv[2] + '/long_flow.py')['long'];"
        "e = Engine(sys.argv[1], workflows=[flow]);"
        "run = e.start(flow, flow.context());"
        "print(run.id, flush=True);"
        "e.run_until_idle()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, store_url, str(tmp_path)],
        env={**os.environ, "KILL_IN_STEP_3": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    run_id = done.stdout.split()[0]
    with Engine(store_url, workflows=[workflow]) as engine:
        store = engine.store
        assert isinstance(store, SQLStore)
        store.expire_leases(store.running_owners())  # the killed worker
        interrupted = store.get_run(run_id)
        assert interrupted is not None
        assert (interrupted.record.status, interrupted.record.state) == ("running", "s3")
        assert json.loads(interrupted.record.context) == {"n": 3, "blob": BLOB}
        engine.resume()
        final = store.get_run(run_id)
        assert final is not None
        assert final.record.status == "succeeded"
        assert json.loads(final.record.context) == {"n": 6, "blob": BLOB}
        assert engine.replay(run_id).differences == []


def _go_on(record: j.RunRecord, worker: str, epoch: int, n: int) -> Boundary:
    """A step's success (the context's ``n`` set, its ``log`` one longer: a splice that,
    applied twice, would not give the same text) and the next step's start."""
    context = json.dumps({"n": n, "blob": BLOB, "log": "y" * n})
    return succeed_and_start(record, Fence(worker, epoch), context)


def _started_long_run(store: SQLStore) -> tuple[StoredRun, StoredRun, Boundary]:
    """A run with a journaled (long) context, created, claimed by worker "a" and its first
    step started: the run as created, as claimed, and the start's boundary."""
    created, _ = store.create_run(new_run(context=json.dumps({"n": 0, "blob": BLOB})))
    claimed = store.claim(worker="a", now=time.time(), limit=1, lease_seconds=30)[0]
    boundary = start_step(claimed, "a")
    assert store.write([boundary]) == [True]
    return created, claimed, boundary


def test_a_claim_past_whole_snapshots_reads_the_latest_context(store_url: str) -> None:
    """More boundaries than ``SNAPSHOT_EVERY`` (so the journal holds whole contexts after
    the creation's), then the writer's lease ends: another worker's claim, a scan of live
    runs and a plain read all see the last context; a new store (no cached contexts)
    reads the same."""
    store = SQLStore(store_url)
    try:
        created, claimed, boundary = _started_long_run(store)
        record = boundary.record
        steps = SNAPSHOT_EVERY + 5
        for n in range(1, steps + 1):
            boundary = _go_on(record, "a", claimed.lease_epoch, n)
            assert store.write([boundary]) == [True]
            record = boundary.record
        store.expire_leases(["a"])
    finally:
        store.close()
    store = SQLStore(store_url)
    try:
        expected = {"n": steps, "blob": BLOB, "log": "y" * steps}
        [live] = [run for page in live_runs(store, created.record.workflow) for run in page]
        assert json.loads(live.context) == expected
        read = store.get_run(created.id)
        assert read is not None and json.loads(read.record.context) == expected
        again = store.claim_interrupted(worker="b", limit=1, lease_seconds=30)
        assert [json.loads(c.record.context) for c in again] == [expected]
        assert again[0].problem is None
    finally:
        store.close()


def test_a_claim_of_many_long_context_runs_reads_their_journals_in_bulk(store_url: str) -> None:
    """Recovery claims interrupted runs in bulk: on PostgreSQL their journaled contexts
    come back in one statement (per 500 runs), not one round trip per run; SQLite, with
    no round trips, runs one cached statement per run. Every context is the run's own."""
    store = SQLStore(store_url)
    count = 30
    try:
        for n in range(count):
            store.create_run(new_run(context=json.dumps({"n": n, "blob": BLOB})))
        claimed = store.claim(worker="a", now=time.time(), limit=count, lease_seconds=30)
        assert store.write([start_step(c, "a") for c in claimed]) == [True] * count
        store.expire_leases(["a"])
        reads: list[str] = []

        def count_reads(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            if "flowloop_journal AS earlier" in statement:
                reads.append(statement)

        sa.event.listen(store.engine, "before_cursor_execute", count_reads)
        try:
            again = store.claim_interrupted(worker="b", limit=count, lease_seconds=30)
        finally:
            sa.event.remove(store.engine, "before_cursor_execute", count_reads)
        assert sorted(json.loads(c.record.context)["n"] for c in again) == list(range(count))
        postgres = store.engine.dialect.name == "postgresql"
        assert len(reads) == (1 if postgres else count)
    finally:
        store.close()


def test_a_missing_journal_entry_is_the_runs_problem_not_an_error(store_url: str) -> None:
    """A journaled context whose whole entry is gone (a damaged database): reading the run
    names the problem (the executor fails such a run as invalid_row) instead of raising,
    and other runs read as before."""
    store = SQLStore(store_url)
    try:
        broken, _ = store.create_run(new_run(context=json.dumps({"n": 0, "blob": BLOB})))
        fine, _ = store.create_run(new_run(context=json.dumps({"n": 1, "blob": BLOB})))
        with store.engine.begin() as conn:
            conn.execute(sa.delete(journal).where(journal.c.run_id == broken.id))
        both = store.find_runs(RunFilter(limit=10))
        problems = {s.id: s.problem for s in both}
        assert problems[fine.id] is None
        assert "missing" in (problems[broken.id] or "")
        read = store.get_run(fine.id)
        assert read is not None and json.loads(read.record.context)["n"] == 1
    finally:
        store.close()


def test_migration__0015_downgrade_writes_long_contexts_back_into_the_rows(
    store_url: str, tmp_path: Path
) -> None:
    """Down to 0014, every row holds its context whole again (the finished run's last one,
    the interrupted run's as of its snapshot); up again, new runs keep theirs in the
    journal and the old rows read as before."""
    workflow = _load(tmp_path)
    with Engine(store_url, workflows=[workflow]) as engine:
        info = engine.run(workflow, workflow.context())
        waiting = engine.start(workflow, workflow.context(n=40))
    assert _raw_context(store_url, info.id) == JOURNALED
    to_revision(store_url, "0014")
    assert json.loads(_raw_context(store_url, info.id)) == {"n": 6, "blob": BLOB}
    assert json.loads(_raw_context(store_url, waiting.id)) == {"n": 40, "blob": BLOB}
    to_revision(store_url, "head")
    with Engine(store_url, workflows=[workflow]) as engine:
        again = engine.run(workflow, workflow.context())
        assert _raw_context(store_url, again.id) == JOURNALED
        engine.resume()
        stored = engine.store.get_run(waiting.id)
        assert stored is not None and json.loads(stored.record.context)["n"] == 46


@pytest.mark.parametrize("size", [ROW_CONTEXT_MAX, ROW_CONTEXT_MAX + 1])
def test_the_row_keeps_a_context_up_to_the_limit(store_url: str, size: int) -> None:
    store = SQLStore(store_url)
    try:
        context = json.dumps({"blob": "c" * (size - len('{"blob": ""}'))})
        assert len(context) == size
        created, _ = store.create_run(new_run(context=context))
        assert created.record.context == context
        stored = _raw_context(store_url, created.id)
        assert stored == (context if size <= ROW_CONTEXT_MAX else JOURNALED)
        read = store.get_run(created.id)
        assert read is not None and read.record.context == context
    finally:
        store.close()


class Napping(BaseModel):
    naps: int = 0
    blob: str = BLOB


def test_a_run_released_and_claimed_again_and_again_keeps_its_reads_short(
    store_url: str,
) -> None:
    """A step that sleeps (the run released with a due time, then claimed again) more
    times than ``SNAPSHOT_EVERY``: after each claim the run's next context is whole, so
    no read ever folds more than ``SNAPSHOT_EVERY`` splices (each claim used to splice
    onto the last, and every read replayed them all back to the creation)."""
    naps = SNAPSHOT_EVERY + 8
    flow = Workflow("napper", context=Napping)

    @flow.step(initial=True, on={"again": "nap", "done": "done"})
    async def nap(ctx: Napping, step: Step) -> object:
        if ctx.naps >= naps:
            return "done"
        ctx.naps += 1
        return step.sleep(0.001, "again")

    flow.final("done")
    with Engine(store_url, workflows=[flow]) as engine:
        started = engine.start(flow, Napping())
        engine.run_until_idle()
        info = engine.get(started.id)
        assert info.status == "succeeded" and getattr(info.context, "naps", None) == naps
        assert _raw_context(store_url, started.id) == JOURNALED
        assert engine.replay(started.id).differences == []
        store = engine.store
        assert isinstance(store, SQLStore)
        with store.engine.connect() as conn:
            rows = conn.execute(
                sa.select(journal.c.data)
                .where(journal.c.run_id == started.id, journal.c.context.is_not(None))
                .order_by(journal.c.seq)
            ).all()
    chain = longest = 0
    for (data,) in rows:
        chain = chain + 1 if SPLICE_KEY in (data or "") else 0
        longest = max(longest, chain)
    assert len(rows) > naps and longest < SNAPSHOT_EVERY


def test_an_unreadable_journaled_context_is_never_folded_into_a_new_one(store_url: str) -> None:
    """A running run whose whole context entry is gone: the claim that recovers it names
    the problem and folds none of its splices onto nothing; the run fails invalid_row and
    its row still says the journal has the context (so every read still names it)."""
    store = SQLStore(store_url)
    try:
        created, claimed, boundary = _started_long_run(store)
        boundary = _go_on(boundary.record, "a", claimed.lease_epoch, 1)
        assert store.write([boundary]) == [True]
        store.expire_leases(["a"])
        with store.engine.begin() as conn:
            conn.execute(
                sa.delete(journal).where(journal.c.run_id == created.id, journal.c.seq == 1)
            )
        [again] = store.claim_interrupted(worker="b", limit=1, lease_seconds=30)
        assert again.problem is not None and "missing" in again.problem
        assert again.record.context == JOURNALED  # not the tail's splice folded onto ''
        assert again.record.last_seq == boundary.record.last_seq  # a failure goes after it
    finally:
        store.close()


class Held(BaseModel):
    n: int
    blob: str = BLOB


class Parent(BaseModel):
    total: int = 0


def _held_map() -> tuple[Workflow, Workflow]:
    child = Workflow("held_child", context=Held)
    child.wait("hold", on={"go": "done"}, initial=True)
    child.final("done")
    parent = Workflow("held_parent", context=Parent)

    def reduce(ctx: Parent, results: list[Any]) -> None:
        ctx.total = sum(r.context.n for r in results)

    parent.map(
        "fan",
        child=child,
        items=lambda ctx: range(3),
        context=lambda ctx, i: Held(n=i),
        on={"done": "joined"},
        reduce=reduce,
        initial=True,
    )
    parent.final("joined")
    return parent, child


def test_a_join_whose_child_context_is_unreadable_fails_its_parent(store_url: str) -> None:
    """Three children with long contexts end while no worker of the parent runs; one
    child's journal is lost (a damaged database); the parent's join cannot read that child's
    context: the parent fails (child_unreadable) instead of hanging, claimed, forever."""
    parent, child = _held_map()
    with Engine(store_url, workflows=[parent, child]) as engine:
        started = engine.start(parent, Parent())
        engine.run_until_idle()  # the children are created and wait
        store = engine.store
        assert isinstance(store, SQLStore)
        kids = store.children_of(started.id)
        assert len(kids) == 3
    with Engine(store_url, workflows=[child]) as engine:  # the children end, not the parent
        for kid in kids:
            engine.send(kid.id, "go")
        engine.run_until_idle()
        assert {engine.get(kid.id).status for kid in kids} == {"succeeded"}
        assert engine.get(started.id).state == "fan"
    broken = kids[1].id
    store = SQLStore(store_url)
    try:
        with store.engine.begin() as conn:
            conn.execute(sa.delete(journal).where(journal.c.run_id == broken))
    finally:
        store.close()
    with Engine(store_url, workflows=[parent, child]) as engine:
        engine.run_until_idle()
        info = engine.get(started.id)
        assert (info.status, info.reason) == ("failed", "child_unreadable")
