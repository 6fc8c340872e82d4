"""Claims read only what they take (migration 0017, flowloop/store/claims.py).

A worker's claim, a limited workflow's claim, the look at the next due time and the look
for stranded waits used to read every claimable run of the workflows, runs due tomorrow
included (a durable ``step.sleep``, a wait with a timeout, a start for later): with
50,000 runs asleep an empty poll cost 7.4 ms on SQLite, and with 20,000 due each claim of
ten 11.5 ms (bench/due_backlog.py). The due index now holds a status and workflow's runs
in claim order, and the statements read it a (status, workflow, priority) segment at a
time. These tests hold the claim's order, its locks and the next due time on both
databases, the work of the statements against the runs they need not read, the
statements a claim sends, and the migration."""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import time
from typing import Any

import pytest
import sqlalchemy as sa
from storekit import (
    FINGERPRINT,
    copy_run_pg,
    new_run,
    past,
    pg_rows_read,
    start_step,
    to_revision,
)

from flowloop import journal as j
from flowloop.parking import _stranded_query
from flowloop.store import Boundary, SQLStore, StoredRun, built, claims
from flowloop.store.limits import ClaimLimits

LATER = 3600.0


def _run_id(name: str) -> str:
    """An id that sorts like ``name`` (ties between equal due times go by id)."""
    return name.encode().hex().ljust(32, "0")


def _scheduled(
    store: SQLStore, name: str, *, priority: int, due: float, workflow: str = "w"
) -> StoredRun:
    stored, created = store.create_run(
        new_run(_run_id(name), priority=priority, due=due, workflow=workflow)
    )
    assert created
    return stored


def _retrying(
    store: SQLStore, name: str, *, priority: int, due: float, workflow: str = "w"
) -> StoredRun:
    """A run whose step failed and waits to be tried again at ``due`` (status retrying)."""
    created = _scheduled(store, name, priority=priority, due=past(), workflow=workflow)
    [claimed] = store.claim(
        worker="first", now=time.time(), limit=1, lease_seconds=30, run_ids=[created.id]
    )
    started = start_step(claimed, "first")
    assert store.write([started]) == [True]
    record = started.record
    failed = j.JournalEvent(
        run_id=record.id,
        seq=record.last_seq + 1,
        kind=j.STEP_FAILED,
        at=time.time(),
        state=record.state,
        attempt=record.attempt,
        error_type="Flaky",
        error_message="try again",
        data={"retry_at": due},
    )
    after = j.apply(record, failed)
    assert after.status == "retrying"
    boundary = Boundary(events=[failed], record=after, fence=started.fence, release=True)
    assert store.write([boundary]) == [True]
    row = store.get_run(record.id)
    assert row is not None and row.record.status == "retrying" and row.owner is None
    return row


def _claimed_in_turns(store: SQLStore, limit: int, workflows: list[str]) -> list[list[str]]:
    turns = []
    for _ in range(100):  # (a claim that took nothing for good would loop: bounded)
        rows = store.claim(
            worker="me", now=time.time(), limit=limit, lease_seconds=30, workflows=workflows
        )
        turns.append([row.id for row in rows])
        if not rows:
            return turns
    raise AssertionError(f"claims never ran out: {turns[:3]}")


@pytest.mark.parametrize("limit", [1, 2, 10])
@pytest.mark.parametrize("workflows", [["w"], ["w", "v"]], ids=["one workflow", "two"])
def test_claims_take_due_runs_by_priority_then_due_time_then_id_across_statuses(
    store: SQLStore, limit: int, workflows: list[str]
) -> None:
    _claims_in_order(store, limit, workflows)


@pytest.mark.parametrize("limit", [1, 2, 10])
def test_a_limited_claim_without_keys_takes_due_runs_in_the_same_order(
    store: SQLStore, limit: int
) -> None:
    """A workflow with ``max_concurrency`` alone: its claim counts slots, and reads its due
    runs a segment at a time up to its window, in claim order."""
    store.set_claim_limits({"w": ClaimLimits(max_concurrency=1000)})
    _claims_in_order(store, limit, ["w"])


