"""Engine.run costs the same at any depth of its caller's stack: where CPython's data-stack
chunk ends inside the frames a run goes down and up at every step, each crossing maps,
faults in and unmaps a chunk (gh-142183; at the worst depth of bench/stack_depth.py a
10-step run took 256 page faults and 3.4 times the CPU). flowloop.freshstack watches the
thread's page faults and, once runs keep faulting, starts them on a fresh chunk. Measured
with the thread's real page-fault count, each caller depth in a thread of its own."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow, freshstack
from flowloop.freshstack import STRIKES, THRASH_FAULTS

pytestmark = pytest.mark.skipif(
    freshstack.thread_faults is None, reason="a thread's page faults: CPython on Linux"
)

DEPTHS = range(0, 280, 2)
"""Caller depths in frames of ``at_depth``: two chunks' worth (~136 frames each here)."""

RUNS = STRIKES + 5


class Nothing(BaseModel):
    pass


def one_step() -> Workflow:
    wf = Workflow("depth", context=Nothing)

    async def step(ctx: Nothing) -> None:
        return None

    wf.step(name="s", initial=True, next="done")(step)
    wf.final("done")
    return wf


def at_depth(depth: int, body: Callable[[], None]) -> None:
    if depth == 0:
        body()
    else:
        at_depth(depth - 1, body)


class Seen:
    def __init__(self) -> None:
        self.faults: list[int] = []
        self.fresh = False


def runs_at(engine: Engine, wf: Workflow, depth: int) -> Seen:
    """RUNS runs started from ``depth`` frames down a new thread: each run's page faults."""
    seen = Seen()
    counter = freshstack.thread_faults
    assert counter is not None

    def body() -> None:
        for _ in range(RUNS):
            before = counter()
            engine.run(wf, {})
            seen.faults.append(counter() - before)
        seen.fresh = freshstack.fresh_on_this_thread()

    thread = threading.Thread(target=at_depth, args=(depth, body))
    thread.start()
    thread.join()
    assert len(seen.faults) == RUNS, "the thread's runs did not all finish"
    return seen


def test_runs_stop_page_faulting_at_every_caller_depth(sqlite_url: str) -> None:
    wf = one_step()
    with Engine(sqlite_url, workflows=[wf]) as engine:
        engine.run(wf, {})  # the store's statements prepared, its tables made
        seen = {depth: runs_at(engine, wf, depth) for depth in DEPTHS}
    thrashed = [d for d, s in seen.items() if min(s.faults[1:STRIKES]) >= THRASH_FAULTS]
    if not thrashed:
        pytest.skip(f"no caller depth made runs fault (Python {sys.version.split()[0]})")
    # Once the rule decided (after STRIKES runs), runs fault no more than a steady_call one
    # does: at most a page or two of the fresh chunk, now and then a growing heap. A depth
    # that still thrashes faults at every run (as `thrashed` says of the first runs): the
    # least of its runs' faults, not their median (a growing heap faulted 12 and 8 in two
    # of four runs at one depth on a loaded machine, median 5: a false alarm, 1 run in 3).
    after = {d: min(s.faults[STRIKES + 1 :]) for d, s in seen.items()}
    still = {d: (after[d], seen[d].faults) for d in DEPTHS if after[d] >= THRASH_FAULTS}
    assert not still, f"runs still fault at these depths: {still}"
    assert all(seen[d].fresh for d in thrashed), "a thread whose runs faulted runs plainly"
    # The common case stays plain: most depths never fault (and pay nothing).
    fresh = [d for d, s in seen.items() if s.fresh]
    assert len(fresh) <= len(DEPTHS) // 4, f"fresh chunks taken at {fresh}"


def frames_of_this_call() -> set[str]:
    names = set()
    frame = sys._getframe(1)
    while frame is not None:
        names.add(frame.f_code.co_name)
        frame = frame.f_back  # type: ignore[assignment]
    return names


def test_run_and_run_until_idle_go_through_the_fresh_chunk_once_taken(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    wf = Workflow("where", context=Nothing)
    stacks: list[set[str]] = []

    async def step(ctx: Nothing) -> None:
        stacks.append(frames_of_this_call())

    wf.step(name="s", initial=True, next="done")(step)
    wf.final("done")
    with Engine(sqlite_url, workflows=[wf]) as engine:
        engine.run(wf, {})
        freshstack.reset_thread()  # (that first run made the engine's loop: it faulted)
        counts = iter(range(0, 10_000, THRASH_FAULTS))  # every call faults THRASH_FAULTS
        monkeypatch.setattr(freshstack, "thread_faults", lambda: next(counts))
        for _ in range(STRIKES):
            engine.run(wf, {})
        assert freshstack.fresh_on_this_thread()
        engine.run(wf, {})
        engine.start(wf, {})
        engine.run_until_idle()
    assert ["on_fresh_stack" in names for names in stacks] == [False] * (STRIKES + 1) + [True] * 2
