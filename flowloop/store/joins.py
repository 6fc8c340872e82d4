"""Child runs and their joins (SQL shared by SQLite and PostgreSQL).

Contract:

* A join row exists per visit of a call or map state (id derived from parent, state and
  visit); its parent creates it, then its children in batches, each batch one transaction
  that also counts them in ``created``. A child's id is derived too, so creating a batch
  again after a crash returns the children that exist instead of adding others.
* ``max_parallel`` without polling: at any time the first ``min(total, max_parallel +
  ended)`` children (by item index) are due; the others are created *held* (scheduled,
  ``join_state`` "held", no due time). Each child's first end — the transaction of its
  final boundary — marks the child reported, adds one to its join's counter, makes the
  next held child due (the first still held from the frontier on) and, when that was the
  last child, makes the parent due. A child that ends while held (stopped) took no slot:
  it frees none, counted apart (``ended_held``) so that the frontier moves with the ends
  that free one. No scan per child, no timer.
* An operator's retry of a child whose parent is still in the join's state and visit takes
  its end back (uncounted, ``join_state`` "open" again) when fewer than ``max_parallel``
  siblings run, in one transaction (:meth:`JoinStoreMixin.retry_child`): its next end is
  counted as a first. With fewer than ``max_parallel`` running no created child is held, so
  the frontier stays true.
* The parent's own "children started" boundary is written with :meth:`wait_join`, which
  makes it due in the same transaction if every child has already ended.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import (
    ColumnElement,
    Connection,
    and_,
    bindparam,
    case,
    exists,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from flowloop import journal as j
from flowloop.errors import StoreError
from flowloop.journal import RunRecord
from flowloop.lifecycle import FINISHED, HELD, LIVE
from flowloop.store import built
from flowloop.store.base import Boundary, NewRun, StoredRun
from flowloop.store.entries import (
    JOURNALED,
    Unreadable,
    definition_structure,
    event_row,
    stored_from_row,
    stored_waits,
)
from flowloop.store.journaled import contexts_at
from flowloop.store.schema import definitions, joins, journal, runs

RESULT_BATCH: Final = 1_000
"""Children's final contexts read per query when a join folds its results."""
PARENTS_PER_QUERY: Final = 500
"""Parents looked up in one ``IN`` list by :meth:`JoinStoreMixin.live_descendants` (under
the 999 bound variables of SQLite before 3.32)."""
OUTCOME_COLUMNS: Final = {"succeeded": joins.c.succeeded, "failed": joins.c.failed}

