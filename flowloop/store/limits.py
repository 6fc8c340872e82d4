"""Flow control in the database: claims under concurrency limits, rate-limit buckets and
circuit breakers (SQL shared by SQLite and PostgreSQL; the decisions are the pure functions
of :mod:`flowloop.flowcontrol`).

Concurrency. A run *holds a slot* while a worker owns it with a lease still running by the
database's clock — from its claim to the write that releases it (finished, waiting,
sleeping, backing off, handed back). Claims of limited workflows count the slots held and
take only what fits, inside the claim transaction: on SQLite under ``BEGIN IMMEDIATE``
(one writer at a time); on PostgreSQL after a transaction-scoped advisory lock taken by
every claim of a limited workflow, so two workers claiming at once cannot both see room
for the same slot (the lock is taken by its own statement first: a statement's snapshot
is taken when it starts, so counting in the same statement would still race). Claims of
unlimited workflows keep the one-statement ``SKIP LOCKED`` claim and take no lock.

Round-robin. Runs of a workflow with a ``concurrency_key`` are claimed by their key's
turn (:data:`_TURN`): the first run of every key, then the second of every key, … —
counting the key's runs held, within one priority; on a turn, by their place in their
key's queue (``limit_rank``: the key's live runs + 1 when created). A key with 10,000
queued runs gets one slot per round like a key with one.

Within a key, oldest first: a key's candidates go in the order they were created
(:data:`_QUEUED`), however their due times moved, up to its limit.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Final

from sqlalchemy import ColumnElement, Connection, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError

from flowloop.flowcontrol import (
    Admission,
    Breaker,
    BreakerState,
    Bucket,
    RateLimit,
    admit,
    failed,
    parse_call,
    succeeded,
    take_all,
)
from flowloop.lifecycle import LIVE
from flowloop.store import claims, dialect
from flowloop.store.base import BreakerRow, NewRun
from flowloop.store.schema import breaker_journal, breakers, journal, rate_limits, runs

UNLIMITED: Final = 1_000_000_000
LOCK_KEY: Final = "flowloop limited claims"
# A counted claim ranks only the first `claims.window(limit)` due runs (4 x limit + 32, in
# claim order, keys at their limit left out), not the whole queue: it may then take fewer
# runs than fit (when the candidates crowd into few keys), never none while some run may
# go — the oldest run of a key below its limit always qualifies.


@dataclass(frozen=True)
class ClaimLimits:
    """What the claim of one workflow must respect (``None``: no such limit)."""

    max_concurrency: int | None = None
    key_limit: int | None = None
    keyed: bool = False


@dataclass(frozen=True, kw_only=True)
class BreakerEntry:
    name: str
    seq: int
    kind: str
    at: float
    worker: str | None
    data: Mapping[str, Any]


@dataclass(frozen=True, kw_only=True)
class RateRow:
    name: str
    last_grant: float | None
    queue_end: float
    grants: int
    deferrals: int


_DUE_SQL: Final = """r.workflow = :p_workflow AND r.status IN ('scheduled', 'retrying')
    AND r.next_run_at <= :p_now"""
"""A due run of the workflow."""
_ROOM_SQL: Final = """(r.owner IS NULL OR r.lease_expires_at < {now}) {ids}
    AND (r.limit_key IS NULL
         OR r.limit_key NOT IN (SELECT limit_key FROM per_key WHERE n >= :p_key_limit))"""
"""A run nobody holds, that its key's limit leaves room for (``{now}``: the database's
clock; ``{ids}``: the scope's test, or nothing)."""
_RANKED_SQL: Final = """SELECT r.id, r.priority, r.next_run_at, r.limit_key,
         coalesce(r.limit_rank, 0) AS lr, r.created_at
  FROM flowloop_runs r{indexed}
  WHERE {where}
  ORDER BY r.priority DESC, lr, r.next_run_at, r.id
  LIMIT :p_scan"""
