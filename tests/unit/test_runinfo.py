"""RunInfo's annotations resolve at run time (typing.get_type_hints, pydantic's
TypeAdapter: a FastAPI response model), although flowloop.runinfo imports pydantic for
type checking only (reading commands load no pydantic, issue 13)."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, TypeAdapter

from flowloop.runinfo import RunInfo


class Order(BaseModel):
    order_id: str


def _info(context: Any) -> RunInfo:
    return RunInfo(
        id="r1",
        workflow="order",
        version=1,
        status="succeeded",
        state="done",
        context=context,
        attempt=0,
        key=None,
        reason=None,
        error=None,
        next_run_at=None,
        owner=None,
        last_seq=3,
        created_at=1.0,
        updated_at=2.0,
        visits={"done": 1},
    )


def test_runinfo__annotations_resolve_at_run_time() -> None:
    hints = typing.get_type_hints(RunInfo)
    assert set(hints) == {field.name for field in RunInfo.__dataclass_fields__.values()}
    assert hints["visits"] == Mapping[str, int]


def test_runinfo__serialises_through_pydantic_with_either_kind_of_context() -> None:
    adapter = TypeAdapter(RunInfo)
    for context in (Order(order_id="A1"), {"order_id": "A1"}):
        dumped = adapter.dump_python(_info(context), mode="json")
        assert dumped["context"] == {"order_id": "A1"}
        assert (dumped["id"], dumped["visits"]) == ("r1", {"done": 1})
