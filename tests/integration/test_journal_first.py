"""Journal-first writes (issue 13), on SQLite and PostgreSQL: a boundary that keeps a run
running appends to the journal and leaves the run row alone; every read folds the tail;
contexts are journaled as splices and replay exactly; migration 0012 moves a database of
the previous layout (live runs included) to this one and back."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from deploykit import OrderV1, order, run_killed_in_charge
from pydantic import BaseModel
from storekit import new_run, start_step, to_revision

from flowloop import Engine, Workflow
from flowloop import journal as j
from flowloop.clock import FakeClock
from flowloop.heat import heat
from flowloop.store import SQLStore, migrate
from flowloop.store.entries import SNAPSHOT_EVERY, SPLICE_KEY, THEN_KEY
from flowloop.store.schema import journal, runs
from flowloop.ui import queries

LATER_S = 5_000.0
"""Past every due time of the order runs (backoff, sleep, wait timeout)."""


class Big(BaseModel):
    n: int = 0
    blob: str = "x" * 20_000


def big_chain(steps: int) -> Workflow:
    wf = Workflow("big", context=Big)
    for i in range(steps):

        async def fn(ctx: Big) -> None:
            ctx.n += 1

        wf.step(name=f"s{i}", initial=i == 0, next=f"s{i + 1}" if i < steps - 1 else "done")(fn)
    wf.final("done")
    return wf


def _row(store: SQLStore, run_id: str) -> Any:
    with store.engine.connect() as conn:
        return conn.execute(sa.select(runs).where(runs.c.id == run_id)).one()


# -- the write path -----------------------------------------------------------------------


def test_append__a_running_boundary_leaves_the_row_alone(store_url: str) -> None:
    """An outcome + next start is an append only: the row keeps its snapshot (seq, time,
    lease), the journal has the entries, and every read shows the latest state."""
    store = SQLStore(store_url)
    try:
        created, _ = store.create_run(new_run())
        claimed = store.claim(
            worker="a", now=time.time(), limit=1, lease_seconds=30, run_ids=[created.id]
        )[0]
        first = start_step(claimed, "a")
        assert store.write([first]) == [True]  # scheduled -> running: the row is written
        assert store.renews_lease(first)
        before = _row(store, created.id)
        assert before.status == "running" and before.last_seq == 2
        done = j.JournalEvent(
            run_id=created.id,
            seq=3,
            kind=j.STEP_SUCCEEDED,
            at=time.time(),
            state="a",
            event="next",
            next_state="b",
            context='{"n":1}',
            worker="a",
        )
        again = j.JournalEvent(
            run_id=created.id, seq=4, kind=j.STEP_STARTED, at=time.time(), state="b", attempt=1
        )
        record = j.apply(j.apply(first.record, done), again)
        boundary = type(first)(events=[done, again], record=record, fence=first.fence)
        assert store.write([boundary]) == [True]
        assert not store.renews_lease(boundary)
        after = _row(store, created.id)
        assert after == before  # not one column written
        stored = store.get_run(created.id)
        assert stored is not None
        assert (stored.record.state, stored.record.last_seq, stored.record.context) == (
            "b",
            4,
            '{"n":1}',
        )
        assert stored.record == j.fold(store.journal(created.id))
        # The dashboard reads rows itself: it shows the latest entry too.
        progress = queries.run_progress(store.engine, created.id)
        assert (progress["last_seq"], progress["state"], progress["status"]) == (4, "b", "running")
        assert queries.run_row(store.engine, created.id)["context"] == {"n": 1}
        assert heat(store.engine, created.record.workflow, since=None).states["b"].live == {
            "running": 1
        }
        listed = queries.list_runs(store.engine, queries.RunsQuery())
        assert [(r["id"], r["last_seq"], r["state"]) for r in listed.runs] == [(created.id, 4, "b")]
        # The same boundary again follows seq 2, the journal is at 4: refused, no change.
        assert store.write([boundary]) == [False]
        assert [e.seq for e in store.journal(created.id)] == [1, 2, 3, 4]
    finally:
        store.close()


def test_append__refused_once_the_lease_ended(store_url: str) -> None:
    """The fence of an append is in the statement: an expired lease writes nothing."""
    store = SQLStore(store_url)
    try:
        created, _ = store.create_run(new_run())
        claimed = store.claim(
            worker="a", now=time.time(), limit=1, lease_seconds=30, run_ids=[created.id]
        )[0]
        first = start_step(claimed, "a")
        assert store.write([first]) == [True]
        store.expire_leases(["a"])
        done = j.JournalEvent(
            run_id=created.id,
            seq=3,
            kind=j.STEP_SUCCEEDED,
            at=time.time(),
            state="a",
            event="next",
            next_state="b",
            context='{"n":1}',
        )
        boundary = type(first)(events=[done], record=j.apply(first.record, done), fence=first.fence)
        assert store.write([boundary]) == [False]
        assert [e.seq for e in store.journal(created.id)] == [1, 2]
    finally:
        store.close()


def test_contexts__spliced_in_the_journal_and_replayed_exactly(store_url: str) -> None:
    """A 20 KB context changed by one field per step: the journal keeps small splices (a
    whole context every SNAPSHOT_EVERY), history shows every context whole, replay at any
    seq folds them, and the fold equals the stored row."""
    steps = SNAPSHOT_EVERY + 8
    wf = big_chain(steps)
    with Engine(store_url, workflows=[wf]) as engine:
        info = engine.run(wf, Big())
        assert info.status == "succeeded"
        store = engine.store
        assert isinstance(store, SQLStore)
        with store.engine.connect() as conn:
            rows = conn.execute(
                sa.select(journal.c.seq, journal.c.context, journal.c.data)
                .where(journal.c.run_id == info.id, journal.c.context.is_not(None))
                .order_by(journal.c.seq)
            ).all()
        spliced = [r for r in rows if r.data and SPLICE_KEY in r.data]
        whole = [r for r in rows if not (r.data and SPLICE_KEY in r.data)]
        assert len(spliced) >= steps - 2
        assert all(len(r.context) < 100 for r in spliced)
        assert 2 <= len(whole) <= 3  # run_created, and one snapshot every SNAPSHOT_EVERY
        events = engine.history(info.id)
        contexts = [json.loads(e.context) for e in events if e.context is not None]
        assert [c["n"] for c in contexts] == list(range(steps + 1))
        assert all(c["blob"] == "x" * 20_000 for c in contexts)
        assert all(SPLICE_KEY not in e.data for e in events)
        replay = engine.replay(info.id)
        assert replay.differences == []
        middle = engine.replay(info.id, at=2 * (steps // 2) + 1)
        assert json.loads(middle.record.context)["n"] == steps // 2


def _journal_rows(store: SQLStore, run_id: str) -> list[Any]:
    with store.engine.connect() as conn:
        return conn.execute(
            sa.select(journal).where(journal.c.run_id == run_id).order_by(journal.c.seq)
        ).all()


def test_append__a_step_boundary_is_one_row(store_url: str) -> None:
    """A step's success and the next step's start are one journal row: a 6-step run is
    its creation, its first start, 5 joined rows and its end (8 rows for 14 entries).
    History, replay at every seq, and the fold of the journal still see every entry."""
    steps = 6
    wf = big_chain(steps)
    with Engine(store_url, workflows=[wf]) as engine:
        info = engine.run(wf, Big(blob="y"))
        assert info.status == "succeeded"
        store = engine.store
        assert isinstance(store, SQLStore)
        rows = _journal_rows(store, info.id)
        events = engine.history(info.id)
        assert [e.kind for e in events] == [j.RUN_CREATED, j.STEP_STARTED] + [
            j.STEP_SUCCEEDED,
            j.STEP_STARTED,
        ] * (steps - 1) + [j.STEP_SUCCEEDED]
        assert [e.seq for e in events] == list(range(1, 2 * steps + 2))
        assert len(rows) == steps + 2
        joined = [r for r in rows if r.data and THEN_KEY in r.data]
        assert [r.seq for r in joined] == list(range(3, 2 * steps, 2))
        starts = [e for e in events if e.kind == j.STEP_STARTED]
        assert [e.state for e in starts] == [f"s{i}" for i in range(steps)]
        assert all(e.worker == engine.worker_id and e.attempt == 1 for e in starts)
        assert all(THEN_KEY not in e.data for e in events)
        for seq in range(1, 2 * steps + 2):
            replayed = engine.replay(info.id, at=seq)
            assert replayed.record.last_seq == seq
        assert engine.replay(info.id).differences == []


def test_migration__0013_down_splits_joined_rows_and_up_again(store_url: str) -> None:
    """Migration 0013 down: every joined row becomes its two entries again (the layout of
    0012: one entry per row); up again: the journal reads the same, the run resumes."""
    wf = big_chain(4)
    with Engine(store_url, workflows=[wf]) as engine:
        done = engine.run(wf, Big(blob="z"))
        before = engine.history(done.id)
    to_revision(store_url, "0012")
    store = SQLStore(store_url, check_schema=False)
    try:
        rows = _journal_rows(store, done.id)
        assert len(rows) == len(before)
        assert not any(r.data and THEN_KEY in r.data for r in rows)
        assert [(r.seq, r.kind, r.state, r.attempt, r.at) for r in rows] == [
            (e.seq, e.kind, e.state, e.attempt, e.at) for e in before
        ]
    finally:
        store.close()
    to_revision(store_url, "head")
    with Engine(store_url, workflows=[wf]) as engine:
        assert engine.history(done.id) == before
        again = engine.run(wf, Big(blob="z"))
        assert again.status == "succeeded"
        assert engine.replay(done.id).differences == []


# -- migration 0012 ------------------------------------------------------------------------


def _positions(url: str) -> tuple[dict[str, str], float]:
    """Order runs at every position: retrying, sleeping, waiting, interrupted by a SIGKILL
    inside a step (its journal ahead of its row), queued."""
    positions: dict[str, str] = {}
    now = time.time()
    with Engine(url, clock=FakeClock(now), workflows=[order()]) as engine:
        wf = engine.workflow("order")
        positions["retrying"] = engine.start(wf, OrderV1(order_id="r", fail_reserve=1)).id
        positions["sleeping"] = engine.start(wf, OrderV1(order_id="s", sleep=True)).id
        positions["waiting"] = engine.start(wf, OrderV1(order_id="w")).id
        engine.run_until_idle(idle_horizon=10)
        positions["interrupted"] = run_killed_in_charge(url)
        positions["queued"] = engine.start(wf, OrderV1(order_id="q")).id
    return positions, now


def _finish(url: str, now: float, positions: dict[str, str]) -> dict[str, tuple[str, str, str]]:
    clock = FakeClock(now + LATER_S)
    with Engine(url, clock=clock, workflows=[order()]) as engine:
        engine.run_until_idle()
        clock.advance(LATER_S)
        engine.run_until_idle()
        out = {}
        for position, run_id in positions.items():
            info = engine.get(run_id)
            assert engine.replay(run_id).differences == []
            context = json.loads(engine.store.get_run(run_id).record.context)  # type: ignore[union-attr]
            out[position] = (info.status, info.state, json.dumps(context, sort_keys=True))
    return out


def test_migration__previous_layout_upgraded_live_runs_resume_the_same(
    store_url: str, tmp_path: Any
) -> None:
    """Live runs at every position are taken back to the previous layout (0011: every row
    equal to the fold of its journal, every context whole, the (kind, at) index), then
    `flowloop db upgrade` brings the database to head: every run resumes and ends exactly
    as the same runs that never left the new layout."""
    positions, now = _positions(store_url)
    store = SQLStore(store_url)
    try:  # the killed run's row is a snapshot behind its journal (appends only since)
        row = _row(store, positions["interrupted"])
        assert row.status == "running"
        assert row.last_seq < len(store.journal(positions["interrupted"]))
    finally:
        store.close()
    to_revision(store_url, "0011")
    store = SQLStore(store_url, check_schema=False)
    try:
        with store.engine.connect() as conn:
            assert migrate.current(conn) == "0011"
            names = {ix["name"] for ix in sa.inspect(conn).get_indexes("flowloop_journal")}
            assert "ix_flowloop_journal_kind_at" in names
            assert not conn.execute(
                sa.select(journal.c.seq).where(journal.c.data.like(f'%"{SPLICE_KEY}"%'))
            ).first()
            for run_id in positions.values():
                row = conn.execute(sa.select(runs).where(runs.c.id == run_id)).one()
                rows = conn.execute(
                    sa.select(journal).where(journal.c.run_id == run_id).order_by(journal.c.seq)
                ).all()
                folded = j.fold(
                    j.JournalEvent(
                        run_id=r.run_id,
                        seq=r.seq,
                        kind=r.kind,
                        at=r.at,
                        state=r.state,
                        attempt=r.attempt,
                        event=r.event,
                        next_state=r.next_state,
                        context=r.context,
                        data=j.load_data(r.data),
                    )
                    for r in rows
                )
                assert (row.status, row.state, row.context, row.last_seq) == (
                    folded.status,
                    folded.state,
                    folded.context,
                    folded.last_seq,
                )
    finally:
        store.close()
    upgraded = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", "db", "upgrade", "--db", store_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ},
    )
    assert upgraded.returncode == 0, upgraded.stderr
    ended = _finish(store_url, now, positions)
    assert {p: status for p, (status, _, _) in ended.items()} == dict.fromkeys(
        positions, "succeeded"
    )
    # The control: the same positions on a database that stays in the new layout.
    control_url = f"sqlite:///{tmp_path / 'control.db'}"
    control, control_now = _positions(control_url)
    assert _finish(control_url, control_now, control) == ended


# -- a database written by the previous code ---------------------------------------------


class OldCtx(BaseModel):
    n: int = 0
    blob: str = "b" * 2000


def old_layout_flow() -> Workflow:
    """The workflow of tests/fixtures/layout_0011_interrupted.sql, exactly as the code
    before journal-first defined it (same fingerprint): 5 steps, ``n`` counts them."""
    wf = Workflow("oldnew", context=OldCtx)

    def make(i: int) -> Any:
        def fn(ctx: OldCtx) -> None:
            ctx.n += 1

        return fn

    for i in range(5):
        wf.step(name=f"s{i}", initial=i == 0, next=f"s{i + 1}" if i < 4 else "done")(make(i))
    wf.final("done")
    return wf


FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "layout_0011_interrupted.sql"


def test_migration__a_database_written_by_the_previous_code_resumes(tmp_path: Path) -> None:
    """A SQLite file written by flowloop 33efa28 (schema 0011): three runs whose worker was
    killed inside their third step (``running``, dead owner). `flowloop db upgrade`, then
    `resume`: each re-runs that step and ends with the five steps counted once each."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(FIXTURE.read_text())
    conn.close()
    url = f"sqlite:///{path}"
    upgraded = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", "db", "upgrade", "--db", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert upgraded.returncode == 0, upgraded.stderr
    assert f"0011 to {migrate.HEAD}" in upgraded.stdout
    with Engine(url, workflows=[old_layout_flow()]) as engine:
        store = engine.store
        assert isinstance(store, SQLStore)
        store.expire_leases(store.running_owners())  # the killed worker
        before = [(r.status, r.state) for r in engine.runs()]
        assert before == [("running", "s2")] * 3
        engine.resume()
        for info in engine.runs():
            stored = store.get_run(info.id)
            assert stored is not None
            assert (info.status, json.loads(stored.record.context)["n"]) == ("succeeded", 5)
            assert engine.replay(info.id).differences == []


