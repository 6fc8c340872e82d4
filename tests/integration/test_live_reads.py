"""Reads of live runs (issue 13's review): a read folds the journal after the snapshot it
holds, never after the row's later ``last_seq`` (a release committed between the two
statements); a tail that cannot be folded fails its run once, even when recovery finds it.
Each on SQLite and PostgreSQL, the interleaving forced by a hook on the reader's engine."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel
from storekit import dead_owner, event, new_run, start_step, succeed_step

from flowloop import Engine, Workflow
from flowloop import journal as j
from flowloop.store import Boundary, Fence, RunFilter, SQLStore, StoredRun
from flowloop.store.schema import journal, runs
from flowloop.ui import queries


def _running_at_4(store: SQLStore) -> StoredRun:
    """A run whose row is a snapshot at seq 2 (state a) and whose tail makes it seq 4
    (state b, running)."""
    created, _ = store.create_run(new_run())
    claimed = store.claim(
        worker="a", now=time.time(), limit=1, lease_seconds=30, run_ids=[created.id]
    )[0]
    first = start_step(claimed, "a")
    assert store.write([first]) == [True]
    moved = succeed_step(first.record, first.fence, release=False)
    again = event(moved.record, j.STEP_STARTED, state="b", attempt=1)
    record = j.apply(moved.record, again)
    assert store.write([Boundary(events=[*moved.events, again], record=record, fence=first.fence)])
    seen = store.get_run(created.id)
    assert seen is not None and (seen.record.state, seen.record.last_seq) == ("b", 4)
    return seen


def _release_before_tail(store: SQLStore, release: Callable[[], None]) -> list[int]:
    """Commit ``release`` (on another connection) just before the reader's first journal
    SELECT: after the reader took the row's snapshot, before it reads the tail."""
    fired: list[int] = []

    @sa.event.listens_for(store.engine, "before_cursor_execute")
    def hook(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        text = statement.lower()
        if not fired and text.lstrip().startswith("select") and "from flowloop_journal" in text:
            fired.append(1)
            release()

    return fired


@pytest.mark.parametrize("reader", ["get_run", "find_runs", "dashboard"])
def test_read__a_release_between_snapshot_and_tail_is_not_a_step_back(
    store_url: str, reader: str
) -> None:
    """Seen at seq 4 (state b); a release writes seq 5 between the reader's two statements:
    the reader shows seq 5 (or at least 4), never the snapshot's seq 2 / state a."""
    store, other = SQLStore(store_url), SQLStore(store_url)
    try:
        seen = _running_at_4(store)
        done = succeed_step(seen.record, _fence(seen))

        def release() -> None:
            assert other.write([done]) == [True]

        fired = _release_before_tail(store, release)
        if reader == "get_run":
            got = store.get_run(seen.id)
            assert got is not None
            found = (got.record.status, got.record.state, got.record.last_seq)
        elif reader == "find_runs":
            every = store.find_runs(RunFilter(workflow=seen.record.workflow))
            one = next(s.record for s in every if s.id == seen.id)
            found = (one.status, one.state, one.last_seq)
        else:
            row = queries.run_progress(store.engine, seen.id)
            found = (row["status"], row["state"], row["last_seq"])
        assert fired, "the hook never ran: the test did not interleave"
        # Either view is whole (SQLite reads in one transaction: still seq 4); the snapshot
        # alone ("running", "a", 2) is a state older than one already seen.
        assert found in {("running", "b", 4), (done.record.status, done.record.state, 5)}
    finally:
        other.close()
        store.close()


def _fence(stored: StoredRun) -> Fence:
    return Fence("a", stored.lease_epoch)


class N(BaseModel):
    n: int = 0


def _w() -> Workflow:
    wf = Workflow("w", context=N)

    @wf.step(name="a", initial=True, next="done")
    async def a(ctx: N) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


@pytest.mark.parametrize("damage", ["null_context", "unknown_kind", "damaged_then"])
def test_recovery__a_tail_that_cannot_be_folded_fails_the_run_once(
    store_url: str, damage: str
) -> None:
    """A dead worker's run whose journal tail is broken: recovery fails it at once as
    ``invalid_row`` naming the entry (not claimed again and again), and reads still work."""
    store = SQLStore(store_url)
    try:
        created, _ = store.create_run(new_run(owner=dead_owner()))
        broken = {
            "run_id": created.id,
            "seq": 3,
            "kind": "no_such_kind" if damage == "unknown_kind" else j.STEP_SUCCEEDED,
            "at": time.time(),
            "state": "a",
            "attempt": 1,
            "event": "next",
            "next_state": "done",
            "context": '{"n":1}' if damage == "damaged_then" else None,
            # A row that says it holds the next start too (seq 4), unreadably.
            "data": '{"~then":"garbage"}' if damage == "damaged_then" else None,
        }
        with store.engine.begin() as conn:
            conn.execute(sa.insert(journal).values(**broken))
        got = store.get_run(created.id)  # readable, the problem named
        assert got is not None and got.problem is not None and "seq 3" in got.problem
    finally:
        store.close()
    engine = Engine(store_url, workflows=[_w()], lease_seconds=3)
    try:
        engine.run_until_idle()
        run = engine.get(created.id)
        assert (run.status, run.reason) == ("failed", "invalid_row")
        assert run.error is not None and "seq 3" in run.error
        # The failure goes after the row's last seq (a damaged joined row holds two).
        end = 5 if damage == "damaged_then" else 4
        assert run.last_seq == end
        engine.run_until_idle()  # never retried in a loop
        with engine.store.engine.connect() as conn:  # type: ignore[attr-defined]
            kinds = conn.execute(
                sa.select(journal.c.kind).where(journal.c.run_id == created.id)
            ).scalars()
            assert list(kinds).count(j.RUN_FAILED) == 1
            row = conn.execute(sa.select(runs).where(runs.c.id == created.id)).one()
            assert (row.status, row.owner, row.last_seq) == ("failed", None, end)
        if damage == "damaged_then":  # the journal is still shown, the damage in it
            shown = engine.history(created.id)
            assert shown[2].data == {"~then": "garbage"}
    finally:
        engine.close()


def test_workers__a_busy_worker_shows_its_latest_entry_not_its_claim(store_url: str) -> None:
    """The dashboard's workers page: a running run's row is not written while it goes on,
    so its owner's latest write is the run's latest journal entry."""
    store = SQLStore(store_url)
    try:
        seen = _running_at_4(store)
        row_written = queries.workers(store.engine, time.time())["owners"][0]["last_write"]
        later = row_written + 1_000.0
        done = event(seen.record, j.STEP_SUCCEEDED, state="b", attempt=1, event="next")
        done = dataclasses.replace(done, at=later, next_state="c", context='{"n":2}')
        again = event(seen.record, j.STEP_STARTED, 2, state="c", attempt=1)
        again = dataclasses.replace(again, at=later + 1)
        record = j.apply(j.apply(seen.record, done), again)
        going = Boundary(events=[done, again], record=record, fence=_fence(seen))
        assert store.write([going]) == [True]
        owners = queries.workers(store.engine, time.time())["owners"]
        # One row per boundary (the start is joined to the success): its time is the row's.
        assert [(o["owner"], o["runs"], o["last_write"]) for o in owners] == [("a", 1, later)]
    finally:
        store.close()


def _going_on(store: SQLStore, seen: StoredRun, steps: int, blob: int) -> StoredRun:
    """``seen`` (running, owner a) goes on ``steps`` more boundaries of outcome + next start,
    each changing a little of a ``blob``-character context (spliced when that saves)."""
    record = seen.record
    for i in range(steps):
        context = '{"blob":"' + "x" * blob + '","i":' + str(i) + "}"
        done = event(record, j.STEP_SUCCEEDED, state=record.state, attempt=1, event="next")
        done = dataclasses.replace(done, next_state=f"s{i}", context=context)
        again = event(record, j.STEP_STARTED, 2, state=f"s{i}", attempt=1)
        ahead = j.apply(j.apply(record, done), again)
        assert store.write([Boundary(events=[done, again], record=ahead, fence=_fence(seen))])
        record = ahead
    got = store.get_run(seen.id)
    assert got is not None and got.record == record
    return got


@pytest.mark.parametrize("chunk", [2, 500])
def test_claim_interrupted__folds_each_claimed_runs_own_tail(
    store_url: str, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Runs left running with tails of different lengths (none, two entries, many with
    spliced contexts) and snapshots at different seqs: the claim of their dead worker's runs
    returns each as of its own latest entry, in one query per ``CLAIM_TAIL_CHUNK`` runs, the
    epoch moved on; the new owner's next entry goes after it."""
    from flowloop.store import appends

    monkeypatch.setattr(appends, "CLAIM_TAIL_CHUNK", chunk)
    store, other = SQLStore(store_url), SQLStore(store_url)
    try:
        short = _running_at_4(store)  # snapshot seq 2, tail to seq 4
        long = _going_on(store, _running_at_4(store), 40, 3000)  # tail 4 .. 84
        small = _going_on(store, _running_at_4(store), 3, 10)
        none = start_step(
            store.claim(  # snapshot is its latest entry (seq 2): no tail
                worker="a",
                now=time.time(),
                limit=1,
                lease_seconds=30,
                run_ids=[store.create_run(new_run())[0].id],
            )[0],
            "a",
        )
        assert store.write([none]) == [True]
        with store.engine.begin() as conn:
            spliced = conn.execute(
                sa.select(sa.func.count()).where(
                    journal.c.run_id == long.id, journal.c.data.like('%"~ctx"%')
                )
            ).scalar_one()
        assert spliced > 20  # the long tail's contexts travel as splices
        before = {s.id: s for s in (short, long, small)}
        before[none.run_id] = store.get_run(none.run_id)  # type: ignore[assignment]
        assert other.expire_leases(["a"]) == 4
        reads: list[str] = []

        @sa.event.listens_for(other.engine, "before_cursor_execute")
        def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            text = statement.lower()
            if text.lstrip().startswith("select") and "flowloop_journal" in text:
                reads.append(statement)

        claimed = other.claim_interrupted(worker="b", limit=10, lease_seconds=30)
        sa.event.remove(other.engine, "before_cursor_execute", count)
        assert len(reads) == -(-4 // chunk)
        assert sorted(c.id for c in claimed) == sorted(before)
        for c in claimed:
            assert c.problem is None
            assert c.record == before[c.id].record, c.id
            assert (c.owner, c.lease_epoch) == ("b", before[c.id].lease_epoch + 1)
        assert before[long.id].record.last_seq == 84
        # The claimer's write goes after the tail's end, under the new epoch only.
        taken = next(c for c in claimed if c.id == long.id)
        assert store.write([succeed_step(taken.record, _fence(taken))]) == [False]
        assert other.write([succeed_step(taken.record, Fence("b", taken.lease_epoch))]) == [True]
        after = other.get_run(long.id)
        assert after is not None and after.record.last_seq == 85
    finally:
        store.close()
        other.close()