"""The candidates of a claim of a workflow with keys (or of a scope of runs): its first due
runs with room, a key's place in its queue (``lr``) before the due time, with their
creation (:data:`_QUEUED`). The order is not the due index's: every due run of the
workflow is read and sorted (10 ms with 20,000 due, bench/due_backlog.py) — for a
workflow with keys only when the window read from the keyed due index comes up short
(claims.keyed_window)."""
_QUEUED: Final = "CASE WHEN c.limit_key IS NULL THEN c.next_run_at ELSE c.created_at END"
"""A candidate's order within its key (``ranked``'s ``rn``, then its id): its creation,
which never moves. A run retried at once, recovered after its worker died
(``step_interrupted``, due at recovery) or deferred is due later than its key's runs
created after it, yet goes before them once due (ranked by due time, it went after every
one); a run started for later (``run_at``), once due, before its key's runs started after
it. Not ``limit_rank``: the key's live runs at creation are not monotonic (once runs
ahead end, a newer run counts fewer than an older one still queued; a run started later
went first: tests/integration/test_key_order.py). Runs without a key: by due time, as a
workflow's runs are claimed without keys (all of them, in the claim of a workflow whose
definition has no key: ``c.next_run_at`` there)."""
_TURN: Final = "CASE WHEN lr = 0 THEN 0 ELSE rn + kn END"
"""A candidate's turn among its key's runs (``ordered``): the key's runs held now plus its
place among the key's candidates (``rn``, by creation). The claim takes the first run of
every key, then the second…, by turn, then by place in the key's queue (``lr``), so a
key's runs are taken oldest first whatever their places: ordered by place first, a run
started later, whose place was smaller (once runs ahead of it ended), went before an
older one of its key when ``key_limit`` let both go (tests/integration/test_key_order.py).
While none of a key's runs end, its turns are its runs' places: the round-robin the places
gave. Runs without a key or a place (``lr`` 0): turn 0, first, by
``rn``, as before."""
_CLAIM_SQL: Final = """
WITH {priorities}held AS (
  SELECT limit_key FROM flowloop_runs
  WHERE owner IS NOT NULL AND {plus}workflow = :p_workflow AND lease_expires_at >= {now}
),
per_key AS (
  SELECT limit_key, count(*) AS n FROM held WHERE limit_key IS NOT NULL GROUP BY limit_key
),
candidates AS (
  {candidates}
),
ranked AS (
  SELECT c.id, c.priority, c.next_run_at, c.lr,
         row_number() OVER (
           PARTITION BY c.limit_key ORDER BY c.priority DESC, {queued}, c.id
         ) AS rn,
         coalesce(k.n, 0) AS kn
  FROM candidates c LEFT JOIN per_key k ON k.limit_key = c.limit_key
),
ordered AS (
  SELECT id, row_number() OVER (
           ORDER BY priority DESC, {turn}, lr, rn, next_run_at, id
         ) AS g
  FROM ranked WHERE rn + kn <= :p_key_limit
)
UPDATE flowloop_runs
SET owner = :p_worker, lease_epoch = lease_epoch + 1, lease_expires_at = {now} + :p_lease
FROM (
    SELECT id AS chosen FROM ordered
    WHERE g <= :p_limit AND g + (SELECT count(*) FROM held) <= :p_max
  ) AS picked
WHERE flowloop_runs.id = picked.chosen
  AND flowloop_runs.status IN ('scheduled', 'retrying')
  AND (flowloop_runs.owner IS NULL OR flowloop_runs.lease_expires_at < {now})
RETURNING *
"""


