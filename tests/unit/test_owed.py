"""Which compensations a compensating run owes across deploys (flowloop/owed.py), on
journals written by hand: renamed, dropped by a migration (journaled or not, the version
that had it loaded or not), dropped by a redeploy of the same version — and the advice
of :class:`CompensationLost` in each case, which must name a way out that works there.

Before: a step a migration dropped stayed lost through every later migration (even to a
version that had it again); not lost at all when the version that had it was not loaded
(skipped unseen), nor when a redeploy of the same version dropped it (decided by version
number, not definition); and the advice named renames the version did not do
(``mapping`` to a state it still has), ``load vN`` of a version without the step, or
``migrate`` when no version to migrate to could exist yet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import pytest
from pydantic import BaseModel

from flowloop import Workflow, owed
from flowloop import journal as j
from flowloop.compose import CompensationLost, compensations_due


class Ctx(BaseModel):
    pass


def trip(
    version: int,
    steps: Sequence[str] = ("reserve", "charge"),
    *,
    undo: Sequence[str] | None = None,
    migrates: Mapping[int, Mapping[str, str]] | None = None,
    waits: Sequence[str] = (),
) -> Workflow:
    """``steps`` in a row (each with ``compensate=`` when in ``undo``, all by default) into
    a wait ``confirm`` (``no`` -> ``cancelled``, compensating); ``waits`` more wait states."""
    wf = Workflow("trip", context=Ctx, version=version, migrates_from=migrates)
    names = list(steps)
    for name, nxt in zip(names, [*names[1:], "confirm"], strict=True):
        undoes = undo is None or name in undo
        wf.step(
            name=name,
            initial=name == names[0],
            next=nxt,
            compensate=(lambda ctx, step: None) if undoes else None,
        )(lambda ctx: None)
    wf.wait("confirm", on={"no": "cancelled", **{f"to_{w}": w for w in waits}})
    for wait in waits:
        wf.wait(wait, on={"no": "cancelled"})
    wf.final("cancelled", compensate=True)
    return wf.validate()


class Journal:
    """A run's entries, written as the engine would."""

    def __init__(self, wf: Workflow) -> None:
        self.events: list[j.JournalEvent] = []
        data = {"workflow": wf.name, "version": wf.version, "fingerprint": wf.fingerprint}
        self.add(j.RUN_CREATED, state=next(iter(wf.steps)), context="{}", data=data)

    def add(self, kind: str, **fields: object) -> Journal:
        seq = len(self.events) + 1
        event = j.JournalEvent(run_id="r", seq=seq, kind=kind, at=float(seq), **fields)  # type: ignore[arg-type]
        self.events.append(event)
        return self

    def succeeded(self, *states: str) -> Journal:
        for state, nxt in zip(states, [*states[1:], "confirm"], strict=True):
            self.add(j.STEP_SUCCEEDED, state=state, next_state=nxt, context="{}")
        return self

    def migrated(self, source: Workflow, target: Workflow, **extra: object) -> Journal:
        data = {
            "from": source.version,
            "to": target.version,
            "fingerprint": target.fingerprint,
            "from_state": "confirm",
            **extra,
        }
        return self.add(j.RUN_MIGRATED, state="confirm", data=data)

    def cancelled(self) -> list[j.JournalEvent]:
        cancel = {"state": "confirm", "event": "no", "next_state": "cancelled", "context": "{}"}
        return self.add(j.EVENT_RECEIVED, **cancel).events


def loaded(*workflows: Workflow):  # type: ignore[no-untyped-def]
    return {wf.version: wf for wf in workflows}.get


def lost(wf: Workflow, events: Sequence[j.JournalEvent], *versions: Workflow) -> str:
    with pytest.raises(CompensationLost) as raised:
        compensations_due(wf, events, loaded(*versions))
    return str(raised.value)


