"""The store contract (flowloop/store/base.py), the same suite on SQLite files and PostgreSQL."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from storekit import new_run, past, pause, start_step, succeed_step

from flowloop import journal as j
from flowloop.errors import SchemaMismatch, StoreError
from flowloop.store import Fence, RunFilter, SQLStore, migrate
from flowloop.store.limits import ClaimLimits

DEADLINE_S = 10.0


@pytest.fixture
def other(store_url: str, store: SQLStore) -> Iterator[SQLStore]:
    """A second store instance on the same database (another process, as far as it knows)."""
    s = SQLStore(store_url)
    yield s
    s.close()


def journal_kinds(store: SQLStore, run_id: str) -> list[str]:
    return [e.kind for e in store.journal(run_id)]


def claim_one(store: SQLStore, worker: str, run_id: str, lease: float = 30.0) -> Any:
    rows = store.claim(
        worker=worker, now=time.time(), limit=1, lease_seconds=lease, run_ids=[run_id]
    )
    assert [r.id for r in rows] == [run_id]
    return rows[0]


# -- creating -----------------------------------------------------------------------------


def test_create_run__same_business_key_returns_existing(store: SQLStore) -> None:
    first, created = store.create_run(new_run(key="order-1"))
    again, created_again = store.create_run(new_run(key="order-1"))
    other_wf, created_other = store.create_run(new_run(key="order-1", workflow="other"))
    assert created and not created_again and created_other
    assert again.id == first.id
    assert other_wf.id != first.id
    assert journal_kinds(store, first.id) == [j.RUN_CREATED]


def test_create_run__same_idempotency_key_returns_existing(store: SQLStore) -> None:
    first, created = store.create_run(new_run(idempotency_key="req-7"))
    again, created_again = store.create_run(new_run(idempotency_key="req-7"))
    assert created and not created_again
    assert again.id == first.id
    assert len(store.find_runs(RunFilter(workflow="w"))) == 1


def test_create_runs__one_transaction_keys_taken_before_or_earlier_in_the_batch(
    store: SQLStore,
) -> None:
    old, _ = store.create_run(new_run(key="order-1"))
    old_request, _ = store.create_run(new_run(idempotency_key="req-1"))
    batch = [
        new_run(key="order-1"),  # an existing run's key
        new_run(key="order-2"),
        new_run(),  # no key at all
        new_run(key="order-2"),  # the key the second run of this batch takes
        new_run(idempotency_key="req-1"),  # an existing run's idempotency key
        new_run(key="order-2", workflow="other"),  # same key, another workflow
    ]
    results = store.create_runs(batch)
    ids = [stored.id for stored, _ in results]
    assert [created for _, created in results] == [False, True, True, False, False, True]
    assert ids[0] == old.id and ids[4] == old_request.id and ids[3] == ids[1]
    assert ids[1] == batch[1].record.id and ids[2] == batch[2].record.id
    assert results[1][0].record.status == "scheduled" and results[1][0].owner is None
    assert len(store.find_runs(RunFilter(workflow="w"))) == 4
    for run_id in (ids[1], ids[2], ids[5]):
        assert journal_kinds(store, run_id) == [j.RUN_CREATED]
    assert store.create_runs([]) == []


def test_create_runs__a_key_race_returns_the_winner(pg_url: str) -> None:
    # Another process inserts the key between this batch's lookup and its insert: the
    # batch's transaction fails on the unique key, nothing of it stays, and the retry
    # returns the winner. (PostgreSQL: on SQLite the write lock is taken before the lookup,
    # so no other writer can come between.)
    store, other = SQLStore(pg_url), SQLStore(pg_url)
    try:
        check_key_race(store, other)
    finally:
        store.close()
        other.close()


def check_key_race(store: SQLStore, other: SQLStore) -> None:
    batch = [new_run(key="k-1"), new_run(key="k-2")]
    real_lookup = store._existing_many
    raced: list[str] = []

    def lookup_then_lose_the_race(conn: Any, news: Any) -> Any:
        found = real_lookup(conn, news)
        if not raced:
            winner, _ = other.create_run(new_run(key="k-2"))
            raced.append(winner.id)
        return found

    store._existing_many = lookup_then_lose_the_race  # type: ignore[method-assign]
    results = store.create_runs(batch)
    assert [created for _, created in results] == [True, False]
    assert results[1][0].id == raced[0]
    assert len(store.find_runs(RunFilter(workflow="w"))) == 2


def _create_together(stores: list[SQLStore], batches: list[list[Any]]) -> list[dict[str, str]]:
    """Each store creates its batch at the same moment; each result as {key: run id}."""
    barrier = threading.Barrier(len(stores))

    def produce(store: SQLStore, batch: list[Any]) -> dict[str, str]:
        barrier.wait()
        return {stored.record.key or "": stored.id for stored, _ in store.create_runs(batch)}

    with ThreadPoolExecutor(len(stores)) as pool:
        futures = [pool.submit(produce, *pair) for pair in zip(stores, batches, strict=True)]
        return [future.result(timeout=60) for future in futures]


def test_create_runs__overlapping_batches_in_opposite_orders_both_succeed(pg_url: str) -> None:
    """Two producers fanning out the same keys, one list reversed: each gets every run,
    the same ones, with no deadlock surfacing (inserts take the keys in one order)."""
    stores = [SQLStore(pg_url), SQLStore(pg_url)]
    try:
        for trial in range(3):
            keys = [f"t{trial}-{n:04d}" for n in range(600)]
            batches = [[new_run(key=k) for k in keys], [new_run(key=k) for k in keys[::-1]]]
            first, second = _create_together(stores, batches)
            assert first == second and sorted(first) == keys
        assert len(stores[0].find_runs(RunFilter(workflow="w", limit=10_000))) == 3 * 600
    finally:
        for store in stores:
            store.close()


def test_create_run__with_owner_starts_claimed(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run(owner="me"))
    assert stored.owner == "me" and stored.lease_epoch == 1
    assert stored.record.status == "running" and stored.record.attempt == 1
    assert stored.lease_expires_at is not None and stored.lease_expires_at > store.db_now()
    assert journal_kinds(store, stored.id) == [j.RUN_CREATED, j.STEP_STARTED]


def test_definitions__saved_once_and_read_back(store: SQLStore, other: SQLStore) -> None:
    store.save_definition("abc", "w", 1, '{"states": {}}')
    other.save_definition("abc", "w", 1, '{"states": {}}')  # idempotent
    assert other.definition("abc") == {"states": {}}
    assert store.definition("missing") is None


def test_find_runs__filters_newest_first(store: SQLStore) -> None:
    a, _ = store.create_run(new_run(key="a"))
    b, _ = store.create_run(new_run(key="b", workflow="other"))
    found = store.find_runs(RunFilter())
    assert {r.id for r in found} == {a.id, b.id}
    assert [r.id for r in store.find_runs(RunFilter(workflow="other"))] == [b.id]
    assert [r.id for r in store.find_runs(RunFilter(key="a"))] == [a.id]
    assert store.find_runs(RunFilter(statuses=["failed"])) == []


def test_db_now__is_the_wall_clock(store: SQLStore) -> None:
    assert abs(store.db_now() - time.time()) < 5.0


# -- journal ------------------------------------------------------------------------------


def test_journal__in_seq_order_and_cut_at_seq(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    claimed = claim_one(store, "me", stored.id)
    started = start_step(claimed, "me")
    assert store.write([started]) == [True]
    done = succeed_step(started.record, started.fence, release=False)
    assert store.write([done]) == [True]
    events = store.journal(stored.id)
    assert [e.seq for e in events] == [1, 2, 3]
    assert [e.kind for e in events] == [j.RUN_CREATED, j.STEP_STARTED, j.STEP_SUCCEEDED]
    assert [e.seq for e in store.journal(stored.id, until_seq=2)] == [1, 2]
    row = store.get_run(stored.id)
    assert row is not None
    assert j.compare(j.fold(events), row.record) == []


# -- claiming -----------------------------------------------------------------------------


def test_claim__takes_only_due_runs(store: SQLStore) -> None:
    due, _ = store.create_run(new_run())
    later, _ = store.create_run(new_run(due=time.time() + 3600))
    assert store.count_due(now=time.time()) == 1
    rows = store.claim(worker="me", now=time.time(), limit=10, lease_seconds=30)
    assert [r.id for r in rows] == [due.id]
    assert store.claim(worker="me", now=time.time() + 7200, limit=10, lease_seconds=30)[0].id == (
        later.id
    )


def test_claim__highest_priority_first_then_oldest_due(store: SQLStore) -> None:
    base = past()
    low_old, _ = store.create_run(new_run(priority=0, due=base - 10))
    high_new, _ = store.create_run(new_run(priority=5, due=base))
    high_old, _ = store.create_run(new_run(priority=5, due=base - 5))
    mid, _ = store.create_run(new_run(priority=1, due=base - 20))
    first = store.claim(worker="me", now=time.time(), limit=3, lease_seconds=30)
    assert [r.id for r in first] == [high_old.id, high_new.id, mid.id]
    rest = store.claim(worker="me", now=time.time(), limit=3, lease_seconds=30)
    assert [r.id for r in rest] == [low_old.id]


def test_claim__sets_owner_fresh_lease_and_next_epoch(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    assert stored.lease_epoch == 0 and stored.owner is None
    claimed = claim_one(store, "me", stored.id, lease=30)
    assert claimed.owner == "me" and claimed.lease_epoch == 1
    assert claimed.lease_expires_at is not None
    assert 20 < claimed.lease_expires_at - store.db_now() <= 30.5


def test_claim__filters_by_workflow_and_run_ids(store: SQLStore) -> None:
    a, _ = store.create_run(new_run())
    b, _ = store.create_run(new_run(workflow="other"))
    assert (
        store.claim(worker="me", now=time.time(), limit=5, lease_seconds=30, workflows=["nope"])
        == []
    )
    assert [
        r.id
        for r in store.claim(
            worker="me", now=time.time(), limit=5, lease_seconds=30, run_ids=[b.id]
        )
    ] == [b.id]
    assert [
        r.id
        for r in store.claim(
            worker="me", now=time.time(), limit=5, lease_seconds=30, workflows=["w"]
        )
    ] == [a.id]


SCOPE_IDS = 70_000
"""More run ids than one statement may bind: SQLite refuses past 32,766 variables, psycopg
past 65,535 parameters (``engine.run`` of a big map scopes its claims to its family)."""


def _default_variable_limit(connection: sqlite3.Connection, _: Any) -> None:
    connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 32_766)


@pytest.mark.parametrize("limited", [False, True], ids=["unlimited", "max_concurrency"])
def test_claim_and_next_due__take_a_scope_of_any_size(store: SQLStore, limited: bool) -> None:
    if store.engine.dialect.name == "sqlite":  # SQLite's own default (Debian builds 250,000)
        sa.event.listen(store.engine, "connect", _default_variable_limit)
        store.set_write_lease(30.0)  # (the held write connection closed too: made again)
        with store._write() as conn, store._read() as reading:
            for connection in (conn, reading):
                raw = connection.connection.dbapi_connection
                assert isinstance(raw, sqlite3.Connection)
                assert raw.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) == 32_766
    if limited:  # claims of a limited workflow go through their own statement
        store.set_claim_limits({"w": ClaimLimits(max_concurrency=10)})
    outside, _ = store.create_run(new_run(due=past() - 600))  # due first of all
    inside, _ = store.create_run(new_run())
    later, _ = store.create_run(new_run(due=time.time() + 100))
    scope = [f"{i:032x}" for i in range(SCOPE_IDS)] + [later.id, inside.id]
    due = store.next_due(run_ids=scope)
    assert due == pytest.approx(inside.record.next_run_at, abs=1e-3)
    assert store.next_due(run_ids=[later.id]) == pytest.approx(later.record.next_run_at, abs=1e-3)
    assert store.next_due(run_ids=[]) is None
    claimed = store.claim(
        worker="me", now=time.time(), limit=5, lease_seconds=30, workflows=["w"], run_ids=scope
    )
    assert [r.id for r in claimed] == [inside.id]
    # The run outside the scope was left alone: due, and claimable.
    rest = store.claim(worker="me", now=time.time(), limit=5, lease_seconds=30, workflows=["w"])
    assert [r.id for r in rest] == [outside.id]


def test_claim__concurrent_claimers_never_get_the_same_run(
    store: SQLStore, other: SQLStore
) -> None:
    ids = {store.create_run(new_run())[0].id for _ in range(60)}
    barrier = threading.Barrier(2)
    taken: dict[str, list[str]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def claimer(s: SQLStore, name: str) -> None:
        try:
            barrier.wait(timeout=DEADLINE_S)
            while True:
                rows = s.claim(worker=name, now=time.time(), limit=3, lease_seconds=30)
                if not rows:
                    return
                taken[name].extend(r.id for r in rows)
        except BaseException as error:  # reported below, in the test's thread
            errors.append(error)

    threads = [
        threading.Thread(target=claimer, args=(store, "a")),
        threading.Thread(target=claimer, args=(other, "b")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=DEADLINE_S * 3)
    assert not errors
    assert not set(taken["a"]) & set(taken["b"])
    assert len(taken["a"]) + len(taken["b"]) == len(ids)
    assert set(taken["a"]) | set(taken["b"]) == ids
    for run_id in taken["b"]:
        row = store.get_run(run_id)
        assert row is not None and row.owner == "b" and row.lease_epoch == 1


def test_claim__validly_leased_run_is_not_claimed(store: SQLStore, other: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    claim_one(store, "a", stored.id, lease=30)
    assert other.claim(worker="b", now=time.time(), limit=5, lease_seconds=30) == []


def test_claim__expired_lease_makes_run_claimable(store: SQLStore, other: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    # Long enough that the next claim, however loaded the machine, comes within it.
    first = claim_one(store, "a", stored.id, lease=2.0)
    assert other.claim(worker="b", now=time.time(), limit=5, lease_seconds=30) == []
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the lease runs out by the database's clock
        rows = other.claim(worker="b", now=time.time(), limit=5, lease_seconds=30)
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [r.id for r in rows] == [stored.id]
    assert rows[0].owner == "b" and rows[0].lease_epoch == first.lease_epoch + 1


# -- fencing ------------------------------------------------------------------------------


def _taken_over(store: SQLStore, other: SQLStore) -> tuple[Any, Any]:
    """Run claimed by a (lease already expired), then claimed by b."""
    stored, _ = store.create_run(new_run())
    stale = claim_one(store, "a", stored.id, lease=-1)
    fresh = claim_one(other, "b", stored.id)
    assert fresh.lease_epoch == stale.lease_epoch + 1
    return stale, fresh


def test_write__stale_epoch_changes_nothing(store: SQLStore, other: SQLStore) -> None:
    stale, fresh = _taken_over(store, other)
    before = store.get_run(stale.id)
    assert store.write([start_step(stale, "a")]) == [False]
    after = store.get_run(stale.id)
    assert after == before
    assert journal_kinds(store, stale.id) == [j.RUN_CREATED]
    assert other.write([start_step(fresh, "b")]) == [True]
    assert journal_kinds(store, stale.id) == [j.RUN_CREATED, j.STEP_STARTED]


def test_write__wrong_owner_changes_nothing(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    claimed = claim_one(store, "a", stored.id)
    before = store.get_run(stored.id)
    # Right epoch, wrong owner.
    assert store.write([start_step(claimed, "intruder")]) == [False]
    assert store.get_run(stored.id) == before
    assert journal_kinds(store, stored.id) == [j.RUN_CREATED]


def test_write__not_following_last_seq_changes_nothing(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    claimed = claim_one(store, "a", stored.id)
    assert store.write([start_step(claimed, "a")]) == [True]
    # The same boundary again follows seq 1, but the run is at seq 2 now.
    assert store.write([start_step(claimed, "a")]) == [False]
    assert journal_kinds(store, stored.id) == [j.RUN_CREATED, j.STEP_STARTED]


def test_write__unowned_write_refused_while_leased(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    claimed = claim_one(store, "a", stored.id)
    assert store.write([pause(claimed)]) == [False]
    store.release(worker="a", run_ids=[stored.id])
    released = store.get_run(stored.id)
    assert released is not None
    assert store.write([pause(released)]) == [True]
    row = store.get_run(stored.id)
    assert row is not None and row.record.status == "paused"


def test_write__batch_judges_each_boundary_alone(store: SQLStore, other: SQLStore) -> None:
    good = [claim_one(store, "a", store.create_run(new_run())[0].id) for _ in range(3)]
    stale, _fresh = _taken_over(store, other)
    batch = [
        start_step(good[0], "a"),
        start_step(stale, "a"),
        start_step(good[1], "a"),
        start_step(good[2], "a"),
    ]
    assert store.write(batch) == [True, False, True, True]
    for run in good:
        assert journal_kinds(store, run.id) == [j.RUN_CREATED, j.STEP_STARTED]
    assert journal_kinds(store, stale.id) == [j.RUN_CREATED]
    # Mixed kinds of write in one batch: continue one, release another.
    rec0, rec1 = batch[0], batch[2]
    results = store.write(
        [
            succeed_step(rec0.record, rec0.fence, release=False),
            succeed_step(rec1.record, rec1.fence, release=True),
        ]
    )
    assert results == [True, True]
    row0, row1 = store.get_run(good[0].id), store.get_run(good[1].id)
    assert row0 is not None and row0.owner == "a"
    assert row1 is not None and row1.owner is None and row1.record.state == "b"


def test_write__many_boundaries_one_transaction(store: SQLStore) -> None:
    claimed = [claim_one(store, "a", store.create_run(new_run())[0].id) for _ in range(50)]
    statements = count_statements(store, lambda: store.write([start_step(c, "a") for c in claimed]))
    for c in claimed:
        assert journal_kinds(store, c.id) == [j.RUN_CREATED, j.STEP_STARTED]
    assert statements.result == [True] * 50
    # One transaction for all: BEGIN (SQLite), the appends (SQLite: one executemany;
    # PostgreSQL: one statement on their JSON), the row writes likewise, COMMIT.
    assert 2 <= statements.count <= 8


def test_write__one_boundary_and_a_creation_are_one_statement_on_postgresql(
    store: SQLStore,
) -> None:
    """PostgreSQL: a run's creation and a boundary each one autocommit statement (one
    round trip); SQLite: each one driver transaction."""
    created = count_statements(store, lambda: store.create_run(new_run()))
    claimed = claim_one(store, "a", created.result[0].id)
    wrote = count_statements(store, lambda: store.write([start_step(claimed, "a")]))
    assert wrote.result == [True]
    assert journal_kinds(store, claimed.id) == [j.RUN_CREATED, j.STEP_STARTED]
    if store._postgres:
        assert (created.count, wrote.count) == (1, 1)
    else:  # each: BEGIN IMMEDIATE, two statements (a start after a claim writes the row), COMMIT
        assert (created.count, wrote.count) == (4, 4)


# -- leases -------------------------------------------------------------------------------


def test_claim_interrupted__takes_running_runs_whose_lease_expired(
    store: SQLStore, other: SQLStore
) -> None:
    dead, _ = store.create_run(new_run(owner="dead", lease_seconds=-1))
    alive, _ = store.create_run(new_run(owner="alive", lease_seconds=30))
    queued, _ = store.create_run(new_run())
    rows = other.claim_interrupted(worker="b", limit=10, lease_seconds=30)
    assert [r.id for r in rows] == [dead.id]
    assert rows[0].owner == "b" and rows[0].lease_epoch == dead.lease_epoch + 1
    assert rows[0].record.status == "running"
    assert other.claim_interrupted(worker="b", limit=10, lease_seconds=30) == []
    assert queued.record.status == "scheduled" and alive.owner == "alive"


def test_claim_interrupted__only_named_workflows(store: SQLStore) -> None:
    store.create_run(new_run(owner="dead", lease_seconds=-1, workflow="other"))
    assert store.claim_interrupted(worker="b", limit=10, lease_seconds=30, workflows=["w"]) == []


def test_expire_leases__dead_owner_runs_become_interrupted(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run(owner="dead", lease_seconds=30))
    assert store.running_owners() == ["dead"]
    assert store.claim_interrupted(worker="b", limit=10, lease_seconds=30) == []
    assert store.expire_leases(["dead"]) == 1
    assert [r.id for r in store.claim_interrupted(worker="b", limit=10, lease_seconds=30)] == [
        stored.id
    ]
    assert store.expire_leases([]) == 0


def test_renew__extends_only_own_valid_leases(store: SQLStore) -> None:
    mine = [claim_one(store, "a", store.create_run(new_run())[0].id, lease=5) for _ in range(2)]
    theirs = claim_one(store, "b", store.create_run(new_run())[0].id, lease=5)
    expired = claim_one(store, "a", store.create_run(new_run())[0].id, lease=-1)
    ids = [m.id for m in mine]
    kept = store.renew(worker="a", run_ids=[*ids, theirs.id, expired.id], lease_seconds=60)
    assert kept == set(ids)
    for run_id in ids:
        row = store.get_run(run_id)
        assert row is not None and row.lease_expires_at is not None
        assert row.lease_expires_at - store.db_now() > 50
    assert store.renew(worker="a", run_ids=[], lease_seconds=60) == set()


def test_release__drops_ownership_keeps_status(store: SQLStore, other: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    claim_one(store, "a", stored.id)
    store.release(worker="b", run_ids=[stored.id])  # not b's: nothing happens
    row = store.get_run(stored.id)
    assert row is not None and row.owner == "a"
    store.release(worker="a", run_ids=[stored.id])
    row = store.get_run(stored.id)
    assert row is not None and row.owner is None and row.lease_expires_at is None
    assert row.record.status == "scheduled"
    assert [r.id for r in other.claim(worker="b", now=time.time(), limit=1, lease_seconds=30)] == [
        stored.id
    ]


# -- control ------------------------------------------------------------------------------


def test_request_control__pending_only_for_its_owner(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    claimed = claim_one(store, "a", stored.id)
    assert store.request_control(stored.id, "pause") is True
    assert store.request_control("no-such-run", "pause") is False
    assert store.pending_controls(worker="a") == {stored.id: "pause"}
    assert store.pending_controls(worker="b") == {}
    # The owner honours it: the write clears the request.
    started = start_step(claimed, "a")
    paused_event = j.JournalEvent(
        run_id=stored.id, seq=3, kind=j.RUN_PAUSED, at=time.time(), state="a"
    )
    boundary = type(started)(
        events=[*started.events, paused_event],
        record=j.apply(started.record, paused_event),
        fence=Fence("a", claimed.lease_epoch),
        release=True,
        clear_control=True,
        seen_control="pause",
    )
    assert store.write([boundary]) == [True]
    assert store.pending_controls(worker="a") == {}
    row = store.get_run(stored.id)
    assert row is not None and row.control is None and row.record.status == "paused"


def test_request_control__withdrawn_with_none(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    claim_one(store, "a", stored.id)
    store.request_control(stored.id, "stop")
    store.request_control(stored.id, None)
    assert store.pending_controls(worker="a") == {}


def test_request_control__unless_keeps_that_request(store: SQLStore) -> None:
    """A pause asked for after a stop leaves the stop pending (the run still stops)."""
    stored, _ = store.create_run(new_run())
    claim_one(store, "a", stored.id)
    assert store.request_control(stored.id, "stop") is True
    assert store.request_control(stored.id, "pause", unless=("stop",)) is False
    assert store.pending_controls(worker="a") == {stored.id: "stop"}
    store.request_control(stored.id, None)
    assert store.request_control(stored.id, "pause", unless=("stop",)) is True
    assert store.pending_controls(worker="a") == {stored.id: "pause"}
    # A parent's pause leaves the child's own pause (or stop) as it is.
    assert store.request_control(stored.id, "parent pause", unless=("pause", "stop")) is False
    assert store.pending_controls(worker="a") == {stored.id: "pause"}
    store.request_control(stored.id, None)
    assert store.request_control(stored.id, "parent pause", unless=("pause", "stop")) is True
    assert store.pending_controls(worker="a") == {stored.id: "parent pause"}


def test_withdraw_control__only_the_request_it_names(store: SQLStore) -> None:
    """An operator's unpause withdraws a pause; a stop made meanwhile is not withdrawn."""
    stored, _ = store.create_run(new_run())
    claim_one(store, "a", stored.id)
    store.request_control(stored.id, "stop")
    assert store.withdraw_control(stored.id, "pause") is False
    assert store.pending_controls(worker="a") == {stored.id: "stop"}
    store.request_control(stored.id, "pause")
    assert store.withdraw_control(stored.id, "pause") is True
    assert store.pending_controls(worker="a") == {}
    assert store.withdraw_control(stored.id, "pause") is False
    assert store.withdraw_control("no-such-run", "pause") is False