def test_a_limited_claims_window_is_the_first_due_runs_in_claim_order(store: SQLStore) -> None:
    """More due runs than a limited claim's window (36 for a claim of one): the window is
    each segment's first runs, in claim order — the higher priority, then the earlier due
    time, whichever was queued first or is due earliest."""
    store.set_claim_limits({"w": ClaimLimits(max_concurrency=1000)})
    base = past()
    for n in range(60):
        _scheduled(store, f"low{n:02d}", priority=0, due=base - 1000 + n)
    for n in range(2):
        _retrying(store, f"retry-low{n}", priority=0, due=base - 1000 + n)
    high = [
        _scheduled(store, "high-late", priority=5, due=base - 10),
        _scheduled(store, "high-early", priority=5, due=base - 20),
        _retrying(store, "high-retry", priority=5, due=base - 15),
    ]
    turns = _claimed_in_turns(store, 1, ["w"])
    firsts = [high[1].id, high[2].id, high[0].id, _run_id("low00"), _run_id("retry-low0")]
    assert turns[:5] == [[run_id] for run_id in firsts]
    assert len(turns) == 66 and turns[-1] == []


def test_a_limited_claim_without_keys_orders_runs_an_earlier_definition_keyed_by_due_time(
    store: SQLStore,
) -> None:
    """A run keeps the key (and its place in the key's queue) that an earlier definition
    gave it. Once the workflow has no key, the claim takes runs by priority and due time:
    the keyed run is not put before an older run for being its key's first."""
    store.set_claim_limits({"w": ClaimLimits(max_concurrency=1000)})
    base = past()
    first = _scheduled(store, "u1", priority=0, due=base - 30)
    second = _scheduled(store, "u2", priority=0, due=base - 20)
    stored, created = store.create_run(
        dataclasses.replace(new_run(_run_id("k1"), due=base - 10), limit_key="k")
    )
    assert created and stored.record.status == "scheduled"
    turns = _claimed_in_turns(store, 2, ["w"])
    assert turns == [[first.id, second.id], [stored.id], []]


def _claims_in_order(store: SQLStore, limit: int, workflows: list[str]) -> None:
    base = past()
    soon = time.time() + LATER
    last = workflows[-1]  # with two workflows, every other run is of the second
    expected = [
        _scheduled(store, "s7", priority=7, due=base),
        _retrying(store, "r2", priority=2, due=base - 5, workflow=last),
        _retrying(store, "r0", priority=0, due=base - 40),
        _scheduled(store, "s0b", priority=0, due=base - 30, workflow=last),
        _retrying(store, "s0c", priority=0, due=base - 30),  # a tie across statuses: by id
        _scheduled(store, "s-3", priority=-3, due=base - 100, workflow=last),
    ]
    tie = _scheduled(store, "s0a", priority=0, due=base - 30)  # created last, sorts first
    expected.insert(3, tie)
    # Never claimed here: due later (whatever their priority), another workflow's, or
    # held by a live lease.
    _scheduled(store, "later9", priority=9, due=soon)
    _retrying(store, "later-r9", priority=9, due=soon, workflow=last)
    _scheduled(store, "other", priority=9, due=base - 1000, workflow="other")
    held = _scheduled(store, "held", priority=9, due=base - 1000, workflow=last)
    store.claim(worker="holder", now=time.time(), limit=1, lease_seconds=60, run_ids=[held.id])

    turns = _claimed_in_turns(store, limit, workflows)

    assert [run_id for turn in turns for run_id in turn] == [run.id for run in expected]
    assert [len(turn) for turn in turns[:-1]] == [limit] * (len(turns) - 2) + [
        len(expected) - limit * (len(turns) - 2)
    ]


