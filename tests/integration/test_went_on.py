"""The usual boundary built at once (``journal.went_on``, ``Stepping._went_on``) writes the
journal and the row that the general path (``Stepping._advance``, one fold per event)
writes for the same run, on both databases."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Step, Workflow
from flowloop import journal as j
from flowloop.journal import JournalEvent
from flowloop.stepping import Stepping
from flowloop.straight import PlainNexts


class Ctx(BaseModel):
    n: int = 0
    seen: list[str] = []


def three_steps() -> Workflow:
    """A context at version 2 (its entries say so), a note, a durable sleep of 0 (due at
    once: it goes straight on), a plain and an async step."""
    wf = Workflow("straight", context=Ctx, context_version=2)

    @wf.step(initial=True, next="b")
    def a(ctx: Ctx, step: Step) -> None:
        ctx.n += 1
        step.note("counted one")

    @wf.step(next="c")
    async def b(ctx: Ctx, step: Step) -> Any:
        ctx.seen.append("b")
        return step.sleep(0)

    @wf.step(next="done")
    def c(ctx: Ctx) -> None:
        ctx.n += 10

    wf.final("done")
    return wf


def _written(events: list[JournalEvent]) -> list[dict[str, Any]]:
    """What a journal says, without what differs between two runs (id, times, worker)."""
    skipped = {"run_id", "at", "duration", "worker"}
    return [{k: v for k, v in dataclasses.asdict(e).items() if k not in skipped} for e in events]


def test_went_on__writes_what_the_general_path_writes(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    wf = three_steps()
    built: list[int] = []
    went_on = j.went_on

    def counted(record: j.RunRecord, **fields: Any) -> Any:
        built.append(record.last_seq)
        return went_on(record, **fields)

    monkeypatch.setattr(j, "went_on", counted)
    with Engine(store_url, workflows=[wf], clock=FakeClock()) as engine:
        fast = engine.run(wf, Ctx())
        assert built == [2, 4]  # a -> b and b -> c; c -> done is an end
        monkeypatch.setattr(Stepping, "_straight_on", lambda *_: False)
        # ... and without the usual success decided once per state (flowloop/straight.py):
        # the general path asks the definition at every step.
        monkeypatch.setattr(PlainNexts, "__missing__", lambda *_: None)
        engine._executor()._plains.clear()
        general = engine.run(wf, Ctx())
        assert built == [2, 4]  # (the general path did not build them)
        fast_journal, general_journal = engine.history(fast.id), engine.history(general.id)
        assert engine.replay(fast.id).differences == []
        fast_row = engine.store.get_run(fast.id)
        general_row = engine.store.get_run(general.id)
    assert _written(fast_journal) == _written(general_journal)
    assert (fast.status, fast.state, fast.context) == ("succeeded", "done", Ctx(n=11, seen=["b"]))
    assert fast_row is not None and general_row is not None
    compared = ("status", "state", "context", "context_version", "attempt", "visits", "last_seq")
    for name in compared:
        assert getattr(fast_row.record, name) == getattr(general_row.record, name), name


def test_went_on__a_note_stays_with_its_own_success(sqlite_url: str) -> None:
    wf = three_steps()
    with Engine(sqlite_url, workflows=[wf], clock=FakeClock()) as engine:
        journal = engine.history(engine.run(wf, Ctx()).id)
    successes = [e for e in journal if e.kind == j.STEP_SUCCEEDED]
    assert [e.state for e in successes] == ["a", "b", "c"]
    assert [dict(e.data) for e in successes] == [
        {j.CONTEXT_VERSION: 2, "note": "counted one"},
        {j.CONTEXT_VERSION: 2},
        {j.CONTEXT_VERSION: 2, "final": True},
    ]
    # Each joined start is at its success's time: one boundary, one instant.
    starts = {e.seq: e for e in journal if e.kind == j.STEP_STARTED}
    assert [starts[e.seq + 1].at for e in successes[:2]] == [e.at for e in successes[:2]]
