"""History retention: delete finished runs older than a cutoff, with their journal, inbox and
join rows (the call/map joins they were the parent of), old loop journal entries and old
breaker journal entries, in batches (one short transaction each).

What is kept, always: live runs (``scheduled``, ``running``, ``retrying``, ``paused`` …),
runs that finished at or after the cutoff, the finished descendants of a run that stays
(its join reads their results when it gets on, or is retried), and with ``keep_failed``
every ``failed`` run (and failed loop iterations). A run goes with its family: a finished
run with no parent left and its finished descendants — only when none of its descendants
stays (a run kept keeps its parent, at any depth, as prune reads them: a child an operator
retries between that read and its family's DELETE may be left naming a gone parent).
A run is deleted
only if it is still finished and old when its batch deletes it and its parent is gone (a
root, or deleted before it: a family goes top down, a generation per statement, and once a
run is gone nobody can retry it): the DELETE re-checks both, so an operator's retry racing
with prune either wins (the run and everything below it are kept) or finds the run gone.

A breaker's journal entries (``opened``, ``half_opened``, ``closed``) older than the cutoff
go, except its latest ``opened`` entry and every entry after it, whatever their age: the
breaker's current or last episode (why it opened, its trials, its closing), which is what
an operator reading the journal asks about its present state. Nothing else reads the
journal: the breaker's maths (flowloop/flowcontrol.py) works on its row in
``flowloop_breakers`` (status, the failures within ``within``, ``until``, the trial call)
and the next entry's seq comes from that row's ``last_seq``, so no seq is ever reused.

A join row goes with its parent, unless a child of it has not reported its end yet (a
child held by a worker when its parent was stopped only gets a stop request): that child's
final transaction updates the join row, so the row stays, and a later prune deletes it
once the child has ended (its parent gone).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    and_,
    case,
    delete,
    exists,
    func,
    literal,
    or_,
    select,
)

from flowloop.store.joins import UNREPORTED
from flowloop.store.reads import reading
from flowloop.store.schema import breaker_journal, inbox, joins, journal, loop_journal, runs

DEFAULT_BATCH: Final = 500
"""Runs per transaction: short enough that workers sharing the database barely wait."""
LOOP_BATCH_FACTOR: Final = 10
"""Loop journal entries are small: this many times ``batch`` per transaction."""
FINISHED: Final = ("succeeded", "failed", "stopped")
FAILED_ITERATIONS: Final = ("iteration_failed", "iteration_interrupted")


@dataclass
class PruneResult:
    cutoff: float
    runs: int = 0
    journal: int = 0
    inbox: int = 0
    joins: int = 0
    loop_journal: int = 0
    breaker_journal: int = 0
    batches: int = 0
    dry_run: bool = False

    def as_dict(self) -> dict[str, float | int | bool]:
        return {
            "cutoff": self.cutoff,
            "runs": self.runs,
            "journal": self.journal,
            "inbox": self.inbox,
            "joins": self.joins,
            "loop_journal": self.loop_journal,
            "breaker_journal": self.breaker_journal,
            "batches": self.batches,
            "dry_run": self.dry_run,
        }


def statuses(keep_failed: bool) -> tuple[str, ...]:
    return tuple(s for s in FINISHED if not (keep_failed and s == "failed"))


_parent = runs.alias("parent")


def _finished_before(table: Any, kinds: Sequence[str], cutoff: float) -> ColumnElement[bool]:
    return and_(table.c.status.in_(list(kinds)), table.c.updated_at < cutoff)


def _root(kinds: Sequence[str], cutoff: float) -> ColumnElement[bool]:
    """A run finished (as ``kinds``) before ``cutoff`` with no parent (left): it goes with
    its finished descendants (:func:`_family`). A child goes with its parent or after it,
    never before: a call's or map's join reads its children's final contexts when the
    parent gets on (a paused parent, a map waiting for its last child, a failed one kept
    and retried — at any depth), so pruned first, its reduce saw fewer results or the call
    failed."""
    return and_(
        _finished_before(runs, kinds, cutoff),
        or_(runs.c.parent_id.is_(None), ~exists().where(_parent.c.id == runs.c.parent_id)),
    )


def _family(roots: Any, kinds: Sequence[str], cutoff: float) -> Any:
    """``roots`` (a select of run ids) and their descendants finished before ``cutoff``,
    down through those only (a child that stays keeps its own), each with its depth."""
    tree = select(runs.c.id, literal(0).label("depth")).where(runs.c.id.in_(roots))
    tree_cte = tree.cte("family", recursive=True)
    child = runs.alias("child")
    return tree_cte.union_all(
        select(child.c.id, (tree_cte.c.depth + 1).label("depth")).where(
            child.c.parent_id == tree_cte.c.id, _finished_before(child, kinds, cutoff)
        )
    )


def _held_by_below(roots: Any, kinds: Sequence[str], cutoff: float) -> Any:
    """The runs of ``roots`` (a select of run ids, or a list) with a descendant, at any
    depth, that stays — live, finished at or after ``cutoff``, or failed and kept: such a
    run stays too, so a run kept never names a parent that is gone (a failed map child
    ``--keep-failed`` kept lost its parent: `flowloop status` named a run that no longer
    existed, the dashboard linked to a 404)."""
    top = runs.alias("below_top")
    tree = select(top.c.id, top.c.id.label("root")).where(top.c.id.in_(roots))
    tree_cte = tree.cte("below", recursive=True)
    child = runs.alias("below_child")
    tree_cte = tree_cte.union_all(
        select(child.c.id, tree_cte.c.root).where(child.c.parent_id == tree_cte.c.id)
    )
    staying = runs.alias("staying")
    return (
        select(tree_cte.c.root)
        .join(staying, staying.c.id == tree_cte.c.id)
        .where(~_finished_before(staying, kinds, cutoff))
    )


def prune(
    db: Engine,
    *,
    cutoff: float,
    keep_failed: bool = False,
    loop_history: bool = True,
    batch: int = DEFAULT_BATCH,
    dry_run: bool = False,
) -> PruneResult:
    """Delete runs that finished before ``cutoff`` (UTC epoch seconds, judged by the run's
    last update) with their journal and inbox rows, and loop journal entries older than
    ``cutoff`` (``loop_history``), and breaker journal entries older than ``cutoff`` but
    each breaker's latest episode (:func:`_breaker_keeps`). With ``dry_run`` count what
    would go, delete nothing."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    result = PruneResult(cutoff=cutoff, dry_run=dry_run)
    kinds = statuses(keep_failed)
    if dry_run:
        _count(db, result, kinds, keep_failed, loop_history)
        return result
    after = ""
    while True:
        with reading(db) as reader:
            candidates = list(
                reader.execute(
                    select(runs.c.id)
                    .where(runs.c.id > after, _root(kinds, cutoff))
                    .order_by(runs.c.id)
                    .limit(batch)
                ).scalars()
            )
            if not candidates:
                break
            after = candidates[-1]
            held = set(reader.execute(_held_by_below(candidates, kinds, cutoff)).scalars())
            roots = [run_id for run_id in candidates if run_id not in held]
            if not roots:
                continue
            family = _family(roots, kinds, cutoff)
            # The roots first, then down, a generation per DELETE: once a run is gone nobody
            # can retry it, and a run goes only once its parent has (one retried meanwhile
            # keeps what is below it, at any depth). Cut off between two transactions, what
            # is left are runs whose parent is gone: roots of the next prune.
            rows = [
                (row.id, int(row.depth))
                for row in reader.execute(
                    select(family.c.id, family.c.depth).order_by(family.c.depth)
                )
            ]
        for first in range(0, len(rows), batch):
            _delete_batch(db, rows[first : first + batch], kinds, cutoff, result)
    _prune_orphaned_joins(db, batch, result)
    if loop_history:
        _prune_loop_journal(db, cutoff, keep_failed, batch * LOOP_BATCH_FACTOR, result)
    _prune_breaker_journal(db, cutoff, batch * LOOP_BATCH_FACTOR, result)
    return result