def test_rename__undone_by_the_new_name() -> None:
    v1, v2 = trip(1), trip(2, ("hold", "charge"), migrates={1: {"reserve": "hold"}})
    events = Journal(v1).succeeded("reserve", "charge").migrated(v1, v2).cancelled()
    due = compensations_due(v2, events, loaded(v1, v2))
    assert [(u.state, u.ran_as) for u in due] == [("charge", "charge"), ("hold", "reserve")]


def test_dropped_by_a_migration__a_later_version_that_has_it_again_undoes_it() -> None:
    v1, v2 = trip(1), trip(2, ("charge",), migrates={1: {}})
    v3 = trip(3, migrates={2: {}})  # reserve back, with compensate=
    journal = Journal(v1).succeeded("reserve", "charge").migrated(v1, v2)
    lost(v2, journal.cancelled(), v1, v2)
    events = journal.migrated(v2, v3).events
    assert [u.state for u in compensations_due(v3, events, loaded(v1, v2, v3))] == [
        "charge",
        "reserve",
    ]


def test_dropped_by_a_migration__mapped_by_a_later_version_to_the_step_undoing_it() -> None:
    v1, v2 = trip(1), trip(2, ("charge",), migrates={1: {}})
    v3 = trip(3, ("release", "charge"), migrates={2: {"reserve": "release"}})
    journal = Journal(v1).succeeded("reserve", "charge").migrated(v1, v2)
    events = journal.cancelled() + Journal(v3).migrated(v2, v3).events[1:]
    due = compensations_due(v3, _renumbered(events), loaded(v1, v2, v3))
    assert [(u.state, u.ran_as) for u in due] == [("charge", "charge"), ("release", "reserve")]


def _renumbered(events: Sequence[j.JournalEvent]) -> list[j.JournalEvent]:
    return [dataclasses.replace(e, seq=i + 1) for i, e in enumerate(events)]


def test_dropped_without_compensate__owes_nothing_when_known() -> None:
    from flowloop import owed  # (new: what a move journals, a move refused)

    v1 = trip(1, ("check", "charge"), undo=("charge",))
    v2 = trip(2, ("charge",), migrates={1: {}})
    journal = Journal(v1).succeeded("check", "charge")
    assert owed.dropped_by(v2, journal.events, loaded(v1, v2), {}) == {"check": False}
    # Journaled by the move: known with v1 loaded or not.
    events = journal.migrated(v1, v2, dropped={"check": False}).cancelled()
    assert [u.state for u in compensations_due(v2, events, loaded(v2))] == ["charge"]


def test_dropped_journaled_as_undone__owed_once_the_version_is_unloaded() -> None:
    from flowloop import owed  # (new: what a move journals, a move refused)

    v1, v2 = trip(1), trip(2, ("charge",), migrates={1: {}})
    journal = Journal(v1).succeeded("reserve", "charge")
    assert owed.dropped_by(v2, journal.events, loaded(v1, v2), {}) == {"reserve": True}
    events = journal.migrated(v1, v2, dropped={"reserve": True}).cancelled()
    message = lost(v2, events, v2)  # (v1 no longer loaded: skipped, before)
    assert message == (
        "it is compensating and owes the compensation of 'reserve' (v1), which trip v2 has "
        "no step for; deploy a version above v2 whose migrates_from={2: {...}} maps each to "
        "a step that undoes it, and `flowloop migrate r --to <that version>`"
    )


def test_advice__renamed_by_the_version_judging_it() -> None:
    v1 = trip(1)
    v2 = trip(2, ("hold", "charge"), migrates={1: {"reserve": "hold"}})
    message = lost(v2, Journal(v1).succeeded("reserve", "charge").cancelled(), v2)
    assert message.endswith("; v2 renames it (reserve -> hold): `flowloop migrate r --to 2`")