# -- migration 0014: the due index leaves out runs with no due time --------------------------


def _due_index_sql(store_url: str) -> str:
    """The database's own definition of the runs' due index."""
    engine = sa.create_engine(store_url)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                query = "SELECT sql FROM sqlite_master WHERE name = 'ix_flowloop_runs_due'"
            else:
                query = (
                    "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_flowloop_runs_due'"
                    " AND schemaname = current_schema()"  # each test has a schema of its own
                )
            return str(conn.exec_driver_sql(query).scalar_one())
    finally:
        engine.dispose()


def test_migration__0014_the_due_index_is_partial_and_claims_still_find_due_runs(
    store_url: str,
) -> None:
    """A new database, and one taken down to 0013 and up again, index only runs with a due
    time; a due run is claimed and the earliest due time is read, whichever the layout."""
    store = SQLStore(store_url)
    try:
        due, _ = store.create_run(new_run(due=time.time() - 60))
        running, _ = store.create_run(new_run(owner="w0"))
    finally:
        store.close()
    assert "next_run_at IS NOT NULL" in _due_index_sql(store_url)
    to_revision(store_url, "0013")
    assert "WHERE" not in _due_index_sql(store_url)
    to_revision(store_url, "head")
    assert "next_run_at IS NOT NULL" in _due_index_sql(store_url)
    store = SQLStore(store_url)
    try:
        assert store.next_due() == due.record.next_run_at
        claimed = store.claim(worker="w1", now=time.time(), limit=10, lease_seconds=30.0)
        assert [c.id for c in claimed] == [due.id]  # not the running one
        assert running.record.next_run_at is None
    finally:
        store.close()
