"""flowloop/straight.py: a next= step's usual success, decided once per state, says what
the general path (Workflow.event_for / next_state, entering, _straight_on) says."""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel

from flowloop import Workflow
from flowloop.definition import NEXT_EVENT
from flowloop.events import entering
from flowloop.flowcontrol import RateLimit
from flowloop.straight import PlainNexts, plain_next, plain_step


class Ctx(BaseModel):
    n: int = 0


def _flow(version: int = 1) -> Workflow:
    wf = Workflow("straight", context=Ctx, context_version=version)

    def undo_a(ctx: Ctx) -> None: ...

    @wf.step(initial=True, next="b", max_visits=3, compensate=undo_a)
    def a(ctx: Ctx) -> None: ...

    @wf.step(next="gated", max_visits=4)
    def b(ctx: Ctx) -> None: ...

    @wf.step(next="waiting", rate_limit=RateLimit("s", 10, per=timedelta(seconds=1)))
    def gated(ctx: Ctx) -> None: ...

    wf.wait("waiting", on={"go": "chooser"}, timeout=60, on_timeout="done")

    @wf.step(on={"x": "a", "y": "last"})
    def chooser(ctx: Ctx) -> str:
        return "x"

    @wf.step(next="undo")
    def last(ctx: Ctx) -> None: ...

    wf.final("done")
    wf.final("undo", compensate=True)
    return wf


def test_a_plain_target_is_decided_once_as_the_general_path_decides_it() -> None:
    wf = _flow(version=2)
    plain = plain_next(wf, wf.steps["a"])
    assert plain is not None
    assert plain.target == wf.next_state("a", wf.event_for("a", None)) == "b"
    assert wf.event_for("a", None) == NEXT_EVENT
    # the entry's data: what entering says at any time (a plain step names no due time)
    assert plain.data == entering(wf, "b", 123.0) == wf.context_stamp() != {}
    assert plain.limit == wf.max_visits("b") == 4
    assert plain_step(wf, "b")


def test_any_other_target_is_left_to_the_general_path() -> None:
    wf = _flow()
    assert plain_next(wf, wf.steps["b"]) is None  # its target is gated (a rate limit)
    assert not plain_step(wf, "gated")
    assert plain_next(wf, wf.steps["gated"]) is None  # a wait state (its timeout is due)
    assert not plain_step(wf, "waiting")
    assert plain_next(wf, wf.steps["chooser"]) is None  # an on= step returns its event
    assert plain_next(wf, wf.steps["last"]) is None  # a final state (compensating)
    assert not plain_step(wf, "undo") and not plain_step(wf, "done")


def test_the_executors_cache_finds_each_state_once() -> None:
    wf = _flow()
    plains = PlainNexts()
    first = plains[wf, "a"]
    assert first is not None and plains[wf, "a"] is first
    assert plains[wf, "b"] is None and (wf, "b") in plains
