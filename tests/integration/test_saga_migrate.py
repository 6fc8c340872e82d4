"""A run paused mid-compensation meets a version that renames (or removes) a step it still
owes the undoing of (SQLite and PostgreSQL).

Before: ``flowloop check`` said it continues as is; ``migrate`` refused any run in a final
state ("add it to migrates_from", which could not help); unpaused under the new version
only, the run ended ``compensated`` with the renamed step never undone
(``compose.compensations_due`` dropped a succeeded step the definition did not have).
Now the run is a definition mismatch (check says so, the worker parks it, the compensating
drive never skips it) and ``migrate`` moves it to the new version's compensating state,
where the renamed step's compensation runs under the key it ran with.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.checking import check_runs
from flowloop.compose import CompensationLost, compensations_due
from flowloop.errors import DefinitionMismatch

UNDONE: list[str] = []
DOWN: list[bool] = []


class Trip(BaseModel):
    pass


def _undo(name: str, version: int):  # type: ignore[no-untyped-def]
    def undo(ctx: Trip, step: Step) -> None:
        if name == "book_flight" and DOWN:
            DOWN.pop()  # (its retry is due in 10 minutes: the run rests, then is paused)
            raise RuntimeError("airline down")
        UNDONE.append(f"v{version} {name} {step.idempotency_key.split(':', 1)[1]}")

    return undo


def _book(name: str):  # type: ignore[no-untyped-def]
    def book(ctx: Trip) -> None:
        if name == "book_car":
            raise RuntimeError("sold out")

    return book


def trip(version: int = 1, *, first: str = "book_flight", renames: bool = True) -> Workflow:
    """``first`` -> book_hotel -> book_car (fails, into ``cancelled``: compensating)."""
    migrates = ({1: {"book_flight": first}} if renames else {1: {}}) if version > 1 else {}
    wf = Workflow("a_mig", context=Trip, version=version, migrates_from=migrates or None)
    names = [first, "book_hotel", "book_car"] if first else ["book_hotel", "book_car"]
    for name, nxt in zip(names, [*names[1:], "booked"], strict=True):
        wf.step(
            name=name,
            initial=name == names[0],
            next=nxt,
            retry=Retry(attempts=1),
            on_error={"*": "cancelled"},
            compensate=_undo(name, version),
            compensate_retry=Retry(attempts=3, backoff="fixed", base=600),
        )(_book(name))
    wf.final("booked")
    wf.final("cancelled", compensate=True)
    return wf


@pytest.fixture(autouse=True)
def _calls() -> Iterator[None]:
    UNDONE.clear()
    DOWN[:] = [True]
    yield


def _paused_mid_compensation(store_url: str, clock: FakeClock) -> str:
    """A v1 run paused in ``cancelled``: book_hotel undone, book_flight still owed."""
    with Engine(store_url, workflows=[trip()], clock=clock) as engine:
        run_id = engine.start(engine.workflow("a_mig"), Trip()).id
        engine.run_until_idle()
        assert UNDONE == ["v1 book_hotel book_hotel:1:undo"]
        engine.pause(run_id)
        info = engine.get(run_id)
        assert (info.status, info.state) == ("paused", "cancelled")
    return run_id


def test_renamed_owed_step__check_parks_worker_parks_migrate_moves_it_undone_once(
    store_url: str,
) -> None:
    clock = FakeClock()
    run_id = _paused_mid_compensation(store_url, clock)
    v2 = trip(2, first="book_plane")
    with Engine(store_url, workflows=[v2], clock=clock) as engine:
        [verdict] = check_runs(engine.store, v2, validate=True).runs
        assert verdict.kind == "parks"
        assert verdict.reason is not None
        assert verdict.reason.startswith("definition_mismatch: ")
        assert "'book_flight'" in verdict.reason
        assert f"`flowloop migrate {run_id} --to 2`" in verdict.reason
        engine.unpause(run_id)
        clock.advance(601)  # (its compensation's retry is due)
        engine.run_until_idle()
        info = engine.get(run_id)
        assert (info.status, info.state) == ("paused", "cancelled")
        assert info.reason is not None and info.reason.startswith("definition_mismatch: ")
        assert UNDONE == ["v1 book_hotel book_hotel:1:undo"]  # nothing skipped, nothing run
        moved = engine.migrate(run_id, to=2, by="deployer")
        assert (moved.version, moved.state, moved.status) == (2, "cancelled", "scheduled")
        engine.run_until_idle()
        info = engine.get(run_id)
        kinds = [event.kind for event in engine.history(run_id)]
    assert (info.status, info.state) == ("succeeded", "cancelled")
    assert info.reason == "compensated: book_hotel, book_plane"
    # book_plane's compensate= undoes it, once, under the key book_flight ran with.
    assert UNDONE == ["v1 book_hotel book_hotel:1:undo", "v2 book_plane book_flight:1:undo"]
    assert kinds.count(j.RUN_MIGRATED) == 1


def test_removed_owed_step__migrate_refused_saying_what_to_map(store_url: str) -> None:
    clock = FakeClock()
    run_id = _paused_mid_compensation(store_url, clock)
    v2 = trip(2, first="", renames=False)  # book_flight removed, nothing undoes it
    with Engine(store_url, workflows=[v2], clock=clock) as engine:
        with pytest.raises(DefinitionMismatch) as refused:
            engine.migrate(run_id, to=2, by="deployer")
        message = str(refused.value)
        assert "'book_flight'" in message
        assert "migrates_from={1: {...}}" in message
        info = engine.get(run_id)
        assert (info.version, info.status) == (1, "paused")
        # Run on anyway under v2 (no migration): parked, never ended without the undo.
        with pytest.raises(CompensationLost):
            compensations_due(v2, engine.store.journal(run_id))
        engine.unpause(run_id)
        clock.advance(601)  # (its compensation's retry is due)
        engine.run_until_idle()
        info = engine.get(run_id)
    assert info.status == "paused"
    assert info.reason is not None and "'book_flight'" in info.reason
    assert UNDONE == ["v1 book_hotel book_hotel:1:undo"]
