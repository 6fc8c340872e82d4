"""Frozen dataclasses built on the hot path without their generated ``__init__``.

A frozen dataclass's ``__init__`` sets every field through ``object.__setattr__`` (its
frozen ``__setattr__`` refuses plain assignment): 3.7 us for a :class:`JournalEvent` of 16
fields, 5.5 us for a :class:`Step`, where filling the instance's dict at once costs about
1 us. A step boundary builds two events and a step. :func:`build` checks what the
constructor checks (no unknown field, every required one given), so a typo still raises.
It serves only plain frozen dataclasses: no ``__post_init__``, no ``__slots__``, no
``InitVar``.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")


class _Plan(NamedTuple):
    names: frozenset[str]
    defaults: dict[str, Any]
    factories: tuple[tuple[str, Callable[[], Any]], ...]
    template: dict[str, Any]
    """Every field, in order: its default, or :data:`_UNSET` (required, or made by a
    factory). A new instance's dict starts as a copy of it (a dict copied whole into an
    empty one is cloned at C speed) and takes the given values over it."""
    required: tuple[str, ...]


_UNSET: Any = object()
"""A field of :attr:`_Plan.template` no default fills."""


_PLANS: dict[type[Any], _Plan] = {}


def _plan(cls: type[Any]) -> _Plan:
    if not dataclasses.is_dataclass(cls) or "__slots__" in vars(cls):
        raise TypeError(f"{cls.__name__}: build() serves dataclasses without __slots__")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: build() would skip its __post_init__")
    fields = dataclasses.fields(cls)
    if len(fields) != len(cls.__dataclass_fields__):  # an InitVar or a ClassVar
        raise TypeError(f"{cls.__name__}: build() serves plain fields only")
    defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
    factories = tuple(
        (f.name, f.default_factory) for f in fields if f.default_factory is not dataclasses.MISSING
    )
    made_by = {name for name, _ in factories}
    plan = _PLANS[cls] = _Plan(
        names=frozenset(f.name for f in fields),
        defaults=defaults,
        factories=factories,
        template={f.name: defaults.get(f.name, _UNSET) for f in fields},
        required=tuple(f.name for f in fields if f.name not in defaults.keys() | made_by),
    )
    return plan


def build(cls: type[T], values: Mapping[str, Any]) -> T:
    """``cls(**values)`` for a frozen dataclass, its dict filled at once. Raises
    TypeError for an unknown field or a missing required one."""
    plan = _PLANS.get(cls) or _plan(cls)
    made = object.__new__(cls)
    fields = vars(made)
    fields.update(plan.template)
    fields.update(values)
    if len(fields) != len(plan.names):  # the template holds every field: more is unknown
        unknown = ", ".join(sorted(values.keys() - plan.names))
        raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
    for name, factory in plan.factories:
        if name not in values:
            fields[name] = factory()
    for name in plan.required:
        if fields[name] is _UNSET:
            missing = ", ".join(sorted(n for n in plan.required if fields[n] is _UNSET))
            raise TypeError(f"{cls.__name__} needs {missing}")
    return made


def replaced(made: T, **change: Any) -> T:
    """``dataclasses.replace(made, **change)`` for a frozen dataclass :func:`build` serves,
    its dict copied (``replace`` calls the generated ``__init__`` through a generic path)."""
    plan = _PLANS.get(type(made)) or _plan(type(made))
    if not plan.names.issuperset(change):
        unknown = ", ".join(sorted(change.keys() - plan.names))
        raise TypeError(f"{type(made).__name__} has no field(s) {unknown}")
    copy = object.__new__(type(made))
    fields = vars(copy)
    fields.update(vars(made))
    fields.update(change)
    return copy