# A child's end, told to its join (JoinStoreMixin._report_ends): its statements built once.
# Built per end, SQLAlchemy's construction of them cost more than running them (a map of
# 2,000 items: 40 % of engine.run's time under cProfile).
_MARK_END: Final = {
    # A child's first end, told apart by where it ended: open (it held a slot, which the
    # next held child takes) or held (it never took one).
    was: update(runs)
    .where(runs.c.id == bindparam("r_id"), runs.c.join_state == was)
    .values(join_state=bindparam("r_outcome"))
    for was in ("open", "held")
}
UNREPORTED: Final = ("open", "held")
"""A child's ``join_state`` before its end has been counted in its join row."""
HELD_END: Final = "held_"
"""Prefixed to the outcome a child that ended while held leaves in its ``join_state``: a
retry of it gives back no slot (:meth:`JoinStoreMixin.retry_child`)."""
_JOIN_STATE_OF: Final = select(runs.c.join_state).where(runs.c.id == bindparam("r_id"))
_RUNNING: Final = (
    # Its children released and not ended: at most max_parallel (by the join index).
    select(func.count())
    .select_from(runs)
    .where(runs.c.join_id == bindparam("j_id"), runs.c.join_state == "open")
)
_RUN_LOCKED: Final = built.RUN_BY_ID.with_for_update()
_REOPEN: Final = update(runs).where(runs.c.id == bindparam("r_id")).values(join_state="open")
_UNCOUNT_END: Final = {
    column.name: update(joins).where(joins.c.id == bindparam("j_id")).values({column: column - 1})
    for column in (joins.c.succeeded, joins.c.failed, joins.c.stopped, joins.c.ended_held)
}
_ENDED_HELD: Final = (
    # Counted apart too: the turns come with the ends that free a slot only.
    update(joins).where(joins.c.id == bindparam("j_id")).values(ended_held=joins.c.ended_held + 1)
)
_COUNT_END: Final = {
    column.name: update(joins).where(joins.c.id == bindparam("j_id")).values({column: column + 1})
    for column in (joins.c.succeeded, joins.c.failed, joins.c.stopped)
}
_READ_JOIN: Final = select(joins).where(joins.c.id == bindparam("j_id"))
_FIND_JOIN: Final = select(joins).where(
    # By its id, or — its state renamed by a migration since — by what it is the join of.
    or_(
        and_(joins.c.id == bindparam("j_id"), joins.c.state == bindparam("j_state")),
        and_(
            joins.c.parent_id == bindparam("j_parent"),
            joins.c.state == bindparam("j_state"),
            joins.c.visit == bindparam("j_visit"),
        ),
    )
)
_RENAME_JOIN: Final = (
    update(joins)
    .where(joins.c.id == bindparam("j_id"))
    .values(state=bindparam("j_state"), visit=bindparam("j_visit"))
)
_CONTROL_OF: Final = select(runs.c.control).where(runs.c.id == bindparam("r_id"))
_LOCK_JOINS: Final = (
    select(joins.c.id)
    .where(joins.c.id.in_(bindparam("j_ids", expanding=True)))
    .order_by(joins.c.id)
    .with_for_update()
)
_FIRST_HELD: Final = (
    # The held child whose turn it is: the first from the frontier on (one that ended while
    # held is passed by: it took no slot, and its turn frees none). By the join index.
    select(runs.c.id)
    .where(
        runs.c.join_id == bindparam("j_id"),
        runs.c.child_index >= bindparam("r_index"),
        runs.c.join_state == "held",
    )
    .order_by(runs.c.child_index)
    .limit(1)
)
_RELEASE_NEXT: Final = (
    update(runs)
    .where(runs.c.id == bindparam("r_id"), runs.c.join_state == "held")
    .values(join_state="open", next_run_at=bindparam("r_at"))
)
_HELD_NEXT: Final = (
    select(runs.c.id, runs.c.last_seq, runs.c.state, runs.c.fingerprint, runs.c.owner)
    .where(runs.c.id == bindparam("r_id"), runs.c.join_state == "held")
    # PostgreSQL: a writer of the child (it holds the row KEY SHARE until it commits)
    # passes it by: this transaction holds the join's row, and waiting on that writer's
    # journal entry could deadlock with its own end. SQLite: one writer at a time.
    .with_for_update(skip_locked=True)
)
_RELEASE_TURN: Final = (
    update(runs)
    .where(
        runs.c.id == bindparam("r_id"),
        runs.c.last_seq == bindparam("r_prev"),
        runs.c.join_state == "held",
    )
    .values(join_state="open", next_run_at=bindparam("r_at"), last_seq=bindparam("r_seq"))
)
_STRUCTURE: Final = select(definitions.c.structure).where(
    definitions.c.fingerprint == bindparam("f_print")
)
_TURN: Final = {
    # The turn's entry, or nothing when a writer took its seq meanwhile (never an error:
    # it would undo the sibling's end that makes the turn).
    name: dialect_insert(journal)
    .on_conflict_do_nothing(index_elements=[journal.c.run_id, journal.c.seq])
    .execution_options(preserve_rowcount=True)
    for name, dialect_insert in (("postgresql", pg_insert), ("sqlite", sqlite_insert))
}
_RESULTS: Final = (
    select(
        runs.c.child_index,
        runs.c.id,
        runs.c.status,
        runs.c.context,
        runs.c.error,
        runs.c.last_seq,
        runs.c.context_version,
    )
    .where(runs.c.join_id == bindparam("j_id"), runs.c.child_index > bindparam("r_after"))
    .order_by(runs.c.child_index)
    .limit(RESULT_BATCH)
)
_JOIN_EXISTS: Final = select(joins.c.id).where(joins.c.id == bindparam("j_id"))
_INSERT_JOIN: Final = insert(joins)
_SET_CREATED: Final = (
    update(joins).where(joins.c.id == bindparam("j_id")).values(created=bindparam("j_created"))
)
_DUE_IF_COMPLETE: Final = (
    update(runs)
    .where(
        runs.c.id == bindparam("r_id"),
        runs.c.status == "scheduled",
        exists(
            select(joins.c.id).where(
                joins.c.id == bindparam("j_id"),
                joins.c.created >= joins.c.total,
                joins.c.succeeded + joins.c.failed + joins.c.stopped >= joins.c.total,
            )
        ),
    )
    .values(next_run_at=bindparam("r_at"))
)
_PARENT_AT: Final = select(runs.c.state, runs.c.visits).where(runs.c.id == bindparam("j_parent"))
_PARENT_DUE: Final = (
    # Only while it still waits for this join: in its state, at the visit read with it.
    update(runs)
    .where(
        runs.c.id == bindparam("j_parent"),
        runs.c.status == "scheduled",
        runs.c.state == bindparam("j_state"),
        runs.c.visits == bindparam("j_visits"),
    )
    .values(next_run_at=bindparam("r_at"))
)


