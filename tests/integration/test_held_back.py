"""A step that starts a run and waits for it, where the slots that run needs are all held
by the runs waiting for it (its own run, and the runs whose steps called it), is refused
at once with ``HeldBack`` (flowloop/holding.py) instead of waiting for ever. On SQLite
files and PostgreSQL; runs that can be claimed still run."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow, holding
from flowloop.errors import HeldBack
from flowloop.stepping import SYNC_STEPS_INLINE

WAIT_S = 20.0
"""A bound on each nested wait: before the refusal existed, it waited for ever."""


class Ctx(BaseModel):
    order: str | None = None
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
    assert got.nested == (
        "refused: a step waiting for a run of 'nesting' would wait for ever: its "
        "max_concurrency=1 is held by the calling run(s); start it with engine.start() "
        "to run once the step has ended, or raise the limit"
    )


def test_a_step_waiting_for_its_own_keys_only_slot_is_refused(store_url: str) -> None:
    got = _top(store_url, concurrency_key=lambda ctx: ctx.customer, key_limit=1)
    assert "would wait for ever: the key_limit=1 of key 'c1' is held" in got.nested, got.nested


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
    assert got.nested.startswith("succeeded / refused: a step waiting for a run"), got.nested
    assert "its max_concurrency=2 is held" in got.nested


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


def _as_if_in_a_step_of(engine: Engine, workflow: str) -> Any:
    """A context as a step of a ``workflow`` run (without a key) driven here has."""
    slot = holding.Held(holding.database_of(engine.store), workflow, None)
    return holding.context_holding(slot)


def _one_step(name: str, **limits: Any) -> Workflow:
    workflow = Workflow(name, context=Ctx, **limits)

    @workflow.step(initial=True, next="done")
    def only(ctx: Ctx) -> None:
        ctx.nested = "ran"

    workflow.final("done")
    return workflow


def test_a_run_found_by_its_key_that_has_ended_is_returned(store_url: str) -> None:
    """The run waited for was made earlier and has ended: found by its idempotency key it
    is returned at once, needing no slot, not refused."""
    child = _one_step("child", max_concurrency=1)
    with Engine(store_url, workflows=[child]) as engine:
        ended = engine.run(child, Ctx(), idempotency_key="once")
        assert ended.status == "succeeded"
        in_a_step = _as_if_in_a_step_of(engine, "child")
        again = in_a_step.run(engine.run, child, Ctx(), idempotency_key="once")
        assert again.id == ended.id and again.status == "succeeded"
        with pytest.raises(HeldBack, match="max_concurrency=1"):
            in_a_step.run(engine.run, child, Ctx())  # a new one would wait for ever
        assert len(engine.runs()) == 1


def test_a_limited_workflow_that_starts_waiting_is_not_refused(store_url: str) -> None:
    """Its run is made waiting for an event: ``run`` returns it at once, holding no slot."""
    waiting = Workflow("waiting", context=Ctx, max_concurrency=1)
    waiting.wait("idle", on={"go": "done"}, initial=True)
    waiting.final("done")
    with Engine(store_url, workflows=[waiting]) as engine:
        info = _as_if_in_a_step_of(engine, "waiting").run(engine.run, waiting, Ctx())
    assert (info.state, info.status) == ("idle", "scheduled"), info


def test_a_run_on_another_database_is_not_held_back(store_url: str, tmp_path: Any) -> None:
    other_url = f"sqlite:///{tmp_path / 'other.db'}"
    engines: dict[str, Engine] = {}
    workflow = _nesting(engines, "nesting", until=1, max_concurrency=1)
    with Engine(store_url, workflows=[workflow]) as here, Engine(other_url) as there:
        engines["engine"] = there  # the step's call goes to the other database
        info = here.run(workflow, Ctx())
    assert info.status == "succeeded", info
    assert info.context.nested == "succeeded"  # type: ignore[attr-defined]


def test_a_keyed_run_made_by_the_refused_call_runs_once_the_caller_has_ended(
    store_url: str,
) -> None:
    """With a business key the run is made (so that the step's retry finds it, not a
    second), then refused: the message names it, and it runs after its caller."""
    engines: dict[str, Engine] = {}
    workflow = Workflow("keyed", context=Ctx, max_concurrency=1, key=lambda ctx: f"k{ctx.depth}")
    refused: list[str] = []

    @workflow.step(initial=True, next="done")
    async def call_myself(ctx: Ctx) -> None:
        if ctx.depth == 0:
            try:
                await asyncio.wait_for(engines["engine"].arun(workflow, Ctx(depth=1)), WAIT_S)
            except HeldBack as error:
                refused.append(str(error))

    workflow.final("done")
    with Engine(store_url, workflows=[workflow]) as engine:
        engines["engine"] = engine
        assert engine.run(workflow, Ctx()).status == "succeeded"
        (queued,) = [run for run in engine.runs() if run.key == "k1"]
        assert refused == [
            f"a step waiting for a run of 'keyed' would wait for ever: its "
            f"max_concurrency=1 is held by the calling run(s); run {queued.id} is queued "
            f"and runs once the calling step has ended"
        ]
        engine.run_until_idle()
        assert engine.get(queued.id).status == "succeeded"


def test_a_def_step_in_a_thread_has_engine_runs_inline_flag_off(
    store_url: str,
) -> None:
    """``engine.run`` runs its ``def`` steps without a timeout inline (a context flag); one
    with a timeout runs in a thread with the run's context variables, that flag off, so an
    engine the step calls drives its own steps as usual."""
    seen: list[bool] = []
    workflow = Workflow("flagged", context=Ctx)

    @workflow.step(initial=True, next="done", timeout=WAIT_S)
    def threaded(ctx: Ctx) -> None:
        seen.append(SYNC_STEPS_INLINE.get())

    workflow.final("done")
    with Engine(store_url, workflows=[workflow]) as engine:
        assert engine.run(workflow, Ctx()).status == "succeeded"
    assert seen == [False]


def test_a_run_whose_business_key_is_none_is_refused_before_it_is_written(
    store_url: str,
) -> None:
    """The workflow names a key field, but this context's is ``None``: the run has no key,
    so it is refused before anything is written, every time (no queued run per call)."""
    child = _one_step("optional-key", max_concurrency=1, key="order")
    with Engine(store_url, workflows=[child]) as engine:
        in_a_step = _as_if_in_a_step_of(engine, "optional-key")
        for _ in range(3):
            with pytest.raises(HeldBack, match=r"start it with engine\.start"):
                in_a_step.run(engine.run, child, Ctx())
        assert engine.runs() == []


def test_a_run_found_by_its_key_queued_after_its_first_wait_is_refused(
    store_url: str,
) -> None:
    """A workflow that starts waiting: a run of it that an event moved on into a step is
    queued for a claim; found by its key from a step holding the slot, it is refused
    (named), not waited for."""
    workflow = Workflow("wait-first", context=Ctx, max_concurrency=1)
    workflow.wait("idle", on={"go": "work"}, initial=True)
    workflow.step(name="work", next="done")(_noted)
    workflow.final("done")
    with Engine(store_url, workflows=[workflow]) as engine:
        queued = engine.start(workflow, Ctx(), idempotency_key="other")
        assert engine.send(queued.id, "go").run.state == "work"
        in_a_step = _as_if_in_a_step_of(engine, "wait-first")

        async def waited_for() -> object:
            return await asyncio.wait_for(
                engine.arun(workflow, Ctx(), idempotency_key="other"), WAIT_S
            )

        with pytest.raises(HeldBack, match=f"run {queued.id} is queued"):
            in_a_step.run(asyncio.run, waited_for())
        assert engine.run_until_idle() is not None
        assert engine.get(queued.id).status == "succeeded"


def _noted(ctx: Ctx) -> None:
    ctx.nested = "ran"


def test_a_run_found_by_its_key_due_beyond_the_horizon_is_returned(store_url: str) -> None:
    """Found by its key and queued, but due in an hour: ``run`` returns it as it is (it
    waits only for runs due within its horizon), so it is not refused."""
    child = _one_step("later", max_concurrency=1)
    with Engine(store_url, workflows=[child]) as engine:
        queued = engine.start(child, Ctx(), idempotency_key="later", run_at=time.time() + 3600)
        in_a_step = _as_if_in_a_step_of(engine, "later")
        found = in_a_step.run(engine.run, child, Ctx(), idempotency_key="later")
    assert (found.id, found.status) == (queued.id, "scheduled")


def test_an_empty_idempotency_key_is_none(store_url: str) -> None:
    """As the store looks runs up, an empty idempotency key is none: two starts with it
    make two runs (before, the second broke the unique index: IntegrityError)."""
    child = _one_step("empty-key")
    with Engine(store_url, workflows=[child]) as engine:
        first = engine.start(child, Ctx(), idempotency_key="")
        second = engine.start(child, Ctx(), idempotency_key="")
    assert first.id != second.id


def _calling_the_limited(max_concurrency: int) -> tuple[Workflow, Workflow, dict[str, Engine]]:
    """A limited workflow whose step runs an unlimited one, whose call state starts a
    child of the limited one (depth 1): the child needs a slot its caller's run holds."""
    engines: dict[str, Engine] = {}
    limited = Workflow("limited", context=Ctx, max_concurrency=max_concurrency)
    plain = Workflow("plain", context=Ctx)
    plain.call(
        "calling",
        child=limited,
        context=lambda ctx: Ctx(depth=ctx.depth + 1),
        on={"succeeded": "done"},
        initial=True,
    )
    plain.final("done")

    @limited.step(initial=True, next="done")
    async def work(ctx: Ctx) -> None:
        if ctx.depth > 0:
            return
        try:
            info = await asyncio.wait_for(engines["engine"].arun(plain, Ctx()), WAIT_S)
        except HeldBack as refused:
            ctx.nested = f"refused: {refused}"
        else:
            ctx.nested = info.status

    limited.final("done")
    return limited, plain, engines


