"""Compensations across deploys (SQLite and PostgreSQL): a run migrated before it
compensates to a version without a step it must undo, and a redeploy of the same version
that drops one.

Before: migrated (v1 -> v2, dropping ``book_flight``) and compensating later, the run was
parked for ever — a migration to a v3 that had ``book_flight`` again still found it "lost"
— or, with v1 no longer loaded, ended ``compensated`` without undoing it; ``migrate`` of
the parked run to a version that lacked it as well moved it (to park again). A redeploy of
v1 without ``book_flight`` ended the run ``compensated`` without undoing it, ``check``
saying it continues (the decision went by version number, not definition).

Before too: a step that ran with ``compensate=`` under a version no longer loaded (v1
unloaded, the run driven by or migrated to a v2 without the step) left the run parked
saying it "may owe" its undo — whether it declared ``compensate=`` was read only off a
loaded definition. Its ``step_succeeded`` entry journals the undo's name now (``undo``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.checking import check_runs
from flowloop.cli import cli
from flowloop.errors import DefinitionMismatch
from flowloop.store import SQLStore
from flowloop.store.entries import dumps_sorted
from flowloop.store.schema import journal

undone: list[str] = []  # the compensations called, in order
hotel_down: list[bool] = []


class Trip(BaseModel):
    pass


def trip(
    version: int,
    *,
    flight: str | None = "book_flight",
    migrates: Mapping[int, Mapping[str, str]] | None = None,
) -> Workflow:
    """``flight`` (undone, when given) -> book_hotel (undone) -> wait ``confirm``
    (``no``: into ``cancelled``, compensating)."""
    wf = Workflow("trip_deploys", context=Trip, version=version, migrates_from=migrates)

    def undo_flight(ctx: Trip, step: Step) -> None:
        undone.append(f"v{version} {flight} {step.idempotency_key.split(':', 1)[1]}")

    def undo_hotel(ctx: Trip, step: Step) -> None:
        if hotel_down:
            hotel_down.pop()  # (retried in 10 minutes: the run is mid-compensation)
            raise RuntimeError("hotel down")
        undone.append(f"v{version} book_hotel")

    if flight:
        wf.step(name=flight, initial=True, next="book_hotel", compensate=undo_flight)(
            lambda ctx: None
        )
    wf.step(
        name="book_hotel",
        initial=flight is None,
        next="confirm",
        compensate=undo_hotel,
        compensate_retry=Retry(attempts=3, backoff="fixed", base=600),
    )(lambda ctx: None)
    wf.wait("confirm", on={"ok": "booked", "no": "cancelled"})
    wf.final("booked")
    wf.final("cancelled", compensate=True)
    return wf


V1 = trip(1)
V2 = trip(2, flight=None, migrates={1: {}})  # book_flight dropped, nothing undoes it


@pytest.fixture(autouse=True)
def _calls() -> Iterator[None]:
    undone.clear()
    hotel_down.clear()
    yield


def _history_detail(url: str, run_id: str, kind: str) -> str:
    """The detail column of ``kind``'s row in `flowloop history`."""
    shown = CliRunner().invoke(cli, ["history", run_id, "--db", url], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    for line in shown.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│").split("│")]
        if len(cells) > 3 and cells[2] == kind:
            return cells[-1]
    raise AssertionError(f"no {kind} row in:\n{shown.stdout}")


def _migrated_then_cancelled(store_url: str, clock: FakeClock, *, v1_loaded: bool) -> str:
    """A v1 run past book_flight and book_hotel, migrated to v2 (v1 loaded), then told
    ``no`` with v1 loaded or not: it compensates on v2, which has no book_flight."""
    with Engine(store_url, workflows=[V1], clock=clock) as engine:
        run_id = engine.start(V1, Trip()).id
        engine.run_until_idle()
    with Engine(store_url, workflows=[V1, V2], clock=clock) as engine:
        engine.migrate(run_id, to=2, by="deployer")
        assert engine.history(run_id)[-1].data["dropped"] == {"book_flight": True}
    assert _history_detail(store_url, run_id, "run_migrated") == (
        "v1 → v2, in confirm, by deployer, leaves book_flight with no step to undo it"
    )
    with Engine(store_url, workflows=[V1, V2] if v1_loaded else [V2], clock=clock) as engine:
        engine.send(run_id, "no")
        engine.run_until_idle()
        info = engine.get(run_id)
        [verdict] = check_runs(engine.store, V2).runs
    assert (info.version, info.status, info.state) == (2, "paused", "cancelled")
    assert info.reason is not None and info.reason.startswith("definition_mismatch: ")
    assert "'book_flight' (v1, compensate=undo_flight)" in info.reason
    assert "migrates_from={2: {...}}" in info.reason
    assert (verdict.kind, verdict.reason) == ("parks", info.reason)  # (check says so too)
    assert undone == []  # nothing skipped, nothing run
    return run_id


@pytest.mark.parametrize("v1_loaded", [True, False])
@pytest.mark.parametrize(
    "v3",
    [
        trip(3, migrates={2: {}}),  # book_flight back
        trip(3, flight="cancel_seat", migrates={2: {"book_flight": "cancel_seat"}}),
    ],
    ids=["brought-back", "mapped"],
)
def test_migrated_before_compensating__parked_until_a_version_undoing_the_dropped_step(
    store_url: str, v1_loaded: bool, v3: Workflow
) -> None:
    clock = FakeClock()
    run_id = _migrated_then_cancelled(store_url, clock, v1_loaded=v1_loaded)
    with Engine(store_url, workflows=[V2, v3], clock=clock) as engine:
        moved = engine.migrate(run_id, to=3, by="deployer")
        assert (moved.version, moved.status) == (3, "scheduled")
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.state) == ("succeeded", "cancelled")
    flight = next(iter(v3.steps))
    assert info.reason == f"compensated: book_hotel, {flight}"
    # Undone once, by v3's step, under the key book_flight ran with.
    expected = ["v3 book_hotel", f"v3 {flight} book_flight:1:undo"]
    assert undone == expected