def test_advice__a_mapping_of_a_state_it_still_has_is_no_rename() -> None:
    # v2 has a wait named reserve (runs in it move to hold): migrated, the step's undo is
    # still reserve's, which v2 has no step for — "v2 renames it" did not help.
    v1 = trip(1, ("reserve", "charge"))
    v2 = trip(2, ("hold", "charge"), migrates={1: {"reserve": "hold"}}, waits=("reserve",))
    message = lost(v2, Journal(v1).succeeded("reserve", "charge").cancelled(), v2)
    assert "renames" not in message
    assert (
        "; map each that declared compensate= to the v2 step that undoes it in "
        "migrates_from={1: {...}} and `flowloop migrate r --to 2`, or load v1 (with "
        "'reserve') beside v2, where the run "
        "compensates, and `flowloop unpause r`"
    ) in message


def test_advice__its_own_version_loaded_elsewhere_offers_no_load() -> None:
    v1, v2 = trip(1), trip(2, ("charge",), migrates={1: {}})
    events = Journal(v1).succeeded("reserve", "charge").migrated(v1, v2).cancelled()
    message = lost(v2, events, v1, v2)  # (v1 loaded: it declares compensate= on reserve)
    assert "load v" not in message and "unpause" not in message
    assert "deploy a version above v2 whose migrates_from={2: {...}}" in message


def test_advice__dropped_before_journaling__load_the_version_that_had_it() -> None:
    v1, v2 = trip(1), trip(2, ("charge",), migrates={1: {}})
    events = Journal(v1).succeeded("reserve", "charge").migrated(v1, v2).cancelled()
    message = lost(v2, events, v2)  # (an entry without `dropped`, v1 not loaded)
    assert message.endswith(
        ", or if v1 declared no compensate= on 'reserve', load v1 beside v2 (nothing is "
        "owed then) and `flowloop unpause r`"
    )
    # Loaded, and it declared none: nothing is owed.
    plain = trip(1, undo=("charge",))
    assert plain.fingerprint == v1.fingerprint  # (compensate= is not in the fingerprint)
    assert [u.state for u in compensations_due(v2, events, loaded(plain, v2))] == ["charge"]


def test_advice__judged_past_its_version_never_loads_one_without_the_step() -> None:
    # On v2 (which dropped reserve), judged by v3 with v2 not loaded: loading v2 cannot
    # help (it has no reserve either); before, the advice said to.
    v1, v2 = trip(1), trip(2, ("charge",), migrates={1: {}})
    v3 = trip(3, ("charge",), migrates={2: {}})
    events = Journal(v1).succeeded("reserve", "charge")
    events = events.migrated(v1, v2, dropped={"reserve": True}).cancelled()
    message = lost(v3, events, v3)
    assert "load v2" not in message
    assert message.endswith(
        "; map each to the v3 step that undoes it in migrates_from={2: {...}} and "
        "`flowloop migrate r --to 3`"
    )


def test_advice__a_redeploy_of_its_version_dropped_it() -> None:
    v1, redeployed = trip(1), trip(1, ("charge",))
    assert redeployed.fingerprint != v1.fingerprint
    events = Journal(v1).succeeded("reserve", "charge").cancelled()
    message = lost(redeployed, events, redeployed)  # (before: skipped, same version number)
    assert message == (
        "it is compensating and may owe the compensation of 'reserve' (v1) (whether it "
        "declared compensate= is not known), which trip v1 has no step for; deploy a version "
        "above v1 whose migrates_from={1: {...}} maps each that declared compensate= to a "
        "step that undoes it, and `flowloop migrate r --to <that version>`, or deploy v1 as "
        "the run knew it (with 'reserve') again and `flowloop unpause r`"
    )


def test_advice__judged_by_an_older_version_load_its_own() -> None:
    v1, v2 = trip(1, ("charge",)), trip(2, migrates={1: {}})
    events = Journal(v2).succeeded("reserve", "charge").cancelled()
    message = lost(v1, events, v1)  # (a rollback: v2's run under v1)
    assert message.endswith(
        "; deploy a version above v2 whose migrates_from={2: {...}} maps each that declared "
        "compensate= to a step that undoes it, and `flowloop migrate r --to <that version>`, "
        "or load v2 (with 'reserve') "
        "beside v1, where the run compensates, and `flowloop unpause r`"
    )


