"""The statements that claim runs and find the next due time, built once per shape.

A claim takes the first due runs in claim order: the highest priority first, then the
earliest due time, then the id. Its plain statement (``UPDATE … WHERE id IN (SELECT …
ORDER BY … LIMIT … FOR UPDATE SKIP LOCKED)``) names both claimable statuses and any
priority, and both databases planned it on the workflow's index (SQLite plans without
statistics; PostgreSQL could not range on the due time past the priority): every claim
read every claimable run of the workflows, those due tomorrow (a durable sleep, a wait's
timeout, a start for later) included, and sorted the due ones. With 50,000 runs asleep an
empty claim cost 7.4 ms on SQLite and 2.2 ms on PostgreSQL (analyzed); beside 4,000 runs
due later a claim of ten read 4,031 rows on PostgreSQL; with 20,000 runs due each claim
of ten cost 11.5 ms on SQLite and 22.0 ms on PostgreSQL, so draining a backlog cost time in
the square of its size (bench/due_backlog.py).

``ix_flowloop_runs_due`` orders a run by (status, workflow, priority DESC, next_run_at,
id), and a worker's claim, a limited workflow's claim and the look at the next due time
read it a segment at a time: one segment per status, workflow and priority. Each status
and workflow's priorities are found by a loose scan of the index (one seek per priority:
:func:`_priorities`, :func:`_pg_segments`). Within a segment the runs are in claim order,
the due ones first, so a claim reads each segment from its first run up to its limit (on
PostgreSQL a window wider than the limit, :func:`window`) or the first run not yet due,
and sorts those together; so does a limited claim of a workflow without keys. One with
keys orders its runs by a key's place in its queue before the due time: it reads its
window from an index of its own in that order (:func:`keyed_window`, migration 0018),
and every due run only when that window comes up short. Runs due later and other
workflows' runs are not read; the work grows with the number of segments, so with the
number of distinct priorities. On SQLite the statement names each workflow (one is built
per number of workflows, up to :data:`MOST_SEGMENTED`) and says which index to use; on
PostgreSQL the workflows are one array, and the runs taken are locked in claim order as by
the plain statement, but only among each segment's window: when other claimers hold more
than the window's surplus over the limit in a segment at the same moment, a claim comes
back short, or takes a lower priority's runs first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from sqlalchemy import ColumnElement, bindparam, literal_column, or_, select, text, update
from sqlalchemy.sql.elements import TextClause

from flowloop.lifecycle import CLAIMABLE
from flowloop.store import dialect
from flowloop.store.schema import KEYED_DUE_INDEX, KEYED_DUE_WHERE, runs

SEGMENTED_STATUSES: Final = tuple(sorted(CLAIMABLE))
_STATUSES: Final = ", ".join(f"'{status}'" for status in SEGMENTED_STATUSES)
"""The claimable statuses as SQL literals, for ``IN (…)``."""
MOST_SEGMENTED: Final = 64
"""The most workflows a SQLite segment statement names (a term of a compound select per
status and workflow; SQLite's default build takes at most 500). A claim naming more gets
the plain statement."""
DUE_INDEX: Final = "INDEXED BY ix_flowloop_runs_due"
"""Said, not left to the planner: with the workflow and a status named, SQLite preferred
the workflow's index for a limited claim (every claimable run of the workflow again)."""


def sql_literal(value: str) -> Any:
    """``value`` written into the statement as a quoted SQL literal (a constant of ours,
    never user input), so the planner sees it."""
    assert "'" not in value
    return literal_column(f"'{value}'")


def claim_statement(
    kind: str,
    *,
    by_workflow: bool,
    workflows: int | None,
    by_id: bool,
    looked_up: bool,
    postgres: bool,
    now_sql: ColumnElement[float],
    now_text: str,
) -> Any:
    """The claim of ``kind`` ("due" or "interrupted") for one shape of filter: workflows
    ``p_workflows`` (a list), run ids ``p_ids`` (:func:`dialect.ids_value`,
    looked up by id when ``looked_up``); the claimer ``p_worker``, its lease ``p_lease``,
    the limit ``p_limit`` and, for due runs, the time ``p_now``. ``now_text``: ``now_sql``
    as this database's SQL. ``workflows``: :func:`segments`, and then the workflows are
    the parameters of :func:`workflow_params`."""
    if workflows == 0:
        return _pg_segmented_claim(now_text)
    if workflows is not None:
        return _segmented_claim(workflows, now_text=now_text)
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


def segments(
    kind: str, workflows: Sequence[str] | None, *, by_id: bool, postgres: bool
) -> int | None:
    """The statement a claim of ``kind`` (or a look at the next due time, "due") gets:
    ``None``, the plain one (a claim of interrupted runs or of a scope of ids, no workflow
    named, or on SQLite more than :data:`MOST_SEGMENTED`); ``0``, PostgreSQL's segments,
    the workflows one array; else SQLite's, naming that many workflows."""
    if kind != "due" or by_id or not workflows:
        return None
    if postgres:
        return 0
    return len(workflows) if len(workflows) <= MOST_SEGMENTED else None


def workflow_params(workflows: Sequence[str], segmented: int | None) -> dict[str, Any]:
    """The parameters naming ``workflows`` in a statement of :func:`segments`' answer."""
    if not segmented:
        return {"p_workflows": list(workflows)}
    return {f"p_w{n}": name for n, name in enumerate(workflows)}


SCAN_PER_CLAIMED: Final = 4
SCAN_EXTRA: Final = 32


def window(limit: int) -> int:
    """How many due runs of each segment PostgreSQL's claim of ``limit`` runs reads:
    ``4 x limit + 32``, as a limited claim ranks (flowloop/store/limits.py)."""
    return SCAN_PER_CLAIMED * limit + SCAN_EXTRA


def _pairs(workflows: int) -> list[tuple[int, str]]:
    """Each status's position and each workflow's parameter (``p_w0``…): the segments
    of a SQLite statement naming ``workflows`` workflows."""
    return [(s, f"p_w{w}") for s in range(len(SEGMENTED_STATUSES)) for w in range(workflows)]


def _claimed(candidates: str, now_text: str) -> TextClause:
    """The claim of the runs ``candidates`` (SQL: their ids) by ``p_worker``, leased for
    ``p_lease``, returned whole."""
    return text(f"""UPDATE flowloop_runs
SET owner = :p_worker, lease_epoch = lease_epoch + 1, lease_expires_at = {now_text} + :p_lease
WHERE {candidates}
RETURNING *""")


def _priorities(status: int, workflow: str) -> str:
    """A CTE ``p{status}_{workflow}(p)``: the priorities of the runs with a due time of the
    workflow ``workflow`` (a parameter's name) in the status at ``status`` in
    :data:`SEGMENTED_STATUSES`, highest first, then one NULL: a seek of the due index per
    priority, however many runs each has."""
    name = f"p{status}_{workflow}"
    runs_of = (
        f"FROM flowloop_runs {DUE_INDEX} WHERE status = '{SEGMENTED_STATUSES[status]}' "
        f"AND workflow = :{workflow} AND next_run_at IS NOT NULL"
    )
    return f"""{name}(p) AS (
  SELECT max(priority) {runs_of}
  UNION ALL
  SELECT (SELECT max(priority) {runs_of} AND priority < {name}.p)
  FROM {name} WHERE {name}.p IS NOT NULL
)"""


def _with_priorities(pairs: Sequence[tuple[int, str]]) -> str:
    return "WITH RECURSIVE " + ",\n".join(_priorities(s, w) for s, w in pairs)


def limited_candidates(*, postgres: bool, until: str = ":p_now") -> tuple[str, str]:
    """For a limited claim of workflow ``p_workflow``: the CTEs of its priorities (to
    follow ``WITH RECURSIVE``), and the test of its due runs by the due index's ranges
    (``r``: the runs): each status and priority's runs up to ``p_now``, not those due
    later. (The claim of a workflow with keys orders its runs by a key's place in its
    queue before the due time: read so, every due run of the workflow is read and sorted,
    as :func:`keyed_window` does when its own window comes up short.)
    ``until``: SQL of the latest due time read (:func:`unless_whole`)."""
    if postgres:
        ctes = _pg_segments("ARRAY[CAST(:p_workflow AS VARCHAR)]").removeprefix("WITH RECURSIVE ")
        each = "ANY(ARRAY(SELECT seg.p FROM seg WHERE seg.p IS NOT NULL))"
        priority = f"r.priority = {each}"
    else:
        pairs = [(s, "p_workflow") for s in range(len(SEGMENTED_STATUSES))]
        ctes = ",\n".join(_priorities(s, w) for s, w in pairs)
        priority = (
            "r.priority IN (" + " UNION ".join(f"SELECT p FROM p{s}_{w}" for s, w in pairs) + ")"
        )
    due = (
        f"r.status IN ({_STATUSES}) AND r.workflow = :p_workflow AND {priority} "
        f"AND r.next_run_at <= {until}"
    )
    return ctes, due


NO_KEY: Final = "CAST(NULL AS VARCHAR(400)) AS limit_key"
"""A candidate's key in :func:`limited_window`: none."""


def limited_window(room: str, *, postgres: bool, keyless: bool = False) -> str:
    """The candidates of a limited claim of workflow ``p_workflow`` whose definition has
    no key (``max_concurrency`` alone): its first ``p_scan`` due runs that ``room`` (SQL of
    the runs ``r``) leaves free, in claim order, with the columns the ranking reads: no
    key and no place in a key's queue (a run keeps the key an earlier definition gave it;
    ranked by it, it would go before older runs). Each segment is read up to ``p_scan``
    runs, as PostgreSQL's worker claim reads its window, after the CTEs of
    :func:`limited_candidates`: 20,000 due runs are not all read and sorted for a claim of
    ten. ``keyless``: of that window, the runs without a key or a place in its queue, with
    their key and their creation, which orders a key's runs (:func:`keyed_window`)."""
    if keyless:
        outer = "limit_key, 0 AS lr, created_at"
        kept = "WHERE limit_key IS NULL OR limit_rank IS NULL"
        created = ", {}.created_at"  # of the runs, then of the segments' windows
    else:
        outer, kept, created = f"{NO_KEY}, 0 AS lr", "", ""
    if postgres:
        return f"""SELECT id, priority, next_run_at, {outer} FROM (
    SELECT c.id, c.priority, c.next_run_at, c.limit_key, c.limit_rank{created.format("c")}
    FROM seg CROSS JOIN LATERAL (
      SELECT r.id, r.priority, r.next_run_at, r.limit_key, r.limit_rank{created.format("r")}
      FROM flowloop_runs r
      WHERE r.status = seg.status AND r.workflow = seg.workflow AND r.priority = seg.p
        AND r.next_run_at <= :p_now AND {room}
      ORDER BY r.next_run_at, r.id LIMIT :p_scan
    ) AS c WHERE seg.p IS NOT NULL
    ORDER BY c.priority DESC, c.next_run_at, c.id LIMIT :p_scan
  ) AS windowed {kept}"""
    segments = " UNION ALL ".join(
        f"""SELECT * FROM (
    SELECT r.id, r.priority, r.next_run_at, r.limit_key, r.limit_rank{created.format("r")}
    FROM flowloop_runs r {DUE_INDEX}
    WHERE r.status = '{SEGMENTED_STATUSES[s]}' AND r.workflow = :p_workflow
      AND r.priority IN (SELECT p FROM p{s}_p_workflow) AND r.next_run_at <= :p_now
      AND +({room})
    ORDER BY r.priority DESC, r.next_run_at, r.id LIMIT :p_scan
  )"""
        for s in range(len(SEGMENTED_STATUSES))
    )
    return f"""SELECT id, priority, next_run_at, {outer} FROM (
    SELECT * FROM ({segments}) ORDER BY priority DESC, next_run_at, id LIMIT :p_scan
  ) {kept}"""


EXAMINED_PER_WINDOW: Final = 16
KEYED_INDEX: Final = f"INDEXED BY {KEYED_DUE_INDEX}"


def examined(limit: int) -> int:
    """How many claimable runs with a key a limited claim of ``limit`` runs reads at most
    in its order before it falls back to reading every due run (:func:`keyed_window`)."""
    return EXAMINED_PER_WINDOW * window(limit)


WHOLE: Final = "(SELECT whole FROM keyed_whole)"
"""Whether :func:`keyed_window`'s window from the index is whole."""
UNLESS_WHOLE: Final = f"CASE WHEN {WHOLE} THEN NULL ELSE :p_now END"


def unless_whole(*, postgres: bool) -> tuple[str, str]:
    """How the ranked read behind :func:`keyed_window` reads nothing when the window is
    whole: the latest due time it reads (for :func:`limited_candidates`) and a term to add
    to its test. SQLite: no due time (a bound of the due index's range, tested once; as a
    term of the statement, or outside it, SQLite scanned every due run first).
    PostgreSQL: ``NOT`` :data:`WHOLE`, which it tests once before the scan (with the bound
    instead, it could not estimate the range and planned a scan of the whole table)."""
    if postgres:
        return ":p_now", f" AND NOT {WHOLE}"
    return UNLESS_WHOLE, ""


def keyed_window(room: str, ranked: str, *, postgres: bool) -> str:
    """The candidates of a limited claim of workflow ``p_workflow`` whose definition has a
    key: its first ``p_scan`` due runs that ``room`` (SQL of the runs ``r``) leaves free,
    in claim order — priority, then the key's place in its queue, then due time — with the
    columns the ranking reads (their creation too: a key's runs go by it), after the CTEs
    of :func:`limited_candidates`.

    They are read from the keyed due index, in that order: its first ``p_examine`` runs,
    due or not, free or not, of which the due and free ones are the window. If those were
    too few although more runs lay beyond (runs due later, or of keys at their limit, ahead
    in the order), the claim reads ``ranked`` instead: every due run, sorted, as before
    this index (``ranked`` reads nothing when the window is whole: :func:`unless_whole`).
    That window holds the runs with a key the ranked read would take. Runs without a key
    or a place (made before their workflow had a key) are not in that index: the window
    takes those among each segment's first ``p_scan`` due runs (:func:`limited_window`),
    place 0; one behind more runs due earlier waits for them, where the ranked read took
    it first."""
    hint = "" if postgres else f" {KEYED_INDEX}"
    keyless = limited_window(room, postgres=postgres, keyless=True)
    keyed = f"""FROM flowloop_runs r{hint}
      WHERE r.workflow = :p_workflow AND {KEYED_DUE_WHERE}"""
    # (A CASE, not an OR: SQLite counted the prefix again even when the window was full.)
    # The window's runs come in the index's order: PostgreSQL knows the prefix's order and
    # stops at p_scan; SQLite reads the prefix as a coroutine, in its order, and stops
    # there too, where an ORDER BY of its own would sort every run of the prefix first.
    in_order = "ORDER BY r.priority DESC, r.lr, r.next_run_at, r.id" if postgres else ""
    return f"""WITH keyed_free AS (
    SELECT r.id, r.priority, r.next_run_at, r.limit_key, r.lr, r.created_at FROM (
      SELECT r.id, r.priority, r.next_run_at, r.limit_key, r.limit_rank AS lr, r.owner,
             r.lease_expires_at, r.created_at
      {keyed}
      ORDER BY r.priority DESC, r.limit_rank, r.next_run_at, r.id
      LIMIT :p_examine
    ) AS r
    WHERE r.next_run_at <= :p_now AND {room}
    {in_order}
    LIMIT :p_scan
  ),
  keyed_whole AS (
    SELECT CASE
      WHEN (SELECT count(*) FROM keyed_free) >= :p_scan THEN TRUE
      WHEN (SELECT count(*) FROM (SELECT 1 {keyed} LIMIT :p_examine) AS examined)
           < :p_examine THEN TRUE
      ELSE FALSE
    END AS whole
  )
  SELECT * FROM (
    SELECT * FROM (
      SELECT id, priority, next_run_at, limit_key, lr, created_at FROM keyed_free
      UNION ALL
      SELECT * FROM ({keyless}) AS keyless
    ) AS found
    WHERE {WHOLE}
    ORDER BY priority DESC, lr, next_run_at, id
    LIMIT :p_scan
  ) AS windowed
  UNION ALL
  SELECT * FROM ({ranked}) AS every_due"""


def _segmented_claim(workflows: int, *, now_text: str) -> TextClause:
    pairs = _pairs(workflows)
    segments = " UNION ALL ".join(
        f"""SELECT * FROM (
    SELECT id, priority, next_run_at FROM flowloop_runs {DUE_INDEX}
    WHERE status = '{SEGMENTED_STATUSES[s]}' AND workflow = :{w}
      AND priority IN (SELECT p FROM p{s}_{w}) AND next_run_at <= :p_now
      AND +(owner IS NULL OR lease_expires_at < {now_text})
    ORDER BY priority DESC, next_run_at, id LIMIT :p_limit
  )"""
        for s, w in pairs
    )
    return _claimed(
        f"""id IN (
  {_with_priorities(pairs)}
  SELECT id FROM ({segments})
  ORDER BY priority DESC, next_run_at, id LIMIT :p_limit
)""",
        now_text,
    )


def segmented_next_due(workflows: int) -> TextClause:
    """SQLite's earliest due time of a claimable run of the workflows ``p_w0``…: the first
    run of each segment."""
    pairs = _pairs(workflows)
    firsts = " UNION ALL ".join(
        f"""SELECT (
    SELECT next_run_at FROM flowloop_runs {DUE_INDEX}
    WHERE status = '{SEGMENTED_STATUSES[s]}' AND workflow = :{w} AND priority = p{s}_{w}.p
      AND next_run_at IS NOT NULL
    ORDER BY next_run_at LIMIT 1
  ) AS due FROM p{s}_{w} WHERE p{s}_{w}.p IS NOT NULL"""
        for s, w in pairs
    )
    return text(f"{_with_priorities(pairs)}\nSELECT min(due) FROM ({firsts})")


def _pg_segments(workflows: str) -> str:
    """PostgreSQL's segments, ``seg(status, workflow, p)``: each claimable status and each
    workflow of the array ``workflows`` (SQL) with each priority its runs have, found by a
    loose scan of the due index, then a NULL priority each."""
    return f"""WITH RECURSIVE seg(status, workflow, p) AS (
  SELECT s, w, (SELECT r.priority FROM flowloop_runs r
                WHERE r.status = s AND r.workflow = w AND r.next_run_at IS NOT NULL
                ORDER BY r.priority DESC LIMIT 1)
  FROM unnest(CAST(ARRAY[{_STATUSES}] AS VARCHAR[])) AS s,
       unnest({workflows}) AS w
  UNION ALL
  SELECT seg.status, seg.workflow, (SELECT r.priority FROM flowloop_runs r
    WHERE r.status = seg.status AND r.workflow = seg.workflow AND r.next_run_at IS NOT NULL
      AND r.priority < seg.p ORDER BY r.priority DESC LIMIT 1)
  FROM seg WHERE seg.p IS NOT NULL
)"""


_PG_SEGMENTS: Final = _pg_segments("CAST(:p_workflows AS VARCHAR[])")
"""The segments of the workflows ``p_workflows`` (a list)."""

PG_NEXT_DUE: Final = text(f"""{_PG_SEGMENTS}
SELECT min((SELECT r.next_run_at FROM flowloop_runs r
            WHERE r.status = seg.status AND r.workflow = seg.workflow AND r.priority = seg.p
              AND r.next_run_at IS NOT NULL ORDER BY r.next_run_at LIMIT 1))
FROM seg WHERE seg.p IS NOT NULL""")
"""PostgreSQL's earliest due time of a claimable run of the workflows ``p_workflows``:
each segment's first run. PostgreSQL's own plan read every claimable run of the
workflows, analyzed or not (50,000 runs asleep, analyzed: 7.5 ms by a sequential scan;
0.13 ms this way)."""


def _pg_segmented_claim(now_text: str) -> TextClause:
    """PostgreSQL's claim of the workflows ``p_workflows``: each segment's first due runs,
    up to a window of ``p_scan`` (:func:`window`), read without a lock; then these runs,
    looked up by key, locked in claim order, skipping those another claimer holds, up to
    the limit. Only the runs taken are locked, and the lock tests each again if another
    transaction changed it meanwhile, as in the plain claim. A claim comes back short of
    runs that are due only if other claimers hold more than the window's surplus over
    the limit in one segment, at the same moment."""
    free = f"(owner IS NULL OR lease_expires_at < {now_text})"
    # `id = ANY(ARRAY(…))`, not `id IN (…)`: the runs are looked up by their key. A generic
    # plan cannot know the limits, guessed millions of candidates, and joined them by hash
    # with a walk of the whole table.
    return _claimed(
        f"""id = ANY(ARRAY(
  SELECT id FROM flowloop_runs
  WHERE id = ANY(ARRAY(
    {_PG_SEGMENTS}
    SELECT c.id FROM seg CROSS JOIN LATERAL (
      SELECT r.id FROM flowloop_runs r
      WHERE r.status = seg.status AND r.workflow = seg.workflow AND r.priority = seg.p
        AND r.next_run_at <= :p_now AND (r.owner IS NULL OR r.lease_expires_at < {now_text})
      ORDER BY r.priority DESC, r.next_run_at, r.id LIMIT :p_scan
    ) AS c WHERE seg.p IS NOT NULL
  ))
  AND status IN ({_STATUSES}) AND next_run_at <= :p_now AND {free}
  ORDER BY priority DESC, next_run_at, id LIMIT :p_limit
  FOR UPDATE SKIP LOCKED
))""",
        now_text,
    )