def test_count_due_and_next_due(store: SQLStore) -> None:
    assert store.next_due() is None
    soon = time.time() + 100
    store.create_run(new_run(due=soon))
    early, _ = store.create_run(new_run())
    assert store.count_due(now=time.time()) == 1
    assert store.count_due(now=time.time(), workflows=["other"]) == 0
    assert store.next_due() == pytest.approx(early.record.next_run_at, abs=1e-3)
    assert store.next_due(run_ids=["nope"]) is None
    assert store.next_due(workflows=["w"], run_ids=[early.id]) == pytest.approx(
        early.record.next_run_at
    )


# -- opening a database -------------------------------------------------------------------


def _set_schema_revision(url: str, revision: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(f"UPDATE {migrate.VERSION_TABLE} SET version_num = :r"), {"r": revision}
        )
    engine.dispose()


@pytest.mark.parametrize(
    ("revision", "words"),
    [
        ("0001", "older than this flowloop .*run `flowloop db upgrade`"),
        ("9999", "newer than this flowloop .*upgrade flowloop"),
    ],
    ids=["older", "newer"],
)
def test_open__schema_version_mismatch_refused(store_url: str, revision: str, words: str) -> None:
    assert migrate.head() > "0001"  # there is an older revision to pretend to be at
    SQLStore(store_url).close()
    _set_schema_revision(store_url, revision)
    with pytest.raises(SchemaMismatch, match=f"schema revision {revision} is {words}"):
        SQLStore(store_url)


