"""Run ids by prefix, on SQLite and PostgreSQL: the store's indexed prefix query, the
engine methods that take a run id, and the short form `status` prints."""

from __future__ import annotations

import pytest
from storekit import new_run

from flowloop import Engine
from flowloop import journal as j
from flowloop.errors import UnknownRun
from flowloop.ids import AmbiguousRunId, prefix_bounds, resolve, short_id

IDS = [
    "abcd0001" + "0" * 24,
    "abcd0002" + "0" * 24,
    "abce0003" + "0" * 24,
    "abcc" + "f" * 28,
    "abc" + "0" * 29,
]


@pytest.fixture
def engine(store_url: str) -> Engine:
    engine = Engine(store_url)
    for run_id in IDS:
        engine.store.create_run(new_run(run_id))
    return engine


def test_prefix_bounds__hold_exactly_the_strings_with_the_prefix() -> None:
    low, high = prefix_bounds("abcd")
    inside = ["abcd", "abcd0", "abcdf", "abcdzz"]
    outside = ["abc", "abcc", "abce", "abd", "b"]
    assert all(low <= s < high for s in inside)
    assert not any(low <= s < high for s in outside)


def test_run_ids_with_prefix__an_index_range_on_both_databases(engine: Engine) -> None:
    with engine:
        store = engine.store
        assert store.run_ids_with_prefix("abcd", limit=10) == IDS[:2]
        assert store.run_ids_with_prefix("abcd", limit=1) == IDS[:1]
        assert store.run_ids_with_prefix("abc", limit=10) == sorted(IDS)
        assert store.run_ids_with_prefix("abce0003", limit=10) == [IDS[2]]
        assert store.run_ids_with_prefix("abcf", limit=10) == []
        assert store.run_ids_with_prefix(IDS[3], limit=10) == [IDS[3]]


def test_resolve__unique_prefix_whole_id_ambiguous_and_too_short(engine: Engine) -> None:
    with engine:
        assert resolve(engine.store, "abce") == IDS[2]
        assert resolve(engine.store, "abcd0002") == IDS[1]
        # A whole id that is also a prefix of nothing else, and one that is a prefix of others.
        assert resolve(engine.store, IDS[4]) == IDS[4]
        with pytest.raises(AmbiguousRunId) as ambiguous:
            resolve(engine.store, "abcd")
        assert IDS[0] in str(ambiguous.value) and IDS[1] in str(ambiguous.value)
        with pytest.raises(UnknownRun, match="at least 4 characters"):
            resolve(engine.store, "abc")
        with pytest.raises(UnknownRun, match="'ffff'"):
            resolve(engine.store, "ffff")


def test_engine_methods__take_a_unique_prefix(engine: Engine) -> None:
    with engine:
        assert engine.get("abce").id == IDS[2]
        assert engine.resolve("abcc") == IDS[3]
        assert [e.kind for e in engine.history("abce")] == [j.RUN_CREATED]
        replay = engine.replay("abce0", at=1)
        assert replay.run_id == IDS[2] and replay.matches
        assert engine.pause("abcc").status == "paused"
        assert engine.unpause("abcc").status == "scheduled"
        assert engine.stop("abce").status == "stopped"
        assert engine.get(IDS[2]).status == "stopped"
        with pytest.raises(AmbiguousRunId):
            engine.pause("abcd")
        assert {engine.get(i).status for i in IDS[:2]} == {"scheduled"}


def test_short_id__eight_characters_or_as_many_as_it_takes(engine: Engine) -> None:
    with engine:
        assert short_id(engine.store, IDS[2]) == "abce0003"
        assert short_id(engine.store, IDS[3]) == "abccffff"
        # "abc000000…" is a prefix of no other id from its 8th character on.
        assert short_id(engine.store, IDS[4]) == IDS[4][:8]
        engine.store.create_run(new_run("abce0003" + "1" * 24))
        shorter = short_id(engine.store, IDS[2])
        assert len(shorter) == 10 and resolve(engine.store, shorter) == IDS[2]


def test_the_engine_gives_runs_ids_that_grow_with_time_and_resolve_by_a_short_prefix(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pydantic import BaseModel

    from flowloop import Workflow, runids

    class Ctx(BaseModel):
        pass

    wf = Workflow("ids_grow", context=Ctx)

    @wf.step(initial=True, next="end")
    async def go(ctx: Ctx) -> None:
        return None

    wf.final("end")
    with Engine(store_url, workflows=[wf]) as engine:
        made = []
        for second in range(3):  # a fake clock: a second between the starts
            unix_ms = runids.EPOCH_MS + 9_000_000_000 + second * 1000
            monkeypatch.setattr(runids.time, "time_ns", lambda ms=unix_ms: ms * 1_000_000)
            made.append(engine.start(wf, Ctx()).id)
        assert made == sorted(made)
        assert [resolve(engine.store, run_id[:8]) for run_id in made] == made
        assert [short_id(engine.store, run_id) for run_id in made] == [r[:8] for r in made]
