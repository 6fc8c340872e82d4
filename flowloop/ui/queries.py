"""The dashboard's reads: SQLAlchemy Core on the store's tables, one code path for SQLite and
PostgreSQL, every query in a read transaction (plain ``BEGIN`` on SQLite: a reader never
takes the write lock, so the dashboard cannot slow a worker's commits).

The runs list is keyset-paged on the ``(created_at DESC, id)`` order that the indexes
``ix_flowloop_runs_created`` / ``_workflow_created`` / ``_status_created`` already serve:
a page costs the same at the first run as at the 100,000th (no OFFSET scan).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

from sqlalchemy import Engine as SQLEngine
from sqlalchemy import Integer, and_, func, select
from sqlalchemy import cast as sql_cast

from flowloop import family
from flowloop import journal as j
from flowloop.errors import EXIT_FAILURE, FlowloopError
from flowloop.lifecycle import CLAIMABLE, HELD
from flowloop.store.current import current_rows
from flowloop.store.reads import NEWEST_FIRST, after_run, nearest_ranks, ranked_seconds, reading
from flowloop.store.schema import definitions, journal, loop_journal, loops, runs
from flowloop.store.sql import SQLStore
from flowloop.ui import waiting as w

PAGE_SIZE: Final = 50
MAX_PAGE_SIZE: Final = 500
MAX_JOURNAL: Final = 5_000
"""Journal entries one request returns at most (a long-lived run pages with ``after``)."""
JOURNAL_CONTEXTS: Final = 2_000_000
"""Characters of context one journal page holds at most, in all (:func:`journal_page`):
every entry held its whole context, and a run with a 1 MB context answered 1 MB an entry,
5 GB at :data:`MAX_JOURNAL`."""
LOOP_EVENTS: Final = 50
ID_PREFIX: Final = re.compile(r"[0-9A-Za-z_-]{1,40}")
NAME_LIMIT: Final = 400
NUL: Final = "\x00"
"""No name, key or id holds it (PostgreSQL's text cannot): a parameter with it is refused
here, as the same 4xx on both databases (PostgreSQL's driver refused it: a 503)."""


class BadInput(FlowloopError):
    """A request parameter is malformed (HTTP 400); the message names it and what it takes."""


class NotFound(FlowloopError):
    """What the request names does not exist (HTTP 404)."""


class Unreadable(FlowloopError):
    """What the store holds cannot be read (a corrupt journal; HTTP 409)."""

    exit_code = EXIT_FAILURE


# -- parameters ----------------------------------------------------------------------------


def int_param(
    params: Mapping[str, str], name: str, default: int, *, low: int = 0, high: int | None = None
) -> int:
    """``params[name]`` as an int in ``low..high`` (BadInput otherwise)."""
    text = params.get(name)
    if text is None or text == "":
        return default
    try:
        value = int(text)
    except ValueError:
        raise BadInput(f"{name}={text[:40]!r} is not a whole number") from None
    if value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        raise BadInput(f"{name}={value} is out of range ({span})")
    return value


def text_param(params: Mapping[str, str], name: str) -> str | None:
    text = params.get(name)
    if text is None or text == "":
        return None
    if len(text) > NAME_LIMIT:
        raise BadInput(f"{name} is longer than {NAME_LIMIT} characters")
    if NUL in text:
        raise BadInput(f"{name} contains a NUL character (no name, key or id holds one)")
    return text


@dataclass(frozen=True, kw_only=True)
class RunsQuery:
    """One page of the runs list: filters, the cursor it continues after, its size."""

    workflow: str | None = None
    status: str | None = None
    key: str | None = None
    prefix: str | None = None
    after: tuple[float, str] | None = None
    limit: int = PAGE_SIZE

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> RunsQuery:
        """From query parameters ``workflow``, ``status``, ``key``, ``id`` (a prefix),
        ``after`` (a cursor from a previous page) and ``limit``. Raises BadInput."""
        status = text_param(params, "status")
        if status is not None and status not in w.SHOWN_STATUSES:
            shown = ", ".join(w.SHOWN_STATUSES)
            raise BadInput(f"status={status[:40]!r} is not a status (one of {shown})")
        prefix = text_param(params, "id")
        if prefix is not None and not ID_PREFIX.fullmatch(prefix):
            raise BadInput("id must be a run id or its first characters (letters, digits, - _)")
        after = params.get("after")
        return cls(
            workflow=text_param(params, "workflow"),
            status=status,
            key=text_param(params, "key"),
            prefix=prefix,
            after=decode_cursor(after) if after else None,
            limit=int_param(params, "limit", PAGE_SIZE, low=1, high=MAX_PAGE_SIZE),
        )

    def filters(self) -> dict[str, str]:
        """The filters as query parameters (to build links that keep them)."""
        given = {"workflow": self.workflow, "status": self.status, "key": self.key}
        given["id"] = self.prefix
        return {name: value for name, value in given.items() if value is not None}


def encode_cursor(created_at: float, run_id: str) -> str:
    raw = json.dumps([created_at, run_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(text: str) -> tuple[float, str]:
    """A cursor made by :func:`encode_cursor` (BadInput for anything else)."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        created_at, run_id = json.loads(raw)
        if isinstance(created_at, bool) or not isinstance(created_at, int | float):
            raise ValueError
        if not isinstance(run_id, str) or NUL in run_id:
            raise ValueError
        return float(created_at), run_id
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError):
        raise BadInput(
            "after is not a cursor from a previous page (follow the next link)"
        ) from None


# -- runs ----------------------------------------------------------------------------------

RUN_LIST_COLUMNS: Final = (
    runs.c.id,
    runs.c.workflow,
    runs.c.version,
    runs.c.key,
    runs.c.status,
    runs.c.state,
    runs.c.attempt,
    runs.c.last_seq,
    runs.c.owner,
    runs.c.next_run_at,
    runs.c.created_at,
    runs.c.updated_at,
    runs.c.error,
    runs.c.reason,
    runs.c.fingerprint,
    runs.c.join_state,  # a map's child held back shows `held` (waiting.shown_status)
)


def _prefix_range(prefix: str) -> Any:
    # A range on the primary key (LIKE would not use the index on SQLite, where it is
    # case-insensitive): ids from the prefix up to the next string after all its extensions.
    return and_(runs.c.id >= prefix, runs.c.id < prefix + "\U0010ffff")


def _run_filters(query: RunsQuery) -> list[Any]:
    where: list[Any] = []
    if query.workflow is not None:
        where.append(runs.c.workflow == query.workflow)
    if query.key is not None:
        where.append(runs.c.key == query.key)
        if query.workflow is None:
            # The key index is (workflow, key): naming the workflows (a tiny table) turns a
            # scan of every run (130 ms at 100k) into one lookup per workflow. Complete,
            # because Engine.register stores a workflow's definition before any run of it.
            where.append(runs.c.workflow.in_(select(definitions.c.name).distinct()))
    if query.prefix is not None:
        where.append(_prefix_range(query.prefix))
    return where


@dataclass(frozen=True, kw_only=True)
class RunsPage:
    runs: list[dict[str, Any]]
    """Each with ``display_status``: ``waiting`` for a run resting in a wait state,
    ``held`` for a map's child held back (and ``held``: true)."""
    next_cursor: str | None
    counts: dict[str, int]
    """Runs per shown status (``waiting`` and ``held`` apart from ``scheduled``) matching
    the filters other than status."""


def list_runs(db: SQLEngine, query: RunsQuery) -> RunsPage:
    """One page of runs, newest first, and the counts per status."""
    where = _run_filters(query)
    counts = select(runs.c.status, func.count()).where(*where).group_by(runs.c.status)
    with reading(db) as conn:
        waits = w.wait_states(conn)
        page = select(*RUN_LIST_COLUMNS).where(*where)
        if query.status is not None:
            page = page.where(w.status_condition(query.status, waits))
        if query.after is not None:
            page = page.where(after_run(*query.after))
        page = page.order_by(*NEWEST_FIRST).limit(query.limit + 1)
        # A running run's row is a snapshot; its latest state comes from its journal.
        rows = current_rows(conn, [row._mapping for row in conn.execute(page)])
        found = {status: int(n) for status, n in conn.execute(counts)}
        held = waiting = 0
        if found.get("scheduled"):
            # The held ones from their index alone (ix_flowloop_runs_held); the waiting
            # ones (not held) only when some definition has a wait state.
            parked = conn.execute(w.held_counts(*where))
            held = sum(int(n) for _, status, n in parked if status == "scheduled")
            if waits:
                counted = select(func.count()).select_from(runs)
                resting = counted.where(*where, w.is_waiting(waits), w.not_held())
                waiting = int(conn.execute(resting).scalar_one())
    more = len(rows) > query.limit
    rows = rows[: query.limit]
    for row in rows:
        row["display_status"] = w.shown_status(row, waits)
        row["held"] = row.pop("join_state") == HELD and row["status"] == "scheduled"
    cursor = encode_cursor(rows[-1]["created_at"], rows[-1]["id"]) if more and rows else None
    return RunsPage(runs=rows, next_cursor=cursor, counts=w.split_counts(found, waiting, held))


def run_row(db: SQLEngine, run_id: str) -> dict[str, Any]:
    """The whole run row (NotFound when there is none)."""
    if len(run_id) > NAME_LIMIT:
        raise NotFound(f"no run {run_id[:40]}…")
    with reading(db) as conn:
        row = conn.execute(select(runs).where(runs.c.id == run_id)).first()
        if row is None:
            raise NotFound(f"no run {run_id}")
        found = current_rows(conn, [row._mapping])[0]
        waits = w.wait_states(conn, found["fingerprint"])
    for column in ("context", "visits"):
        found[column] = _json_or_text(found[column])
    found["display_status"] = w.shown_status(found, waits)
    events = w.waits_for(found, waits)
    found["waits_for"] = list(events) if events is not None else None
    return found


def run_progress(db: SQLEngine, run_id: str) -> dict[str, Any]:
    """The cheap row a live page polls: ``last_seq``, ``status``, ``state``."""
    with reading(db) as conn:
        row = conn.execute(
            select(
                runs.c.id, runs.c.last_seq, runs.c.status, runs.c.state, runs.c.updated_at
            ).where(runs.c.id == run_id)
        ).first()
        if row is None:
            raise NotFound(f"no run {run_id[:80]}")
        found = current_rows(conn, [row._mapping])[0]
    del found["id"]
    return found


def _json_or_text(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def event_dict(event: j.JournalEvent, *, with_context: bool = True) -> dict[str, Any]:
    """A journal entry as JSON (the context parsed when it is JSON; ``None`` without
    ``with_context``)."""
    return {
        "seq": event.seq,
        "kind": event.kind,
        "at": event.at,
        "state": event.state,
        "attempt": event.attempt,
        "event": event.event,
        "next_state": event.next_state,
        "context": _json_or_text(event.context) if with_context else None,
        "duration": event.duration,
        "error_type": event.error_type,
        "error_message": event.error_message,
        "traceback": event.traceback,
        "retryable": event.retryable,
        "worker": event.worker,
        "data": dict(event.data),
    }


def journal_page(
    run_id: str, events: Sequence[j.JournalEvent], *, after: int, limit: int
) -> list[dict[str, Any]]:
    """The entries after seq ``after``, at most ``limit``, as JSON, bounded whatever the
    context: an entry that wrote a context holds it (``context_status`` ``shown``) only
    where it differs from the one before it (else ``unchanged``, ``context`` null) and
    while the page's contexts stay within :data:`JOURNAL_CONTEXTS` characters (else
    ``cut``, and so are the changed ones after it on the page); ``context_url`` gives it
    whole. An entry that wrote none has both null."""
    chosen = [e for e in events if e.seq > after][:limit]
    before = next(
        (e.context for e in reversed(events) if e.seq <= after and e.context is not None), None
    )
    spent, cut = 0, False
    entries: list[dict[str, Any]] = []
    for event in chosen:
        text = event.context
        status: str | None = None
        if text is not None:
            spent += 0 if text == before else len(text)
            cut = cut or spent > JOURNAL_CONTEXTS
            status = "unchanged" if text == before else "cut" if cut else "shown"
            before = text
        entry = event_dict(event, with_context=status == "shown")
        entry["context_status"] = status
        entry["context_url"] = (
            None if text is None else f"/api/runs/{quote(run_id, safe='')}/context?seq={event.seq}"
        )
        entries.append(entry)
    return entries


FAMILY_LIMIT: Final = 50
"""Children listed on a run page (the counts per status cover them all)."""


def run_family(store: SQLStore, run_id: str) -> dict[str, Any]:
    """A run's child runs (call, map and parallel states): the first :data:`FAMILY_LIMIT`
    by join and index, and how many are in each status (one indexed read each) — those
    held back by a map's ``max_parallel`` as ``held``, as `flowloop status` counts them."""
    with reading(store.engine) as conn:
        listed = conn.execute(
            select(
                runs.c.id,
                runs.c.workflow,
                runs.c.status,
                runs.c.state,
                runs.c.child_index,
                runs.c.join_state,
            )
            .where(runs.c.parent_id == run_id)
            .order_by(runs.c.join_id, runs.c.child_index)
            .limit(FAMILY_LIMIT)
        ).all()
        children = current_rows(conn, [row._mapping for row in listed])
    for child in children:
        child["status"] = family.child_status(child["status"], child.pop("join_state"))
    by_status = family.child_counts(store, run_id)
    return {
        "children": children,
        "counts": dict(sorted(by_status.items())),
        "total": sum(by_status.values()),
    }


def run_journal(store: SQLStore, run_id: str) -> list[j.JournalEvent]:
    """A run's journal through the store interface (NotFound for an unknown run)."""
    events = store.journal(run_id)
    if not events:
        raise NotFound(f"no run {run_id[:80]}")
    return events


def context_at(events: Sequence[j.JournalEvent], seq: int) -> Any:
    """The run's context as of ``seq`` (the journal folded up to it); BadInput outside."""
    if not 1 <= seq <= len(events):
        raise BadInput(f"seq {seq} is outside this run's journal (1..{len(events)})")
    try:
        record = j.fold(events, until_seq=seq)
    except (j.FoldError, KeyError, TypeError, ValueError) as error:
        # A journal another tool wrote badly must not take the page down with it.
        raise Unreadable(f"cannot fold this run's journal to seq {seq}: {error!r}") from None
    return _json_or_text(record.context)


def timeline(events: Sequence[j.JournalEvent]) -> list[dict[str, Any]]:
    """The journal as steps: each ``step_started`` paired with its outcome (duration,
    attempt, error), other entries as they are."""
    items: list[dict[str, Any]] = []
    open_step: dict[str, Any] | None = None
    start = events[0].at if events else 0.0
    for event in events:
        if event.kind == j.STEP_STARTED:
            open_step = {
                "seq": event.seq,
                "kind": "step",
                "state": event.state,
                "attempt": event.attempt,
                "at": event.at,
                "offset": event.at - start,
                "outcome": "running",
                "end_seq": None,
                "duration": None,
                "event": None,
                "next_state": None,
                "error": None,
                "worker": event.worker,
            }
            items.append(open_step)
            continue
        if open_step is not None and event.kind in (
            j.STEP_SUCCEEDED,
            j.STEP_FAILED,
            j.STEP_INTERRUPTED,
        ):
            open_step["outcome"] = {
                j.STEP_SUCCEEDED: "succeeded",
                j.STEP_FAILED: "failed",
                j.STEP_INTERRUPTED: "interrupted",
            }[event.kind]
            open_step["end_seq"] = event.seq
            open_step["duration"] = (
                event.duration if event.duration is not None else event.at - open_step["at"]
            )
            open_step["event"] = event.event
            open_step["next_state"] = event.next_state
            if event.error_type or event.error_message:
                open_step["error"] = {
                    "type": event.error_type,
                    "message": event.error_message,
                    "traceback": event.traceback,
                    "retryable": event.retryable,
                }
            open_step = None
            continue
        open_step = None
        items.append(
            {
                "seq": event.seq,
                "kind": event.kind,
                "state": event.state,
                "attempt": event.attempt,
                "at": event.at,
                "offset": event.at - start,
                "outcome": None,
                "end_seq": None,
                "duration": None,
                "event": event.event,
                "next_state": event.next_state,
                "worker": event.worker,
                "error": (
                    {"type": event.error_type, "message": event.error_message, "traceback": None}
                    if event.error_type or event.error_message
                    else None
                ),
            }
        )
    return items


# -- workflows -----------------------------------------------------------------------------


def definitions_seen(db: SQLEngine) -> dict[str, list[dict[str, Any]]]:
    """Every definition stored, by workflow name: versions and fingerprints, newest first."""
    query = select(
        definitions.c.name,
        definitions.c.version,
        definitions.c.fingerprint,
        definitions.c.created_at,
        definitions.c.structure,
    ).order_by(definitions.c.name, definitions.c.version.desc(), definitions.c.created_at.desc())
    found: dict[str, list[dict[str, Any]]] = {}
    with reading(db) as conn:
        for row in conn.execute(query):
            found.setdefault(row.name, []).append(
                {
                    "version": row.version,
                    "fingerprint": row.fingerprint,
                    "created_at": row.created_at,
                    "structure": _json_or_text(row.structure),
                }
            )
    return found


def status_counts(db: SQLEngine) -> dict[str, dict[str, int]]:
    """Runs per workflow and shown status, ``waiting`` and ``held`` apart from
    ``scheduled`` (the ``(workflow, status)`` index serves it)."""
    query = select(runs.c.workflow, runs.c.status, func.count()).group_by(
        runs.c.workflow, runs.c.status
    )
    found: dict[str, dict[str, int]] = {}
    with reading(db) as conn:
        for workflow, status, n in conn.execute(query):
            found.setdefault(workflow, {})[status] = int(n)
        waits = w.wait_states(conn)
        held: dict[str, int] = {}
        waiting: dict[str, int] = {}
        if any(counts.get("scheduled") for counts in found.values()):
            for name, status, n in conn.execute(w.held_counts()):
                if status == "scheduled":
                    held[name] = int(n)
            if waits:
                resting = select(runs.c.workflow, func.count()).where(
                    w.is_waiting(waits), w.not_held()
                )
                resting = resting.group_by(runs.c.workflow)
                waiting = {name: int(n) for name, n in conn.execute(resting)}
    shown = {}
    for name, counts in found.items():
        split = w.split_counts(counts, waiting.get(name, 0), held.get(name, 0))
        shown[name] = {s: n for s, n in split.items() if n}
    return shown


# -- loops and workers ---------------------------------------------------------------------


def loop_rows(db: SQLEngine) -> list[dict[str, Any]]:
    with reading(db) as conn:
        return [dict(row._mapping) for row in conn.execute(select(loops).order_by(loops.c.name))]


def loop_row(db: SQLEngine, name: str) -> dict[str, Any]:
    with reading(db) as conn:
        row = conn.execute(select(loops).where(loops.c.name == name)).first()
    if row is None:
        raise NotFound(f"no loop {name[:80]}")
    return dict(row._mapping)


def loop_events(db: SQLEngine, name: str, *, limit: int = LOOP_EVENTS) -> list[dict[str, Any]]:
    """A loop's newest journal entries, newest first."""
    query = (
        select(loop_journal)
        .where(loop_journal.c.loop == name)
        .order_by(loop_journal.c.seq.desc())
        .limit(limit)
    )
    with reading(db) as conn:
        rows = [dict(row._mapping) for row in conn.execute(query)]
    for row in rows:
        row["data"] = _json_or_text(row["data"]) or {}
    return rows


def loop_kind_counts(db: SQLEngine, name: str) -> dict[str, int]:
    query = (
        select(loop_journal.c.kind, func.count())
        .where(loop_journal.c.loop == name)
        .group_by(loop_journal.c.kind)
    )
    with reading(db) as conn:
        return {kind: int(n) for kind, n in conn.execute(query)}


def workers(db: SQLEngine, now: float) -> dict[str, Any]:
    """Who holds leases (runs and loops per owner, the lease that ends first and last, the
    latest heartbeat seen as a write), and the queue: runs due now per workflow."""
    owners: dict[str, dict[str, Any]] = {}
    run_leases = (
        select(
            runs.c.owner,
            func.count(),
            func.min(runs.c.lease_expires_at),
            func.max(runs.c.lease_expires_at),
            func.max(runs.c.updated_at),
        )
        .where(runs.c.owner.is_not(None))
        .group_by(runs.c.owner)
    )
    loop_leases = (
        select(
            loops.c.owner,
            func.count(),
            func.min(loops.c.lease_expires_at),
            func.max(loops.c.lease_expires_at),
            func.max(loops.c.updated_at),
        )
        .where(loops.c.owner.is_not(None))
        .group_by(loops.c.owner)
    )
    # A running run's row is written only at claim/release/pause/finish (issue 13): its
    # owner's latest write is its journal's latest entry (the row's snapshot entry or the
    # tail after it: a key range per run), else a busy worker looks stale.
    run_entries = (
        select(runs.c.owner, func.max(journal.c.at))
        .join(journal, and_(journal.c.run_id == runs.c.id, journal.c.seq >= runs.c.last_seq))
        .where(runs.c.owner.is_not(None))
        .group_by(runs.c.owner)
    )
    due = (
        select(runs.c.workflow, func.count())
        .where(runs.c.status.in_(sorted(CLAIMABLE)), runs.c.next_run_at <= now)
        .group_by(runs.c.workflow)
    )
    waiting = (
        select(runs.c.workflow, func.count())
        .where(runs.c.status.in_(sorted(CLAIMABLE)), runs.c.next_run_at > now)
        .group_by(runs.c.workflow)
    )
    with reading(db) as conn:
        for what, query in (("runs", run_leases), ("loops", loop_leases)):
            for owner, n, first, last, seen in conn.execute(query):
                entry = owners.setdefault(
                    owner,
                    {"owner": owner, "runs": 0, "loops": 0, "lease_min": None, "lease_max": None},
                )
                entry[what] = int(n)
                entry["lease_min"] = _least(entry["lease_min"], first)
                entry["lease_max"] = _most(entry["lease_max"], last)
                entry["last_write"] = _most(entry.get("last_write"), seen)
        for owner, at in conn.execute(run_entries):
            if owner in owners:
                owners[owner]["last_write"] = _most(owners[owner].get("last_write"), at)
        queue = {workflow: int(n) for workflow, n in conn.execute(due)}
        later = {workflow: int(n) for workflow, n in conn.execute(waiting)}
    for entry in owners.values():
        entry["expired"] = entry["lease_max"] is not None and entry["lease_max"] < now
    return {
        "now": now,
        "owners": sorted(owners.values(), key=lambda e: str(e["owner"])),
        "due": queue,
        "scheduled_later": later,
    }


def _least(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _most(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


# -- whole runs of a window ----------------------------------------------------------------

CHART_BUCKETS: Final = 24
FINISHED_STATUSES: Final = ("succeeded", "failed", "stopped")


def run_summary(db: SQLEngine, workflow: str, *, since: float | None, now: float) -> dict[str, Any]:
    """Runs of ``workflow`` created since ``since`` (``None``: all): p50/p95/p99 of the
    whole run (created to last update, finished runs), and runs started per time bucket
    and status for a small chart. Both read the ``(workflow, created_at)`` index."""
    where = [runs.c.workflow == workflow]
    if since is not None:
        where.append(runs.c.created_at >= since)
    picked = nearest_ranks(
        runs.c.updated_at - runs.c.created_at,
        where=[*where, runs.c.status.in_(FINISHED_STATUSES)],
    )
    with reading(db) as conn:
        ranks = ranked_seconds(conn.execute(picked))
        start = since
        if start is None:
            start = conn.execute(select(func.min(runs.c.created_at)).where(*where)).scalar()
        buckets: list[dict[str, Any]] = []
        if start is not None:
            width = max((now - float(start)) / CHART_BUCKETS, 1e-6)
            offset = (runs.c.created_at - float(start)) / width
            index = sql_cast(offset, Integer) if db.dialect.name == "sqlite" else func.floor(offset)
            counted = (
                select(index.label("i"), runs.c.status, func.count())
                .where(*where)
                .group_by(index, runs.c.status)
            )
            buckets = [
                {"start": float(start) + i * width, "width": width, "counts": {}}
                for i in range(CHART_BUCKETS)
            ]
            for i, status, n in conn.execute(counted):
                slot = min(max(int(i), 0), CHART_BUCKETS - 1)
                counts = buckets[slot]["counts"]
                counts[status] = counts.get(status, 0) + int(n)
    return {
        "finished": ranks.size(""),
        "p50": ranks.at("", 50),
        "p95": ranks.at("", 95),
        "p99": ranks.at("", 99),
        "buckets": buckets,
        "peak": max((sum(b["counts"].values()) for b in buckets), default=0),
    }