def test_a_child_that_an_unlimited_workflows_call_state_starts_is_refused(
    store_url: str,
) -> None:
    """The caller's ``max_concurrency=1`` slot holds back the child of the run it waits
    for: refused once the call state has made it, naming it (before, only the workflow
    called was judged, and the step waited for ever). The child runs once the step has
    ended, and its parent with it."""
    limited, plain, engines = _calling_the_limited(max_concurrency=1)
    with Engine(store_url, workflows=[limited, plain]) as engine:
        engines["engine"] = engine
        info = engine.run(limited, Ctx())
        nested = info.context.nested  # type: ignore[attr-defined]
        (child,) = [run for run in engine.runs(workflow="limited") if run.id != info.id]
        assert nested == (
            "refused: a step waiting for a run of 'limited' would wait for ever: its "
            f"max_concurrency=1 is held by the calling run(s); run {child.id} is queued and "
            "runs once the calling step has ended"
        )
        engine.run_until_idle()
        (parent,) = engine.runs(workflow="plain")
        assert (engine.get(child.id).status, engine.get(parent.id).status) == (
            "succeeded",
            "succeeded",
        )
    assert info.status == "succeeded", info


def test_a_child_with_a_free_slot_is_not_refused(store_url: str) -> None:
    """``max_concurrency=2``: the caller holds one slot, the child takes the other."""
    limited, plain, engines = _calling_the_limited(max_concurrency=2)
    with Engine(store_url, workflows=[limited, plain]) as engine:
        engines["engine"] = engine
        info = engine.run(limited, Ctx())
    assert info.status == "succeeded", info
    assert info.context.nested == "succeeded"  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_step_that_lets_the_refusal_out_fails_at_once_not_retried(
    store_url: str, kind: str
) -> None:
    """The audit's held.py: a ``max_concurrency=1`` workflow whose step runs another of
    its runs and lets ``HeldBack`` out. Its retry would hold the same slot and be refused
    the same way: the step fails on its first attempt (before, it was retried with the
    default backoff, failing after attempt 3, some 3 s later)."""
    from flowloop import journal as j

    workflow = Workflow("held", context=Ctx, max_concurrency=1)
    engines: dict[str, Engine] = {}
    if kind == "def":

        @workflow.step(initial=True, next="done")
        def call_myself(ctx: Ctx) -> None:
            engines["engine"].run(workflow, Ctx(depth=1))

    else:

        @workflow.step(initial=True, next="done")
        async def call_myself(ctx: Ctx) -> None:
            await asyncio.wait_for(engines["engine"].arun(workflow, Ctx(depth=1)), WAIT_S)

    workflow.final("done")
    with Engine(store_url, workflows=[workflow]) as engine:
        engines["engine"] = engine
        info = engine.run(workflow, Ctx())
        failed = [e for e in engine.history(info.id) if e.kind == j.STEP_FAILED]
        assert [run.id for run in engine.runs()] == [info.id]  # nothing written
    assert (info.status, info.state) == ("failed", "call_myself"), info
    assert [(e.attempt, e.retryable, e.error_type) for e in failed] == [(1, False, "HeldBack")]
    assert info.error == (
        "HeldBack: a step waiting for a run of 'held' would wait for ever: its "
        "max_concurrency=1 is held by the calling run(s); start it with engine.start() to "
        "run once the step has ended, or raise the limit"
    )


def test_a_refusal_naming_a_queued_run_is_retried(store_url: str) -> None:
    """One whose run is made and queued (a business key) is retried as any error: the run
    goes once the step has ended, and the retry finds it (README: "the step's retry finds
    it")."""
    from flowloop import FakeClock, Retry
    from flowloop import journal as j

    engines: dict[str, Engine] = {}
    workflow = Workflow("keyed", context=Ctx, max_concurrency=1, key=lambda ctx: f"k{ctx.depth}")

    @workflow.step(initial=True, next="done", retry=Retry(attempts=2, backoff="fixed", base=0))
    async def call_myself(ctx: Ctx) -> None:
        if ctx.depth == 0:
            await asyncio.wait_for(engines["engine"].arun(workflow, Ctx(depth=1)), WAIT_S)

    workflow.final("done")
    with Engine(store_url, workflows=[workflow], clock=FakeClock()) as engine:
        engines["engine"] = engine
        info = engine.run(workflow, Ctx())
        failed = [e for e in engine.history(info.id) if e.kind == j.STEP_FAILED]
    assert [(e.attempt, e.retryable, e.error_type) for e in failed][:1] == [(1, True, "HeldBack")]
