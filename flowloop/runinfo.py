"""What the engine hands its users about runs: ``RunInfo`` and friends (plain data)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, TypeAlias, overload

from flowloop import frozen
from flowloop.errors import FlowloopError
from flowloop.journal import JournalEvent, RunRecord, holds_context
from flowloop.lifecycle import FINISHED
from flowloop.store.base import StoredRun

if TYPE_CHECKING:
    # Annotations only: reading runs (flowloop.reading) needs neither pydantic nor the
    # definitions' modules; a context is loaded by the run's Workflow when it has one.
    from pydantic import BaseModel

    from flowloop.definition import Workflow

# The workflow's context model (a dict for a run whose workflow is not loaded here) —
# typed Any, as a JSON value is: typed `BaseModel | dict`, every `info.context.field` of a
# typed user's code failed mypy (`union-attr`) though the model is the workflow's own.
Context: TypeAlias = Any

INVALID_JSON_KEY: Final = "_invalid_json"
"""``RunInfo.context`` of a run whose stored context is not a JSON object: the raw text."""


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """A run as users see it."""

    id: str
    workflow: str
    version: int
    status: str
    state: str
    context: Context
    attempt: int
    key: str | None
    reason: str | None
    error: str | None
    next_run_at: float | None
    owner: str | None
    last_seq: int
    created_at: float
    updated_at: float
    visits: Mapping[str, int]
    fingerprint: str = ""
    """The definition the run follows (its structure is stored under this fingerprint)."""

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


@dataclass(frozen=True)
class StartedRuns(Sequence[RunInfo]):
    """What :meth:`Engine.start_many` enqueued: one run per context, in order (iterate or
    index it like a list), and how many of them it created — the others already held
    their key (an existing run, or an earlier context of the same call)."""

    runs: tuple[RunInfo, ...]
    created: int

    def __len__(self) -> int:
        return len(self.runs)

    @overload
    def __getitem__(self, index: int) -> RunInfo: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[RunInfo]: ...

    def __getitem__(self, index: int | slice) -> RunInfo | Sequence[RunInfo]:
        return self.runs[index]


@dataclass(frozen=True, kw_only=True)
class Replay:
    """A journal folded: the record at ``seq``, and whether the full fold equals the row."""

    run_id: str
    seq: int
    record: RunRecord
    events: list[JournalEvent]
    differences: list[str]

    @property
    def matches(self) -> bool:
        return not self.differences


@dataclass(frozen=True)
class SendResult:
    """``applied`` (the run took the event), ``buffered`` or ``duplicate``."""

    status: str
    run: RunInfo


@dataclass(frozen=True)
class Stranded:
    """A live run the current definition cannot continue."""

    run_id: str
    state: str
    status: str
    reason: str


def run_info(
    stored: StoredRun, workflow: Workflow | None, parsed: tuple[str, BaseModel] | None = None
) -> RunInfo:
    """A stored run as users see it (its context loaded by ``workflow`` when it is known).
    ``parsed``: a context text and its parse by ``workflow``'s model at its version, taken
    as the context when the run holds that very text (no second parse of it)."""
    return info_of(
        stored.record, stored.owner, stored.created_at, stored.updated_at, workflow, parsed
    )


def info_of(
    record: RunRecord,
    owner: str | None,
    created_at: float,
    updated_at: float,
    workflow: Workflow | None,
    parsed: tuple[str, BaseModel] | None = None,
) -> RunInfo:
    """:func:`run_info` of a run whose row holds ``record``, ``owner`` and the times given:
    ``Engine.run`` answers with the row its run's end wrote, without a copy of the stored
    run made first to carry them."""
    context: BaseModel | dict[str, Any]
    if (
        parsed is not None
        and workflow is not None
        and holds_context(record, parsed[0], workflow.context_version)
        and type(parsed[1]) is workflow.context
    ):
        context = parsed[1]
    else:
        context = _loaded(record, workflow)
    return frozen.build(  # RunInfo(...) without its generated __init__ (one per run)
        RunInfo,
        {
            "id": record.id,
            "workflow": record.workflow,
            "version": record.version,
            "status": record.status,
            "state": record.state,
            "context": context,
            "attempt": record.attempt,
            "key": record.key,
            "reason": record.reason,
            "error": record.error,
            "next_run_at": record.next_run_at,
            "owner": owner,
            "last_seq": record.last_seq,
            "created_at": created_at,
            "updated_at": updated_at,
            "visits": dict(record.visits),
            "fingerprint": record.fingerprint,
        },
    )


def _loaded(record: RunRecord, workflow: Workflow | None) -> BaseModel | dict[str, Any]:
    """The stored context loaded by ``workflow`` (as JSON when it is unknown, or the
    context no longer validates: a run must stay readable)."""
    context: BaseModel | dict[str, Any]
    try:
        context = (
            workflow.load_context(record.context, record.context_version)
            if workflow is not None
            else json.loads(record.context)
        )
    except (ValueError, FlowloopError):
        # A stored context that no longer validates (or parses) must not make the run
        # unreadable: show what is there.
        try:
            context = json.loads(record.context)
        except ValueError:
            context = {INVALID_JSON_KEY: record.context}
        if not isinstance(context, dict):
            context = {INVALID_JSON_KEY: record.context}
    return context