def test_advice__a_move_refused_starts_from_the_version_it_is_on() -> None:
    from flowloop import owed  # (new: what a move journals, a move refused)

    v1, v2 = trip(1), trip(2, ("charge",), migrates={1: {}})
    journal = Journal(v1).succeeded("reserve", "charge").cancelled()
    moving = [*journal, *Journal(v1).migrated(v1, v2).events[1:]]
    refused = owed.stranded_compensations(v2, _renumbered(moving), loaded(v2), moving=True)
    assert str(refused).endswith(
        "; map each that declared compensate= to the v2 step that undoes it in "
        "migrates_from={1: {...}} and `flowloop migrate r --to 2`, or load v1 beside v2 and "
        "leave it on v1, where "
        "it compensates"
    )
    refused = owed.stranded_compensations(v2, _renumbered(moving), loaded(v1, v2), moving=True)
    assert str(refused).endswith(", or leave it on v1, where it compensates")


def test_migrated_to_a_version_redeployed_since_without_the_step__owed() -> None:
    # reserve undoes nothing in v1, something in v2 (the run moved there); v2 redeployed
    # without it: v1's word on it does not count, v2's as the run knew it is unknown.
    v1 = trip(1, undo=("charge",))
    v2, v2_redeployed = trip(2, migrates={1: {}}), trip(2, ("charge",), migrates={1: {}})
    events = Journal(v1).succeeded("reserve", "charge").migrated(v1, v2).cancelled()
    assert [u.state for u in compensations_due(v2, events, loaded(v1, v2))] == [
        "charge",
        "reserve",
    ]
    message = lost(v2_redeployed, events, v1, v2_redeployed)
    assert "'reserve' (v2)" in message
    assert message.endswith(
        ", or deploy v2 as the run knew it (with 'reserve') again and `flowloop unpause r`"
    )


def test_redeployed_version_loaded_with_the_step__says_whether_it_undoes() -> None:
    # The run knew v1 as started (its row's fingerprint); v1 redeployed since (a wait
    # more) still has check, without compensate=: known. Before: only an exact fingerprint
    # counted, so a plain step was "owed" (dropped_by left it out, the run parked).
    from flowloop import owed

    started = trip(1, ("check", "charge"), undo=("charge",))
    redeployed = trip(1, ("check", "charge"), undo=("charge",), waits=("hold",))
    assert redeployed.fingerprint != started.fingerprint
    v2 = trip(2, ("charge",), migrates={1: {}})
    journal = Journal(started).succeeded("check", "charge")
    assert owed.dropped_by(v2, journal.events, loaded(redeployed, v2), {}) == {"check": False}
    events = journal.migrated(started, v2).cancelled()  # (an entry without `dropped`)
    due = compensations_due(v2, events, loaded(redeployed, v2))
    assert [u.state for u in due] == ["charge"]


def test_may_owe__a_loaded_definition_of_that_version_is_not_offered_to_load() -> None:
    # v2 (the run moved there) redeployed without reserve and loaded: "load v2" would not
    # help — deploying v2 as the run knew it would.
    v1, v2 = trip(1), trip(2, migrates={1: {}})
    v2_redeployed, v3 = (
        trip(2, ("charge",), migrates={1: {}}),
        trip(3, ("charge",), migrates={2: {}}),
    )
    events = Journal(v1).succeeded("reserve", "charge").migrated(v1, v2)
    events = events.migrated(v2, v3).cancelled()
    message = lost(v3, _renumbered(events), v3, v2_redeployed)
    assert message.startswith(
        "it is compensating and may owe the compensation of 'reserve' (v2) (whether it "
        "declared compensate= is not known), which trip v3 has no step for; "
    )
    assert "load v2" not in message
    assert "if v2 declared no compensate= on 'reserve', deploy v2 as the run knew it" in message