def test_next_due_is_the_earliest_due_time_of_the_workflows_claimable_runs(
    store: SQLStore,
) -> None:
    now = time.time()
    assert store.next_due(workflows=["w"]) is None
    _scheduled(store, "a", priority=5, due=now + 300)
    assert store.next_due(workflows=["w"]) == pytest.approx(now + 300, abs=1e-3)
    _retrying(store, "b", priority=-1, due=now + 200)
    _scheduled(store, "c", priority=0, due=now + 250)
    _scheduled(store, "d", priority=9, due=now + 100, workflow="other")
    assert store.next_due(workflows=["w"]) == pytest.approx(now + 200, abs=1e-3)
    assert store.next_due(workflows=["other"]) == pytest.approx(now + 100, abs=1e-3)
    assert store.next_due(workflows=["w", "other"]) == pytest.approx(now + 100, abs=1e-3)
    assert store.next_due() == pytest.approx(now + 100, abs=1e-3)
    assert store.next_due(workflows=["none"]) is None


# -- SQLite's work ---------------------------------------------------------------------------


def _fill(url: str, *, later: int, due: int, others: int = 0) -> None:
    """``later`` runs of workflow ``w`` due in an hour and ``due`` due now, over two
    priorities, and ``others`` runs of workflow ``other`` due now, written by SQL (a copy
    of one run per row: the test is about reading them)."""
    with contextlib.closing(SQLStore(url)) as store:
        template = _scheduled(store, "template", priority=0, due=past())
    copies = [(f"{n:032x}", "w", n % 2, time.time() + LATER) for n in range(later)]
    copies += [(f"{later + n:032x}", "w", n % 2, past()) for n in range(due)]
    copies += [(f"{later + due + n:032x}", "other", 0, past() - 60) for n in range(others)]
    with contextlib.closing(sqlite3.connect(url.removeprefix("sqlite:///"))) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(flowloop_runs)")]
        kept = [c for c in columns if c not in ("id", "workflow", "priority", "next_run_at")]
        conn.executemany(
            f"INSERT INTO flowloop_runs (id, workflow, priority, next_run_at, {', '.join(kept)})"
            f" SELECT ?, ?, ?, ?, {', '.join(kept)} FROM flowloop_runs WHERE id = ?",
            [(*copy, template.id) for copy in copies],
        )
        conn.commit()


def _steps(url: str, statement: Any, params: dict[str, Any]) -> tuple[int, list[Any]]:
    """SQLite's virtual machine instructions (in tens) to run ``statement``, and its rows;
    in a transaction rolled back, so the database stays as it was. (Begun by hand: the
    driver begins one itself only before a statement that opens with INSERT, UPDATE,
    DELETE or REPLACE, and a claim opens with WITH — it was committed.)"""
    engine = sa.create_engine(url, poolclass=sa.NullPool, connect_args={"isolation_level": None})
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return 0

    try:
        with engine.connect() as conn:
            raw = conn.connection.dbapi_connection
            assert isinstance(raw, sqlite3.Connection)
            raw.set_progress_handler(count, 10)
            with conn.begin() as transaction:
                conn.exec_driver_sql("BEGIN")
                rows = list(conn.execute(statement, params))
                transaction.rollback()
            assert raw.in_transaction is False
            raw.set_progress_handler(None, 0)
    finally:
        engine.dispose()
    return counted[0], rows


def _claims_and_next_due(url: str) -> dict[str, tuple[int, list[Any]]]:
    """The instructions of the claims a worker polls with (ten runs of workflow ``w``; the
    same workflow with a limit) and of ``run_until_idle``'s next due time, as the store
    sends them."""
    with contextlib.closing(SQLStore(url)) as store:
        claim = store._claim_statement("due", True, False, False, 1)
        store.set_claim_limits({"w": ClaimLimits(max_concurrency=1000)})
        limited = store._limited_statement(False, False, False)
        keyed = store._limited_statement(False, False, True)
    next_due = built.next_due(
        by_workflow=True, by_id=False, postgres=False, looked_up=False, segmented=1
    )
    claiming = {"p_worker": "me", "p_lease": 30.0, "p_limit": 10, "p_now": time.time()}
    limits = {"p_workflow": "w", "p_max": 1000, "p_key_limit": 1000, "p_scan": 72}
    limits["p_examine"] = claims.examined(10)
    stranded = {"name": "w", "loaded": [FINGERPRINT], "batch": 1000}
    return {
        "look for stranded waits": _steps(url, _stranded_query(postgres=False), stranded),
        "claim": _steps(url, claim, {**claiming, "p_w0": "w"}),
        "limited claim": _steps(url, limited, {**claiming, **limits}),
        "keyed claim": _steps(url, keyed, {**claiming, **limits}),
        "next due": _steps(url, next_due, {"p_w0": "w"}),
    }


