"""A step that starts a run and waits for it, where the slots that run needs are all held
by the runs waiting for it (its own run, and the runs whose steps called it), is refused
at once with ``HeldBack`` (flowloop/holding.py) instead of waiting for ever. On SQLite
files and PostgreSQL; runs that can be claimed still run."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.errors import HeldBack

WAIT_S = 20.0
"""A bound on each nested wait: before the refusal existed, it waited for ever."""


class Ctx(BaseModel):
    customer: str = "c1"
    other: str = "c1"
    depth: int = 0
    nested: str = ""
    """What the nested call gave: its status, or the refusal's message."""


def _nesting(engine_of: dict[str, Engine], name: str, *, until: int, **limits: Any) -> Workflow:
    """A workflow whose step waits for a run of itself (customer ``ctx.other``, one level
    deeper) until ``until`` levels deep, and notes what that call gave."""
    workflow = Workflow(name, context=Ctx, **limits)

    @workflow.step(initial=True, next="done")
    async def call_myself(ctx: Ctx) -> None:
        if ctx.depth >= until:
            return
        inner = Ctx(customer=ctx.other, other=ctx.other, depth=ctx.depth + 1)
        try:
            info = await asyncio.wait_for(engine_of["engine"].arun(workflow, inner), WAIT_S)
        except HeldBack as refused:
            ctx.nested = f"refused: {refused}"
        else:
            nested = info.context.nested  # type: ignore[attr-defined]
            ctx.nested = f"{info.status}" + (f" / {nested}" if nested else "")

    workflow.final("done")
    return workflow


def _top(store_url: str, **limits: Any) -> Ctx:
    engines: dict[str, Engine] = {}
    until = limits.pop("until", 1)
    top = limits.pop("top", Ctx())
    workflow = _nesting(engines, "nesting", until=until, **limits)
    with Engine(store_url, workflows=[workflow]) as engine:
        engines["engine"] = engine
        info = engine.run(workflow, top)
    assert info.status == "succeeded", info
    return info.context  # type: ignore[return-value]


def test_a_step_waiting_for_its_own_workflows_only_slot_is_refused(store_url: str) -> None:
    got = _top(store_url, max_concurrency=1)
    assert got.nested.startswith("refused: a run of 'nesting' waited for"), got.nested
    assert "max_concurrency=1 is held by the calling run(s)" in got.nested


def test_a_step_waiting_for_its_own_keys_only_slot_is_refused(store_url: str) -> None:
    got = _top(store_url, concurrency_key=lambda ctx: ctx.customer, key_limit=1)
    assert got.nested.startswith("refused: a run of 'nesting' with key 'c1'"), got.nested
    assert "key_limit=1" in got.nested


def test_a_run_of_another_key_is_not_held_back(store_url: str) -> None:
    """The caller holds key c1's one slot; a run for c2 is claimed and runs."""
    got = _top(
        store_url,
        concurrency_key=lambda ctx: ctx.customer,
        key_limit=1,
        top=Ctx(customer="c1", other="c2"),
    )
    assert got.nested == "succeeded", got.nested


def test_slots_held_along_a_chain_of_callers_count_together(store_url: str) -> None:
    """``max_concurrency=2``: the top run's call is claimed (one slot held), the second
    level's is refused (both slots held by its callers)."""
    got = _top(store_url, max_concurrency=2, until=2)
    assert got.nested.startswith("succeeded / refused: a run of 'nesting'"), got.nested
    assert "max_concurrency=2" in got.nested


def test_a_def_step_in_a_thread_is_refused_too(store_url: str) -> None:
    """A ``def`` step with a timeout runs in a thread: the context reaches it there."""
    workflow = Workflow("threaded", context=Ctx, max_concurrency=1)
    engines: dict[str, Engine] = {}

    @workflow.step(initial=True, next="done", timeout=WAIT_S)
    def call_myself(ctx: Ctx) -> None:
        if ctx.depth == 0:
            with pytest.raises(HeldBack, match="max_concurrency=1"):
                engines["engine"].run(workflow, Ctx(depth=1))
            ctx.nested = "refused"

    workflow.final("done")
    with Engine(store_url, workflows=[workflow]) as engine:
        engines["engine"] = engine
        info = engine.run(workflow, Ctx())
        assert [run.id for run in engine.runs()] == [info.id]  # nothing written
    assert info.status == "succeeded", info
    assert info.context.nested == "refused"  # type: ignore[attr-defined]


def test_a_worker_claimed_run_holds_its_slot_too(store_url: str) -> None:
    """A run a worker (``run_until_idle``) claims, not one ``engine.run`` made."""
    engines: dict[str, Engine] = {}
    workflow = _nesting(engines, "queued", until=1, max_concurrency=1)
    with Engine(store_url, workflows=[workflow]) as engine:
        engines["engine"] = engine
        run_id = engine.start(workflow, Ctx()).id
        engine.run_until_idle()
        info = engine.get(run_id)
    assert info.status == "succeeded", info
    assert info.context.nested.startswith("refused: ")  # type: ignore[attr-defined]
