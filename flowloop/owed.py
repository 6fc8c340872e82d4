"""Which compensations a compensating run owes, across the deploys it lived through.

A compensating run undoes every step that succeeded in it and declares ``compensate=``,
newest first, minus those whose ``compensation_succeeded`` is journaled. Its journal names
each step as it ran; a migration (``run_migrated``) since may have renamed it — its new
name's ``compensate=`` undoes it — or dropped it, and a redeploy of the same version may
have dropped it too. The definition the run compensates under then has no step for it,
and whether it declared ``compensate=`` is known only from the definition that last had it
as a step (:class:`StepOf`): journaled by the migration that dropped it (``dropped`` in
its data, read off that definition when it was loaded then), else that definition loaded
now (same version, same fingerprint). Unknown counts as owed. One owed that has no step
is a :class:`CompensationLost`: the run parks (a definition mismatch) and the message says
what gets it out — never a compensation skipped unseen.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from flowloop import journal as j
from flowloop.journal import JournalEvent, RunRecord

if TYPE_CHECKING:
    from flowloop.definition import Workflow

VersionOf = Callable[[int], "Workflow | None"]
"""The loaded definition of a version of the run's workflow (``None``: not loaded)."""

DROPPED = "dropped"
"""The ``run_migrated`` data key: ``{step: declares compensate=}`` of the steps the move
left without a step, as the definition that last had each one said (when loaded then)."""


@dataclass(frozen=True)
class StepOf:
    """The last definition that had a step as a step: its version and fingerprint (as the
    journal has them) and its name there."""

    version: int
    fingerprint: str
    name: str


@dataclass(frozen=True)
class Undo:
    """One compensation to run: of the step that succeeded at journal ``seq``, in visit
    ``visit`` of the state it ran as (``ran_as``: its name then; ``state`` is its name in
    the run's definition now, which a migration may have renamed it to)."""

    state: str
    seq: int
    visit: int
    ran_as: str
    step_of: StepOf | None = None
    undoes: bool | None = None
    """Whether ``step_of`` declares ``compensate=`` on it, as the migration that dropped it
    journaled (``None``: not journaled)."""


@dataclass(frozen=True)
class Owing:
    """A compensating run's journal read for :func:`compensations_due`."""

    succeeded: list[Undo]
    """The steps that succeeded and are not undone yet, oldest first, named as the version
    the journal's migrations moved the run to names them."""
    version: int
    fingerprint: str
    """The version and fingerprint of the definition the run is on."""
    lost: list[Undo]
    """Those the definition it is read under has no step for, and that may need undoing."""


def compensations_due(
    workflow: Workflow, events: Sequence[JournalEvent], version_of: VersionOf | None = None
) -> list[Undo]:
    """The compensations a compensating run still owes, in the order they must run: every
    step that succeeded in this run and declares ``compensate=``, newest first, except
    those whose ``compensation_succeeded`` is journaled. Each one's visit is the one its
    step ran under, read off the journal's own fold (:func:`journal.apply`): a retry from a
    past state or a migration begins or moves visits too. A step a migration renamed since
    (``version_of`` gives the versions it crossed) is undone by its new name's
    ``compensate=``. One owed that ``workflow`` has no step for raises
    :class:`CompensationLost`: skipped, it was never undone."""
    owing = not_undone(workflow, events, version_of)
    if owing.lost:
        raise CompensationLost(workflow, events[0].run_id, owing, version_of)
    owed = [undo for undo in owing.succeeded if compensates(workflow, undo.state)]
    owed.reverse()
    return owed


def stranded_compensations(
    workflow: Workflow,
    events: Sequence[JournalEvent],
    version_of: VersionOf | None = None,
    *,
    moving: bool = False,
) -> CompensationLost | None:
    """Why a compensating run cannot compensate under ``workflow``: a step that succeeded
    and is not undone yet which ``workflow`` has no step for, and which declared
    ``compensate=`` or may have (``moving``: ``events`` end with the ``run_migrated``
    entry of a move being decided, refused when this is not ``None``)."""
    owing = not_undone(workflow, events, version_of)
    if not owing.lost:
        return None
    if moving:  # (refused, the run stays on the version it is on: the advice starts there)
        before = j.fold(events[:-1])
        owing = replace(owing, version=before.version, fingerprint=before.fingerprint)
    return CompensationLost(workflow, events[0].run_id, owing, version_of, moving=moving)