def test_sqlite_claims_and_next_due_read_no_run_they_do_not_need(tmp_path: Any) -> None:
    """The same statements on a small database (20 runs of workflow ``w`` due later, 100 due
    now: more than a limited claim's window of 72) and on ones with 4,000 runs due later,
    4,000 due now, or 4,000 runs of another workflow due first: each claim takes ten every
    time, and does no more work for
    the runs due later or the other workflow's, nor for the due runs it leaves. Before, the
    claim and the next due time read all 8,000 runs of ``w``: 39 and 116 times the
    instructions; the limited claim of a workflow without keys 14 times, and one with keys
    6.5 times (each ranked every due run; with keys, test_keyed_claims.py)."""
    sizes = {"small": (20, 100, 0), "later": (4000, 20, 0), "due": (4000, 4000, 0)}
    sizes["others"] = (20, 20, 4000)
    urls = {name: f"sqlite:///{tmp_path / name}.db" for name in sizes}
    for name, (later, due, others) in sizes.items():
        _fill(urls[name], later=later, due=due, others=others)
    steps = {name: _claims_and_next_due(url) for name, url in urls.items()}
    for found in steps.values():
        claimed = [found[name][1] for name in ("claim", "limited claim", "keyed claim")]
        assert [len(rows) for rows in claimed] == [10, 10, 10]
        # (the same runs: without keys, a key's place in its queue orders nothing)
        assert {row.id for row in claimed[1]} == {row.id for row in claimed[2]}
        assert found["next due"][1][0][0] <= time.time()
    flat = {
        (statement, db): (steps["small"][statement][0], steps[db][statement][0])
        for statement in steps["small"]
        for db in sizes
        if db != "small"
    }
    grew = {name: steps for name, steps in flat.items() if steps[1] > 1.5 * steps[0] + 20}
    assert grew == {}, flat


def _pg_fill(store: SQLStore, *, later: int, due: int) -> None:
    """``later`` runs of workflow ``w`` due in an hour and ``due`` due now, copies of one run
    over two priorities (statistics analyzed, as autovacuum keeps them)."""
    template = _scheduled(store, f"template{later}-{due}", priority=0, due=past())
    changed = {"id": "md5(g::text)", "priority": "mod(g, 2)"}
    changed["next_run_at"] = f"CASE WHEN g <= {later} THEN {time.time() + LATER} ELSE {past()} END"
    copy_run_pg(store, template.id, later + due, changed)


def _pg_work(store: SQLStore) -> dict[str, int]:
    """The rows the claim a worker polls with (ten runs of workflow ``w``) and the look at
    the next due time read."""
    claim = store._claim_statement("due", True, False, False, 0)
    next_due = built.next_due(
        by_workflow=True, by_id=False, postgres=True, looked_up=False, segmented=0
    )
    store.set_claim_limits({"w": ClaimLimits(max_concurrency=1000)})
    limited = store._limited_statement(False, False, False)
    keyed = store._limited_statement(False, False, True)
    claiming = {"p_worker": "me", "p_lease": 30.0, "p_limit": 10, "p_now": time.time()}
    limits = {"p_workflow": "w", "p_max": 1000, "p_key_limit": 1000, "p_scan": 72}
    limits["p_examine"] = claims.examined(10)
    return {
        "claim": pg_rows_read(store, claim, {**claiming, "p_workflows": ["w"], "p_scan": 72}),
        "limited claim": pg_rows_read(store, limited, {**claiming, **limits}),
        "keyed claim": pg_rows_read(store, keyed, {**claiming, **limits}),
        "next due": pg_rows_read(store, next_due, {"p_workflows": ["w"]}),
    }


