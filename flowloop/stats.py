"""Statistics straight from the journals: per workflow and state, how many step attempts,
how many succeeded, how many were retried, p50/p95/p99 duration and the slowest runs
(:func:`step_stats`); per workflow, the runs that finished, their success rate and the
whole-run latency (:func:`run_stats`); per loop, iterations by outcome, slots not run and
p50/p95 iteration duration (:func:`loop_stats`).

Computed in SQL, one code path for SQLite and PostgreSQL: plain aggregates for the counts,
and window functions (``ROW_NUMBER``/``COUNT`` over a partition per workflow and state)
for the nearest-rank percentiles, so only a handful of rows per state leave the database.

Cost grows with the runs inside the window, not with the whole history: the ``since``
bound picks the window's runs and reads their entries by the journal's key
(flowloop/store/windows.py; the journal has no time index, which every step would pay
for). Percentiles over all of a large history need a sort of every outcome ever
journaled; hence ``flowloop stats`` looks at the last day unless told otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import ColumnElement, Engine, FromClause, Row, Select, case, func, select, true

from flowloop import journal as j
from flowloop.store.reads import PERCENTILES, Ranks, counts_and_seconds, nearest_ranks, reading
from flowloop.store.schema import journal, loop_journal, runs
from flowloop.store.windows import journal_since

OUTCOME_KINDS: Final = (j.STEP_SUCCEEDED, j.STEP_FAILED, j.STEP_INTERRUPTED)
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

    @classmethod
    def of(
        cls,
        counted: Row[Any],
        *,
        workflow: str,
        at: Callable[[int], float | None],
        slowest: tuple[tuple[str, float], ...] = (),
    ) -> StateStats:
        """One state's row of :func:`attempt_counts`, with its percentiles (``at(p)``)."""
        return cls(
            workflow=workflow,
            state=counted.state or "",
            count=int(counted.n),
            succeeded=int(counted.ok or 0),
            retries=int(counted.retries or 0),
            p50=at(50),
            p95=at(95),
            p99=at(99),
            slowest=slowest,
        )

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


def attempt_counts(
    *groups: ColumnElement[Any], where: Sequence[ColumnElement[bool]], joined: FromClause
) -> Select[Any]:
    """Step attempts that ended, per group: ``n`` in all, ``ok`` succeeded, ``retries``
    failed and tried again (the counts of :class:`StateStats`)."""
    return (
        select(
            *groups,
            func.count().label("n"),
            func.sum(case((journal.c.kind == j.STEP_SUCCEEDED, 1), else_=0)).label("ok"),
            func.sum(case((journal.c.retryable == true(), 1), else_=0)).label("retries"),
        )
        .select_from(joined)
        .where(*where)
        .group_by(*groups)
    )


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
        where.append(journal_since(since))
    if workflow is not None:
        where.append(runs.c.workflow == workflow)
    joined = journal.join(runs, runs.c.id == journal.c.run_id)
    counts = attempt_counts(runs.c.workflow, journal.c.state, where=where, joined=joined)
    # A run can own several of the slowest attempts (its retries): take a few more and
    # keep distinct runs.
    candidates = slowest * SLOWEST_CANDIDATES
    picked = nearest_ranks(
        journal.c.duration,
        where=where,
        groups={"workflow": runs.c.workflow, "state": journal.c.state},
        columns=[journal.c.run_id],
        select_from=joined,
        top=candidates,
    )
    with reading(db) as conn:
        count_rows = conn.execute(counts).all()
        ranks = Ranks.of(
            conn.execute(picked),
            group=lambda row: (row.workflow, row.state or ""),
            value=lambda row: (str(row.run_id), float(row.value)),
        )

    result = []
    for row in count_rows:
        group = (row.workflow, row.state or "")

        def pick(percentile: int, group: tuple[str, str] = group) -> float | None:
            found = ranks.at(group, percentile)
            return None if found is None else found[1]

        top: dict[str, float] = {}
        for run_id, seconds in sorted(
            ranks.highest(group, candidates), key=lambda item: (-item[1], item[0])
        ):
            if len(top) < slowest:
                top.setdefault(run_id, seconds)
        result.append(
            StateStats.of(row, workflow=row.workflow, at=pick, slowest=tuple(top.items()))
        )
    result.sort(key=lambda s: (s.workflow, s.state))
    return result


# -- whole runs ------------------------------------------------------------------------------

RUN_FINAL_STATUSES: Final = ("succeeded", "failed", "stopped")
FINAL_ENTRY_KINDS: Final = (
    j.STEP_SUCCEEDED,
    j.EVENT_RECEIVED,
    j.STEP_FAILED,
    j.STEP_INTERRUPTED,
    j.RUN_FAILED,
    j.RUN_STOPPED,
    j.SLEEP_ENDED,
)
"""The kinds a finished run's last entry can have: a range on the journal's ``(kind, at)``
index finds the runs that finished in the window without reading every run."""


@dataclass(frozen=True, kw_only=True)
class RunStats:
    """One workflow's runs that finished in the window (their final journal entry in it)."""

    workflow: str
    finished: int
    succeeded: int
    failed: int
    stopped: int
    p50: float | None
    p95: float | None
    p99: float | None
    """Nearest-rank percentiles, in seconds, of the whole-run latency of the *succeeded*
    runs: from ``run_created`` to the final entry (waits, retries and backoff included)."""

    @property
    def success_rate(self) -> float:
        """Succeeded runs among the finished ones (whatever their steps' retries)."""
        return self.succeeded / self.finished if self.finished else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "finished": self.finished,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "stopped": self.stopped,
            "success_rate": round(self.success_rate, 6),
            "latency_p50": self.p50,
            "latency_p95": self.p95,
            "latency_p99": self.p99,
        }