def _delete_batch(
    db: Engine,
    rows: Sequence[tuple[str, int]],
    kinds: Sequence[str],
    cutoff: float,
    result: PruneResult,
) -> None:
    """One short transaction of :func:`_delete_runs`, a generation (``(id, depth)`` rows of
    one depth) per statement, the shallowest first."""
    with db.begin() as conn:
        _lock_joins(conn, [run_id for run_id, _ in rows])
        for depth in sorted({depth for _, depth in rows}):
            _delete_runs(conn, [run_id for run_id, d in rows if d == depth], kinds, cutoff, result)
    result.batches += 1


def _lock_joins(conn: Connection, ids: Sequence[str]) -> None:
    """PostgreSQL: the join rows a batch may delete (its runs' as parents) or that its runs
    report to, all of them at once in id order, before any run's row — joins before runs,
    as a child's end, a worker's batch of ends and an operator's retry of a child take them
    (a generation at a time, they came out of order across generations: a deadlock)."""
    if conn.dialect.name != "postgresql":
        return
    child_joins = select(runs.c.join_id).where(runs.c.id.in_(list(ids)))
    conn.execute(
        select(joins.c.id)
        .where(or_(joins.c.parent_id.in_(list(ids)), joins.c.id.in_(child_joins)))
        .order_by(joins.c.id)
        .with_for_update()
    ).all()