class LimitStoreMixin:
    """Concurrency-limited claims, rate-limit buckets and breakers (mixed into SQLStore)."""

    now_sql: ColumnElement[float]
    engine: Any
    _claim_limits: dict[str, ClaimLimits]

    def _write(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    def _read(self) -> AbstractContextManager[Connection]:  # provided by SQLStore
        raise NotImplementedError

    # -- concurrency -----------------------------------------------------------------------

    def set_claim_limits(self, limits: Mapping[str, ClaimLimits]) -> None:
        """The workflows whose claims count slots (cluster-wide ``max_concurrency``,
        ``concurrency_key``/``key_limit``); the others claim as before."""
        self._claim_limits = dict(limits)
        self._limited_sql: dict[tuple[bool, bool, bool], Any] = {}

    def _limited_statement(self, by_id: bool, looked_up: bool, keyed: bool) -> Any:
        """The limited claim of workflow ``p_workflow``: of the runs ``p_ids`` (``by_id``;
        looked up by id when ``looked_up``) or of the workflow's due runs, read a segment
        at a time (claims.py); those of a workflow without keys (not ``keyed``) only up to
        their window, as they come in claim order."""
        key = (by_id, looked_up, keyed)
        cache: dict[tuple[bool, bool, bool], Any] = self.__dict__.setdefault("_limited_sql", {})
        found = cache.get(key)
        if found is None:
            now = str(self.now_sql.compile(dialect=self.engine.dialect))
            postgres = self.engine.dialect.name == "postgresql"
            scope = dialect.ids_in_sql("r.id", "p_ids", postgres=postgres) if by_id else ""
            segmented = not by_id
            room = _ROOM_SQL.format(now=now, ids="")
            ranges = ""
            if looked_up:  # a small family's runs, by their ids (see dialect.within_ids)
                where = f"{scope} AND +({_DUE_SQL} AND {room})"
            elif segmented:  # the due runs by the due index's ranges (claims.py)
                # keyed: the ranked read is the keyed window's fallback (claims.keyed_window)
                until, gate = claims.unless_whole(postgres=postgres) if keyed else (":p_now", "")
                priorities, due = claims.limited_candidates(postgres=postgres, until=until)
                ranges = f"RECURSIVE {priorities},\n"
                where = f"{due} AND {room}{gate}"
            else:
                scoped = _ROOM_SQL.format(now=now, ids=f"AND {scope}" if scope else "")
                where = f"{_DUE_SQL} AND {scoped}"
            # SQLite: the runs held now by the owner index, not every run of the workflow
            # by its own (its finished runs too: a limited claim slowed as they piled up).
            # It reads every held run of every workflow, once per limited workflow a claim
            # looks at: cheap while a few hundred runs are held at a time.
            plus = "" if postgres else "+"
            indexed = f" {claims.DUE_INDEX}" if segmented and not postgres else ""
            ranked = _RANKED_SQL.format(where=where, indexed=indexed)
            queued = _QUEUED
            if segmented and not keyed:
                candidates = claims.limited_window(room, postgres=postgres)
                queued = "c.next_run_at"  # no keys
            elif segmented:  # the keyed index's window, or the ranked read when short
                candidates = claims.keyed_window(room, ranked, postgres=postgres)
            else:
                candidates = ranked
            found = text(
                _CLAIM_SQL.format(
                    now=now,
                    plus=plus,
                    priorities=ranges,
                    candidates=candidates,
                    queued=queued,
                    turn=_TURN,
                )
            )
            cache[key] = found
        return found

    def _claim_limited(
        self,
        conn: Connection,
        names: Sequence[str],
        *,
        worker: str,
        lease_seconds: float,
        limit: int,
        now: float,
        ids: str | list[str] | None,
        looked_up: bool,
    ) -> list[Any]:
        """Claim due runs of limited workflows ``names`` within ``conn``'s transaction:
        per workflow, at most what its limits leave free (rows of the run table); with
        ``ids`` (:func:`~flowloop.store.dialect.ids_value`), only those runs."""
        if self.engine.dialect.name == "postgresql":
            # Serializes limited claims (see the module docstring); held until commit.
            conn.exec_driver_sql(
                "SELECT pg_advisory_xact_lock(hashtext(current_schema() || %(key)s))",
                {"key": LOCK_KEY},
            )
        rows: list[Any] = []
        for name in sorted(names):
            if limit - len(rows) <= 0:
                break
            spec = self._claim_limits[name]
            params: dict[str, Any] = {
                "p_workflow": name,
                "p_now": now,
                "p_worker": worker,
                "p_lease": lease_seconds,
                "p_limit": limit - len(rows),
                "p_max": spec.max_concurrency or UNLIMITED,
                "p_key_limit": spec.key_limit or UNLIMITED,
                "p_scan": claims.window(limit - len(rows)),
                "p_examine": claims.examined(limit - len(rows)),
            }
            if ids is not None:
                params["p_ids"] = ids
            statement = self._limited_statement(ids is not None, looked_up, spec.keyed)
            rows.extend(conn.execute(statement, params))
        return rows

    def _ranked(self, conn: Connection, news: Sequence[NewRun]) -> list[NewRun]:
        """``news`` with the place each keyed run takes in its key's queue: its key's live
        runs (in the database and earlier in ``news``) plus one. One grouped count per
        workflow, on the partial (workflow, limit_key) index; unkeyed runs unchanged."""
        wanted: dict[str, set[str]] = {}
        for new in news:
            if new.limit_key is not None:
                wanted.setdefault(new.record.workflow, set()).add(new.limit_key)
        if not wanted:
            return list(news)
        live: Counter[tuple[str, str]] = Counter()
        for workflow, keys in wanted.items():
            rows = conn.execute(
                select(runs.c.limit_key, func.count())
                .where(
                    runs.c.workflow == workflow,
                    runs.c.limit_key.in_(sorted(keys)),
                    runs.c.status.in_(sorted(LIVE)),
                )
                .group_by(runs.c.limit_key)
            )
            live.update({(workflow, key): int(n) for key, n in rows})
        ranked = []
        for new in news:
            if new.limit_key is None:
                ranked.append(new)
                continue
            slot = (new.record.workflow, new.limit_key)
            live[slot] += 1
            ranked.append(dataclasses.replace(new, limit_rank=live[slot]))
        return ranked

    # -- rate limits -----------------------------------------------------------------------

    def take_tokens(
        self, limits: Sequence[RateLimit], *, queued: set[str], lead: float = 0.0
    ) -> tuple[bool, float, float]:
        """Take one token of each of ``limits``, all or nothing, by the database's clock
        (one transaction; the buckets' rows are locked, so workers take turns). Returns
        ``(True, at, now)``: granted for ``at`` (``now`` or up to ``lead`` s later: call
        then), or ``(False, due, now)``: come back at ``due`` (a new caller was given a
        slot in each refusing limit's queue). ``queued``: names of the limits that
        rescheduled this caller before (it comes back for its slot)."""
        ordered = sorted(limits, key=lambda limit: limit.name)
        names = [limit.name for limit in ordered]
        self._ensure_rows(
            rate_limits, [{"name": n, "queue_end": 0.0, "updated_at": 0.0} for n in names]
        )
        with self._write() as conn:
            found = {
                row.name: row
                for row in conn.execute(
                    select(rate_limits).where(rate_limits.c.name.in_(names)).with_for_update()
                )
            }
            now = float(conn.execute(select(self.now_sql)).scalar_one())
            buckets = [Bucket(found[n].last_grant, found[n].queue_end) for n in names]
            granted, due, after = take_all(ordered, buckets, now, queued=queued, lead=lead)
            for name, before, bucket in zip(names, buckets, after, strict=True):
                if bucket == before and not granted:
                    continue
                conn.execute(
                    update(rate_limits)
                    .where(rate_limits.c.name == name)
                    .values(
                        last_grant=bucket.last_grant,
                        queue_end=bucket.queue_end,
                        updated_at=now,
                        **(
                            {"grants": rate_limits.c.grants + 1}
                            if granted
                            else {"deferrals": rate_limits.c.deferrals + 1}
                        ),
                    )
                )
        return granted, due, now

    def rate_limits(self) -> list[RateRow]:
        with self._read() as conn:
            rows = conn.execute(select(rate_limits).order_by(rate_limits.c.name))
            return [
                RateRow(
                    name=row.name,
                    last_grant=row.last_grant,
                    queue_end=row.queue_end,
                    grants=row.grants,
                    deferrals=row.deferrals,
                )
                for row in rows
            ]

    def _ensure_rows(self, table: Any, rows: list[dict[str, Any]]) -> None:
        """Insert the rows whose primary key is missing (another writer may insert them at
        the same time: that one wins, same content). Rows are never deleted: once seen,
        a name is not looked up again."""
        seen: set[tuple[str, str]] = self.__dict__.setdefault("_limit_rows_seen", set())
        rows = [row for row in rows if (table.name, row["name"]) not in seen]
        if not rows:
            return
        with self._read() as conn:
            have = set(
                conn.execute(
                    select(table.c.name).where(table.c.name.in_([r["name"] for r in rows]))
                ).scalars()
            )
        for row in rows:
            if row["name"] in have:
                continue
            try:
                with self._write() as conn:
                    conn.execute(insert(table), [row])
            except IntegrityError:
                pass
        seen.update((table.name, row["name"]) for row in rows)

    # -- breakers --------------------------------------------------------------------------

    def breaker_state(self, name: str) -> BreakerState:
        """A plain read (the closed fast path): no row yet means closed."""
        with self._read() as conn:
            row = conn.execute(select(breakers).where(breakers.c.name == name)).first()
        return BreakerState() if row is None else _state(row)

    def breaker_admit(self, breaker: Breaker, worker: str, call: str) -> Admission:
        """May ``call`` (:func:`flowloop.flowcontrol.call_id`), a step behind ``breaker``,
        be made now? Opening the trial (half open) is journaled in the same transaction.
        Half open past its ``until``, the trial is looked at in that transaction too:
        while its run holds its lease and has journaled nothing after the trial's start,
        nobody else goes through."""
        state = self.breaker_state(breaker.name)
        if state.status == "closed":
            return admit(breaker, state, 0.0, call)

        def decide(before: BreakerState, now: float, conn: Connection) -> Admission:
            runs_yet = (
                before.status == "half_open"
                and before.until is not None
                and now >= before.until
                and _trial_runs(conn, before.trial, now)
            )
            return admit(breaker, before, now, call, runs_yet)

        return self._breaker_change(breaker, worker, decide)

    def breaker_failed(
        self, breaker: Breaker, worker: str, error: str, call: str | None = None
    ) -> str | None:
        """Count a failed call (``call``: its :func:`~flowloop.flowcontrol.call_id`, which
        a half-open breaker's trial has); returns ``"opened"`` when it opened the breaker."""
        answer = self._breaker_change(
            breaker,
            worker,
            lambda s, now, _: _failed(breaker, s, now, call),
            data={"error": error},
        )
        return answer.change

    def breaker_succeeded(self, breaker: Breaker, worker: str, call: str) -> str | None:
        """``call`` succeeded; the trial's success closes the breaker (returns ``"closed"``)."""
        answer = self._breaker_change(breaker, worker, lambda s, now, _: _succeeded(s, call))
        return answer.change

    def _breaker_change(
        self, breaker: Breaker, worker: str, decide: Any, data: Mapping[str, Any] | None = None
    ) -> Admission:
        self._ensure_rows(
            breakers,
            [{"name": breaker.name, "status": "closed", "failures": "[]", "updated_at": 0.0}],
        )
        with self._write() as conn:
            row = conn.execute(
                select(breakers).where(breakers.c.name == breaker.name).with_for_update()
            ).one()
            now = float(conn.execute(select(self.now_sql)).scalar_one())
            before = _state(row)
            answer: Admission = decide(before, now, conn)
            after = answer.state
            if after == before:
                return answer
            values: dict[str, Any] = {
                "status": after.status,
                "failures": json.dumps(list(after.failures)),
                "until": after.until,
                "trial": after.trial,
                "updated_at": now,
            }
            if answer.change is not None:
                seq = row.last_seq + 1
                values["last_seq"] = seq
                if answer.change == "opened":
                    values["opened"] = breakers.c.opened + 1
                said: dict[str, Any] = {"until": after.until, "from": before.status}
                if answer.change == "half_opened":
                    said["trial"] = after.trial
                    if before.status == "half_open":
                        said["given_up"] = before.trial  # no longer running
                conn.execute(
                    insert(breaker_journal),
                    [
                        {
                            "name": breaker.name,
                            "seq": seq,
                            "kind": answer.change,
                            "at": now,
                            "worker": worker,
                            "data": json.dumps({**said, **(data or {})}, sort_keys=True),
                        }
                    ],
                )
            conn.execute(update(breakers).where(breakers.c.name == breaker.name).values(**values))
        return answer

    def breakers(self) -> list[BreakerRow]:
        with self._read() as conn:
            columns = [getattr(breakers.c, name) for name in BreakerRow.COLUMNS]
            rows = conn.execute(select(*columns).order_by(breakers.c.name))
            return [BreakerRow.of(*row) for row in rows]

    def breaker_journal(self, name: str) -> list[BreakerEntry]:
        with self._read() as conn:
            rows = conn.execute(
                select(breaker_journal)
                .where(breaker_journal.c.name == name)
                .order_by(breaker_journal.c.seq)
            )
            return [
                BreakerEntry(
                    name=row.name,
                    seq=row.seq,
                    kind=row.kind,
                    at=row.at,
                    worker=row.worker,
                    data=json.loads(row.data) if row.data else {},
                )
                for row in rows
            ]


def _state(row: Any) -> BreakerState:
    return BreakerState(
        status=row.status,
        failures=tuple(float(t) for t in json.loads(row.failures)),
        until=row.until,
        trial=row.trial,
    )


def _trial_runs(conn: Connection, trial: str | None, now: float) -> bool:
    """Whether the trial call still runs: its run is held (a lease not ended by the
    database's clock ``now``) and has journaled nothing after the trial's ``step_started``.
    Not when its worker died (once the lease ends), its call ended or was cut off, or
    ``trial`` names no call."""
    named = parse_call(trial)
    if named is None:
        return False
    run_id, seq = named
    later = select(journal.c.seq).where(journal.c.run_id == run_id, journal.c.seq > seq).exists()
    held = conn.execute(
        select(runs.c.id).where(
            runs.c.id == run_id,
            runs.c.owner.is_not(None),
            runs.c.lease_expires_at >= now,
            ~later,
        )
    ).first()
    return held is not None


def _failed(breaker: Breaker, state: BreakerState, now: float, call: str | None) -> Admission:
    after, change = failed(breaker, state, now, call)
    return Admission(True, state=after, change=change)


def _succeeded(state: BreakerState, call: str) -> Admission:
    after, change = succeeded(state, call)
    return Admission(True, state=after, change=change)
