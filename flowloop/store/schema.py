"""The tables, as SQLAlchemy Core. Times are UTC epoch seconds (floats): the same arithmetic
on SQLite and PostgreSQL, and lease times can be computed by the database's own clock."""

from __future__ import annotations

from typing import Final

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    text,
)

from flowloop.store.entries import JOURNAL_FIELDS

KEYED_DUE_INDEX: Final = "ix_flowloop_runs_keyed_due"
KEYED_DUE_WHERE: Final = (
    "limit_key IS NOT NULL AND limit_rank IS NOT NULL AND next_run_at IS NOT NULL"
    " AND status IN ('retrying', 'scheduled')"
)
"""The runs :data:`KEYED_DUE_INDEX` holds: claimable, with a key, a place in its queue and a
due time (a query uses the index only when its own terms say as much, spelled alike)."""
HELD_WHERE: Final = "join_state = 'held'"
"""A map's children held back by ``max_parallel`` (those scheduled are shown ``held``):
what ``ix_flowloop_runs_held`` holds (a listing's count says it alike, as text)."""

# Every change here needs a migration in flowloop/store/migrations/versions (autogenerate
# one with `flowloop db revision -m "what changed"`).
metadata = MetaData()

meta = Table(
    "flowloop_meta",
    metadata,
    Column("key", String(64), primary_key=True),
    Column("value", Text, nullable=False),
)