def _delete_runs(
    conn: Connection, ids: Sequence[str], kinds: Sequence[str], cutoff: float, result: PruneResult
) -> None:
    # The run rows first, re-checked under their lock: only what is still finished and old,
    # with no parent left (a root, or a child whose parent went first: one retried meanwhile
    # keeps it), goes, and only its journal and inbox rows follow it. (PostgreSQL: the join
    # rows locked first, by _delete_batch.)
    gone = list(
        conn.execute(
            delete(runs)
            .where(
                runs.c.id.in_(list(ids)),
                _finished_before(runs, kinds, cutoff),
                or_(
                    runs.c.parent_id.is_(None),
                    ~exists().where(_parent.c.id == runs.c.parent_id),
                ),
            )
            .returning(runs.c.id)
        ).scalars()
    )
    if not gone:
        return
    result.runs += len(gone)
    result.journal += conn.execute(delete(journal).where(journal.c.run_id.in_(gone))).rowcount
    result.inbox += conn.execute(delete(inbox).where(inbox.c.run_id.in_(gone))).rowcount
    result.joins += conn.execute(
        delete(joins).where(_unneeded(joins.c.parent_id.in_(gone)))
    ).rowcount


def _unneeded(joins_of: ColumnElement[bool]) -> ColumnElement[bool]:
    """The join rows matching ``joins_of`` that no child still needs: a child that has not
    reported its end updates its join row when it does."""
    pending = runs.alias("pending")
    return joins_of & ~exists().where(
        pending.c.join_id == joins.c.id, pending.c.join_state.in_(UNREPORTED)
    )


def _orphaned() -> ColumnElement[bool]:
    """Join rows whose parent is gone and whose last child has reported since (kept by an
    earlier prune while that child was live)."""
    return _unneeded(~exists().where(runs.c.id == joins.c.parent_id))


def _prune_orphaned_joins(db: Engine, batch: int, result: PruneResult) -> None:
    # Found in a read (no write lock while the join table is scanned), then deleted by id
    # in short batches, the condition checked again under the lock.
    with reading(db) as reader:
        ids = list(reader.execute(select(joins.c.id).where(_orphaned())).scalars())
    for first in range(0, len(ids), batch):
        with db.begin() as conn:
            result.joins += conn.execute(
                delete(joins).where(joins.c.id.in_(ids[first : first + batch]), _orphaned())
            ).rowcount
        result.batches += 1