def test_migrate_to_a_version_still_without_the_dropped_step__refused(store_url: str) -> None:
    clock = FakeClock()
    run_id = _migrated_then_cancelled(store_url, clock, v1_loaded=True)
    v3 = trip(3, flight=None, migrates={2: {}})
    with Engine(store_url, workflows=[V1, V2, v3], clock=clock) as engine:
        with pytest.raises(DefinitionMismatch) as refused:
            engine.migrate(run_id, to=3, by="deployer")  # (before: moved, to park again)
        info = engine.get(run_id)
    assert "'book_flight' (v1, compensate=undo_flight), which trip_deploys v3 has no step for" in (
        str(refused.value)
    )
    assert "migrates_from={2: {...}}" in str(refused.value)
    assert (info.version, info.status) == (2, "paused")


def test_migrated_dropping_a_step_without_compensate__owes_nothing_once_v1_is_unloaded(
    store_url: str,
) -> None:
    plain = Workflow("trip_deploys", context=Trip, version=1)
    plain.step(name="check_fare", initial=True, next="book_hotel")(lambda ctx: None)
    plain.step(name="book_hotel", next="confirm", compensate=lambda ctx, step: None)(
        lambda ctx: None
    )
    plain.wait("confirm", on={"ok": "booked", "no": "cancelled"})
    plain.final("booked")
    plain.final("cancelled", compensate=True)
    clock = FakeClock()
    with Engine(store_url, workflows=[plain], clock=clock) as engine:
        run_id = engine.start(plain, Trip()).id
        engine.run_until_idle()
    with Engine(store_url, workflows=[plain, V2], clock=clock) as engine:
        engine.migrate(run_id, to=2, by="deployer")
        assert engine.history(run_id)[-1].data["dropped"] == {"check_fare": False}
    with Engine(store_url, workflows=[V2], clock=clock) as engine:
        engine.send(run_id, "no")
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.reason) == ("succeeded", "compensated: book_hotel")
    assert undone == ["v2 book_hotel"]


