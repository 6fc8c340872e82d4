"""The store contract: what the engine may ask of a database, and which rows each call touches.

Leases. A run being worked on has an ``owner`` (a worker id), a ``lease_expires_at``
computed by the *database's* clock, and a ``lease_epoch`` that grows by one with every
claim. Every write by an owner names the owner and epoch it believes it holds (a
:class:`Fence`); if either changed — the lease expired and another worker claimed the run —
the write changes nothing and is reported as refused. A write by no owner (an operator's
pause of a queued run) names ``Fence(None, epoch)`` and only applies while nobody owns it.
Every write also names the ``last_seq`` it follows, so two writers can never interleave
journal entries.

Journal first. The journal is the source of truth of a run in flight: a boundary that
keeps a running run running (a step's outcome and the next step's start) only appends to
it. The run row is written at claim, release, finish, pause/stop and when a due time
changes; while a run is ``running`` its row's state and context are a snapshot as of the
row's ``last_seq``, and every read of a run (:meth:`Store.get_run`, claims, listings) folds
the journal entries after it.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Protocol

from flowloop.journal import JournalEvent, RunRecord

VERSION_TABLE: Final = "flowloop_alembic_version"
"""The table holding a database's schema revision (flowloop/store/migrate.py)."""
SCHEMA_HEAD: Final = "0022"
"""The newest revision in migrations/versions, known without loading Alembic (a new
revision moves it: tests/acceptance/test_cli_cold_start.py checks it is Alembic's head)."""


@dataclass(frozen=True, kw_only=True)
class StoredRun:
    """A run row: the journal-determined record plus the bookkeeping around it."""

    record: RunRecord
    idempotency_key: str | None
    priority: int
    owner: str | None
    lease_expires_at: float | None
    lease_epoch: int
    control: str | None
    created_at: float
    updated_at: float
    problem: str | None = None
    """Why part of the row could not be read (a corrupt JSON column), else ``None``: the
    executor then fails the run with this as its error instead of stepping it."""
    limit_key: str | None = None
    """The key whose ``key_limit`` the run counts against (its workflow's
    ``concurrency_key``), else ``None``."""

    @property
    def id(self) -> str:
        return self.record.id


@dataclass(frozen=True, kw_only=True)
class BreakerRow:
    """A circuit breaker shared by the workers (flowloop/flowcontrol.py), as stored."""

    name: str
    status: str
    failures: int
    """Failures counted in the current window (closed)."""
    until: float | None
    trial: str | None
    opened: int
    """How many times it opened."""
    updated_at: float

    COLUMNS: ClassVar[tuple[str, ...]] = (
        "name",
        "status",
        "failures",
        "until",
        "trial",
        "opened",
        "updated_at",
    )
    """The breakers table's columns :meth:`of` takes, in this order."""

    @classmethod
    def of(cls, *values: Any) -> BreakerRow:
        """A row's :data:`COLUMNS` values (``failures``: the window's JSON list)."""
        fields = dict(zip(cls.COLUMNS, values, strict=True))
        fields["failures"] = len(json.loads(fields["failures"]))
        return cls(**fields)


@dataclass(frozen=True)
class Fence:
    """The owner and lease epoch a write requires (``owner=None``: nobody may own it)."""

    owner: str | None
    epoch: int


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """One atomic change of one run: journal events appended plus the row they produce."""

    events: Sequence[JournalEvent]
    record: RunRecord
    fence: Fence
    release: bool = False
    """Give up ownership with this write (the run is no longer being worked on)."""
    clear_control: bool = False
    """The pending pause/stop request was honoured by this write (or an operator's entry
    replaces it)."""
    seen_control: str | None = None
    """With ``clear_control``: the request the writer saw on the row (``None``: none). The
    write applies only while the row still holds that one, so a stop asked for after the
    writer looked, or a pause withdrawn, is never cleared unseen (the write is refused)."""

    @property
    def run_id(self) -> str:
        return self.record.id

    @property
    def follows_seq(self) -> int:
        return self.record.last_seq - len(self.events)