def reports_end(boundary: Boundary) -> bool:
    """A child's boundary that ends it (its join hears of it in the same transaction)."""
    return boundary.record.join is not None and boundary.record.status in FINISHED


@dataclass(frozen=True, kw_only=True)
class JoinRow:
    id: str
    parent_id: str
    state: str
    visit: int
    child_workflow: str
    total: int
    created: int
    max_parallel: int
    succeeded: int = 0
    failed: int = 0
    stopped: int = 0
    ended_held: int = 0
    """Of those ended, the ones that ended while held (they freed no slot)."""

    @property
    def ended(self) -> int:
        return self.succeeded + self.failed + self.stopped

    def turn_from(self) -> int:
        """The lowest index the next held child's turn may have: each end that freed a
        slot gave one turn, in index order; the children that ended held lie beyond it."""
        return self.max_parallel + self.ended - self.ended_held - 1

    @property
    def complete(self) -> bool:
        return self.created >= self.total and self.ended >= self.total

    def runnable(self) -> int:
        """How many children (the first, by index) may be due when created now: the turns
        no held child took (each end gave one, those of held children included — the
        children they passed over were created held) lie in a batch not created yet."""
        return min(self.total, self.max_parallel + self.ended)


@dataclass(frozen=True, kw_only=True)
class ChildRow:
    index: int
    id: str
    status: str
    context: str
    error: str | None
    context_version: int = 1
    """The version ``context`` was written with: a child that ended under an older
    definition is read through the child's upcasters."""


def _join(row: Any) -> JoinRow:
    return JoinRow(
        id=row.id,
        parent_id=row.parent_id,
        state=row.state,
        visit=row.visit,
        child_workflow=row.child_workflow,
        total=row.total,
        created=row.created,
        max_parallel=row.max_parallel,
        succeeded=row.succeeded,
        failed=row.failed,
        stopped=row.stopped,
        ended_held=row.ended_held,
    )


class _Refused(Exception):
    """Rolls a transaction back: the parent's fenced write was refused."""


def _join_values(join: JoinRow, at: float) -> dict[str, Any]:
    return {
        "id": join.id,
        "parent_id": join.parent_id,
        "state": join.state,
        "visit": join.visit,
        "child_workflow": join.child_workflow,
        "total": join.total,
        "created": 0,
        "max_parallel": join.max_parallel,
        "succeeded": 0,
        "failed": 0,
        "stopped": 0,
        "created_at": at,
    }