def _as_before_undo_was_journaled(engine: Engine, run_id: str) -> None:
    """The run's ``step_succeeded`` entries without their ``undo`` (as a flowloop before it
    was journaled wrote them: an old database)."""
    store = engine.store
    assert isinstance(store, SQLStore)
    with store.engine.begin() as conn:
        rows = conn.execute(
            sa.select(journal.c.seq, journal.c.data).where(
                journal.c.run_id == run_id, journal.c.kind == j.STEP_SUCCEEDED
            )
        ).all()
        stripped = 0
        for seq, text in rows:
            data = json.loads(text) if text else {}
            if data.pop("undo", None) is not None:
                stripped += 1
                conn.execute(
                    sa.update(journal)
                    .where(journal.c.run_id == run_id, journal.c.seq == seq)
                    .values(data=dumps_sorted(data) if data else None)
                )
    assert stripped


@pytest.mark.parametrize("old_entries", [False, True], ids=["journaled", "old-entries"])
def test_redeploy_of_the_same_version_dropping_an_owed_step__parks_until_it_is_back(
    store_url: str, old_entries: bool
) -> None:
    clock = FakeClock()
    hotel_down.append(True)
    with Engine(store_url, workflows=[V1], clock=clock) as engine:
        run_id = engine.start(V1, Trip()).id
        engine.run_until_idle()
        engine.send(run_id, "no")
        engine.run_until_idle()  # (book_hotel's undo failed once: retried in 10 minutes)
        assert engine.get(run_id).status == "retrying"
        if old_entries:
            _as_before_undo_was_journaled(engine, run_id)
    redeployed = trip(1, flight=None)
    assert redeployed.fingerprint != V1.fingerprint
    with Engine(store_url, workflows=[redeployed], clock=clock) as engine:
        [verdict] = check_runs(engine.store, redeployed).runs
        clock.advance(601)
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.state) == ("paused", "cancelled")
    assert (verdict.kind, verdict.reason) == ("parks", info.reason)
    if old_entries:  # (whether book_flight declared compensate= is read off v1: not loaded)
        owes = (
            "may owe the compensation of 'book_flight' (v1) (whether it declared compensate= "
            "is not known)"
        )
        each = "each that declared compensate="
    else:  # (its entry says so; before: "may owe", as for an old entry)
        owes, each = "owes the compensation of 'book_flight' (v1, compensate=undo_flight)", "each"
    assert info.reason == (
        f"definition_mismatch: it is compensating and {owes}, which trip_deploys v1 has no "
        f"step for; deploy a version above v1 whose migrates_from={{1: {{...}}}} maps {each} "
        f"to a step that undoes it, and `flowloop migrate {run_id} --to <that version>`, or "
        f"deploy v1 as the run knew it (with 'book_flight') again and "
        f"`flowloop unpause {run_id}`"
    )
    assert undone == []  # (before: book_hotel undone, book_flight skipped, run compensated)
    with Engine(store_url, workflows=[trip(1)], clock=clock) as engine:
        engine.unpause(run_id)
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.reason) == ("succeeded", "compensated: book_hotel, book_flight")
    assert undone == ["v1 book_hotel", "v1 book_flight book_flight:1:undo"]


def _replays(engine: Engine, run_id: str) -> None:
    """The journal folds to the stored row."""
    stored = engine.store.get_run(run_id)
    assert stored is not None
    assert j.compare(j.fold(engine.store.journal(run_id)), stored.record) == []


def _fare(version: int, *, hold: bool = False) -> Workflow:
    """check_fare (no compensate=) -> book_hotel (undone) -> confirm; ``hold``: a wait
    state more (a compatible redeploy: another fingerprint, the same steps)."""
    wf = Workflow("trip_deploys", context=Trip, version=version)
    wf.step(name="check_fare", initial=True, next="book_hotel")(lambda ctx: None)
    wf.step(
        name="book_hotel",
        next="confirm",
        compensate=lambda ctx, step: undone.append(f"v{version} book_hotel"),
    )(lambda ctx: None)
    wf.wait(
        "confirm", on={"ok": "booked", "no": "cancelled", **({"later": "hold"} if hold else {})}
    )
    if hold:
        wf.wait("hold", on={"ok": "booked"})
    wf.final("booked")
    wf.final("cancelled", compensate=True)
    return wf