@dataclass(frozen=True, kw_only=True)
class NewRun:
    """A run to create: its first journal events and the record they fold to."""

    record: RunRecord
    events: Sequence[JournalEvent]
    idempotency_key: str | None = None
    priority: int = 0
    owner: str | None = None
    """Create the run already claimed by this worker (saves a claim round trip)."""
    lease_seconds: float = 30.0
    limit_key: str | None = None
    """The run's concurrency key (``Workflow(concurrency_key=...)``), kept on its row."""
    limit_rank: int | None = None
    """Its place in its key's queue when it was created (set by the store)."""
    parent_id: str | None = None
    """The run that started this one (a call's or map's child), else ``None``."""
    child_index: int | None = None
    """The child's item index in its join (0 for a call's child)."""
    held: bool = False
    """A child created before its turn (``max_parallel``): not due until a sibling ends."""


@dataclass(frozen=True, kw_only=True)
class InboxEvent:
    """An event sent to a run: consumed at once, or buffered until a state accepts it."""

    run_id: str
    event: str
    payload: str | None
    """JSON text."""
    dedupe_key: str | None
    sent_at: float
    sender: str | None = None
    id: int | None = None
    consumed_seq: int | None = None


@dataclass(frozen=True, kw_only=True)
class RunFilter:
    workflow: str | None = None
    statuses: Sequence[str] | None = None
    key: str | None = None
    limit: int = 100
    after: tuple[float, str] | None = None
    """(created_at, id) of a run: only runs listed after it (older), for paging."""


class RunSource(Protocol):
    """What reading runs needs of a store (flowloop/reading.py): every :class:`Store`,
    and the stdlib reader of a SQLite file (flowloop/store/lite.py)."""

    def close(self) -> None: ...

    def get_run(self, run_id: str) -> StoredRun | None: ...

    def run_ids_with_prefix(self, prefix: str, *, limit: int) -> list[str]: ...

    def find_runs(self, where: RunFilter) -> list[StoredRun]: ...

    def journal(self, run_id: str, *, until_seq: int | None = None) -> list[JournalEvent]: ...

    def definition(self, fingerprint: str) -> dict[str, Any] | None: ...