class JoinStoreMixin:
    """Join persistence for :class:`~flowloop.store.sql.SQLStore`."""

    now_sql: ColumnElement[float]

    def _write(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _read(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _apply(self, conn: Connection, boundaries: Sequence[Boundary]) -> list[bool]:
        raise NotImplementedError  # provided by AppendStoreMixin

    def _apply_whole(self, conn: Connection, boundary: Boundary) -> bool:
        raise NotImplementedError  # provided by AppendStoreMixin

    def _fold_tails(self, conn: Connection, stored: Sequence[StoredRun]) -> list[StoredRun]:
        raise NotImplementedError  # provided by AppendStoreMixin

    def _create_many_in(
        self, conn: Connection, news: Sequence[NewRun]
    ) -> list[tuple[StoredRun, bool]]:
        raise NotImplementedError  # provided by SQLStore

    # -- the parent's side -----------------------------------------------------------------

    def open_join(self, join: JoinRow, *, at: float) -> JoinRow:
        """The join row ``join.id``: created as given when it does not exist yet, else the
        stored one (a parent resumed after a crash continues its fan-out)."""
        with self._write() as conn:
            found = conn.execute(select(joins).where(joins.c.id == join.id)).first()
            if found is not None:
                return _join(found)
            conn.execute(insert(joins).values(_join_values(join, at)))
        return join

    def find_join(self, join_id: str, parent_id: str, state: str, visit: int) -> JoinRow | None:
        """The join of ``parent_id``'s visit ``visit`` of ``state``: the row ``join_id`` (the
        id derived from them), or the one a migration that renamed the state moved to it
        (its id, and its children's, derived from the old name). One query."""
        params = {"j_id": join_id, "j_parent": parent_id, "j_state": state, "j_visit": visit}
        with self._read() as conn:
            rows = conn.execute(_FIND_JOIN, params).all()
        if not rows:
            return None
        # (One row: the id derived from them names a join of this state and visit only.)
        return _join(rows[0])

    def rename_join(self, boundary: Boundary, join_id: str, state: str, visit: int) -> bool:
        """A migration's entry (``boundary``) that renames the call or map state its run is
        in, in one transaction with its join's row: the join then belongs to ``state`` and
        the run's ``visit`` of it after the move (a renamed state merged into one it had
        visited counts on) — its claim finds it there instead of starting every child
        again. The join's row is locked first on PostgreSQL, as a child's end takes it.
        Whether it was written."""

        def lock(conn: Connection) -> None:
            if conn.dialect.name != "sqlite":
                conn.execute(_LOCK_JOINS, {"j_ids": [join_id]}).all()

        def rename(conn: Connection) -> None:
            conn.execute(_RENAME_JOIN, {"j_id": join_id, "j_state": state, "j_visit": visit})

        return self._write_whole(boundary, before=lock, after=rename)

    def get_join(self, join_id: str) -> JoinRow | None:
        with self._read() as conn:
            row = conn.execute(_READ_JOIN, {"j_id": join_id}).first()
        return None if row is None else _join(row)

    def create_children(
        self, join_id: str, first: int, build: Callable[[int], Sequence[NewRun]]
    ) -> int:
        """One transaction: lock the join row, ``build(runnable)`` the next batch of children
        (those with an index below ``runnable`` due now, the rest held), insert those that do
        not exist yet and count them in ``created``. Returns how many were new."""
        with self._write() as conn:
            row = conn.execute(select(joins).where(joins.c.id == join_id).with_for_update()).first()
            if row is None:
                raise LookupError(f"join {join_id} does not exist")
            join = _join(row)
            news = build(join.runnable())
            results = self._create_many_in(conn, news)
            conn.execute(
                update(joins)
                .where(joins.c.id == join_id)
                .values(created=func.max(joins.c.created, first + len(news)))
                if conn.dialect.name == "sqlite"
                else update(joins)
                .where(joins.c.id == join_id)
                .values(created=func.greatest(joins.c.created, first + len(news)))
            )
            return sum(1 for _, created in results if created)

    def start_children(
        self,
        join: JoinRow,
        build: Callable[[int], Sequence[NewRun]],
        boundary: Boundary,
        *,
        at: float,
    ) -> bool:
        """A fan-out that fits one batch, in ONE transaction: the join row, every child
        (``build(runnable)`` as in :meth:`create_children`) and the parent's boundary that
        leaves it waiting. A refused boundary (lost lease) undoes it all: False."""

        def fan_out(conn: Connection) -> None:
            if conn.execute(_JOIN_EXISTS, {"j_id": join.id}).first() is None:
                conn.execute(_INSERT_JOIN, _join_values(join, at))
            news = build(join.runnable())
            self._create_many_in(conn, news)
            conn.execute(_SET_CREATED, {"j_id": join.id, "j_created": len(news)})

        return self._write_whole(
            boundary, before=fan_out, after=lambda conn: self._note_request(conn, boundary)
        )

    def wait_join(self, boundary: Boundary, join_id: str) -> bool:
        """Write the parent's boundary that leaves it waiting for its children; in the same
        transaction, make it due at once if they have all ended already (the last child's
        transaction found it not waiting yet, or ran first)."""
        params = {"r_id": boundary.run_id, "j_id": join_id, "r_at": boundary.events[-1].at}

        def after(conn: Connection) -> None:
            conn.execute(_DUE_IF_COMPLETE, params)
            self._note_request(conn, boundary)

        return self._write_whole(boundary, after=after)

    def _note_request(self, conn: Connection, boundary: Boundary) -> None:
        """The pause or stop asked of a parent while its fan-out ran, read in the write that
        lets it go waiting (:meth:`request_left`): no transaction of its own for the usual
        fan-out, which finds none."""
        control = conn.execute(_CONTROL_OF, {"r_id": boundary.run_id}).scalar()
        if control is not None:
            self.__dict__.setdefault("_requests_left", {})[boundary.run_id] = control

    def request_left(self, run_id: str) -> str | None:
        """The request :meth:`_note_request` found on ``run_id`` (once), else None."""
        left: dict[str, str] = self.__dict__.get("_requests_left", {})
        return left.pop(run_id, None)

    def _write_whole(
        self,
        boundary: Boundary,
        *,
        before: Callable[[Connection], object] | None = None,
        after: Callable[[Connection], object] | None = None,
    ) -> bool:
        """One transaction that stands or falls with ``boundary``: ``before``, the boundary
        (without a savepoint: :meth:`_apply_whole`), ``after``. Refused, all of it rolls
        back: False."""
        try:
            with self._write() as conn:
                if before is not None:
                    before(conn)
                if not self._apply_whole(conn, boundary):
                    raise _Refused
                if after is not None:
                    after(conn)
        except _Refused:
            return False
        return True

    def join_results(self, join_id: str) -> Iterator[ChildRow]:
        """Every child of a join in item order, read ``RESULT_BATCH`` at a time."""
        last = -1
        while True:
            with self._read() as conn:
                rows = conn.execute(_RESULTS, {"j_id": join_id, "r_after": last}).all()
                journaled = {r.id: r.last_seq for r in rows if r.context == JOURNALED}
                kept = contexts_at(conn, journaled) if journaled else {}
            for row in rows:
                context = kept.get(row.id, row.context)
                if isinstance(context, Unreadable):  # the join fails this child's result
                    raise j.FoldError(f"child run {row.id}: {context.problem}")
                yield ChildRow(
                    index=row.child_index,
                    id=row.id,
                    status=row.status,
                    context=context,
                    error=row.error,
                    context_version=row.context_version,
                )
            if len(rows) < RESULT_BATCH:
                return
            last = rows[-1].child_index

    def children_of(self, parent_id: str) -> list[StoredRun]:
        """The parent's child runs (every call and map visit), by join and index."""
        with self._read() as conn:
            rows = conn.execute(
                select(runs)
                .where(runs.c.parent_id == parent_id)
                .order_by(runs.c.join_id, runs.c.child_index)
            )
            return self._fold_tails(conn, [stored_from_row(row) for row in rows])

    def child_counts(self, parent_id: str) -> dict[str, int]:
        """How many of the parent's children are in each status; the scheduled ones held
        back by ``max_parallel`` counted apart, as ``held``."""
        shown = case(
            (and_(runs.c.join_state == "held", runs.c.status == "scheduled"), HELD),
            else_=runs.c.status,
        ).label("shown")
        with self._read() as conn:
            rows = conn.execute(
                select(shown, func.count()).where(runs.c.parent_id == parent_id).group_by(shown)
            )
            return {row[0]: int(row[1]) for row in rows}

    def live_children(self, parent_id: str) -> list[StoredRun]:
        return [c for c in self.children_of(parent_id) if c.record.status in LIVE]

    def live_descendants(self, run_id: str) -> list[str]:
        """The ids of the run's live children, of theirs, and so on (a finished child's
        are not looked at), a generation at a time: one query per generation (and per
        :data:`PARENTS_PER_QUERY` parents), ids only. Parents before their children."""
        found: list[str] = []
        frontier = [run_id]
        with self._read() as conn:
            while frontier:
                generation: list[str] = []
                for start in range(0, len(frontier), PARENTS_PER_QUERY):
                    parents = frontier[start : start + PARENTS_PER_QUERY]
                    # Live ones kept here, not in the query: a status test there led
                    # SQLite to the status index instead of the (partial) parent index.
                    rows = conn.execute(built.CHILDREN_OF, {"r_parents": parents})
                    generation.extend(row.id for row in rows if row.status in LIVE)
                found.extend(generation)
                frontier = generation
        return found

    def is_held(self, run_id: str) -> bool:
        """A map's child whose turn has not come yet (created held, not released)."""
        with self._read() as conn:
            state = conn.execute(select(runs.c.join_state).where(runs.c.id == run_id)).scalar()
        return state == "held"

    def held_among(self, run_ids: Sequence[str]) -> set[str]:
        """Which of ``run_ids`` are scheduled children held for their turn: one read by
        primary key for a listing's page (not one per run)."""
        if not run_ids:
            return set()
        query = select(runs.c.id).where(
            runs.c.id.in_(list(run_ids)), runs.c.join_state == HELD, runs.c.status == "scheduled"
        )
        with self._read() as conn:
            return {str(row[0]) for row in conn.execute(query)}

    def parent_of(self, run_id: str) -> str | None:
        with self._read() as conn:
            value = conn.execute(select(runs.c.parent_id).where(runs.c.id == run_id)).scalar()
        return None if value is None else str(value)

    # -- the child's side ------------------------------------------------------------------

    def _write_with_ends(self, boundaries: Sequence[Boundary]) -> list[bool]:
        # (_apply journals whole contexts and drops the runs' cached ones.)
        ends = [b for b in boundaries if reports_end(b)]
        if len(boundaries) == 1:  # one end, alone: refused, nothing of it is written
            return [
                self._write_whole(
                    boundaries[0],
                    before=lambda c: self._lock_joins(c, ends),
                    after=lambda c: self._report_ends(c, ends),
                )
            ]
        with self._write() as conn:
            self._lock_joins(conn, ends)
            applied = self._apply(conn, boundaries)
            done = [b for b, ok in zip(boundaries, applied, strict=True) if ok]
            if done:
                self._report_ends(conn, [b for b in done if reports_end(b)])
        return applied

    def _release(self, conn: Connection, join_id: str, index: int, at: float) -> None:
        """A held child's turn: due now. When it rests in a wait state, the turn is
        journaled too (``run_deferred``, ``turn``: its status and reason kept, a paused
        child stays paused), so that its timeout counts from now — through a pause as well,
        which clears the due time. (Other children's turns are not: an entry per child
        would cost every map its share of a write. Nor is the turn of a child another
        writer is writing this instant, or a worker holds: it is released as before.)"""
        target = conn.execute(_FIRST_HELD, {"j_id": join_id, "r_index": index}).scalar()
        if target is None:
            return  # (the rest are not created yet: created due, by the frontier)
        where = {"r_id": target, "r_at": at}
        held = conn.execute(_HELD_NEXT, where).first()
        if (
            held is not None
            # A worker holds it (claimed at its deadline): the turn's entry would take the
            # seq of that worker's next write, refused then until its lease ran out.
            and held.owner is None
            and held.state in self._wait_states(conn, held.fingerprint)
        ):
            turn = j.JournalEvent(
                run_id=held.id,
                seq=held.last_seq + 1,
                kind=j.RUN_DEFERRED,
                at=at,
                state=held.state,
                worker="join",
                data={"due": at, "reason": j.TURN_REASON, j.TURN: True},
            )
            if conn.execute(_TURN[conn.dialect.name], event_row(turn)).rowcount == 1:
                moved = {"r_id": held.id, "r_prev": held.last_seq, "r_seq": turn.seq, "r_at": at}
                if conn.execute(_RELEASE_TURN, moved).rowcount != 1:
                    # Held, unchanged, yet not written: nothing of this end may stand.
                    raise StoreError(f"run {held.id} changed under its turn; try again")
                return
        conn.execute(_RELEASE_NEXT, where)

    def _wait_states(self, conn: Connection, fingerprint: str) -> frozenset[str]:
        """The wait states of the stored definition ``fingerprint`` (read once: a stored
        definition never changes)."""
        known: dict[str, frozenset[str]] = self.__dict__.setdefault("_wait_states_of", {})
        if fingerprint not in known:
            text = conn.execute(_STRUCTURE, {"f_print": fingerprint}).scalar()
            known[fingerprint] = frozenset(stored_waits(definition_structure(text, fingerprint)))
        return known[fingerprint]

    def retry_child(self, boundary: Boundary) -> tuple[str, JoinRow | None]:
        """An operator's retry of a child (``boundary``), in one transaction with its join.
        While its parent is still in the join's state and visit (waiting for children, or
        stopped or failed there: its own retry joins them), the child's end is taken back —
        its outcome counted no more (nor as ended held) — and it runs again as one of the
        ``max_parallel``. Refused, nothing written, when that many run already (``"full"``)
        or when a worker holds the parent with every result in (``"joining"``: it is folding
        them; the parent's row is locked here on PostgreSQL, so a claim racing this one comes
        before or after it whole). Once its parent has gone on, the join is left as it is:
        the child runs on its own. Returns ``"written"``, ``"refused"`` (the child's row
        changed: fenced), ``"full"`` or ``"joining"``, and the join."""
        record = boundary.record
        try:
            with self._write() as conn:
                self._lock_joins(conn, [boundary])
                row = conn.execute(_READ_JOIN, {"j_id": record.join}).first()
                join = None if row is None else _join(row)
                ended = conn.execute(_JOIN_STATE_OF, {"r_id": record.id}).scalar()
                parent = None if join is None else self._parent_at(conn, join)
                rejoins = parent is not None and ended is not None and ended not in UNREPORTED
                if rejoins and join is not None and parent is not None:
                    if join.complete and parent.owner is not None:
                        return "joining", join
                    if self._running(conn, join) >= join.max_parallel:
                        return "full", join  # (nothing written: the transaction ends empty)
                if not self._apply_whole(conn, boundary):
                    raise _Refused
                if rejoins and ended is not None:
                    outcome = ended.removeprefix(HELD_END)
                    column = OUTCOME_COLUMNS.get(outcome, joins.c.stopped)
                    conn.execute(_UNCOUNT_END[column.name], {"j_id": record.join})
                    if ended.startswith(HELD_END):
                        conn.execute(_UNCOUNT_END["ended_held"], {"j_id": record.join})
                    conn.execute(_REOPEN, {"r_id": record.id})
        except _Refused:
            return "refused", None
        return "written", None

    def _parent_at(self, conn: Connection, join: JoinRow) -> StoredRun | None:
        """The join's parent (as folded) when it is still in the join's state and visit;
        its row locked on PostgreSQL (a claim of it waits, or was committed first)."""
        query = built.RUN_BY_ID if conn.dialect.name == "sqlite" else _RUN_LOCKED
        row = conn.execute(query, {"r_id": join.parent_id}).first()
        if row is None:
            return None
        (parent,) = self._fold_tails(conn, [stored_from_row(row)])
        record = parent.record
        at = record.state == join.state and record.visit(join.state) == join.visit
        return parent if at else None

    @staticmethod
    def _running(conn: Connection, join: JoinRow) -> int:
        """How many of the join's children run now (released, not ended)."""
        return int(conn.execute(_RUNNING, {"j_id": join.id}).scalar_one())

    def _lock_joins(self, conn: Connection, ends: Sequence[Boundary]) -> None:
        """PostgreSQL: the joins of children's ends locked before the children's rows are
        written. A sibling's end holds the join's row when its release waits for the next
        held child's row; a held child's end that took its own row first and then waited
        for the join's made a deadlock. Joins before runs, in id order, makes none.
        (SQLite: one writer at a time.)"""
        if conn.dialect.name == "sqlite":
            return
        ids = sorted({b.record.join for b in ends if b.record.join is not None})
        if ids:
            conn.execute(_LOCK_JOINS, {"j_ids": ids}).all()

    def _report_ends(self, conn: Connection, boundaries: Sequence[Boundary]) -> None:
        """The join's side of children's ends, in their final transaction: each child's
        first end is counted once; it releases the next held child; the last one makes
        the parent due."""
        for boundary in boundaries:
            record: RunRecord = boundary.record
            outcome = record.status
            at = boundary.events[-1].at if boundary.events else 0.0
            mark = {"r_id": record.id, "r_outcome": outcome}
            freed = conn.execute(_MARK_END["open"], mark).rowcount == 1
            if not freed:
                mark["r_outcome"] = HELD_END + outcome
                if conn.execute(_MARK_END["held"], mark).rowcount != 1:
                    # Reported before: an operator retried it once its map had every result.
                    continue
            column = OUTCOME_COLUMNS.get(outcome, joins.c.stopped)
            conn.execute(_COUNT_END[column.name], {"j_id": record.join})
            if not freed:  # ended held (stopped): it frees no slot
                conn.execute(_ENDED_HELD, {"j_id": record.join})
            join = _join(conn.execute(_READ_JOIN, {"j_id": record.join}).one())
            nxt = join.turn_from()
            if freed and nxt < join.created:
                # The held child whose turn it is now (none among those created: the turn
                # goes to one not created yet, created due).
                self._release(conn, join.id, nxt, at)
            if join.complete:
                self._wake_parent(conn, join, at)

    @staticmethod
    def _wake_parent(conn: Connection, join: JoinRow, at: float) -> None:
        """Make the join's parent due for its last child's end — unless it no longer waits
        for this join: it went on meanwhile (its deadline passed while another worker ran
        the child, whose stop came at its next boundary), or came back to the state on a
        later visit. Made due there, it was woken early: a parent asleep after its
        deadline (``step.sleep``) ran its next step at once. (A scheduled parent's row is
        whole: written when it was let go.)"""
        row = conn.execute(_PARENT_AT, {"j_parent": join.parent_id}).first()
        if row is None or row.state != join.state:
            return
        try:
            visits = json.loads(row.visits)
        except ValueError:
            visits = None  # (a damaged row: its claim says so; waking it does no harm)
        if isinstance(visits, dict) and visits.get(join.state, 0) != join.visit:
            return
        params = {"j_parent": join.parent_id, "r_at": at}
        conn.execute(_PARENT_DUE, {**params, "j_state": join.state, "j_visits": row.visits})
