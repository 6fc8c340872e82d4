"""The statements that claim runs and find the next due time, built once per shape.

A claim is ``UPDATE … WHERE id IN (the first due runs, in claim order) RETURNING *``: the
highest priority first, then the earliest due time, then the id. PostgreSQL plans it from
its statistics (tests/integration/test_claim_plans.py). SQLite plans without statistics,
and the shape PostgreSQL gets — both claimable statuses, any priority — made it walk the
workflow's index: every claimable run of the workflow read and sorted at every poll, those
due tomorrow (a durable sleep, a wait's timeout, a start for later) included. 50,000 runs
asleep cost an empty claim 7.1 ms instead of 0.09; 20,000 runs due cost each claim of ten
4.4 ms, so draining a backlog cost time in the square of its size.

On SQLite the due claim and the next due time read ``ix_flowloop_runs_due``, which orders
a run by (status, priority DESC, next_run_at, id), a segment at a time: one segment per
status and priority. Each status's priorities are found by a loose scan of the index (one
seek per priority, :func:`_priorities`). Within a segment the runs are in claim order,
the due ones first, so a segment is read from its first run up to the claim's limit or
the first run not yet due, whichever comes first. The two statuses' first runs are then
sorted together: at most twice the limit.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import ColumnElement, bindparam, literal_column, or_, select, text, update
from sqlalchemy.sql.elements import TextClause

from flowloop.lifecycle import CLAIMABLE
from flowloop.store import dialect
from flowloop.store.schema import runs

SEGMENTED_STATUSES: Final = tuple(sorted(CLAIMABLE))


def sql_literal(value: str) -> Any:
    """``value`` written into the statement as a quoted SQL literal (a constant of ours,
    never user input), so the planner sees it."""
    assert "'" not in value
    return literal_column(f"'{value}'")


def claim_statement(
    kind: str,
    *,
    by_workflow: bool,
    by_id: bool,
    looked_up: bool,
    postgres: bool,
    now_sql: ColumnElement[float],
    now_text: str,
) -> Any:
    """The claim of ``kind`` ("due" or "interrupted") for one shape of filter: workflows
    ``p_workflows`` (an expanding list), run ids ``p_ids`` (:func:`dialect.ids_value`,
    looked up by id when ``looked_up``); the claimer ``p_worker``, its lease ``p_lease``,
    the limit ``p_limit`` and, for due runs, the time ``p_now``. ``now_text``: ``now_sql``
    as this database's SQL."""
    if kind == "due" and not by_id and not postgres:
        return _segmented_claim(by_workflow=by_workflow, now_text=now_text)
    # The statuses are literals in the SQL, not parameters: psycopg prepares a statement
    # it runs every poll, and PostgreSQL's generic plan for `status = $1` guesses the
    # average status's share of the rows — with running and due runs rare among many
    # finished ones, it walked the primary key or the created_at index instead of the
    # status index (357 ms, then 60-80 ms, against 0.2-0.4 ms at 200,000 runs;
    # tests/integration/test_claim_plans.py).
    if kind == "due":
        conditions = [
            runs.c.status.in_([sql_literal(status) for status in SEGMENTED_STATUSES]),
            runs.c.next_run_at <= bindparam("p_now"),
        ]
        order: tuple[Any, ...] = (runs.c.priority.desc(), runs.c.next_run_at, runs.c.id)
    else:
        conditions = [runs.c.status == sql_literal("running")]
        order = (runs.c.created_at.desc(), runs.c.id)  # ix_flowloop_runs_status_created's
    conditions.append(or_(runs.c.owner.is_(None), runs.c.lease_expires_at < now_sql))
    if by_workflow:
        conditions.append(runs.c.workflow.in_(bindparam("p_workflows", expanding=True)))
    if by_id:
        conditions = [
            dialect.within_ids(
                runs.c.id, conditions, "p_ids", postgres=postgres, looked_up=looked_up
            )
        ]
    candidates = (
        select(runs.c.id)
        .where(*conditions)
        .order_by(*order)
        .limit(bindparam("p_limit"))
        .with_for_update(skip_locked=True)
    )
    return (
        update(runs)
        .where(runs.c.id.in_(candidates.scalar_subquery()))
        .values(
            owner=bindparam("p_worker"),
            lease_epoch=runs.c.lease_epoch + 1,
            lease_expires_at=now_sql + bindparam("p_lease"),
        )
        .returning(*runs.c)
    )


