"""Turning a step's context into the JSON the journal keeps, with an error that names the
field when a value cannot be kept (a lock, a connection, a file handle, a NaN …)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import pydantic_core
from pydantic import BaseModel, ValidationError

from flowloop.errors import ContextNotSerializable

M = TypeVar("M", bound=BaseModel)


def context_from(model: type[M], data: str | bytes | Mapping[str, Any]) -> M:
    """A context of ``model`` from JSON text or a mapping, its fields taken by name as well as
    by alias: contexts are kept as models dump them, by name, and read back by alias only, a
    field with an alias (and no ``populate_by_name``) came back as its default."""
    if isinstance(data, (str, bytes)):
        return model.model_validate_json(data, by_name=True)
    return model.model_validate(data, by_name=True)


def dump_context(ctx: BaseModel, *, workflow: str, state: str) -> str:
    """``ctx`` as JSON text. Raises :class:`ContextNotSerializable` naming the field (a
    dotted path into nested models, dicts and lists) whose value JSON cannot hold."""
    try:
        return ctx.model_dump_json()
    except pydantic_core.PydanticSerializationError as error:
        where = _culprit(ctx, "") or "(unknown field)"
        raise ContextNotSerializable(workflow, state, where, str(error)) from error


def _serializes(value: Any) -> bool:
    try:
        pydantic_core.to_json(value)
    except pydantic_core.PydanticSerializationError:
        return False
    return True


def _culprit(value: Any, path: str) -> str | None:
    """The dotted path of the first value under ``value`` that does not serialise."""
    children: list[tuple[str, Any]]
    if isinstance(value, BaseModel):
        children = [(name, getattr(value, name)) for name in type(value).model_fields]
        children += list((value.model_extra or {}).items())
    elif isinstance(value, Mapping):
        children = [(str(key), item) for key, item in value.items()]
    elif isinstance(value, list | tuple | set | frozenset):
        children = [(f"[{index}]", item) for index, item in enumerate(value)]
    else:
        return None if _serializes(value) else path
    for name, child in children:
        if _serializes(child):
            continue
        sub = f"{path}{name}" if name.startswith("[") or not path else f"{path}.{name}"
        return _culprit(child, sub) or sub
    return None


def unstorable(error: Exception, ctx: BaseModel, *, workflow: str, state: str) -> Exception:
    """``error`` as :class:`ContextNotSerializable` naming the field when it is the check of
    the context a step left (its JSON parsed back) failing on a float NaN or infinity: JSON
    has neither, so the dump wrote ``null``, which the field refuses ("Input should be a
    valid number" said nothing of the NaN). Any other error is returned as it is. Called
    only when a step failed."""
    if not isinstance(error, ValidationError) or error.title != type(ctx).__name__:
        return error
    for item in error.errors():
        value = _at(ctx, item["loc"])
        if isinstance(value, float) and not math.isfinite(value):
            return ContextNotSerializable(
                workflow,
                state,
                ".".join(str(part) for part in item["loc"]),
                f"{value!r}: JSON has no NaN or infinity",
                advice="store a finite number or None instead",
            )
    return error


def _at(value: Any, loc: Sequence[int | str]) -> Any:
    """What ``value`` holds at a pydantic error's location (``None`` when not found)."""
    for part in loc:
        if isinstance(value, BaseModel):
            value = getattr(value, str(part), None)
        elif isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, Sequence) and isinstance(part, int) and part < len(value):
            value = value[part]
        else:
            return None
    return value