def not_undone(
    workflow: Workflow, events: Sequence[JournalEvent], version_of: VersionOf | None
) -> Owing:
    """The run's journal read as :class:`Owing` under ``workflow``."""
    done = {
        int(event.data["for_seq"])
        for event in events
        if event.kind == j.COMPENSATION_SUCCEEDED and "for_seq" in event.data
    }
    succeeded: list[Undo] = []
    record: RunRecord | None = None
    for event in events:
        if record is None:
            record = j.create(event)
            continue
        if event.kind == j.STEP_SUCCEEDED and event.state is not None and event.seq not in done:
            visit = record.visit(event.state)
            step_of = StepOf(record.version, record.fingerprint, event.state)
            succeeded.append(Undo(event.state, event.seq, visit, event.state, step_of))
        elif event.kind == j.RUN_MIGRATED:
            succeeded = _renamed(succeeded, workflow, event, version_of)
        record = j.apply(record, event)
    if record is None:
        return Owing([], workflow.version, workflow.fingerprint, [])
    lost = [
        undo
        for undo in succeeded
        if undo.state not in workflow.steps and undoes(undo, workflow, version_of) is not False
    ]
    return Owing(succeeded, record.version, record.fingerprint, lost)


def undoes(undo: Undo, workflow: Workflow, version_of: VersionOf | None) -> bool | None:
    """Whether the step ``undo`` names declares ``compensate=``: in ``workflow`` when it has
    that step, else as journaled when a migration dropped it, else in the definition that
    last had it, when loaded (``None``: not known)."""
    if undo.state in workflow.steps:
        return compensates(workflow, undo.state)
    if undo.undoes is not None:
        return undo.undoes
    if undo.step_of is None:
        return None
    had = loaded(workflow, version_of, undo.step_of.version, undo.step_of.fingerprint)
    return None if had is None else compensates(had, undo.step_of.name)


def loaded(
    workflow: Workflow, version_of: VersionOf | None, version: int, fingerprint: str
) -> Workflow | None:
    """The loaded definition of ``version`` with ``fingerprint`` (the one a run knew), if
    any: another one of that number (a redeploy) may lack or change its steps."""
    for candidate in (workflow, version_of(version) if version_of else None):
        if candidate is not None and (candidate.version, candidate.fingerprint) == (
            version,
            fingerprint,
        ):
            return candidate
    return None


def compensates(workflow: Workflow, state: str) -> bool:
    spec = workflow.steps.get(state)
    return spec is not None and spec.compensate is not None


def dropped_by(
    target: Workflow, events: Sequence[JournalEvent], version_of: VersionOf | None
) -> dict[str, bool]:
    """The ``dropped`` data of a move of the run to ``target``: each step that succeeded
    and is not undone which the move leaves without a step (``target`` neither has nor
    renames it), with whether the definition that last had it declares ``compensate=`` —
    known now (that definition loaded), journaled so that the run, compensating once that
    version is no longer loaded, still knows. One not known now is left out (then owed)."""
    owing = not_undone(target, events, version_of)
    mapping = target.migrates_from.get(owing.version, {})
    found: dict[str, bool] = {}
    for undo in owing.succeeded:
        name = _new_name(undo.state, mapping, target)
        if name not in target.steps:
            known = undoes(replace(undo, state=name), target, version_of)
            if known is not None:
                found[undo.state] = known
    return found


def _new_name(state: str, mapping: Mapping[str, str], target: Workflow) -> str:
    """A step's name after a move to ``target``: renamed when ``target`` lacks the state
    and maps it (a mapped state it still has is where runs in it moved to, not a new name
    for its step)."""
    return mapping[state] if state in mapping and state not in target.states else state


def _renamed(
    undos: list[Undo], workflow: Workflow, event: JournalEvent, version_of: VersionOf | None
) -> list[Undo]:
    """``undos`` as a ``run_migrated`` entry moved them: named as the version it moved the
    run to names them, and each one that version has as a step is one of its steps now;
    one it has no step for keeps the definition that last had it, and what the entry
    journaled of it (``dropped``)."""
    to, source = int(event.data["to"]), int(event.data["from"])
    raw = event.data.get(DROPPED)
    dropped: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    target = workflow if to == workflow.version else version_of(to) if version_of else None
    if target is None:  # (its renames are not known: the names stay)
        return [_journaled(undo, dropped) for undo in undos]
    mapping = target.migrates_from.get(source, {})
    fingerprint = str(event.data.get("fingerprint", ""))
    # Another definition of that version loaded (redeployed since): its renames are taken,
    # but not its steps — one the definition moved to may have had is not known dropped.
    exact = target.fingerprint == fingerprint
    moved: list[Undo] = []
    for undo in undos:
        name = _new_name(undo.state, mapping, target)
        if name in target.steps or not (exact or undo.state in dropped):
            moved.append(replace(undo, state=name, step_of=StepOf(to, fingerprint, name)))
        else:
            moved.append(replace(_journaled(undo, dropped), state=name))
    return moved


def _journaled(undo: Undo, dropped: Mapping[str, Any]) -> Undo:
    value = dropped.get(undo.state)
    return undo if not isinstance(value, bool) else replace(undo, undoes=value)