def test_merge_into_a_state_the_source_had__no_rename() -> None:
    from flowloop import owed

    v1 = trip(1)
    v2 = trip(2, ("charge",), migrates={1: {"reserve": "charge"}})  # runs in reserve: charge
    assert owed.renames_by(v2.migrates_from[1], v2, v1.states) == {}
    journal = Journal(v1).succeeded("reserve", "charge")
    assert owed.dropped_by(v2, journal.events, loaded(v1, v2), {}) == {"reserve": True}
    events = journal.migrated(v1, v2, renames={}, dropped={"reserve": True}).cancelled()
    # Before: reserve "renamed" charge, charge's undo run twice, reserve's never.
    assert "owes the compensation of 'reserve' (v1)" in lost(v2, events, v2)


def test_journaled_renames__hold_with_the_version_unloaded() -> None:
    v1 = trip(1)
    v2 = trip(2, ("hold", "charge"), migrates={1: {"reserve": "hold"}})
    v3 = trip(3, ("hold", "charge"), migrates={2: {}})
    events = Journal(v1).succeeded("reserve", "charge")
    events = events.migrated(v1, v2, renames={"reserve": "hold"}).migrated(v2, v3).cancelled()
    due = compensations_due(v3, _renumbered(events), loaded(v3))  # (v1, v2 not loaded)
    assert [(u.state, u.ran_as) for u in due] == [("charge", "charge"), ("hold", "reserve")]


def test_renamed_onto_no_step__what_its_move_journaled_holds_with_the_version_unloaded() -> None:
    # v2 turns the plain step check into a wait (mapped: a rename onto no step); its move
    # journaled that check declared no compensate=. Moved on to v3 with v2 unloaded, that
    # was forgotten: "may owe" check, parked (a review: the README says it holds).
    v1 = trip(1, ("check", "charge"), undo=("charge",))
    v2 = trip(2, ("charge",), migrates={1: {"check": "approval"}}, waits=("approval",))
    v3 = trip(3, ("charge",), migrates={2: {}}, waits=("approval",))
    journal = Journal(v1).succeeded("check", "charge")
    journal.migrated(v1, v2, renames={"check": "approval"}, dropped={"check": False})
    events = _renumbered(journal.migrated(v2, v3).cancelled())
    assert [u.state for u in compensations_due(v3, events, loaded(v3))] == ["charge"]


def test_an_entry_from_before_renames_were_journaled__a_merge_is_no_rename() -> None:
    # Its mapping read as then (no renames journaled) — but a state the run's own steps ran
    # as was the source's: mapped onto, a merge. Taken for a rename, charge's undo ran
    # twice and reserve's never (a review).
    v1 = trip(1)
    v2 = trip(2, ("charge",), migrates={1: {"reserve": "charge"}})
    events = Journal(v1).succeeded("reserve", "charge").migrated(v1, v2).cancelled()
    assert "compensation of 'reserve' (v1)" in lost(v2, events, v2)  # (v1 not loaded)


def test_advice__a_move_refused_onto_a_merge_names_no_rename() -> None:
    # v2 merges reserve into charge (a state v1 had); refused with v1 not loaded, the
    # advice took the mapping for a rename and named the very move just refused (a review).
    from flowloop import owed

    v1 = trip(1)
    v2 = trip(2, ("charge",), migrates={1: {"reserve": "charge"}})
    journal = Journal(v1).succeeded("reserve", "charge").cancelled()
    move = Journal(v1).migrated(v1, v2, renames={}).events[1:]
    refused = owed.stranded_compensations(
        v2, _renumbered([*journal, *move]), loaded(v2), moving=True
    )
    assert refused is not None and "renames it" not in str(refused), str(refused)
    assert "map each that declared compensate= to the v2 step that undoes it" in str(refused)


