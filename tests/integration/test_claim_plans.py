"""The claims a worker polls with, as PostgreSQL plans them once psycopg has prepared them
(a generic plan, blind to the values of its parameters): on a table of many finished runs
they search the status (or due) index, never walk the primary key or another index with a
filter — the statuses are literals in the SQL, so the planner knows they are rare.
Measured before the fix: the claim of interrupted runs took 357 ms at 200,000 runs (then
60-80 ms with the order fixed but the status a parameter), every 10 s."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from storekit import WORKFLOW, copy_run_pg, new_run

from flowloop.store import SQLStore
from flowloop.store.schema import runs

FINISHED = 200_000
"""Where the plans diverged: at 20,000 runs a parameter's guess still chose the status
index; at 200,000 it walked another index."""


def _fill_with_finished_runs(store: SQLStore) -> None:
    """One real run, copied ``FINISHED`` times as succeeded runs (statistics analyzed): two
    statuses in the table, the one a claim asks for rare."""
    template, _ = store.create_run(new_run())
    changed = {
        "id": "md5(g::text)",
        "status": "'succeeded'",
        "created_at": "g::float8",
        "owner": "NULL",
        "lease_expires_at": "NULL",
        "next_run_at": "NULL",
        "key": "NULL",
        "idempotency_key": "NULL",
    }
    copy_run_pg(store, template.id, FINISHED, changed)


def _claim_sql(store: SQLStore, claim: Callable[[], object]) -> tuple[str, dict[str, Any]]:
    """The claim statement and parameters the store sends (seen at the driver)."""
    sent: list[tuple[str, dict[str, Any]]] = []

    def seen(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if "SKIP LOCKED" in statement:
            sent.append((statement, dict(parameters)))

    sa.event.listen(store.engine, "before_cursor_execute", seen)
    try:
        claim()
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", seen)
    [one] = sent
    return one


def _generic_plan(store: SQLStore, claim: Callable[[], object]) -> str:
    """The claim prepared with its parameters as $n and explained as a generic plan (as
    psycopg runs a statement it has prepared, after five executions)."""
    statement, parameters = _claim_sql(store, claim)
    names: list[str] = []

    def numbered(match: re.Match[str]) -> str:
        names.append(match.group(1))
        return f"${len(names)}"

    sql = re.sub(r"%\((\w+)\)s", numbered, statement)
    with store.engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        assert raw is not None
        cursor = raw.cursor()
        try:
            cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")  # this txn only
            cursor.execute(f"PREPARE claim AS {sql}")
            try:
                arguments = ", ".join(_literal(parameters[name]) for name in names)
                cursor.execute(f"EXPLAIN EXECUTE claim({arguments})")
                plan = "\n".join(row[0] for row in cursor.fetchall())
            finally:
                cursor.execute("DEALLOCATE claim")  # a prepared statement outlives a rollback
        finally:
            raw.rollback()
    return plan


def _walks(plan: str) -> list[str]:
    """The scans of ``plan`` that read a table or an index without an index condition:
    walks over every row (what the claims must never do)."""
    lines = plan.splitlines()
    walks = []
    for at, line in enumerate(lines):
        if "Seq Scan" not in line and "Scan using" not in line:
            continue
        depth = len(line) - len(line.lstrip())
        below = []
        for after in lines[at + 1 :]:
            if len(after) - len(after.lstrip()) <= depth or "->" in after:
                break
            below.append(after)
        if not any("Index Cond" in detail for detail in below):
            walks.append(line.strip())
    return walks


def _status_searched(plan: str) -> bool:
    return any("Index Cond" in line and "status" in line for line in plan.splitlines())


def _literal(value: Any) -> str:
    if isinstance(value, list):
        return "ARRAY[" + ", ".join(_literal(item) for item in value) + "]::varchar[]"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


def test_claim_plans__the_polled_claims_search_an_index_and_never_walk_one(pg_url: str) -> None:
    store = SQLStore(pg_url)
    try:
        _fill_with_finished_runs(store)
        with store.engine.connect() as conn:
            counted = conn.execute(
                sa.select(runs.c.status, sa.func.count()).group_by(runs.c.status)
            ).all()
        assert dict(counted) == {"succeeded": FINISHED, "scheduled": 1}
        claims = {
            "interrupted": lambda: store.claim_interrupted(
                worker="w", limit=500, lease_seconds=30.0
            ),
            # recovery's own call: the workflows it has loaded
            "interrupted, by workflow": lambda: store.claim_interrupted(
                worker="w", limit=500, lease_seconds=30.0, workflows=[WORKFLOW]
            ),
            "due": lambda: store.claim(worker="w", now=time.time(), limit=8, lease_seconds=30.0),
            # a worker's poll: its workflows named, read a segment at a time
            "due, by workflow": lambda: store.claim(
                worker="w", now=time.time(), limit=8, lease_seconds=30.0, workflows=[WORKFLOW]
            ),
        }
        for name, claim in claims.items():
            plan = _generic_plan(store, claim)
            assert _walks(plan) == [] and _status_searched(plan), f"{name}:\n{plan}"
        # engine.run's claims, scoped to its run's family (its ids as one array): searched
        # by those ids or by status, never a walk.
        family = [f"{i:032x}" for i in range(2_000)]
        plan = _generic_plan(
            store,
            lambda: store.claim(
                worker="w", now=time.time(), limit=8, lease_seconds=30.0, run_ids=family
            ),
        )
        assert _walks(plan) == [], f"due, scoped to run ids:\n{plan}"
    finally:
        store.close()