definitions = Table(
    "flowloop_definitions",
    metadata,
    Column("fingerprint", String(32), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("version", Integer, nullable=False),
    Column("structure", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)

runs = Table(
    "flowloop_runs",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("workflow", String(200), nullable=False),
    Column("version", Integer, nullable=False),
    Column("fingerprint", String(32), nullable=False),
    Column("key", String(400)),
    Column("idempotency_key", String(400)),
    Column("status", String(16), nullable=False),
    Column("state", String(200), nullable=False),
    Column("context", Text, nullable=False),
    Column("context_version", Integer, nullable=False, server_default=text("1")),
    Column("attempt", Integer, nullable=False, default=0),
    Column("visits", Text, nullable=False),
    Column("next_run_at", Float),
    Column("last_seq", Integer, nullable=False),
    Column("reason", Text),
    Column("error", Text),
    Column("priority", Integer, nullable=False, default=0),
    Column("owner", String(200)),
    Column("lease_expires_at", Float),
    Column("lease_epoch", Integer, nullable=False, default=0),
    Column("control", String(16)),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    # The run's concurrency key (Workflow(concurrency_key=...)), set at start: claims count
    # the runs held per key and go round-robin between keys (flowloop/store/limits.py).
    Column("limit_key", String(400)),
    # Its key's live runs when it was created, plus one: claims serve the first run of
    # every key before the second of any (round-robin that holds across claims).
    Column("limit_rank", Integer),
    # Composition: the whole run's deadline; for a child run, its parent, the join it
    # reports its end to, its item's index, and whether it has reported ('open': not yet).
    Column("deadline_at", Float),
    Column("parent_id", String(40)),
    Column("join_id", String(40)),
    Column("child_index", Integer),
    Column("join_state", String(16)),
)
# Partial (most runs have no parent, no join, no owner): a run's creation and its release
# skip these indexes instead of writing a NULL entry (a WAL page per index per commit).
Index(
    "ix_flowloop_runs_parent",
    runs.c.parent_id,
    sqlite_where=text("parent_id IS NOT NULL"),
    postgresql_where=text("parent_id IS NOT NULL"),
)
# A child's end releases the next held child of its join: found by (join, index).
Index(
    "ix_flowloop_runs_join",
    runs.c.join_id,
    runs.c.child_index,
    sqlite_where=text("join_id IS NOT NULL"),
    postgresql_where=text("join_id IS NOT NULL"),
)
# Claims read runs that are due (every claim says `next_run_at <= now`, which implies NOT
# NULL): a running or finished run has no due time, so it has no entry here — a run's
# creation and its end write one B-tree fewer each (migration 0014). In claim order within
# a status and workflow: the claims read it a (status, workflow, priority) segment at
# a time, from the first run up to the limit or the first one not yet due
# (flowloop/store/claims.py, migration 0017).
Index(
    "ix_flowloop_runs_due",
    runs.c.status,
    runs.c.workflow,
    runs.c.priority.desc(),
    runs.c.next_run_at,
    runs.c.id,
    sqlite_where=text("next_run_at IS NOT NULL"),
    postgresql_where=text("next_run_at IS NOT NULL"),
)
# The runs waiting without a due time (a wait with no timeout): a worker's start and each
# `run_until_idle` look for those the loaded definitions cannot take (flowloop/parking.py);
# without it they read every queued run of the workflow, those asleep included (0017).
Index(
    "ix_flowloop_runs_waiting",
    runs.c.workflow,
    sqlite_where=text("status = 'scheduled' AND next_run_at IS NULL"),
    postgresql_where=text("status = 'scheduled' AND next_run_at IS NULL"),
)
Index(
    "ix_flowloop_runs_owner",
    runs.c.owner,
    sqlite_where=text("owner IS NOT NULL"),
    postgresql_where=text("owner IS NOT NULL"),
)
# The runs whose row was written since a time: a journal window's finished runs (their row
# is written by their final boundary), and prune's old finished runs.
Index("ix_flowloop_runs_updated", runs.c.updated_at)
Index(
    "ix_flowloop_runs_limit_key",
    runs.c.workflow,
    runs.c.limit_key,
    sqlite_where=text("limit_key IS NOT NULL"),
    postgresql_where=text("limit_key IS NOT NULL"),
)
# A limited claim of a workflow with a concurrency_key takes its due runs by a key's place
# in its queue first (limit_rank): this index holds the claimable runs with a key in that
# order, with their key and owner, so the claim reads a window of them instead of every
# due run (flowloop/store/claims.py, migration 0018). Unkeyed runs have no entry in it. Not
# the lease's end: a column of an index, even a partial one, makes PostgreSQL write every
# renewal of every run's lease into each of the table's indexes (no HOT update).
Index(
    KEYED_DUE_INDEX,
    runs.c.workflow,
    runs.c.priority.desc(),
    runs.c.limit_rank,
    runs.c.next_run_at,
    runs.c.id,
    runs.c.limit_key,
    runs.c.owner,
    sqlite_where=text(KEYED_DUE_WHERE),
    postgresql_where=text(KEYED_DUE_WHERE),
)
# The listings count a map's children held back apart (`held`), from this index alone:
# only those children have an entry (migration 0021). Grouped by (workflow, status) and
# without a status term, the count is served by it alone: with one (status =
# 'scheduled'), SQLite (no statistics) took the status index and read every scheduled row.
# join_state is a column too (the same in every entry): SQLite reads a column of the
# partial index's condition from the row otherwise, not from the index.
Index(
    "ix_flowloop_runs_held",
    runs.c.workflow,
    runs.c.status,
    runs.c.join_state,
    sqlite_where=text(HELD_WHERE),
    postgresql_where=text(HELD_WHERE),
)
# Claims use this one; widening it (say, with created_at) made claims 3x slower.
Index("ix_flowloop_runs_workflow", runs.c.workflow, runs.c.status)
# `flowloop status` lists the newest runs first, of all workflows, of one, or of one
# status: each of these reads them in that order instead of sorting every run.
Index("ix_flowloop_runs_created", runs.c.created_at.desc(), runs.c.id)
Index("ix_flowloop_runs_workflow_created", runs.c.workflow, runs.c.created_at.desc(), runs.c.id)
Index("ix_flowloop_runs_status_created", runs.c.status, runs.c.created_at.desc(), runs.c.id)
Index(
    "ux_flowloop_runs_key",
    runs.c.workflow,
    runs.c.key,
    unique=True,
    sqlite_where=text("key IS NOT NULL"),
    postgresql_where=text("key IS NOT NULL"),
)
Index(
    "ux_flowloop_runs_idempotency",
    runs.c.idempotency_key,
    unique=True,
    sqlite_where=text("idempotency_key IS NOT NULL"),
    postgresql_where=text("idempotency_key IS NOT NULL"),
)

# The journal is the source of truth of a run in flight (flowloop/store/appends.py): a step
# boundary appends here and leaves the run row alone. The primary key is the sequencer: two
# writers following the same seq cannot both append (the loser's insert fails and its write
# is refused). On SQLite the table is clustered on that key (WITHOUT ROWID): one B-tree, not
# a rowid table plus a key index, so an append touches one leaf page instead of two. A
# context is stored whole or as a splice of the run's previous one (flowloop/store/entries.py).
journal = Table(
    "flowloop_journal",
    metadata,
    Column("run_id", String(40), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("kind", String(32), nullable=False),
    Column("at", Float, nullable=False),
    Column("state", String(200)),
    Column("attempt", Integer, nullable=False, default=0),
    Column("event", String(200)),
    Column("next_state", String(200)),
    Column("context", Text),
    Column("duration", Float),
    Column("error_type", String(200)),
    Column("error_message", Text),
    Column("traceback", Text),
    Column("retryable", Boolean),
    Column("worker", String(200)),
    Column("data", Text),
    sqlite_with_rowid=False,
)
# No index on the journal's time: every boundary would pay for it (the former (kind, at)
# index cost 2.4 WAL pages per commit, one on `at` alone 1.2-1.5). A time window reaches
# the journal through the runs of the window instead (flowloop/store/windows.py).

loops = Table(
    "flowloop_loops",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("schedule", String(400), nullable=False),
    Column("status", String(16), nullable=False),
    Column("next_fire_at", Float),
    Column("last_slot", Float),
    Column("last_started_at", Float),
    Column("last_ended_at", Float),
    Column("last_result", String(16)),
    Column("last_error", Text),
    Column("iterations", Integer, nullable=False, default=0),
    Column("consecutive_failures", Integer, nullable=False, default=0),
    Column("skipped", Integer, nullable=False, default=0),
    Column("missed", Integer, nullable=False, default=0),
    Column("reason", Text),
    Column("owner", String(200)),
    Column("lease_expires_at", Float),
    Column("lease_epoch", Integer, nullable=False, default=0),
    Column("control", String(16)),
    Column("last_seq", Integer, nullable=False, default=0),
    Column("updated_at", Float, nullable=False),
)

loop_journal = Table(
    "flowloop_loop_journal",
    metadata,
    Column("loop", String(200), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("kind", String(32), nullable=False),
    Column("at", Float, nullable=False),
    Column("slot", Float),
    Column("attempt", Integer, nullable=False, default=0),
    Column("count", Integer, nullable=False, default=0),
    Column("duration", Float),
    Column("error_type", String(200)),
    Column("error_message", Text),
    Column("worker", String(200)),
    Column("data", Text),
)
# A slot of a loop starts at most once, whichever worker fires it.
Index(
    "ux_flowloop_loop_slot",
    loop_journal.c.loop,
    loop_journal.c.slot,
    unique=True,
    sqlite_where=text("kind = 'iteration_started'"),
    postgresql_where=text("kind = 'iteration_started'"),
)

inbox = Table(
    "flowloop_inbox",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("run_id", String(40), nullable=False),
    Column("event", String(200), nullable=False),
    Column("payload", Text),
    Column("dedupe_key", String(400)),
    Column("sent_at", Float, nullable=False),
    Column("sender", String(200)),
    # The journal seq of the event_received that consumed it (NULL: still buffered).
    Column("consumed_seq", Integer),
)
Index("ix_flowloop_inbox_pending", inbox.c.run_id, inbox.c.consumed_seq)
# The events kept, not yet taken (the inbox keeps every taken one too): each recovery sweep
# of every worker looks for waiting runs that no worker holds and that accept one — a
# worker killed before handing them over (flowloop/kept.py) — reading only these, with the
# event, instead of the whole inbox (migration 0022).
Index(
    "ix_flowloop_inbox_kept",
    inbox.c.run_id,
    inbox.c.event,
    sqlite_where=text("consumed_seq IS NULL"),
    postgresql_where=text("consumed_seq IS NULL"),
)
# The same dedupe key twice for one run has effect once.
Index(
    "ux_flowloop_inbox_dedupe",
    inbox.c.run_id,
    inbox.c.dedupe_key,
    unique=True,
    sqlite_where=text("dedupe_key IS NOT NULL"),
    postgresql_where=text("dedupe_key IS NOT NULL"),
)

# Flow control shared by all workers (flowloop/flowcontrol.py, flowloop/store/limits.py).
rate_limits = Table(
    "flowloop_rate_limits",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("last_grant", Float),
    Column("queue_end", Float, nullable=False),
    Column("grants", Integer, nullable=False, default=0),
    Column("deferrals", Integer, nullable=False, default=0),
    Column("updated_at", Float, nullable=False),
)

breakers = Table(
    "flowloop_breakers",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("status", String(16), nullable=False),
    Column("failures", Text, nullable=False),
    Column("until", Float),
    Column("trial", String(200)),
    Column("opened", Integer, nullable=False, default=0),
    Column("last_seq", Integer, nullable=False, default=0),
    Column("updated_at", Float, nullable=False),
)

breaker_journal = Table(
    "flowloop_breaker_journal",
    metadata,
    Column("name", String(200), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("kind", String(32), nullable=False),
    Column("at", Float, nullable=False),
    Column("worker", String(200)),
    Column("data", Text),
)
# One row per visit of a call or map state: how many children it has, how many exist, and
# how many ended which way. Each child's final transaction updates it (the join counter).
joins = Table(
    "flowloop_joins",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("parent_id", String(40), nullable=False),
    Column("state", String(200), nullable=False),
    Column("visit", Integer, nullable=False),
    Column("child_workflow", String(200), nullable=False),
    Column("total", Integer, nullable=False),
    Column("created", Integer, nullable=False, default=0),
    Column("max_parallel", Integer, nullable=False),
    Column("succeeded", Integer, nullable=False, default=0),
    Column("failed", Integer, nullable=False, default=0),
    Column("stopped", Integer, nullable=False, default=0),
    Column("created_at", Float, nullable=False),
    # Of the ended, those that ended while held (stopped before their turn): they took no
    # slot, so their ends free none (migration 0019).
    Column("ended_held", Integer, nullable=False, default=0, server_default="0"),
)
Index("ix_flowloop_joins_parent", joins.c.parent_id)

# Decoding spells the journal's columns out (it needs no SQLAlchemy): keep both in step.
if tuple(column.name for column in journal.columns) != JOURNAL_FIELDS:
    raise RuntimeError("entries.JOURNAL_FIELDS must be the journal's columns in table order")