def test_open__foreign_database_refused(store_url: str) -> None:
    engine = sa.create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)"))
    engine.dispose()
    with pytest.raises(StoreError, match=r"is not a flowloop database .*users"):
        SQLStore(store_url)


def test_open__without_create_refuses_empty_database(store_url: str) -> None:
    with pytest.raises(StoreError, match="no flowloop schema"):
        SQLStore(store_url, create=False)


def test_open__second_open_keeps_data(store_url: str) -> None:
    s = SQLStore(store_url)
    stored, _ = s.create_run(new_run())
    s.close()
    again = SQLStore(store_url, create=False)
    assert again.get_run(stored.id) == stored
    again.close()


def test_open__migrations_build_exactly_the_schema_module(store_url: str) -> None:
    """A database created by the Alembic revisions has every table, column and index that
    flowloop/store/schema.py declares, and nothing else (else: `flowloop db revision`)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from flowloop.store.schema import metadata

    store = SQLStore(store_url)
    try:
        with store.engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"version_table": migrate.VERSION_TABLE}
            )
            assert compare_metadata(context, metadata) == []
    finally:
        store.close()


# -- SQLite specifics ---------------------------------------------------------------------


def test_sqlite_file__created_readable_by_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    old = os.umask(0)  # even a permissive umask gives 0600
    try:
        SQLStore(f"sqlite:///{path}").close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_sqlite_file__wal_normal_by_default_full_on_request(tmp_path: Path) -> None:
    for mode, expected in (("NORMAL", 1), ("FULL", 2)):
        s = SQLStore(f"sqlite:///{tmp_path / mode}.db", synchronous=mode)
        with s.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == expected
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() >= 1000
        s.close()
    with pytest.raises(StoreError, match="not a SQLite mode"):
        SQLStore(f"sqlite:///{tmp_path / 'x.db'}", synchronous="SOMETIMES")


OPENERS = 3
ROUNDS = 20


def _open_new_databases_together(urls: list[str], barrier: Any, go: Any, errors: Any) -> None:
    """Child process: for each URL, wait for every opener, then open it at the same instant
    (CLOCK_MONOTONIC is one clock for all processes; a barrier alone wakes them too far
    apart to collide often)."""
    for url in urls:
        if barrier.wait() == 0:
            go.value = time.monotonic() + 0.02
        barrier.wait()
        while time.monotonic() < go.value:
            pass
        try:
            SQLStore(url).close()
        except StoreError as error:
            errors.put(str(error))


def open_together(urls: list[str]) -> None:
    """OPENERS processes open each new database at the same instant; all must succeed."""
    spawn = multiprocessing.get_context("spawn")
    barrier, go, errors = spawn.Barrier(OPENERS), spawn.Value("d", 0.0), spawn.Queue()
    openers = [
        spawn.Process(target=_open_new_databases_together, args=(urls, barrier, go, errors))
        for _ in range(OPENERS)
    ]
    for opener in openers:
        opener.start()
    for opener in openers:
        opener.join(timeout=60)
    assert [opener.exitcode for opener in openers] == [0] * OPENERS
    failures = [errors.get() for _ in range(errors.qsize())]
    assert not failures, failures


def test_sqlite_file__processes_opening_a_new_file_together_all_succeed(tmp_path: Path) -> None:
    """Two workers (or a worker and `flowloop status`) starting on one new file: all of them
    open it; none fails with "database is locked" while another switches it to WAL."""
    paths = [str(tmp_path / f"new{n}.db") for n in range(ROUNDS)]
    open_together([f"sqlite:///{path}" for path in paths])
    for path in paths:
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
            assert conn.execute(f"SELECT count(*) FROM {migrate.VERSION_TABLE}").fetchone() == (1,)
        conn.close()


def test_postgres__processes_opening_a_new_schema_together_all_succeed(pg_url: str) -> None:
    """Workers started together on a new schema: one creates the tables, the others wait
    for it and use them (none fails on "relation already exists")."""
    admin = sa.create_engine(pg_url)
    schemas = [f"{pg_url[-8:]}_{n}" for n in range(ROUNDS // 2)]  # this test's own names

    def url_of(schema: str) -> str:
        url = sa.make_url(pg_url).update_query_dict({"options": f"-csearch_path=s{schema}"})
        return url.render_as_string(hide_password=False)

    try:
        with admin.begin() as conn:
            for schema in schemas:
                conn.exec_driver_sql(f'CREATE SCHEMA "s{schema}"')
        open_together([url_of(schema) for schema in schemas])
        with admin.begin() as conn:
            for schema in schemas:
                version = f's{schema}".{migrate.VERSION_TABLE}'
                assert conn.exec_driver_sql(f'SELECT count(*) FROM "{version}').scalar() == 1
    finally:
        with admin.begin() as conn:
            for schema in schemas:
                conn.exec_driver_sql(f'DROP SCHEMA IF EXISTS "s{schema}" CASCADE')
        admin.dispose()


def test_sqlite_file__not_sqlite_refused(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello, I am not a database\n")
    with pytest.raises(StoreError, match="not a SQLite database"):
        SQLStore(f"sqlite:///{path}")


def test_sqlite_file__foreign_tables_alone_refused(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER)")
    conn.close()
    with pytest.raises(StoreError, match="not a flowloop database"):
        SQLStore(str(path))  # a bare path is a SQLite file


def test_sqlite_file__missing_directory_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        SQLStore(f"sqlite:///{tmp_path / 'nope' / 'x.db'}")


def _libpq_parameters(url: str) -> dict[str, str]:
    store = SQLStore(url)
    try:
        with store.engine.connect() as conn:
            parameters: dict[str, str] = conn.connection.driver_connection.info.get_parameters()
            return parameters
    finally:
        store.close()


def test_postgres__connections_give_up_on_a_silent_server(pg_url: str) -> None:
    """A partitioned or dead server fails a call within seconds instead of hanging the
    worker's event loop for the OS's TCP timeouts; the URL's own settings win."""
    parameters = _libpq_parameters(pg_url)
    assert {name: parameters.get(name) for name in ("connect_timeout", "tcp_user_timeout")} == {
        "connect_timeout": "5",
        "tcp_user_timeout": "15000",
    }
    assert parameters.get("keepalives") == "1"
    assert parameters.get("keepalives_idle") == "10"
    tuned = _libpq_parameters(f"{pg_url}&keepalives_idle=30&tcp_user_timeout=2000")
    assert (tuned.get("keepalives_idle"), tuned.get("tcp_user_timeout")) == ("30", "2000")


