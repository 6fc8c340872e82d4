"""What a user's ``context=``, ``items=``, ``result=`` or ``reduce=`` raises names the state
and the item (SQLite and PostgreSQL).

A map's ``context=`` that built the child's model itself and failed its validation failed
the parent with "1 validation error for FileJob" (no item, no field); a call's that raised
``KeyError`` with "'a.csv'" (no type, no state); a ``result=`` that raised failed the run
with the reason ``child_succeeded`` (API audit)."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow


class FileJob(BaseModel):
    path: str
    size: int


class Batch(BaseModel):
    files: list[Any] = []


kid = Workflow("fe_kid", context=FileJob)
kid.step(name="load", initial=True, next="loaded")(lambda ctx: None)
kid.final("loaded")


def mapped(context: Any = None, items: Any = None, reduce: Any = None, **options: Any) -> Workflow:
    wf = Workflow("fe_map", context=Batch)
    wf.map(
        "fan",
        child=kid,
        items=items or (lambda ctx: ctx.files),
        context=context or (lambda ctx, item: FileJob(path=item[0], size=item[1])),
        reduce=reduce,
        on={"done": "ok", "failed": "bad"},
        initial=True,
        **options,
    )
    wf.final("ok", "bad")
    return wf


def called(result: Any = None, context: Any = None) -> Workflow:
    wf = Workflow("fe_call", context=Batch)
    wf.call(
        "one",
        child=kid,
        context=context or (lambda ctx: FileJob(path="a.csv", size=1)),
        result=result,
        on={"succeeded": "ok"},
        initial=True,
    )
    wf.final("ok")
    return wf


def _lazy_items(ctx: Batch) -> Iterator[Any]:
    """A generator: what it raises comes as the map reads its items, not at the call.
    (Said bare before — "'b.csv'" — and "'NoneType' object is not iterable" for None.)"""
    yield from ctx.files
    raise KeyError("b.csv")


def _boom(*_: Any) -> None:
    raise RuntimeError("merge broke")


@pytest.mark.parametrize(
    ("build", "files", "reason", "message"),
    [
        (
            lambda: mapped(),
            [["a.csv", 1], ["b.csv", "big"]],
            "invalid_child_context",
            "map state 'fan': item 1: context= is invalid: size: Input should be a valid integer",
        ),
        (
            lambda: mapped(items=lambda ctx: ctx.files["x"]),
            [],
            "invalid_child_context",
            "map state 'fan': items= raised TypeError: list indices must be integers",
        ),
        (
            lambda: mapped(items=lambda ctx: None),
            [],
            "invalid_child_context",
            "map state 'fan': items= returned NoneType, not an iterable of items",
        ),
        (
            lambda: mapped(items=_lazy_items),
            [["a.csv", 1]],
            "invalid_child_context",
            "map state 'fan': items= raised KeyError: 'b.csv'",
        ),
        (
            lambda: called(context=lambda ctx: {"a.csv": 1}["b.csv"] and None),
            [],
            "invalid_child_context",
            "call state 'one': context= raised KeyError: 'b.csv'",
        ),
        (
            lambda: called(context=lambda ctx: sys.exit(3)),
            [],
            "invalid_child_context",
            "call state 'one': context= called sys.exit(3)",
        ),
        (
            lambda: called(result=_boom),
            [],
            "join_failed",
            "call state 'one': result= raised RuntimeError: merge broke",
        ),
        (
            # Endless: read whole, it hung the worker; read one past max_items, refused.
            lambda: mapped(items=lambda ctx: itertools.repeat(["a.csv", 1]), max_items=3),
            [],
            "invalid_child_context",
            "map state 'fan': more than max_items=3 items; raise max_items or split the work",
        ),
        (
            lambda: mapped(reduce=_boom),
            [["a.csv", 1]],
            "join_failed",
            "map state 'fan': reduce= raised RuntimeError: merge broke",
        ),
    ],
    ids=[
        "map-context-invalid",
        "map-items-raises",
        "map-items-not-iterable",
        "map-items-generator-raises",
        "call-context-raises",
        "call-context-exits",
        "result",
        "map-items-endless",
        "reduce",
    ],
)
def test_a_user_function_that_fails_names_the_state_and_item(
    store_url: str, build: Any, files: list[Any], reason: str, message: str
) -> None:
    workflow = build()
    with Engine(store_url, workflows=[workflow, kid]) as engine:
        info = engine.run(workflow, Batch(files=files))
        assert (info.status, info.reason) == ("failed", reason)
        assert info.error is not None and message in info.error, info.error
        assert engine.replay(info.id).matches