def _priorities(position: int) -> str:
    """A CTE ``pN(p)``: the priorities of the runs with a due time in the status at
    ``position`` of :data:`SEGMENTED_STATUSES`, highest first, then one NULL: a seek of the
    due index per priority, however many runs each has."""
    status = SEGMENTED_STATUSES[position]
    return f"""p{position}(p) AS (
  SELECT max(priority) FROM flowloop_runs
  WHERE status = '{status}' AND next_run_at IS NOT NULL
  UNION ALL
  SELECT (SELECT max(priority) FROM flowloop_runs
          WHERE status = '{status}' AND next_run_at IS NOT NULL AND priority < p{position}.p)
  FROM p{position} WHERE p{position}.p IS NOT NULL
)"""


def priorities() -> str:
    """The CTEs ``p0``, ``p1``…: each claimable status's priorities (:func:`_priorities`),
    for a ``WITH RECURSIVE``."""
    return ",\n".join(map(_priorities, range(len(SEGMENTED_STATUSES))))


def _with_priorities() -> str:
    return f"WITH RECURSIVE {priorities()}"


def any_priority() -> str:
    """A due run's test in a statement ``WITH RECURSIVE`` :func:`priorities`: a claimable
    status, a priority one of them has, due by ``p_now`` — the due index's ranges."""
    statuses = ", ".join(f"'{status}'" for status in SEGMENTED_STATUSES)
    each = " UNION ".join(f"SELECT p FROM p{n}" for n in range(len(SEGMENTED_STATUSES)))
    return f"r.status IN ({statuses}) AND r.priority IN ({each}) AND r.next_run_at <= :p_now"


def _workflows(by_workflow: bool) -> str:
    # Behind a unary +: the due index drives, the workflow index is not a way in.
    return "AND +workflow IN :p_workflows" if by_workflow else ""


def _expanding(sql: str, by_workflow: bool) -> TextClause:
    statement = text(sql)
    if by_workflow:
        statement = statement.bindparams(bindparam("p_workflows", expanding=True))
    return statement


def _segmented_claim(*, by_workflow: bool, now_text: str) -> TextClause:
    segments = " UNION ALL ".join(
        f"""SELECT * FROM (
    SELECT id, priority, next_run_at FROM flowloop_runs
    WHERE status = '{status}' AND priority IN (SELECT p FROM p{position})
      AND next_run_at <= :p_now
      AND +(owner IS NULL OR lease_expires_at < {now_text}) {_workflows(by_workflow)}
    ORDER BY priority DESC, next_run_at, id LIMIT :p_limit
  )"""
        for position, status in enumerate(SEGMENTED_STATUSES)
    )
    sql = f"""UPDATE flowloop_runs
SET owner = :p_worker, lease_epoch = lease_epoch + 1, lease_expires_at = {now_text} + :p_lease
WHERE id IN (
  {_with_priorities()}
  SELECT id FROM ({segments})
  ORDER BY priority DESC, next_run_at, id LIMIT :p_limit
)
RETURNING *"""
    return _expanding(sql, by_workflow)


def segmented_next_due(*, by_workflow: bool) -> TextClause:
    """SQLite's earliest due time of a claimable run (of the workflows ``p_workflows``):
    the first run of each (status, priority) segment that the workflows have."""
    firsts = " UNION ALL ".join(
        f"""SELECT (
    SELECT next_run_at FROM flowloop_runs
    WHERE status = '{status}' AND priority = p{position}.p AND next_run_at IS NOT NULL
      {_workflows(by_workflow)}
    ORDER BY next_run_at LIMIT 1
  ) AS due FROM p{position} WHERE p{position}.p IS NOT NULL"""
        for position, status in enumerate(SEGMENTED_STATUSES)
    )
    return _expanding(f"{_with_priorities()}\nSELECT min(due) FROM ({firsts})", by_workflow)