def run_stats(
    db: Engine, *, workflow: str | None = None, since: float | None = None
) -> list[RunStats]:
    """Per workflow: runs whose final entry was journaled at or after ``since`` (``None``:
    all history), by final status, with percentiles of the succeeded runs' latency."""
    created = journal.alias("created")
    ended = journal.alias("ended")
    joined = runs.join(created, (created.c.run_id == runs.c.id) & (created.c.seq == 1)).join(
        ended, (ended.c.run_id == runs.c.id) & (ended.c.seq == runs.c.last_seq)
    )
    filters: list[ColumnElement[bool]] = [runs.c.status.in_(RUN_FINAL_STATUSES)]
    if since is not None:
        filters.extend((runs.c.updated_at >= since, ended.c.at >= since))
    if workflow is not None:
        filters.append(runs.c.workflow == workflow)
    where = [*filters, ended.c.kind.in_(FINAL_ENTRY_KINDS)]
    # A finished run whose last entry is a success is a succeeded run: said by the entry's
    # kind (not `status = 'succeeded'`, which would make the planner read every such run).
    succeeded = [*filters, ended.c.kind.in_((j.STEP_SUCCEEDED, j.EVENT_RECEIVED, j.SLEEP_ENDED))]

    def of(status: str) -> ColumnElement[Any]:
        return func.sum(case((runs.c.status == status, 1), else_=0)).label(status)

    counts = (
        select(runs.c.workflow, func.count().label("n"), *map(of, RUN_FINAL_STATUSES))
        .select_from(joined)
        .where(*where)
        .group_by(runs.c.workflow)
    )
    latency = ended.c.at - created.c.at
    group = ("workflow", runs.c.workflow)
    count_rows, ranks = counts_and_seconds(
        db, counts, latency, where=succeeded, group=group, select_from=joined
    )
    result = []
    for row in count_rows:
        p50, p95, p99 = (ranks.at(row.workflow, p) for p in PERCENTILES)
        result.append(
            RunStats(
                workflow=row.workflow,
                finished=int(row.n),
                succeeded=int(row.succeeded or 0),
                failed=int(row.failed or 0),
                stopped=int(row.stopped or 0),
                p50=p50,
                p95=p95,
                p99=p99,
            )
        )
    result.sort(key=lambda s: s.workflow)
    return result


# -- loops -----------------------------------------------------------------------------------

ITERATION_PREFIX: Final = "iteration_"
SLOT_KINDS: Final = ("skipped_overlap", "missed", "coalesced")
"""Loop journal kinds that count slots not run; their ``count`` says how many."""


@dataclass(frozen=True, kw_only=True)
class LoopStats:
    """One loop's iterations that ended in the window, and the slots it did not run."""

    loop: str
    outcomes: dict[str, int]
    """Ended iterations by outcome (succeeded, failed, interrupted, stopped, cancelled)."""
    slots_not_run: dict[str, int]
    """Slots skipped while an iteration still ran, missed, or coalesced, by kind."""
    p50: float | None
    p95: float | None
    """Nearest-rank percentiles of the ended iterations' durations in seconds."""

    @property
    def iterations(self) -> int:
        return sum(self.outcomes.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "loop": self.loop,
            "iterations": self.iterations,
            "outcomes": dict(self.outcomes),
            "slots_not_run": dict(self.slots_not_run),
            "p50": self.p50,
            "p95": self.p95,
        }


def loop_stats(db: Engine, *, since: float | None = None) -> list[LoopStats]:
    """Per loop: iterations that ended at or after ``since`` by outcome, the slots it did
    not run, and p50/p95 iteration duration, from the loop journal."""
    ended = loop_journal.c.kind.like(ITERATION_PREFIX + "%") & (
        loop_journal.c.kind != "iteration_started"
    )
    counted = ended | loop_journal.c.kind.in_(SLOT_KINDS)
    where: list[ColumnElement[bool]] = [counted]
    if since is not None:
        where.append(loop_journal.c.at >= since)
    slots = case((loop_journal.c.count > 0, loop_journal.c.count), else_=1)
    counts = (
        select(
            loop_journal.c.loop,
            loop_journal.c.kind,
            func.count().label("n"),
            func.sum(slots).label("slots"),
        )
        .where(*where)
        .group_by(loop_journal.c.loop, loop_journal.c.kind)
    )
    count_rows, ranks = counts_and_seconds(
        db,
        counts,
        loop_journal.c.duration,
        where=[*where, ended],
        group=("loop", loop_journal.c.loop),
        percentiles=(50, 95),
    )
    outcomes: dict[str, dict[str, int]] = {}
    not_run: dict[str, dict[str, int]] = {}
    for row in count_rows:
        if row.kind in SLOT_KINDS:
            not_run.setdefault(row.loop, {})[row.kind] = int(row.slots or 0)
        else:
            outcome = row.kind.removeprefix(ITERATION_PREFIX)
            outcomes.setdefault(row.loop, {})[outcome] = int(row.n)
    result = []
    for name in sorted(set(outcomes) | set(not_run)):
        result.append(
            LoopStats(
                loop=name,
                outcomes=dict(sorted(outcomes.get(name, {}).items())),
                slots_not_run=dict(sorted(not_run.get(name, {}).items())),
                p50=ranks.at(name, 50),
                p95=ranks.at(name, 95),
            )
        )
    return result
