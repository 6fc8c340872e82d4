"""Step statistics straight from the journal: per workflow and state, how many attempts,
how many succeeded, how many were retried, p50/p95/p99 duration and the slowest runs.

Computed in SQL, one code path for SQLite and PostgreSQL: plain aggregates for the counts,
and window functions (``ROW_NUMBER``/``COUNT`` over a partition per workflow and state)
for the nearest-rank percentiles, so only a handful of rows per state leave the database.

Cost grows with the step outcomes inside the window, not with the whole history: the
``since`` bound is a range on the journal index ``(kind, at)``. Percentiles over all of a
large history need a sort of every outcome ever journaled; hence ``flowloop stats``
looks at the last day unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import ColumnElement, Engine, case, func, or_, select, true

from flowloop import journal as j
from flowloop.store.dialect import READ_OPTION
from flowloop.store.schema import journal, runs

OUTCOME_KINDS: Final = (j.STEP_SUCCEEDED, j.STEP_FAILED, j.STEP_INTERRUPTED)
PERCENTILES: Final = (50, 95, 99)
DEFAULT_SLOWEST: Final = 3
SLOWEST_CANDIDATES: Final = 3
"""Attempts fetched per slowest run shown (retries of one run are one run)."""


@dataclass(frozen=True, kw_only=True)
class StateStats:
    """One workflow state's step attempts in the window."""

    workflow: str
    state: str
    count: int
    """Step attempts that ended (succeeded, failed or were interrupted)."""
    succeeded: int
    retries: int
    """Attempts that failed and were tried again."""
    p50: float | None
    p95: float | None
    p99: float | None
    """Nearest-rank percentiles of attempt durations in seconds (``None``: no duration)."""
    slowest: tuple[tuple[str, float], ...]
    """(run id, seconds) of the runs with the slowest attempts, slowest first."""

    @property
    def failed(self) -> int:
        return self.count - self.succeeded

    @property
    def success_rate(self) -> float:
        return self.succeeded / self.count if self.count else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "state": self.state,
            "count": self.count,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "retries": self.retries,
            "success_rate": round(self.success_rate, 6),
            "p50": self.p50,
            "p95": self.p95,
            "p99": self.p99,
            "slowest": [{"run_id": run, "duration": seconds} for run, seconds in self.slowest],
        }


def rank(percentile: int, n: Any) -> Any:
    """The nearest-rank position ``ceil(p/100 * n)`` in integer arithmetic (same result on
    every database; works on a Python int or a SQL expression)."""
    return (n * percentile + 99) // 100


def step_stats(
    db: Engine,
    *,
    workflow: str | None = None,
    since: float | None = None,
    slowest: int = DEFAULT_SLOWEST,
) -> list[StateStats]:
    """Per (workflow, state) statistics of step attempts journaled at or after ``since``
    (UTC epoch seconds; ``None``: all history), of one ``workflow`` or all, sorted by
    workflow and state."""
    where: list[ColumnElement[bool]] = [journal.c.kind.in_(OUTCOME_KINDS)]
    if since is not None:
        where.append(journal.c.at >= since)
    if workflow is not None:
        where.append(runs.c.workflow == workflow)
    joined = journal.join(runs, runs.c.id == journal.c.run_id)
    key = (runs.c.workflow, journal.c.state)
    order = journal.c.duration

    counts = (
        select(
            runs.c.workflow,
            journal.c.state,
            func.count().label("n"),
            func.sum(case((journal.c.kind == j.STEP_SUCCEEDED, 1), else_=0)).label("ok"),
            func.sum(case((journal.c.retryable == true(), 1), else_=0)).label("retries"),
        )
        .select_from(joined)
        .where(*where)
        .group_by(*key)
    )
    ranked = (
        select(
            runs.c.workflow.label("workflow"),
            journal.c.state.label("state"),
            journal.c.run_id,
            journal.c.duration,
            # One window (same partition and order) for both: the database sorts once.
            func.row_number().over(partition_by=key, order_by=order).label("rn"),
            func.count().over(partition_by=key, order_by=order, rows=(None, None)).label("n"),
        )
        .select_from(joined)
        .where(*where, journal.c.duration.is_not(None))
        .subquery()
    )
    # A run can own several of the slowest attempts (its retries): take a few more and
    # keep distinct runs.
    candidates = slowest * SLOWEST_CANDIDATES
    picked = select(ranked).where(
        or_(
            ranked.c.rn > ranked.c.n - candidates,
            *[ranked.c.rn == rank(p, ranked.c.n) for p in PERCENTILES],
        )
    )

    with db.connect() as conn:
        conn = conn.execution_options(**{READ_OPTION: True})
        with conn.begin():
            count_rows = conn.execute(counts).all()
            ranked_rows = conn.execute(picked).all()

    values: dict[tuple[str, str], dict[int, tuple[str, float]]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for row in ranked_rows:
        group = (row.workflow, row.state or "")
        values.setdefault(group, {})[int(row.rn)] = (row.run_id, float(row.duration))
        sizes[group] = int(row.n)

    result = []
    for row in count_rows:
        group = (row.workflow, row.state or "")
        at_rank = values.get(group, {})
        n = sizes.get(group, 0)

        def pick(
            percentile: int, ranks: dict[int, tuple[str, float]] = at_rank, size: int = n
        ) -> float | None:
            found = ranks.get(rank(percentile, size)) if size else None
            return None if found is None else found[1]

        top: dict[str, float] = {}
        for run_id, seconds in sorted(
            (at_rank[position] for position in at_rank if position > n - candidates),
            key=lambda item: (-item[1], item[0]),
        ):
            if len(top) < slowest:
                top.setdefault(run_id, seconds)
        result.append(
            StateStats(
                workflow=row.workflow,
                state=row.state or "",
                count=int(row.n),
                succeeded=int(row.ok or 0),
                retries=int(row.retries or 0),
                p50=pick(50),
                p95=pick(95),
                p99=pick(99),
                slowest=tuple(top.items()),
            )
        )
    result.sort(key=lambda s: (s.workflow, s.state))
    return result
