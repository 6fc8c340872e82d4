"""Failure transitions (on_error) on SQLite and PostgreSQL: routed after the retries are
spent, at once for errors the policy gives up on, for timeouts and interruptions; the
error journaled on the routing step_failed and visible to the target's step."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from pydantic import BaseModel
from storekit import dead_owner, start_step

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.errors import Interrupted, StepTimeout


class Declined(Exception):
    pass


class Ctx(BaseModel):
    mode: str = "ok"
    seen: str = ""
    tries: int = 0


def make() -> Workflow:
    wf = Workflow("charging", context=Ctx)

    @wf.step(
        initial=True,
        next="done",
        retry=Retry(attempts=3, backoff="fixed", base=0, giving_up_on=(Declined,)),
        on_error={Declined: "declined", "*": "refund"},
    )
    def charge(ctx: Ctx, step: Step) -> None:
        ctx.tries += 1  # discarded: a failed step's context changes are not kept
        if ctx.mode == "declined":
            raise Declined("card declined")
        if ctx.mode == "flaky":
            raise ConnectionError(f"gateway down (attempt {step.attempt})")

    @wf.step(next="refunded")
    def refund(ctx: Ctx, step: Step) -> None:
        assert step.error is not None
        ctx.seen = f"{step.error.type}|{step.error.message}"

    wf.final("done", "declined", "refunded")
    return wf


def slow() -> Workflow:
    wf = Workflow("slow", context=Ctx)

    @wf.step(
        initial=True,
        next="done",
        timeout=0.05,
        retry=Retry(attempts=1),
        on_error={StepTimeout: "late"},
    )
    async def wait_long(ctx: Ctx) -> None:
        await asyncio.sleep(30)

    wf.final("done", "late")
    return wf


def fragile() -> Workflow:
    wf = Workflow("fragile_pay", context=Ctx)

    @wf.step(initial=True, next="done", idempotent=False, on_error={Interrupted: "check"})
    def pay(ctx: Ctx) -> None:
        pass

    @wf.step(next="done")
    def check(ctx: Ctx, step: Step) -> None:
        assert step.error is not None
        ctx.seen = step.error.type

    wf.final("done")
    return wf


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    with Engine(store_url, clock=FakeClock()) as engine:
        yield engine


def test_on_error__giving_up_on_routes_at_once(engine: Engine) -> None:
    info = engine.run(make(), Ctx(mode="declined"))
    assert (info.status, info.state) == ("succeeded", "declined")
    failed = [e for e in engine.history(info.id) if e.kind == j.STEP_FAILED]
    assert len(failed) == 1
    assert (failed[0].error_type, failed[0].error_message) == ("Declined", "card declined")
    assert (failed[0].event, failed[0].next_state) == ("error:Declined", "declined")
    assert info.context.tries == 0  # type: ignore[union-attr]
    assert engine.replay(info.id).differences == []


def test_on_error__star_routes_after_the_retries_and_the_target_sees_the_error(
    engine: Engine,
) -> None:
    info = engine.run(make(), Ctx(mode="flaky"))
    assert (info.status, info.state) == ("succeeded", "refunded")
    failed = [e for e in engine.history(info.id) if e.kind == j.STEP_FAILED]
    assert [e.next_state for e in failed] == [None, None, "refund"]
    assert info.context.seen == "ConnectionError|gateway down (attempt 3)"  # type: ignore[union-attr]
    assert engine.replay(info.id).differences == []


def test_on_error__no_error_takes_the_normal_transition(engine: Engine) -> None:
    info = engine.run(make(), Ctx())
    assert (info.status, info.state) == ("succeeded", "done")


def test_on_error__a_timeout_routes(engine: Engine) -> None:
    with Engine(engine.url) as real:  # real clock: asyncio enforces the timeout
        info = real.run(slow(), Ctx())
        assert (info.status, info.state) == ("succeeded", "late")
        failed = [e for e in real.history(info.id) if e.kind == j.STEP_FAILED]
        assert failed[-1].error_type == "StepTimeout"


def test_on_error__an_interrupted_non_idempotent_step_routes_on_interrupted(
    engine: Engine,
) -> None:
    wf = fragile()
    engine.register(wf)
    started = engine.start(wf, Ctx())
    store = engine.store
    # A worker claims it, journals step_started, and dies: the next worker recovers it.
    owner = dead_owner()
    [claimed] = store.claim(worker=owner, now=1e12, limit=1, lease_seconds=30.0)
    assert store.write([start_step(claimed, owner)]) == [True]
    engine.run_until_idle()
    info = engine.get(started.id)
    assert (info.status, info.state) == ("succeeded", "done")
    assert info.context.seen == "Interrupted"  # type: ignore[union-attr]
    interrupted = [e for e in engine.history(info.id) if e.kind == j.STEP_INTERRUPTED]
    assert [(e.event, e.next_state) for e in interrupted] == [("error:Interrupted", "check")]


def _cut_off_once(idempotent: bool) -> Workflow:
    """A step with one attempt and only a ``"*"`` route, cut off by a crash below."""
    wf = Workflow(f"cut_off_{'idem' if idempotent else 'once'}", context=Ctx)

    @wf.step(
        initial=True,
        next="done",
        idempotent=idempotent,
        retry=Retry(attempts=1),
        on_error={"*": "check"},
    )
    def pay(ctx: Ctx) -> None:
        pass

    @wf.step(next="done")
    def check(ctx: Ctx, step: Step) -> None:
        assert step.error is not None
        ctx.seen = step.error.type

    wf.final("done")
    return wf


@pytest.mark.parametrize("idempotent", [True, False], ids=["idempotent", "not-idempotent"])
def test_on_error__star_routes_an_idempotent_steps_last_attempt_cut_off(
    engine: Engine, idempotent: bool
) -> None:
    """An idempotent step's last attempt cut off by a crash failed the run ("interrupted")
    although ``"*"`` takes every error once the retries are spent — a crash counts as an
    attempt (API audit). ``"*"`` still never takes a non-idempotent step's: its effect is
    unknown, only ``on_error={Interrupted: ...}`` moves on from it."""
    wf = _cut_off_once(idempotent)
    engine.register(wf)
    started = engine.start(wf, Ctx())
    owner = dead_owner()
    [claimed] = engine.store.claim(worker=owner, now=1e12, limit=1, lease_seconds=30.0)
    assert engine.store.write([start_step(claimed, owner)]) == [True]
    engine.run_until_idle()
    info = engine.get(started.id)
    if idempotent:
        assert (info.status, info.state) == ("succeeded", "done")
        assert info.context.seen == "Interrupted"  # type: ignore[union-attr]
    else:
        assert (info.status, info.state, info.reason) == ("failed", "pay", "interrupted")
    assert engine.replay(info.id).differences == []
