"""A limited claim of a workflow with a ``concurrency_key`` reads a window of its claimable
runs from the keyed due index (migration 0018, flowloop/store/claims.py ``keyed_window``)
instead of every due run of the workflow: it takes what the ranked read of every due run
took, and its work does not grow with the queue.

The order the claim keeps (flowloop/store/limits.py): among the first ``p_scan`` due runs
that are free (nobody holds them, their key is below its limit) by priority, then their
key's place in its queue, then due time, each key's oldest (by creation, runs without a
key by due time) go first, up to its limit — not its earliest due (a run retried or
recovered is due later than the runs queued after it) nor its smallest place (a place is
not monotonic: tests/integration/test_key_order.py); then by priority, turn (that rank
plus the key's runs held; runs without a key or a place first), place, that rank, due
time, up to the claim's limit and the workflow's ``max_concurrency``.
:func:`_expected` is that order written in Python."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import sqlite3
import time
from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa
from storekit import copy_run_pg, new_run, past, pg_rows_read

from flowloop.store import SQLStore, StoredRun, claims
from flowloop.store.limits import UNLIMITED, ClaimLimits
from flowloop.store.schema import runs

LATER = 3600.0


def _create(store: SQLStore, n: int, *, key: str | None, priority: int, due: float) -> StoredRun:
    made = dataclasses.replace(
        new_run(f"{n:08d}".ljust(32, "0"), priority=priority, due=due), limit_key=key
    )
    stored, created = store.create_run(made)
    assert created
    return stored


@dataclasses.dataclass(frozen=True)
class _Run:
    id: str
    status: str
    priority: int
    next_run_at: float | None
    owner: str | None
    limit_key: str | None
    limit_rank: int | None
    created_at: float


def _rows(store: SQLStore) -> list[_Run]:
    fields = [f.name for f in dataclasses.fields(_Run)]
    with store.engine.connect() as conn:
        found = conn.execute(sa.select(*[runs.c[name] for name in fields]))
        return [_Run(*row) for row in found]


def _expected(rows: list[_Run], *, now: float, limit: int, spec: ClaimLimits) -> set[str]:
    """The runs the claim takes, by the rules of the module's docstring (every lease in
    these tests runs for a minute: a run with an owner is held)."""
    key_limit = spec.key_limit or UNLIMITED
    held = [r for r in rows if r.owner is not None]
    per_key = Counter(r.limit_key for r in held if r.limit_key is not None)
    free = [
        r
        for r in rows
        if r.status in ("scheduled", "retrying")
        and r.next_run_at is not None
        and r.next_run_at <= now
        and r.owner is None
        and per_key[r.limit_key] < key_limit
    ]

    def place(r: _Run) -> int:
        return r.limit_rank or 0

    def due(r: _Run) -> float:
        assert r.next_run_at is not None
        return r.next_run_at

    def queued(r: _Run) -> float:
        return due(r) if r.limit_key is None else r.created_at

    window = sorted(free, key=lambda r: (-r.priority, place(r), due(r), r.id))
    window = window[: claims.window(limit)]
    rank: dict[str, int] = {}
    seen: Counter[str | None] = Counter()
    for r in sorted(window, key=lambda r: (-r.priority, queued(r), r.id)):
        seen[r.limit_key] += 1
        rank[r.id] = seen[r.limit_key]
    passing = [r for r in window if rank[r.id] + per_key[r.limit_key] <= key_limit]

    def turn(r: _Run) -> int:
        return 0 if place(r) == 0 else rank[r.id] + per_key[r.limit_key]

    passing.sort(key=lambda r: (-r.priority, turn(r), place(r), rank[r.id], due(r), r.id))
    room = (spec.max_concurrency or UNLIMITED) - len(held)
    return {r.id for r in passing[: max(0, min(limit, room))]}


@pytest.mark.parametrize(
    ("seed", "size", "keyless", "places", "key_limit"),
    [(seed, 150, 0.0, False, None) for seed in range(5)]
    + [(5, 40, 0.15, False, None), (6, 150, 0.0, True, None), (7, 150, 0.0, True, None)]
    + [(8, 150, 0.0, True, 2), (9, 150, 0.0, True, 3), (10, 40, 0.15, True, 2)],
)
def test_a_keyed_claim_takes_what_the_rules_say(
    store: SQLStore,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    size: int,
    keyless: float,
    places: bool,
    key_limit: int | None,
) -> None:
    """Random queues of a keyed workflow (twenty keys, two priorities, some runs due later,
    some held by another worker, some retrying), claimed in turns, each turn's runs done
    before the next: each claim takes exactly the runs :func:`_expected` names. The prefix
    read from the index is twice the claim's window (``EXAMINED_PER_WINDOW`` 2), so some
    claims take the window read from it and others, whose prefix holds too many runs
    due later or held, the ranked read. Runs without a key (made before their workflow
    had one) only in a queue shorter than the window: the window takes those among each
    segment's first due runs, where the rules take every one. ``places``: each run's
    place in its key's queue drawn at random (1-8), as after runs queued ahead of it
    ended: a key's places are not in the order of its runs' creation, so ranking a key's
    runs by place (or by due time) takes other runs than the rules (key limits 1 and 2),
    and ordering the claim by place before a key's turn takes a key's newer run before
    its older one (``key_limit`` 2 or 3, claims of one: the limit does not hide it)."""
    monkeypatch.setattr(claims, "EXAMINED_PER_WINDOW", 2)
    rng = random.Random(seed)
    limit = (1, 3, 1, 3, 10, 1, 3, 3, 1, 1, 1)[seed]  # windows of 36, 44, 72 runs:
    spec = ClaimLimits(  # shorter than the queue
        max_concurrency=rng.choice([None, 12]),
        key_limit=key_limit or rng.choice([1, 2]),
        keyed=True,
    )
    store.set_claim_limits({"w": spec})
    base = past()
    ids = []
    for n in range(size):
        key = None if rng.random() < keyless else f"k{rng.randrange(20)}"
        due = base - rng.randrange(500) if rng.random() < 0.8 else time.time() + LATER
        ids.append(_create(store, n, key=key, priority=rng.choice([0, 0, 5]), due=due).id)
    if places:
        with store.engine.begin() as conn:
            for run_id in ids:
                place = {"limit_rank": rng.randint(1, 8)}
                keyed = sa.and_(runs.c.id == run_id, runs.c.limit_key.is_not(None))
                conn.execute(sa.update(runs).where(keyed).values(**place))
    retrying = rng.sample(ids, size // 7)  # as after a failed attempt: claimed like the others
    with store.engine.begin() as conn:
        conn.execute(sa.update(runs).where(runs.c.id.in_(retrying)).values(status="retrying"))
    held = rng.sample(ids, 3)
    store.claim(worker="other", now=time.time(), limit=3, lease_seconds=60, run_ids=held)
    for turn in range(40):
        now = time.time()
        expected = _expected(_rows(store), now=now, limit=limit, spec=spec)
        taken = store.claim(worker="me", now=now, limit=limit, lease_seconds=60, workflows=["w"])
        assert {row.id for row in taken} == expected, (seed, turn)
        if not taken:
            return
        done = {"status": "succeeded", "owner": None, "next_run_at": None}
        with store.engine.begin() as conn:
            conn.execute(sa.update(runs).where(runs.c.id.in_(expected)).values(**done))


def _fill_sqlite(url: str, *, later: int, due: int, keys: int) -> None:
    """``later`` runs of workflow ``w`` due in an hour, then ``due`` due now, over ``keys``
    keys in turn (each key's runs placed 1, 2, … in its queue, the due ones after those
    due later), two priorities: copies of one run, written by SQL."""
    with contextlib.closing(SQLStore(url)) as store:
        template = _create(store, 99999999, key="k0", priority=0, due=past())
    whens = [time.time() + LATER] * later + [past()] * due
    copies = [
        (f"{n:032x}", "w", n % 2, when, f"k{n % keys}", n // keys + 1)
        for n, when in enumerate(whens)
    ]
    with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(flowloop_runs)")]
        named = ("id", "workflow", "priority", "next_run_at", "limit_key", "limit_rank")
        kept = [c for c in columns if c not in named]
        conn.executemany(
            f"INSERT INTO flowloop_runs ({', '.join(named)}, {', '.join(kept)})"
            f" SELECT ?, ?, ?, ?, ?, ?, {', '.join(kept)} FROM flowloop_runs WHERE id = ?",
            [(*copy, template.id) for copy in copies],
        )
        conn.execute("DELETE FROM flowloop_runs WHERE id = ?", (template.id,))


def _claim_steps(url: str) -> tuple[int, int]:
    """SQLite's virtual machine instructions (in tens) of a keyed claim of ten, and how
    many runs it took; rolled back."""
    with contextlib.closing(SQLStore(url)) as store:
        store.set_claim_limits({"w": ClaimLimits(key_limit=1, keyed=True)})
        statement = store._limited_statement(False, False, True)
    params: dict[str, Any] = {"p_worker": "me", "p_lease": 30.0, "p_limit": 10}
    params |= {"p_now": time.time(), "p_workflow": "w", "p_max": UNLIMITED}
    params |= {"p_key_limit": 1, "p_scan": claims.window(10), "p_examine": claims.examined(10)}
    counted = [0]

    def count() -> int:
        counted[0] += 1
        return 0

    with sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None) as conn:
        conn.set_progress_handler(count, 10)
        conn.execute("BEGIN")
        taken = conn.execute(statement.text, params).fetchall()
        conn.execute("ROLLBACK")
    return counted[0], len(taken)


def test_sqlite_keyed_claim_reads_no_more_for_a_longer_queue(tmp_path: Any) -> None:
    """A claim of ten (one per key) beside 100 keyed runs due and beside 4,000 does the same
    work; with 4,000 or 8,000 keyed runs due later ahead of the due ones in the index (the
    window comes up short: the ranked read of the 20 due runs), the same work too. Before
    the keyed index the claim read every due run of the workflow: 4,000 due cost ~6.5
    times 100 due."""
    sizes = {"short": (20, 100), "long": (20, 4000), "later": (4000, 20), "later2": (8000, 20)}
    found = {}
    for name, (later, due) in sizes.items():
        url = f"sqlite:///{tmp_path / name}.db"
        _fill_sqlite(url, later=later, due=due, keys=100 if due > 20 else 10)
        found[name] = _claim_steps(url)
    assert all(taken == 10 for _, taken in found.values()), found
    short, long_ = found["short"][0], found["long"][0]
    later, later2 = found["later"][0], found["later2"][0]
    assert long_ <= 1.5 * short + 20, found
    assert later2 <= 1.5 * later + 20, found


def _pg_keyed_rows(pg_url: str, *, later: int, due: int, keys: int) -> int:
    """The rows of the runs table PostgreSQL reads for a keyed claim of ten beside
    ``later`` keyed runs due in an hour and ``due`` due now (placed as by
    :func:`_fill_sqlite`), analyzed."""
    store = SQLStore(pg_url)
    try:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM flowloop_runs")
            conn.exec_driver_sql("DELETE FROM flowloop_journal")
        template = _create(store, 99999999, key="k0", priority=0, due=past())
        changed = {"id": "md5(g::text)", "priority": "mod(g, 2)"}
        changed["limit_key"] = f"'k' || mod(g, {keys})"
        changed["limit_rank"] = f"g / {keys} + 1"
        when = f"CASE WHEN g <= {later} THEN {time.time() + LATER} ELSE {past()} END"
        changed["next_run_at"] = when
        copy_run_pg(store, template.id, later + due, changed)
        with store.engine.begin() as conn:
            conn.execute(sa.delete(runs).where(runs.c.id == template.id))
        store.set_claim_limits({"w": ClaimLimits(key_limit=1, keyed=True)})
        statement = store._limited_statement(False, False, True)
        params: dict[str, Any] = {"p_worker": "me", "p_lease": 30.0, "p_limit": 10}
        params |= {"p_now": time.time(), "p_workflow": "w", "p_max": UNLIMITED}
        params |= {"p_key_limit": 1, "p_scan": claims.window(10)}
        params |= {"p_examine": claims.examined(10)}
        return pg_rows_read(store, statement, params)
    finally:
        store.close()


def test_postgres_keyed_claim_reads_a_window_not_the_queue(pg_url: str) -> None:
    """With 4,000 keyed runs due (100 keys), a keyed claim of ten reads its window of the
    keyed index, not every due run (the ranked read: 8,000 rows and more); with 4,000
    keyed runs due later ahead in the index, its examined prefix and the 20 due ones."""
    due = _pg_keyed_rows(pg_url, later=20, due=4000, keys=100)
    later = _pg_keyed_rows(pg_url, later=4000, due=20, keys=10)
    assert due <= 400, due
    assert later <= claims.examined(10) * 2 + 100, later
