"""TestEngine with debounced and throttled starts: it admits (and refuses) them as the
production Engine does, with ids that differ per run and are the same every time the test
runs — on SQLite and PostgreSQL (TestEngine takes a URL)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow
from flowloop.admission import StartThrottled
from flowloop.testing import TestEngine

CLOCK_START = 1_800_000_000.0


class Sync(BaseModel):
    rev: int


def sync() -> Workflow:
    wf = Workflow("te_sync", context=Sync)
    wf.step(name="push", initial=True, next="synced")(lambda ctx: None)
    wf.final("synced")
    return wf


@pytest.fixture
def engine(store_url: str) -> Iterator[TestEngine]:
    with TestEngine(store_url, clock=FakeClock(CLOCK_START)) as e:
        yield e


def throttled(engine: Engine, wf: Workflow, key: str, times: int) -> list[str]:
    """Start ``times`` runs with ``key`` under a throttle of 2 a minute: ids or 'refused'."""
    ids = []
    for n in range(times):
        try:
            ids.append(engine.start(wf, Sync(rev=n), key=key, throttle=(2, 60)).id)
        except StartThrottled:
            ids.append("refused")
    return ids


def test_throttle__admits_two_runs_then_refuses_as_the_engine_does(engine: TestEngine) -> None:
    wf = sync()
    first, second, third = throttled(engine, wf, "c-8", 3)
    # Each admitted start is a run of its own (an id made from the key was given to all
    # three: the later starts found the first run by its throttle key, none was refused).
    assert third == "refused" and len({first, second}) == 2
    assert [engine.get(i).context for i in (first, second)] == [Sync(rev=0), Sync(rev=1)]
    engine.clock.advance(61)  # the window has passed: admitted again, a new run
    [fourth] = throttled(engine, wf, "c-8", 1)
    assert fourth not in ("refused", first, second)
    engine.run_until_idle()
    assert {engine.get(i).status for i in (first, second, fourth)} == {"succeeded"}


def test_debounce__a_second_burst_is_a_new_run(engine: TestEngine) -> None:
    wf = sync()
    first = engine.start(wf, Sync(rev=1), key="c-7", debounce=30)
    merged = engine.start(wf, Sync(rev=2), key="c-7", debounce=30)
    assert merged.id == first.id  # within the window: the burst's run takes the context
    engine.advance(31)
    assert engine.get(first.id).status == "succeeded"
    # A new burst: a new run (an id made from the key was the first run's: a duplicate).
    second = engine.start(wf, Sync(rev=3), key="c-7", debounce=30)
    assert second.id != first.id
    engine.advance(31)
    assert (engine.get(second.id).status, engine.get(second.id).context) == (
        "succeeded",
        Sync(rev=3),
    )


def test_admitted_runs_ids_are_the_same_each_time_the_test_runs() -> None:
    wf = sync()
    runs = []
    for _ in range(2):
        with TestEngine(clock=FakeClock(CLOCK_START)) as e:
            ids = throttled(e, wf, "c-8", 2)
            ids.append(e.start(wf, Sync(rev=9), key="c-7", debounce=30).id)
            runs.append(ids)
    assert runs[0] == runs[1] and len(set(runs[0])) == 3


def test_debounce__a_paused_burst_is_one_run_with_the_last_context(engine: TestEngine) -> None:
    wf = sync()
    first = engine.start(wf, Sync(rev=1), key="c-7", debounce=30)
    engine.pause(first.id)
    later = engine.start(wf, Sync(rev=2), key="c-7", debounce=30)
    assert (later.id, later.status) == (first.id, "paused")  # the pause holds the burst
    engine.run_until_idle()
    assert engine.get(first.id).status == "paused"
    engine.unpause(first.id)
    engine.run_until_idle()  # (the clock jumps to the window's end)
    assert engine.clock.now() == CLOCK_START + 30
    [run] = engine.runs()
    assert (run.id, run.status, run.context) == (first.id, "succeeded", Sync(rev=2))