def _loop_ranges(conn: Connection, cutoff: float) -> list[tuple[str, int, int]]:
    """Per loop: the seq range (first, last) of its journal entries older than ``cutoff``.
    A loop's seq grows with time, so the old entries are a prefix."""
    rows = conn.execute(
        select(loop_journal.c.loop, func.min(loop_journal.c.seq), func.max(loop_journal.c.seq))
        .where(loop_journal.c.at < cutoff)
        .group_by(loop_journal.c.loop)
    ).all()
    return [(row[0], int(row[1]), int(row[2])) for row in rows]


def _prune_loop_journal(
    db: Engine, cutoff: float, keep_failed: bool, batch: int, result: PruneResult
) -> None:
    with reading(db) as reader:
        ranges = _loop_ranges(reader, cutoff)
    for name, first, last in ranges:
        low = first
        while low <= last:
            high = min(last, low + batch - 1)
            where = [
                loop_journal.c.loop == name,
                loop_journal.c.seq.between(low, high),
                loop_journal.c.at < cutoff,
            ]
            if keep_failed:
                where.append(loop_journal.c.kind.not_in(FAILED_ITERATIONS))
            with db.begin() as conn:
                result.loop_journal += conn.execute(delete(loop_journal).where(*where)).rowcount
            result.batches += 1
            low = high + 1


def _breaker_keeps() -> Any:
    """Per breaker, the first seq prune keeps: its latest ``opened`` entry's (with none,
    its latest entry's). That entry and every one after it — the breaker's current or last
    episode — tell its present state; nothing else reads the journal (its row in
    ``flowloop_breakers`` holds the state and the next seq). One grouped read of the
    journal (its primary key is (name, seq))."""
    opened = case((breaker_journal.c.kind == "opened", breaker_journal.c.seq))
    return select(
        breaker_journal.c.name,
        func.coalesce(func.max(opened), func.max(breaker_journal.c.seq)).label("keep_from"),
    ).group_by(breaker_journal.c.name)


def _prune_breaker_journal(db: Engine, cutoff: float, batch: int, result: PruneResult) -> None:
    # Per breaker, its entries before the one it keeps from, older than the cutoff, deleted
    # ``batch`` seqs at a time. A breaker opening meanwhile only moves its keep point on:
    # what is below the old one is below the new one too.
    with reading(db) as reader:
        keeps = [(row.name, int(row.keep_from)) for row in reader.execute(_breaker_keeps())]
    for name, keep_from in keeps:
        with reading(db) as reader:
            first, last = reader.execute(
                select(func.min(breaker_journal.c.seq), func.max(breaker_journal.c.seq)).where(
                    breaker_journal.c.name == name,
                    breaker_journal.c.at < cutoff,
                    breaker_journal.c.seq < keep_from,
                )
            ).one()
        if first is None:
            continue  # nothing old below its keep point: no transaction for it
        low, end = int(first), int(last)
        while low <= end:
            high = min(end, low + batch - 1)
            with db.begin() as conn:
                result.breaker_journal += conn.execute(
                    delete(breaker_journal).where(
                        breaker_journal.c.name == name,
                        breaker_journal.c.seq.between(low, high),
                        breaker_journal.c.at < cutoff,
                    )
                ).rowcount
            result.batches += 1
            low = high + 1


def _count_breaker_journal(conn: Connection, cutoff: float) -> int:
    keeps = _breaker_keeps().subquery("keeps")
    return int(
        conn.execute(
            select(func.count())
            .select_from(breaker_journal)
            .join(keeps, keeps.c.name == breaker_journal.c.name)
            .where(breaker_journal.c.at < cutoff, breaker_journal.c.seq < keeps.c.keep_from)
        ).scalar_one()
    )


