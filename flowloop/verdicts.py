"""What happens to a stored run under a (new) definition: the one decision that the worker,
recovery, the read commands and ``flowloop check`` share, so check tells what a worker does.

``judge`` answers, for one run:

- ``continues``: the definition is the one it started with, or its state and transitions
  still exist and its context validates as stored;
- ``migrates``: the same, after the upcasters carry its context to the new version;
- ``parks``: its state or one of that state's transitions is gone
  (``definition_mismatch: …``) — a worker pauses it; nothing is lost, ``flowloop unpause``
  after a fix (or ``flowloop migrate``) continues it;
- ``fails``: its context does not validate after migration, or cannot be migrated
  (``context_mismatch: field: problem``), or its own, unchanged definition no longer
  validates it (a validator changed: the fingerprint does not cover their code). A worker
  pauses it too (so an operator can deploy a fixed upcaster or validator and unpause it);
  only a run whose row contradicts its own, unchanged definition — a state it does not
  have, a context that is not a JSON object — is failed at once (``outcome == "failed"``).

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from flowloop import frozen
from flowloop.definition import Workflow, compatible
from flowloop.errors import InvalidContext, storable
from flowloop.owed import VersionOf, stranded_compensations
from flowloop.upcast import ContextMigrationError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from flowloop.journal import JournalEvent

Kind = Literal["continues", "migrates", "parks", "fails"]
KINDS: Final[tuple[Kind, ...]] = ("continues", "migrates", "parks", "fails")

DEFINITION_MISMATCH: Final = "definition_mismatch"
CONTEXT_MISMATCH: Final = "context_mismatch"


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What a worker does with one run under one definition."""

    kind: Kind
    reason: str | None = None
    """``definition_mismatch: …`` / ``context_mismatch: …`` (or ``invalid_context``,
    ``unknown_state: S`` for a corrupt row); ``None`` when the run goes on."""
    message: str | None = None
    """The same in words, for the journal and the operator."""
    outcome: Literal["runs", "paused", "failed"] = "runs"
    context: BaseModel | None = field(default=None, compare=False, repr=False)
    """The context as loaded for this definition (carried to its version) when the
    verdict validated it: a worker's first step takes it instead of parsing it again."""

    @property
    def goes_on(self) -> bool:
        return self.kind in ("continues", "migrates")


CONTINUES: Final = Verdict(kind="continues")


def judge(
    workflow: Workflow,
    *,
    state: str,
    fingerprint: str,
    context: str,
    context_version: int,
    old: Mapping[str, Any] | None,
    validate: bool = True,
    cache: dict[tuple[str, str], str | None] | None = None,
    journal: Callable[[], Sequence[JournalEvent]] | None = None,
    versions: VersionOf | None = None,
) -> Verdict:
    """The verdict for a run in ``state`` written under the definition ``fingerprint``
    (whose stored record is ``old``; ``None``/empty when unknown) with ``context`` at
    ``context_version``. ``validate=False`` trusts the context when its model and
    version are unchanged (``flowloop check`` on many runs); ``cache`` keeps the structure
    verdict per (fingerprint, state) across calls for one ``workflow``. ``journal`` reads
    the run's entries: a compensating run still owes the undoing of its steps, each of
    which the definition must have (read only then: the definition it is not on, or its
    own, which a migration may have moved it to without a step it had — a worker's claim
    leaves that to the compensating drive, which finds it itself); ``versions`` gives the
    other loaded versions (whose steps say whether one dropped since undid anything)."""
    same = fingerprint == workflow.fingerprint
    if same and state not in workflow.states:
        # Same definition, yet a state it does not have: the row was changed by hand (or
        # damaged). Fail now, saying so: no deploy can fix it.
        message = (
            f"the run is in state {state!r}, which {workflow.name} v{workflow.version} "
            "does not have (the stored row was changed)"
        )
        return Verdict(
            kind="fails", reason=f"unknown_state: {state}", message=message, outcome="failed"
        )
    why: str | None = None
    if not same:
        if cache is None:
            why = compatible(old or {}, workflow, state)
        else:
            key = (fingerprint, state)
            if key not in cache:
                cache[key] = compatible(old or {}, workflow, state)
            why = cache[key]
    if why is None and journal is not None and workflow.compensates(state):
        # (Its own definition too: a migration may have dropped a step it owes the undoing
        # of, which the compensations would find — check says so, as a worker parks it.)
        why = _stranded(workflow, journal, versions)
    if why is not None:
        reason = f"{DEFINITION_MISMATCH}: {why}"
        return Verdict(kind="parks", reason=reason, message=reason, outcome="paused")
    migrating = context_version != workflow.context_version
    if not validate and not migrating and (same or _same_context(old, workflow)):
        return CONTINUES
    try:
        loaded = workflow.load_context(context, context_version)
    except (InvalidContext, ContextMigrationError) as error:
        problem = error.problems if isinstance(error, InvalidContext) else error.problem
        if same and not migrating and not _an_object(context):
            # Not even a JSON object: the row is corrupt, no definition can take it.
            return Verdict(
                kind="fails",
                reason="invalid_context",
                message=storable(str(error)),
                outcome="failed",
            )
        version = (
            f"context v{context_version} -> v{workflow.context_version}"
            if migrating
            else f"context v{context_version}"
        )
        if same:
            # Its own definition, as the fingerprint sees it, refuses it: a validator
            # changed (the fingerprint does not cover their code) — parked, not failed,
            # so that a fixed deploy and an unpause continue it — or a row edited by hand.
            version += ", definition unchanged: a validator may have changed"
        reason = storable(f"{CONTEXT_MISMATCH}: {problem} ({version})")
        return Verdict(kind="fails", reason=reason, message=reason, outcome="paused")
    # Verdict(...) without its generated __init__: once per run a worker starts.
    kind: Kind = "migrates" if migrating else "continues"
    return frozen.build(Verdict, {"kind": kind, "context": loaded})


def _stranded(
    workflow: Workflow,
    journal: Callable[[], Sequence[JournalEvent]],
    versions: VersionOf | None,
) -> str | None:
    """Why a compensating run cannot compensate under ``workflow``: a step it still owes
    the undoing of that ``workflow`` has no step for (renamed or removed since, by a
    migration or a redeploy). Run on, it ended without that compensation."""
    lost = stranded_compensations(workflow, journal(), versions)
    return None if lost is None else str(lost)


def _an_object(context: str) -> bool:
    """Whether ``context`` is a JSON object (the error path only: parsed once more)."""
    try:
        return isinstance(json.loads(context), dict)
    except ValueError:
        return False


def _same_context(old: Mapping[str, Any] | None, workflow: Workflow) -> bool:
    """The old definition's context model is this one's (so a stored context validates)."""
    if not old or "context" not in old:
        return False
    return bool(old["context"] == workflow.definition_record()["context"])