def test_postgres_claims_and_next_due_read_no_run_they_do_not_need(pg_url: str) -> None:
    """PostgreSQL's own plans read every claimable run of the workflows, analyzed or not:
    with 50,000 runs asleep, 2.0 ms an empty claim and 7.5 ms a look at the next due time;
    with 20,000 due, 21.8 ms a claim of ten (``EXPLAIN ANALYZE``). Read a segment at a
    time, with 4,000 runs due later and 4,000 due now, the claim of ten reads at most 400
    rows (51 beside 4,000 due later, 298 with 4,000 due too: a window of 72 in each of two
    segments, read, then locked by key) and the look at most 10 (2), where the old plans
    read every claimable run (4,031 and 8,011). A limited claim reads at most 400 too (154
    with 4,000 due, without keys), also that of a workflow with keys, whose runs here have
    none (it ranked every due run: 8,011; with keys, test_keyed_claims.py)."""
    found: dict[str, dict[str, int]] = {}
    sizes = {"small": (20, 20), "later": (4000, 20), "due": (4000, 4000)}
    for name, (later, due) in sizes.items():
        store = SQLStore(pg_url)
        try:
            with store.engine.begin() as conn:
                conn.exec_driver_sql("DELETE FROM flowloop_runs")
            _pg_fill(store, later=later, due=due)
            assert store.next_due(workflows=["w"]) is not None
            found[name] = _pg_work(store)
        finally:
            store.close()
    # (On the small table PostgreSQL may well scan it whole: cheaper than an index there.)
    big = [found["later"], found["due"]]
    assert all(rows["claim"] <= 400 and rows["next due"] <= 10 for rows in big), found
    assert all(rows["limited claim"] <= 400 and rows["keyed claim"] <= 400 for rows in big), found


def _no_lock_waits(connection: Any, _: Any) -> None:
    with connection.cursor() as cursor:  # a claim that waited for a lock fails, not hangs
        cursor.execute("SET lock_timeout = '5s'")
    connection.commit()


def test_postgres_claim_skips_runs_another_claimer_holds(pg_url: str) -> None:
    """The claim locks the runs it takes in claim order, skipping those another transaction
    holds: with the first five held, a claim of five takes the next five, in order."""
    store = SQLStore(pg_url)
    sa.event.listen(store.engine, "connect", _no_lock_waits)  # (gone with the engine)
    store.set_write_lease(30.0)  # (the held write connection made again, with the timeout)
    try:
        base = past()
        ids = [_scheduled(store, f"q{n:02d}", priority=0, due=base + n).id for n in range(12)]
        with store.engine.connect() as holder:
            held = holder.execute(
                sa.text("SELECT id FROM flowloop_runs WHERE id = ANY(:ids) ORDER BY id FOR UPDATE"),
                {"ids": ids[:5]},
            ).scalars()
            assert sorted(held) == sorted(ids[:5])
            taken = store.claim(
                worker="me", now=time.time(), limit=5, lease_seconds=30, workflows=["w"]
            )
            assert [run.id for run in taken] == ids[5:10]
            holder.rollback()
        rest = store.claim(
            worker="me", now=time.time(), limit=10, lease_seconds=30, workflows=["w"]
        )
        assert [run.id for run in rest] == ids[:5] + ids[10:]
    finally:
        store.close()