def test_redeployed_then_migrated_dropping_a_plain_step__owes_nothing(store_url: str) -> None:
    # The row keeps the fingerprint it started with (only a migration changes it); v1 as
    # loaded since has check_fare, without compensate=: that is known. Before: parked,
    # "owes the compensation of 'check_fare' ... load v1 beside v2" (v1 was loaded).
    started, redeployed = _fare(1), _fare(1, hold=True)
    assert started.fingerprint != redeployed.fingerprint
    clock = FakeClock()
    with Engine(store_url, workflows=[started], clock=clock) as engine:
        run_id = engine.start(started, Trip()).id
        engine.run_until_idle()
    with Engine(store_url, workflows=[redeployed, V2], clock=clock) as engine:
        engine.migrate(run_id, to=2, by="deployer")
        assert engine.history(run_id)[-1].data["dropped"] == {"check_fare": False}
        engine.send(run_id, "no")
        engine.run_until_idle()
        info = engine.get(run_id)
        _replays(engine, run_id)
    assert (info.status, info.reason) == ("succeeded", "compensated: book_hotel")
    assert undone == ["v2 book_hotel"]


def test_redeploy_dropping_a_plain_step__may_owe_and_says_so(store_url: str) -> None:
    # Whether check_fare declared compensate= is not known (v1 as the run knew it is not
    # loaded): the run parks, saying it may owe it, and mapping it is no way out offered
    # for a step that may undo nothing (its undo would be run for another step's action).
    # (A step without compensate= journals nothing more than it did: its entry cannot tell
    # it from one written before the undo was journaled.)
    started, redeployed = _fare(1), trip(1, flight=None)
    clock = FakeClock()
    with Engine(store_url, workflows=[started], clock=clock) as engine:
        run_id = engine.start(started, Trip()).id
        engine.run_until_idle()
        undos = {e.state: e.data.get("undo") for e in _successes(engine, run_id)}
    assert list(undos) == ["check_fare", "book_hotel"]
    assert undos["check_fare"] is None and undos["book_hotel"] == "<lambda>"
    with Engine(store_url, workflows=[redeployed], clock=clock) as engine:
        engine.send(run_id, "no")
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.state) == ("paused", "cancelled")
    assert info.reason == (
        "definition_mismatch: it is compensating and may owe the compensation of "
        "'check_fare' (v1) (whether it declared compensate= is not known), which "
        "trip_deploys v1 has no step for; deploy a version above v1 whose "
        "migrates_from={1: {...}} maps each that declared compensate= to a step that "
        f"undoes it, and `flowloop migrate {run_id} --to <that version>`, or deploy v1 as "
        f"the run knew it (with 'check_fare') again and `flowloop unpause {run_id}`"
    )
    with Engine(store_url, workflows=[started], clock=clock) as engine:
        engine.unpause(run_id)
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.reason) == ("succeeded", "compensated: book_hotel")


def _successes(engine: Engine, run_id: str) -> list[j.JournalEvent]:
    return [e for e in engine.history(run_id) if e.kind == j.STEP_SUCCEEDED]


def _booked_under_v1(store_url: str, clock: FakeClock) -> str:
    """A v1 run past book_flight and book_hotel (both undone), waiting in confirm; its
    entries name their undos."""
    with Engine(store_url, workflows=[V1], clock=clock) as engine:
        run_id = engine.start(V1, Trip()).id
        engine.run_until_idle()
        undos = [(e.state, e.data.get("undo")) for e in _successes(engine, run_id)]
    assert undos == [("book_flight", "undo_flight"), ("book_hotel", "undo_hotel")]
    return run_id