def _undo_journaled(journal: Journal, state: str, undo: str) -> Journal:
    """A success of ``state`` whose entry names its undo, as a step with ``compensate=``
    writes it (``undo`` in its data)."""
    return journal.add(
        j.STEP_SUCCEEDED, state=state, next_state="charge", context="{}", data={"undo": undo}
    )


def test_undo_journaled__owed_as_the_entry_says_with_its_version_not_loaded() -> None:
    # Before: "may owe the compensation of 'reserve' (v1) (whether it declared compensate=
    # is not known)" — read only off v1, not loaded.
    v1, v2 = trip(1), trip(2, ("charge",), migrates={1: {}})
    journal = _undo_journaled(Journal(v1), "reserve", "release_seat").succeeded("charge")
    message = lost(v2, journal.cancelled(), v2)
    assert message.startswith(
        "it is compensating and owes the compensation of 'reserve' (v1, "
        "compensate=release_seat), which trip v2 has no step for; map each to the v2 step "
        "that undoes it"
    )
    assert "may owe" not in message


def test_undo_journaled__a_rename_onto_a_step_without_compensate_undoes_nothing() -> None:
    # The name journaled is the undo of the step as it ran: renamed onto v2's hold (no
    # compensate=), v2 says there is nothing to undo — dropped later, with v2 loaded, it is
    # not owed (the entry's name does not outlive the rename).
    v1 = trip(1)
    v2 = trip(2, ("hold", "charge"), undo=("charge",), migrates={1: {"reserve": "hold"}})
    v3 = trip(3, ("charge",), migrates={2: {}})
    journal = _undo_journaled(Journal(v1), "reserve", "release_seat").succeeded("charge")
    events = journal.migrated(v1, v2, renames={"reserve": "hold"}).migrated(v2, v3).cancelled()
    assert [u.state for u in compensations_due(v3, events, loaded(v2, v3))] == ["charge"]


def test_undo_journaled__a_later_version_kept_the_step_without_compensate() -> None:
    # v2 kept reserve without compensate=; the v2 -> v3 move dropped it and journaled so
    # (v2 loaded then). Review of the entry's name: it outranked that journaled word, and
    # unloading v2 later made the run owe release_seat and park.
    v1 = trip(1)
    v2 = trip(2, undo=("charge",), migrates={1: {}})
    v3 = trip(3, ("charge",), migrates={2: {}})
    journal = _undo_journaled(Journal(v1), "reserve", "release_seat").succeeded("charge")
    journal.migrated(v1, v2)
    dropped = owed.dropped_by(v3, journal.events, loaded(v1, v2, v3), {})
    assert dropped == {"reserve": False}
    events = journal.migrated(v2, v3, dropped=dropped).cancelled()
    for versions in (loaded(v2, v3), loaded(v3)):  # unloading v2 changes nothing
        assert [u.state for u in compensations_due(v3, events, versions)] == ["charge"]


def test_undo_journaled__a_redeploy_of_its_version_without_compensate_outranks_it() -> None:
    # v1 redeployed with reserve's compensate= removed (the same fingerprint): the loaded
    # definition's word is later than the entry's, under v1 and when a move to v2 drops it.
    v1, v1_again = trip(1), trip(1, undo=("charge",))
    assert v1_again.fingerprint == v1.fingerprint
    v2 = trip(2, ("charge",), migrates={1: {}})
    journal = _undo_journaled(Journal(v1), "reserve", "release_seat").succeeded("charge")
    under_v1 = compensations_due(v1_again, journal.cancelled(), loaded(v1_again))
    assert [u.state for u in under_v1] == ["charge"]
    journal.events.pop()  # (not cancelled yet: moved first)
    dropped = owed.dropped_by(v2, journal.events, loaded(v1_again, v2), {})
    assert dropped == {"reserve": False}
    events = journal.migrated(v1_again, v2, dropped=dropped).cancelled()
    assert [u.state for u in compensations_due(v2, events, loaded(v1_again, v2))] == ["charge"]