def _count(
    db: Engine, result: PruneResult, kinds: Sequence[str], keep_failed: bool, loop_history: bool
) -> None:
    candidates = select(runs.c.id).where(_root(kinds, result.cutoff))
    # An anti-join (NOT EXISTS), not NOT IN: PostgreSQL runs NOT IN over a subquery too
    # large for work_mem as a subplan scanned once per candidate (a review measured over
    # 150 s at 400k runs with --keep-failed, against 5 s before the rule).
    held = _held_by_below(candidates, kinds, result.cutoff).distinct().cte("held_roots")
    roots = candidates.where(~exists(select(held.c.root).where(held.c.root == runs.c.id)))
    old = select(_family(roots, kinds, result.cutoff).c.id)
    with reading(db) as conn:
        result.runs = int(
            conn.execute(select(func.count()).select_from(old.subquery())).scalar_one()
        )
        result.journal = int(
            conn.execute(
                select(func.count()).select_from(journal).where(journal.c.run_id.in_(old))
            ).scalar_one()
        )
        result.inbox = int(
            conn.execute(
                select(func.count()).select_from(inbox).where(inbox.c.run_id.in_(old))
            ).scalar_one()
        )
        result.joins = int(
            conn.execute(
                select(func.count())
                .select_from(joins)
                .where(_unneeded(joins.c.parent_id.in_(old)) | _orphaned())
            ).scalar_one()
        )
        if loop_history:
            query = (
                select(func.count())
                .select_from(loop_journal)
                .where(loop_journal.c.at < result.cutoff)
            )
            if keep_failed:
                query = query.where(loop_journal.c.kind.not_in(FAILED_ITERATIONS))
            result.loop_journal = int(conn.execute(query).scalar_one())
        result.breaker_journal = _count_breaker_journal(conn, result.cutoff)


VACUUMED_TABLES: Final = (runs, journal, inbox, joins, loop_journal, breaker_journal)
TRUNCATE_RETRY_S: Final = 2.0
TRUNCATE_PAUSE_S: Final = 0.05
"""SQLite: the WAL's truncating checkpoint after ``VACUUM`` is tried again, this far apart,
while another checkpoint holds its lock, until 2 s have passed (a try that waits for
readers waits out the busy timeout, as the single try before did)."""


def vacuum(db: Engine) -> str:
    """Make the space of deleted rows usable again; what was done, for the operator.

    PostgreSQL: a plain ``VACUUM (ANALYZE)`` of flowloop's tables. Deleted rows keep their
    space until vacuumed (autovacuum does it eventually); vacuumed space is reused by new
    rows but the files do not shrink — that takes ``VACUUM FULL`` or pg_repack, which lock
    the tables against the workers, so flowloop leaves it to the operator.
    SQLite: ``VACUUM`` rewrites the file without the free pages (the file shrinks); it
    holds the write lock while it runs, so workers wait for it.
    """
    if db.dialect.name == "postgresql":
        names = ", ".join(db.dialect.identifier_preparer.format_table(t) for t in VACUUMED_TABLES)
        with db.connect() as conn:
            conn = conn.execution_options(isolation_level="AUTOCOMMIT")
            # Not cut off by a worker's statement timeout (flowloop.store.dialect): a
            # large history takes a while to vacuum, and nothing waits on this session.
            conn.exec_driver_sql("SET statement_timeout = 0")
            conn.exec_driver_sql(f"VACUUM (ANALYZE) {names}")
        return "vacuumed (space reusable by new rows; files shrink only with VACUUM FULL)"
    with db.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        raw.execute("VACUUM")
        # In WAL mode the rewritten database sits in the WAL until a checkpoint. A store's
        # checkpointing thread (flowloop/store/checkpointer.py) may hold the checkpoint
        # lock for a moment, and SQLite then answers busy at once (no busy handler for it).
        deadline = time.monotonic() + TRUNCATE_RETRY_S
        while raw.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]:  # busy
            if time.monotonic() > deadline:
                break
            time.sleep(TRUNCATE_PAUSE_S)
    return "vacuumed (the database file was rewritten without its free pages)"