def test_v1_unloaded__a_dropped_step_with_compensate_is_owed_as_journaled(
    store_url: str,
) -> None:
    # Driven by v2 (v1 is not loaded), which has no book_flight: its entry says it declared
    # compensate=undo_flight. Before: "may owe ... (whether it declared compensate= is not
    # known)", and the way out offered for that case (load v1 to learn it).
    clock = FakeClock()
    run_id = _booked_under_v1(store_url, clock)
    with Engine(store_url, workflows=[V2], clock=clock) as engine:
        engine.send(run_id, "no")
        engine.run_until_idle()
        info = engine.get(run_id)
        [verdict] = check_runs(engine.store, V2).runs
    assert (info.version, info.status, info.state) == (1, "paused", "cancelled")
    assert (verdict.kind, verdict.reason) == ("parks", info.reason)
    assert info.reason == (
        "definition_mismatch: it is compensating and owes the compensation of 'book_flight' "
        "(v1, compensate=undo_flight), which trip_deploys v2 has no step for; map each to the "
        "v2 step that undoes it in migrates_from={1: {...}} and "
        f"`flowloop migrate {run_id} --to 2`, or load v1 (with 'book_flight') beside v2, "
        f"where the run compensates, and `flowloop unpause {run_id}`"
    )
    assert undone == []
    with Engine(store_url, workflows=[V1, V2], clock=clock) as engine:  # (the way out)
        engine.unpause(run_id)
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.reason) == ("succeeded", "compensated: book_hotel, book_flight")
    assert undone == ["v1 book_hotel", "v1 book_flight book_flight:1:undo"]


def test_migrated_with_v1_unloaded__the_dropped_undo_is_journaled_and_owed(
    store_url: str,
) -> None:
    # Moved to v2 (without book_flight) while v1 is not loaded: the move journals it dropped
    # as owed (read off book_flight's entry). Before: nothing journaled (not known), and
    # compensating, the run parked saying it "may owe" it.
    clock = FakeClock()
    run_id = _booked_under_v1(store_url, clock)
    with Engine(store_url, workflows=[V2], clock=clock) as engine:
        engine.migrate(run_id, to=2, by="deployer")
        assert engine.history(run_id)[-1].data["dropped"] == {"book_flight": True}
        engine.send(run_id, "no")
        engine.run_until_idle()
        info = engine.get(run_id)
        _replays(engine, run_id)
    assert (info.version, info.status, info.state) == (2, "paused", "cancelled")
    assert info.reason == (
        "definition_mismatch: it is compensating and owes the compensation of 'book_flight' "
        "(v1, compensate=undo_flight), which trip_deploys v2 has no step for; deploy a "
        "version above v2 whose migrates_from={2: {...}} maps each to a step that undoes it, "
        f"and `flowloop migrate {run_id} --to <that version>`"
    )
    assert undone == []
    v3 = trip(3, flight="cancel_seat", migrates={2: {"book_flight": "cancel_seat"}})
    with Engine(store_url, workflows=[V2, v3], clock=clock) as engine:
        engine.migrate(run_id, to=3, by="deployer")
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.reason) == ("succeeded", "compensated: book_hotel, cancel_seat")
    assert undone == ["v3 book_hotel", "v3 cancel_seat book_flight:1:undo"]


def test_v1_unloaded__a_step_v2_renames_is_owed_then_undone_by_its_new_name(
    store_url: str,
) -> None:
    # v2 renames book_flight reserve_flight; the run, driven by v2 with v1 not loaded, parks
    # naming the rename, and once moved its undo runs under v2's name. Before: "may owe".
    v2 = trip(2, flight="reserve_flight", migrates={1: {"book_flight": "reserve_flight"}})
    clock = FakeClock()
    run_id = _booked_under_v1(store_url, clock)
    with Engine(store_url, workflows=[v2], clock=clock) as engine:
        engine.send(run_id, "no")
        engine.run_until_idle()
        info = engine.get(run_id)
        assert (info.status, info.state) == ("paused", "cancelled")
        assert info.reason == (
            "definition_mismatch: it is compensating and owes the compensation of "
            "'book_flight' (v1, compensate=undo_flight), which trip_deploys v2 has no step "
            f"for; v2 renames it (book_flight -> reserve_flight): `flowloop migrate {run_id} "
            "--to 2`"
        )
        engine.migrate(run_id, to=2, by="deployer")
        engine.run_until_idle()
        info = engine.get(run_id)
        _replays(engine, run_id)
    assert (info.status, info.reason) == ("succeeded", "compensated: book_hotel, reserve_flight")
    assert undone == ["v2 book_hotel", "v2 reserve_flight book_flight:1:undo"]