class Store(abc.ABC):
    """Persistence for definitions, runs and their journals."""

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def db_now(self) -> float:
        """The database server's clock, in UTC epoch seconds."""

    @abc.abstractmethod
    def save_definition(self, fingerprint: str, name: str, version: int, structure: str) -> None:
        """Remember a definition's structure (idempotent), so a later definition can be
        compared with the one a run started under."""

    @abc.abstractmethod
    def definition(self, fingerprint: str) -> dict[str, Any] | None: ...

    @abc.abstractmethod
    def create_run(self, new: NewRun) -> tuple[StoredRun, bool]:
        """Insert a run and its first journal events in one transaction. When a run with the
        same (workflow, key) or idempotency key exists, nothing is written and that run is
        returned with ``False``."""

    @abc.abstractmethod
    def create_runs(self, news: Sequence[NewRun]) -> list[tuple[StoredRun, bool]]:
        """:meth:`create_run` for many runs in one transaction (in order; a run whose key
        an earlier one of the batch took is returned as existing)."""

    @abc.abstractmethod
    def get_run(self, run_id: str) -> StoredRun | None: ...

    @abc.abstractmethod
    def run_ids_with_prefix(self, prefix: str, *, limit: int) -> list[str]:
        """Up to ``limit`` ids of runs that start with ``prefix``, in id order (an indexed
        range on the primary key: see :mod:`flowloop.ids`)."""

    @abc.abstractmethod
    def find_runs(self, where: RunFilter) -> list[StoredRun]:
        """Runs matching ``where``, newest first."""

    @abc.abstractmethod
    def journal(self, run_id: str, *, until_seq: int | None = None) -> list[JournalEvent]:
        """A run's journal in seq order."""

    def first_entry(self, run_id: str, kinds: Collection[str]) -> int | None:
        """The seq of the run's first journal entry of one of ``kinds`` (``None``: none).
        The SQL store reads rows: a ``step_started`` stored in the row of the success
        before it (flowloop/store/entries.py) is not found — it is never the run's first
        start."""
        return next((e.seq for e in self.journal(run_id) if e.kind in kinds), None)

    @abc.abstractmethod
    def write(self, boundaries: Sequence[Boundary]) -> list[bool]:
        """Apply boundaries (of different runs) in ONE transaction: one commit for all.

        For each boundary the run row is updated only if its fence holds and its
        journal ends at ``boundary.follows_seq``; only then are its events appended.
        Returns, per boundary, whether it was applied. Owned writes of the run row renew
        the lease (:meth:`renews_lease`)."""

    def renews_lease(self, boundary: Boundary) -> bool:
        """Whether applying ``boundary`` (an owned one) also renewed its owner's lease;
        when it did not, only the heartbeat's :meth:`renew` keeps the lease alive."""
        return boundary.fence.owner is not None and not boundary.release

    @abc.abstractmethod
    def claim(
        self,
        *,
        worker: str,
        now: float,
        limit: int,
        lease_seconds: float,
        workflows: Sequence[str] | None = None,
        run_ids: Sequence[str] | None = None,
    ) -> list[StoredRun]:
        """Take up to ``limit`` runs that are due (``scheduled``/``retrying`` with
        ``next_run_at <= now``) and not validly leased by another worker, highest priority
        first, then oldest due. Sets owner, a fresh lease, epoch + 1. Concurrent claimers never
        get the same run."""

    @abc.abstractmethod
    def claim_interrupted(
        self,
        *,
        worker: str,
        limit: int,
        lease_seconds: float,
        workflows: Sequence[str] | None = None,
    ) -> list[StoredRun]:
        """Take up to ``limit`` runs (of ``workflows``) left ``running`` by a worker whose
        lease expired: a ``step_started`` with no outcome. Same ownership effects as
        :meth:`claim`."""

    @abc.abstractmethod
    def running_owners(self) -> list[str]:
        """Distinct owners of runs that are currently owned."""

    @abc.abstractmethod
    def expire_leases(self, owners: Sequence[str]) -> int:
        """End the leases of ``owners`` now (they are known dead). Returns rows changed."""

    @abc.abstractmethod
    def renew(self, *, worker: str, run_ids: Sequence[str], lease_seconds: float) -> set[str]:
        """Extend this worker's leases; returns the ids whose lease it still holds."""

    @abc.abstractmethod
    def release(self, *, worker: str, run_ids: Sequence[str]) -> None:
        """Drop this worker's ownership of runs it will not touch further (no status change)."""

    @abc.abstractmethod
    def request_control(
        self, run_id: str, action: str | None, *, unless: Collection[str] = ()
    ) -> bool:
        """Ask the owner of a run to pause or stop it at its next boundary; False when no
        such run, or when it has one of the requests ``unless`` pending, which stays."""

    @abc.abstractmethod
    def withdraw_control(self, run_id: str, action: str) -> bool:
        """Withdraw the run's pending ``action`` request; False when it holds none (or
        another: a stop made meanwhile stays)."""

    @abc.abstractmethod
    def pending_controls(self, *, worker: str) -> dict[str, str]:
        """Control requests on runs this worker owns."""

    @abc.abstractmethod
    def count_due(self, *, now: float, workflows: Sequence[str] | None = None) -> int: ...

    @abc.abstractmethod
    def next_due(
        self, *, workflows: Sequence[str] | None = None, run_ids: Sequence[str] | None = None
    ) -> float | None:
        """Earliest ``next_run_at`` of a claimable run (of ``workflows``, among ``run_ids``;
        ``None`` when none)."""

    @abc.abstractmethod
    def deliver(self, message: InboxEvent, boundary: Boundary | None) -> str:
        """One transaction: keep ``message`` in the run's inbox (a new one is inserted; its
        ``dedupe_key`` already used for the run → ``"duplicate"``, nothing written) and,
        with a ``boundary``, consume it by applying the boundary (``"applied"``). A refused
        boundary undoes everything (``"conflict"``: re-read and decide again). Without a
        boundary the message stays buffered (``"buffered"``)."""

    @abc.abstractmethod
    def pending_events(self, run_id: str) -> list[InboxEvent]:
        """Buffered (unconsumed) messages of a run, oldest first."""

    @abc.abstractmethod
    def has_message(self, run_id: str, dedupe_key: str) -> bool:
        """Whether a message with this dedupe key was ever sent to the run."""
