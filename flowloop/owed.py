"""Which compensations a compensating run owes, across the deploys it lived through.

A compensating run undoes every step that succeeded in it and declares ``compensate=``,
newest first, minus those whose ``compensation_succeeded`` is journaled. Its journal names
each step as it ran; a migration (``run_migrated``) since may have renamed it — its new
name's ``compensate=`` undoes it — or dropped it, and a redeploy of the same version may
have dropped it too. The definition the run compensates under then has no step for it,
and whether it declared ``compensate=`` is known only from the definition that last had it
as a step (:class:`StepOf`): journaled by its own ``step_succeeded`` entry (``undo``
in its data: the name of its ``compensate=``, written by the step that declared one —
a step without one writes nothing, so an entry without it is that step's or one from
before it was written, not told apart), or by the migration that dropped it (``dropped``
in its data, read off that definition when it was loaded then), else that definition
loaded now (the same version number with that step: the fingerprint does not cover
``compensate=``). Unknown counts as owed (the message says "may owe"). The renames a
migration applied are journaled too (``renames``): a later reader may have neither
version loaded. One owed that has no step is a :class:`CompensationLost`: the run parks (a
definition mismatch) and the message says what gets it out — never a compensation skipped
unseen.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
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

UNDO = "undo"
"""The ``step_succeeded`` data key: the name of the ``compensate=`` the step that succeeded
declared (:func:`with_undo`); absent for a step without one (its entry as it always was)."""

RENAMES = "renames"
"""The ``run_migrated`` data key: ``{state: new name}`` of the states the move renamed
(:func:`renames_by`), written when the mapping names a state the target has not."""


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
    compensation: str | None = None
    """The name of the ``compensate=`` its ``step_succeeded`` entry journaled (:data:`UNDO`):
    the step as it ran (``step_of`` then) declared it. ``None``: no name journaled (a step
    without ``compensate=``, or an entry from before it was written), or the step moved
    since to a version's step (renamed), whose own ``compensate=`` undoes it."""


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
            named = event.data.get(UNDO)
            named = named if isinstance(named, str) else None
            succeeded.append(
                Undo(event.state, event.seq, visit, event.state, step_of, compensation=named)
            )
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
    last had it, when loaded, else as its ``step_succeeded`` entry journaled (a name: it
    did; ``None``: not known). The entry's name comes last: it says what the step
    declared as it ran, and a later word outranks it — a version that kept the step
    without ``compensate=`` (journaled when a later move dropped it), or its own version
    redeployed so."""
    if undo.state in workflow.steps:
        return compensates(workflow, undo.state)
    if undo.undoes is not None:
        return undo.undoes
    step_of = undo.step_of
    if step_of is not None:
        had = loaded(workflow, version_of, step_of.version, step_of.fingerprint, [step_of.name])
        if had is not None:
            return compensates(had, step_of.name)
    return True if undo.compensation is not None else None


def loaded(
    workflow: Workflow,
    version_of: VersionOf | None,
    version: int,
    fingerprint: str,
    steps: Collection[str] = (),
) -> Workflow | None:
    """The loaded definition of ``version`` as the run knew it, if any: with ``fingerprint``,
    or another one of that number (a redeploy) that has ``steps`` as steps. The fingerprint
    covers the steps, not their ``compensate=``: an exact match says no more of a step's
    ``compensate=`` than the loaded one that has it — and a run's row keeps the fingerprint
    it started with across redeploys of its version (only a migration changes it)."""
    for candidate in (workflow, version_of(version) if version_of else None):
        if candidate is None or candidate.version != version:
            continue
        if candidate.fingerprint == fingerprint or (
            steps and all(step in candidate.steps for step in steps)
        ):
            return candidate
    return None


def compensates(workflow: Workflow, state: str) -> bool:
    spec = workflow.steps.get(state)
    return spec is not None and spec.compensate is not None


def dropped_by(
    target: Workflow,
    events: Sequence[JournalEvent],
    version_of: VersionOf | None,
    renames: Mapping[str, str],
) -> dict[str, bool]:
    """The ``dropped`` data of a move of the run to ``target``: each step that succeeded
    and is not undone which the move leaves without a step (``target`` neither has it nor
    ``renames`` it, :func:`renames_by`), with whether the definition that last had it
    declares ``compensate=`` — known now (that definition loaded), journaled so that the
    run, compensating once that version is no longer loaded, still knows. One not known now
    is left out (then owed)."""
    owing = not_undone(target, events, version_of)
    found: dict[str, bool] = {}
    for undo in owing.succeeded:
        name = renames.get(undo.state, undo.state)
        if name not in target.steps:
            known = undoes(replace(undo, state=name), target, version_of)
            if known is not None:
                found[undo.state] = known
    return found


def renames_by(
    mapping: Mapping[str, str], target: Workflow, source_states: Collection[str]
) -> dict[str, str]:
    """The renames of a move to ``target`` by ``mapping`` (its ``migrates_from`` entry) from
    a definition with ``source_states``: each state ``target`` lacks, mapped to a name the
    source had no state by. A mapped state ``target`` still has is where runs in it move
    to; one mapped onto a state the source had merges into that state (runs in it go on
    there) — neither is a new name for its step, whose undo is not that state's: a merged
    step is dropped (owed until a version undoes it)."""
    return {
        state: name
        for state, name in mapping.items()
        if state not in target.states and name not in source_states
    }


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
    fingerprint = str(event.data.get("fingerprint", ""))
    journaled = event.data.get(RENAMES)
    if target is None:
        # Its steps are not known: a step it renamed (journaled) is that version's step by
        # the new name; any other keeps the definition that last had it.
        renames = journaled if isinstance(journaled, dict) else {}
        # (A rename onto no step — a wait, say — is dropped too: what it journaled holds.)
        return [
            _moved(_journaled(undo, dropped), StepOf(to, fingerprint, str(renames[undo.state])))
            if undo.state in renames
            else _journaled(undo, dropped)
            for undo in undos
        ]
    if not isinstance(journaled, dict):
        # An entry from before renames were journaled: its mapping's renames, as then — but
        # a state the run's own steps ran as, or the source version has (when loaded), was
        # the source's: mapped onto, it is a merge, no rename (one undo ran twice).
        had = version_of(source) if version_of else None
        known = {undo.state for undo in undos} | set(had.states if had is not None else ())
        journaled = renames_by(target.migrates_from.get(source, {}), target, known)
    renames = journaled
    # Another definition of that version loaded (redeployed since): its renames are taken,
    # but not its steps — one the definition moved to may have had is not known dropped.
    exact = target.fingerprint == fingerprint
    moved: list[Undo] = []
    for undo in undos:
        name = str(renames.get(undo.state, undo.state))
        if name in target.steps or not (exact or undo.state in dropped):
            moved.append(_moved(undo, StepOf(to, fingerprint, name)))
        else:
            moved.append(replace(_journaled(undo, dropped), state=name))
    return moved


def _moved(undo: Undo, step_of: StepOf) -> Undo:
    # (The name its entry journaled was step_of's, as it ran: the step it moved to has its
    # own compensate=, or none — a rename onto a step without one undoes nothing.)
    return replace(undo, state=step_of.name, step_of=step_of, compensation=None)


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
        maybe = [undo for undo in lost if undoes(undo, workflow, version_of) is None]
        owes = [undo for undo in lost if undo not in maybe]
        what = [f"owes the compensation of {_names(owes)}"] if owes else []
        if maybe:  # (whether the definition that had it declared compensate= is unknown)
            what.append(
                f"may owe {'that' if owes else 'the compensation'} of {_names(maybe)} "
                f"(whether {'it' if len(maybe) == 1 else 'each'} declared compensate= is "
                "not known)"
            )
        super().__init__(
            f"it is compensating and {' and '.join(what)}, which {workflow.name} "
            f"v{workflow.version} has no step for; "
            + advice(workflow, run_id, owing, lost, version_of, moving=moving)
        )


def _names(undos: Sequence[Undo]) -> str:
    return ", ".join(_name(undo) for undo in undos)


def _name(undo: Undo) -> str:
    """A step owed, with the version that last had it and its undo as journaled."""
    said = [f"v{undo.step_of.version}"] if undo.step_of else []
    if undo.compensation is not None:
        said.append(f"compensate={undo.compensation}")
    return f"{undo.state!r} ({', '.join(said)})" if said else repr(undo.state)


def undo_name(function: Callable[..., Any]) -> str:
    """The name a ``compensate=`` function is journaled by (:data:`UNDO`)."""
    name = getattr(function, "__name__", None)
    return name if isinstance(name, str) else type(function).__name__


def with_undo(data: Mapping[str, Any], function: Callable[..., Any]) -> dict[str, Any]:
    """A ``step_succeeded`` entry's ``data`` for a step whose ``compensate=`` is
    ``function``: the name of the undo it owes from now on (:data:`UNDO`), so that the
    journal says so once no loaded definition has the step. Only such a step's entry
    carries it: a step without one writes what it always wrote."""
    return {**data, UNDO: undo_name(function)}


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
    own = version_of(run) if version_of and run != have else None
    # The run's version's states: when loaded, all of them; else those its steps ran as —
    # a mapping onto one is a merge, not a rename (advised as one, the move it named was
    # the one just refused).
    states = {undo.ran_as for undo in owing.succeeded} | set(own.states if own else ())
    renames = renames_by(mapping, workflow, states)
    if run < have and all(renames.get(u.state) in workflow.steps for u in lost):
        named = ", ".join(f"{u.state} -> {renames[u.state]}" for u in lost)
        return f"v{have} renames it ({named}): {to} {have}`"
    # (One that may undo nothing mapped to a step that undoes: that step's action undone
    # for it too.)
    each = (
        "each"
        if all(undoes(u, workflow, version_of) for u in lost)
        else ("each that declared compensate=")
    )
    if run < have:
        ways = [
            f"map {each} to the v{have} step that undoes it in migrates_from={{{run}: {{...}}}} "
            f"and {to} {have}`"
        ]
    else:
        ways = [
            f"deploy a version above v{run} whose migrates_from={{{run}: {{...}}}} maps {each} "
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
    steps = [u.step_of.name for u in lost if u.step_of is not None]
    run, own = owing.version, loaded(workflow, version_of, owing.version, owing.fingerprint, steps)
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
        # (A definition of that number loaded already lacks the step: its own, deployed.)
        where = (
            f"deploy v{version} as the run knew it again"
            if version == workflow.version or (version_of and version_of(version))
            else f"load v{version} beside v{workflow.version}"
        )
        ways.append(
            f"if v{version} declared no compensate= on {', '.join(names)}, {where} "
            f"(nothing is owed then) and {then}"
        )
    return ways