def test_postgres_claim_locks_only_the_runs_it_takes(pg_url: str) -> None:
    """Due runs in two priorities of two workflows (four segments): a claim of three, its
    transaction still open, holds those three runs and no other; a second claimer takes
    the next three meanwhile."""
    store = SQLStore(pg_url)
    sa.event.listen(store.engine, "connect", _no_lock_waits)
    store.set_write_lease(30.0)
    try:
        base = past()
        for n in range(12):
            workflow, priority = ("w", "v")[n % 2], (0, 5)[n // 6]
            _scheduled(store, f"m{n:02d}", priority=priority, due=base + n, workflow=workflow)
        claim = store._claim_statement("due", True, False, False, 0)
        params = {"p_worker": "first", "p_lease": 30.0, "p_now": time.time()}
        params |= {"p_limit": 3, "p_scan": claims.window(3), "p_workflows": ["w", "v"]}
        with store.engine.connect() as first:
            taken = {row.id for row in first.execute(claim, params)}
            assert len(taken) == 3
            with store.engine.connect() as looking:
                lockable = looking.execute(
                    sa.text(
                        "SELECT id FROM flowloop_runs WHERE next_run_at IS NOT NULL "
                        "FOR UPDATE SKIP LOCKED"
                    )
                ).scalars()
                assert len(set(lockable)) == 12 - 3
                looking.rollback()
            second = store.claim(
                worker="second", now=time.time(), limit=3, lease_seconds=30, workflows=["w", "v"]
            )
            # the three highest of what is left: priority 5, the earliest due
            assert [run.id for run in second] == [_run_id(f"m{n:02d}") for n in (9, 10, 11)]
            assert taken == {_run_id(f"m{n:02d}") for n in (6, 7, 8)}
            first.rollback()
    finally:
        store.close()


def _sent(store: SQLStore, call: Any) -> list[str]:
    """The statements ``call`` sends to the database."""
    sent: list[str] = []

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    sa.event.listen(store.engine, "before_cursor_execute", seen)
    try:
        call()
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", seen)
    return sent


def test_a_workers_claim_and_look_at_the_next_due_time_are_read_by_segment(
    store: SQLStore,
) -> None:
    """What ``SQLStore.claim`` and ``next_due`` send when workflows are named: the segment
    statements (SQLite: each workflow a parameter of its own; PostgreSQL: the workflows
    one array, a lateral scan per segment). A workflow named twice is one segment: the
    claim still takes its limit."""
    for n in range(12):
        _scheduled(store, f"d{n:02d}", priority=n % 3, due=past() + n)
    claiming = {"worker": "me", "now": time.time(), "lease_seconds": 30.0}
    taken: list[StoredRun] = []
    sent = _sent(
        store, lambda: taken.extend(store.claim(limit=10, workflows=["w", "w"], **claiming))
    )
    sent += _sent(store, lambda: store.next_due(workflows=["w", "w"]))
    postgres = store.engine.dialect.name == "postgresql"
    segmented = [text for text in sent if ("LATERAL" if postgres else "INDEXED BY") in text]
    assert len(segmented) == (1 if postgres else 2), sent
    if not postgres:  # one workflow named: no segment of a second one
        assert not any("p1_p_w1" in text for text in segmented), segmented
    assert len(taken) == 10
    assert len(store.claim(limit=10, workflows=["w", "w"], **claiming)) == 2


def test_sqlite_names_up_to_64_workflows_in_segments_and_more_in_one_list(
    sqlite_url: str,
) -> None:
    """65 workflows: past SQLite's compound terms a segment statement would need, the
    claim takes the plain statement, and claims in the same order."""
    with contextlib.closing(SQLStore(sqlite_url)) as store:
        names = [f"wf{n:02d}" for n in range(65)]
        base = past() - 100
        for n, name in enumerate(names):
            _scheduled(store, f"x{n:02d}", priority=n % 2, due=base + n, workflow=name)
        claiming = {"worker": "me", "now": time.time(), "lease_seconds": 30.0}
        sent = _sent(store, lambda: store.claim(limit=1, workflows=names[:64], **claiming))
        assert any("INDEXED BY" in text for text in sent), sent
        sent = _sent(store, lambda: store.claim(limit=1, workflows=names, **claiming))
        assert not any("INDEXED BY" in text for text in sent), sent
        rest = store.claim(limit=100, workflows=names, **claiming)
        expected = [f"x{n:02d}" for n in range(1, 65, 2)] + [f"x{n:02d}" for n in range(0, 65, 2)]
        assert [run.id for run in rest] == [_run_id(name) for name in expected][2:]


def test_sqlite_claim_plan_walks_the_due_index_by_segment(sqlite_url: str) -> None:
    """As SQLite plans the claim a worker sends: each status's segment searched on the due
    index by status, workflow and priority, up to the time asked for."""
    sent: list[tuple[str, Any]] = []

    def seen(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.startswith("UPDATE flowloop_runs") and "RETURNING" in statement:
            sent.append((statement, parameters))

    with contextlib.closing(SQLStore(sqlite_url)) as store:
        _scheduled(store, "a", priority=0, due=past())
        sa.event.listen(store.engine, "before_cursor_execute", seen)
        try:
            claimed = store.claim(
                worker="me", now=time.time(), limit=10, lease_seconds=30, workflows=["w"]
            )
        finally:
            sa.event.remove(store.engine, "before_cursor_execute", seen)
        assert len(claimed) == 1 and len(sent) == 1
        statement, parameters = sent[0]
        with store.engine.connect() as conn:
            plan = [
                row[3]
                for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
            ]
    segments = [
        step
        for step in plan
        if "ix_flowloop_runs_due (status=? AND workflow=? AND priority=?" in step
    ]
    assert len(segments) == 2, plan
    assert all("next_run_at<?" in step for step in segments), plan


# -- the migration ---------------------------------------------------------------------------


def _index(url: str, name: str) -> str | None:
    """The index ``name``'s definition, as the database keeps it (``None``: none)."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    query = (
        "SELECT sql FROM sqlite_master WHERE name = :name"
        if engine.dialect.name == "sqlite"
        else "SELECT indexdef FROM pg_indexes"
        " WHERE schemaname = current_schema() AND indexname = :name"
    )
    try:
        with engine.connect() as conn:
            found = conn.execute(sa.text(query), {"name": name}).scalar_one_or_none()
            return None if found is None else str(found)
    finally:
        engine.dispose()


def _due_index(url: str) -> str:
    found = _index(url, "ix_flowloop_runs_due")
    assert found is not None
    return found


def _columns(definition: str) -> list[str]:
    inside = definition[definition.index("(") + 1 : definition.index(")")]
    return [column.strip().strip('"') for column in inside.split(",")]


def test_upgrade_puts_the_due_index_in_claim_order_and_keeps_runs_claimable(
    store_url: str,
) -> None:
    SQLStore(store_url).close()  # a new database, at the head
    to_revision(store_url, "0016")
    assert _columns(_due_index(store_url)) == ["status", "priority", "next_run_at"]
    with contextlib.closing(SQLStore(store_url, check_schema=False)) as old:
        low = _scheduled(old, "low", priority=0, due=past() - 10)
        high = _scheduled(old, "high", priority=3, due=past())
        _scheduled(old, "later", priority=9, due=time.time() + LATER)
    to_revision(store_url, "head")
    definition = _due_index(store_url)
    assert _columns(definition) == ["status", "workflow", "priority DESC", "next_run_at", "id"]
    assert "next_run_at IS NOT NULL" in definition.replace("(", "").replace(")", "")
    assert _index(store_url, "ix_flowloop_runs_waiting") is not None
    with contextlib.closing(SQLStore(store_url)) as store:
        assert store.next_due(workflows=["w"]) == pytest.approx(low.record.next_run_at, abs=1e-3)
        rows = store.claim(worker="me", now=time.time(), limit=5, lease_seconds=30, workflows=["w"])
        assert [row.id for row in rows] == [high.id, low.id]
        with store._read() as conn:
            query = _stranded_query(postgres=store.engine.dialect.name == "postgresql")
            looked = conn.execute(query, {"name": "w", "loaded": ["other"], "batch": 10})
            assert looked.all() == []  # (no run waits without a due time)
    to_revision(store_url, "0016")
    assert _columns(_due_index(store_url)) == ["status", "priority", "next_run_at"]
    assert _index(store_url, "ix_flowloop_runs_waiting") is None