def test_mapping_merging_a_step_into_another_state__no_rename_owed(store_url: str) -> None:
    # v2 drops book_flight; runs still in it go on at book_hotel. That is no rename of
    # book_flight's step: its undo is not book_hotel's. Before: "compensated: book_hotel,
    # book_hotel" — the hotel undone twice, the flight never.
    v2 = trip(2, flight=None, migrates={1: {"book_flight": "book_hotel"}})
    clock = FakeClock()
    with Engine(store_url, workflows=[V1], clock=clock) as engine:
        run_id = engine.start(V1, Trip()).id
        engine.run_until_idle()
    with Engine(store_url, workflows=[V1, v2], clock=clock) as engine:
        engine.migrate(run_id, to=2, by="deployer")
        data = engine.history(run_id)[-1].data
        assert data["dropped"] == {"book_flight": True}
        assert data["renames"] == {}  # (decided: no rename)
        engine.send(run_id, "no")
        engine.run_until_idle()
        info = engine.get(run_id)
        _replays(engine, run_id)
    assert (info.status, info.state) == ("paused", "cancelled")
    assert info.reason is not None
    assert "owes the compensation of 'book_flight' (v1, compensate=undo_flight)" in info.reason
    assert undone == []


def test_renamed_then_migrated_again__the_rename_holds_once_versions_are_unloaded(
    store_url: str,
) -> None:
    # v2 renames book_flight reserve_flight, v3 keeps it; compensating with v3 alone
    # loaded. Before: parked, "owes 'book_flight' (v1) ... load v1 beside v3".
    v2 = trip(2, flight="reserve_flight", migrates={1: {"book_flight": "reserve_flight"}})
    v3 = trip(3, flight="reserve_flight", migrates={2: {}})
    clock = FakeClock()
    with Engine(store_url, workflows=[V1], clock=clock) as engine:
        run_id = engine.start(V1, Trip()).id
        engine.run_until_idle()
    with Engine(store_url, workflows=[V1, v2], clock=clock) as engine:
        engine.migrate(run_id, to=2, by="deployer")
        assert engine.history(run_id)[-1].data["renames"] == {"book_flight": "reserve_flight"}
    with Engine(store_url, workflows=[v2, v3], clock=clock) as engine:
        engine.migrate(run_id, to=3, by="deployer")
    with Engine(store_url, workflows=[v3], clock=clock) as engine:
        engine.send(run_id, "no")
        engine.run_until_idle()
        info = engine.get(run_id)
        _replays(engine, run_id)
    assert (info.status, info.reason) == ("succeeded", "compensated: book_hotel, reserve_flight")
    assert undone == ["v3 book_hotel", "v3 reserve_flight book_flight:1:undo"]


def test_migrate_keeping_every_step__reads_no_journal(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing dropped (decided from the definitions): the run's journal is not read.
    # Before: read, and folded, for every run moved.
    v2 = trip(2, migrates={1: {}})
    clock = FakeClock()
    with Engine(store_url, workflows=[V1], clock=clock) as engine:
        run_id = engine.start(V1, Trip()).id
        engine.run_until_idle()
    with Engine(store_url, workflows=[V1, v2], clock=clock) as engine:
        read: list[str] = []
        journal = engine.store.journal

        def counted(run: str, *args: object, **kwargs: object) -> list[j.JournalEvent]:
            read.append(run)
            return journal(run, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(engine.store, "journal", counted)
        engine.migrate(run_id, to=2, by="deployer")
        monkeypatch.undo()
        assert read == []
        assert "dropped" not in engine.history(run_id)[-1].data