class CompensationLost(Exception):
    """A compensating run owes the compensation of a step the definition it would run
    under has no step for: a definition mismatch (the run parks), never a skip. The message
    says what gets it out (:func:`advice`)."""

    def __init__(
        self,
        workflow: Workflow,
        run_id: str,
        owing: Owing,
        version_of: VersionOf | None,
        *,
        moving: bool = False,
    ) -> None:
        lost = list({undo.state: undo for undo in owing.lost}.values())
        self.states = [undo.state for undo in lost]
        names = ", ".join(
            f"{undo.state!r} (v{undo.step_of.version})" if undo.step_of else repr(undo.state)
            for undo in lost
        )
        super().__init__(
            f"it is compensating and owes the compensation of {names}, which {workflow.name} "
            f"v{workflow.version} has no step for; "
            + advice(workflow, run_id, owing, lost, version_of, moving=moving)
        )


def advice(
    workflow: Workflow,
    run_id: str,
    owing: Owing,
    lost: Sequence[Undo],
    version_of: VersionOf | None,
    *,
    moving: bool = False,
) -> str:
    """What gets a run that owes ``lost`` under ``workflow`` out, each way one that works
    in its case: ``workflow`` renames them (migrate); else map them in a version above the
    run's (always possible); or the run's own definition, which has them, loaded; or, when
    whether they declared ``compensate=`` is not known, the definition that had them."""
    run, have, to = owing.version, workflow.version, f"`flowloop migrate {run_id} --to"
    mapping = workflow.migrates_from.get(run, {})
    if run < have and all(_new_name(u.state, mapping, workflow) in workflow.steps for u in lost):
        renames = ", ".join(f"{u.state} -> {mapping[u.state]}" for u in lost)
        return f"v{have} renames it ({renames}): {to} {have}`"
    if run < have:
        ways = [
            f"map each to the v{have} step that undoes it in migrates_from={{{run}: {{...}}}} "
            f"and {to} {have}`"
        ]
    else:
        ways = [
            f"deploy a version above v{run} whose migrates_from={{{run}: {{...}}}} maps each "
            f"to a step that undoes it, and {to} <that version>`"
        ]
    # (Refused a move, the run stays where it is: migrated again once the fix is loaded.)
    then = f"{to} {have}` again" if moving else f"`flowloop unpause {run_id}`"
    if all(_of(u) == (run, owing.fingerprint) for u in lost):
        ways.append(_own_way(workflow, run_id, owing, lost, version_of, moving=moving))
    else:
        ways += _unknown_ways(workflow, lost, version_of, then)
    return ", or ".join(way for way in ways if way)


def _of(undo: Undo) -> tuple[int, str] | None:
    step_of = undo.step_of
    return None if step_of is None else (step_of.version, step_of.fingerprint)


def _own_way(
    workflow: Workflow,
    run_id: str,
    owing: Owing,
    lost: Sequence[Undo],
    version_of: VersionOf | None,
    *,
    moving: bool,
) -> str:
    """The run's own definition has every step it owes: loaded, it compensates there (a
    move refused: left on it)."""
    names = ", ".join(repr(u.state) for u in lost)
    run, own = owing.version, loaded(workflow, version_of, owing.version, owing.fingerprint)
    if moving:
        where = "" if own is not None else f"load v{run} beside v{workflow.version} and "
        return f"{where}leave it on v{run}, where it compensates"
    if own is not None:
        return ""  # (not judged under its own, loaded definition: nothing to add)
    if run == workflow.version:  # (a redeploy of its version dropped them)
        return (
            f"deploy v{run} as the run knew it (with {names}) again and `flowloop unpause {run_id}`"
        )
    return (
        f"load v{run} (with {names}) beside v{workflow.version}, where the run compensates, "
        f"and `flowloop unpause {run_id}`"
    )


def _unknown_ways(
    workflow: Workflow, lost: Sequence[Undo], version_of: VersionOf | None, then: str
) -> list[str]:
    """Steps an earlier move dropped, by versions not loaded: whether they declared
    ``compensate=`` there is not known; loaded, one that did not owes nothing."""
    unknown: dict[int, list[str]] = {}
    for undo in lost:
        if undoes(undo, workflow, version_of) is None and undo.step_of is not None:
            unknown.setdefault(undo.step_of.version, []).append(repr(undo.step_of.name))
    ways = []
    for version, names in sorted(unknown.items()):
        where = (
            f"deploy v{version} as the run knew it again"
            if version == workflow.version
            else f"load v{version} beside v{workflow.version}"
        )
        ways.append(
            f"if v{version} declared no compensate= on {', '.join(names)}, {where} "
            f"(nothing is owed then) and {then}"
        )
    return ways