def test_open__unknown_backend_refused() -> None:
    with pytest.raises(StoreError, match="unsupported database"):
        SQLStore("mysql://u:secret@host/db")


# -- helpers ------------------------------------------------------------------------------


class Counted:
    def __init__(self) -> None:
        self.count = 0
        self.result: Any = None


class _CountedCursor:
    """A driver cursor whose calls are counted (an executemany is one call)."""

    def __init__(self, cursor: Any, counted: Counted) -> None:
        self._cursor = cursor
        self._counted = counted

    def execute(self, *args: Any) -> Any:
        self._counted.count += 1
        return self._cursor.execute(*args)

    def executemany(self, *args: Any) -> Any:
        self._counted.count += 1
        return self._cursor.executemany(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


class _CountedDriver:
    """The store's real driver connection, its cursors' calls and commits counted."""

    def __init__(self, raw: Any, counted: Counted) -> None:
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_counted", counted)

    def cursor(self) -> _CountedCursor:
        return _CountedCursor(self._raw.cursor(), self._counted)

    def commit(self) -> None:
        self._counted.count += 1
        self._raw.commit()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __setattr__(self, name: str, value: Any) -> None:  # ``autocommit`` (psycopg)
        setattr(self._raw, name, value)


def count_statements(store: SQLStore, action: Any) -> Counted:
    """Run ``action`` and count the statements the store sent to the database: through its
    SQLAlchemy engine, and on the driver connection of its precompiled paths (one per
    execute or executemany, plus commits)."""
    counted = Counted()

    def before(*_: Any) -> None:
        counted.count += 1

    real_driver_of = store._driver_of
    real_executed_pg = store._executed_pg

    def counted_driver_of(conn: Any) -> Any:
        # Every precompiled path takes its driver connection here (_driver, _immediate,
        # _execute_alone): their cursors are made from it while counting (the kept one is
        # dropped before and after, so that none outlives the count).
        return _CountedDriver(real_driver_of(conn), counted)

    def counted_executed_pg(raw: Any, stmt: Any, params: Any) -> Any:
        # PostgreSQL's one-statement writes, on the store's kept RawCursor: counted here,
        # executed on the real connection (the cursor outlives this count)
        counted.count += 1
        return real_executed_pg(getattr(raw, "_raw", raw), stmt, params)

    sa.event.listen(store.engine, "before_cursor_execute", before)
    store._driver_cursor = None
    store._driver_of = counted_driver_of  # type: ignore[method-assign]
    store._executed_pg = counted_executed_pg  # type: ignore[method-assign]
    try:
        counted.result = action()
    finally:
        del store._driver_of
        del store._executed_pg
        store._driver_cursor = None
        sa.event.remove(store.engine, "before_cursor_execute", before)
    return counted


def test_open__postgres_refusals_say_what_the_server_said(pg_url: str) -> None:
    """A database that does not exist and an unknown role were both "the database server
    is unreachable" (libpq gives no SQLSTATE for a refused connection); a search_path
    naming no existing schema was told `flowloop db upgrade` would create the tables,
    which it could not."""
    from conftest import pg_base_url, with_search_path

    base = sa.make_url(pg_base_url())
    with pytest.raises(StoreError, match="the database does not exist"):
        SQLStore(base.set(database="flowloop_no_such_db").render_as_string(hide_password=False))
    with pytest.raises(StoreError, match="refused the credentials"):
        SQLStore(base.set(username="flowloop_no_such_role").render_as_string(hide_password=False))
    nowhere = with_search_path(pg_base_url(), "flowloop_no_such_schema")
    with pytest.raises(StoreError, match=r"no schema of its search_path exists: create one"):
        SQLStore(nowhere, create=False)
    with pytest.raises(StoreError, match=r"no schema of its search_path exists: create it first"):
        SQLStore(nowhere)
