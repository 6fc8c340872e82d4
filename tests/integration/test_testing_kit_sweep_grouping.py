"""The crash sweep names each crash point by the journal entries its commit carried, not by
the commit's number: group commit shares a transaction among the boundaries ready together,
so two runs of one script (children's steps in threads) may group the same entries
otherwise — and a crash point named by number was then "never reached", at random.
Real SQLite files (the kit's)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pydantic import BaseModel

from flowloop import Workflow
from flowloop.testing import TestEngine, assert_crash_safe, check_crash_points

SWEEPS = 12
"""Sweeps of a map of three sync steps at once: before the fix 7 of 20 failed (the audit's
map of four, two at a time: 4 of 20, 11 of 30), so 12 in a row passed with a chance below
1% without it; a sweep costs about 1.8 s of CPU."""


class Item(BaseModel):
    n: int


class Numbers(BaseModel):
    ns: list[int]


def fan_out(item: Workflow, name: str, *, max_parallel: int = 2) -> Workflow:
    wf = Workflow(name, context=Numbers)
    wf.map(
        "fan",
        child=item,
        items=lambda c: c.ns,
        context=lambda c, n: Item(n=n),
        max_parallel=max_parallel,
        on={"done": "ok", "failed": "bad"},
        initial=True,
    )
    wf.final("ok", "bad")
    return wf


def test_sweep__a_crashed_run_grouping_its_commits_otherwise_reaches_every_point(
    tmp_path: Path,
) -> None:
    """Deterministically: the uninterrupted run's first child takes a few more event-loop
    turns than later runs' do, so it commits its success alone (6 commits) where the
    crashed runs commit both children's successes together (5). Before, the crash points
    around commit #6 were "never reached". (Commit #2 is the fan-out: the parent's
    children_started and the two children's run_created.)"""
    calls: list[int] = []
    item = Workflow("grouping_item", context=Item)

    @item.step(initial=True, next="fin")
    async def square(ctx: Item) -> None:
        calls.append(ctx.n)
        if ctx.n == 1 and calls.count(1) == 1:  # only the first run's first child
            for _ in range(3):
                await asyncio.sleep(0)

    item.final("fin")
    wf = fan_out(item, "grouping_map")
    # The premise: the same script, run twice, groups its commits otherwise.
    grouped = []
    for _ in range(2):
        with TestEngine(workflows=[wf, item]) as engine:
            engine.start(wf, Numbers(ns=[1, 2]))
            engine.run_until_idle()
            grouped.append([len(commit.events) for commit in engine.commits])
    assert grouped == [[1, 3, 2, 1, 1, 1], [1, 3, 2, 2, 1]]
    calls.clear()
    sweep = assert_crash_safe(wf, Numbers(ns=[1, 2]), directory=tmp_path)
    assert len(sweep.commits) == 6 and len(sweep.outcomes) == 12


def test_sweep__a_map_of_sync_steps_passes_every_time(tmp_path: Path) -> None:
    """The audit's case: sync steps run in threads, so when they finish (and whose
    boundaries share a commit) varies from run to run."""
    item = Workflow("threads_item", context=Item)
    item.step(name="square", initial=True, next="fin")(lambda ctx: None)
    item.final("fin")
    wf = fan_out(item, "threads_map", max_parallel=3)
    failed = []
    for sweep_number in range(SWEEPS):
        sweep = check_crash_points(wf, Numbers(ns=[1, 2, 3]), directory=tmp_path)
        failed += [f"sweep {sweep_number}: {o.label}: {o.problems}" for o in sweep.failures]
    assert failed == []
