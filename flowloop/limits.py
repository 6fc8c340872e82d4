"""Lengths and characters the schema stores, checked before the database sees them.

PostgreSQL refuses a value longer than its column (``varchar(400)``) and any text with a
NUL character; SQLite stores both. The same limits apply on both databases, so a flowloop
that works on SQLite in development keeps working on PostgreSQL, and a value that cannot
be stored is refused with one line naming it instead of a driver traceback.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from datetime import datetime
from typing import Final

import pydantic_core

from flowloop.errors import FlowloopError
from flowloop.retry import MAX_DURATION_SECONDS

MAX_NAME_LENGTH: Final = 200
"""Workflow, state, event and loop names (``varchar(200)`` columns)."""
MAX_KEY_LENGTH: Final = 400
"""Business keys, idempotency keys and dedupe keys (``varchar(400)`` columns)."""


def shown(value: str, limit: int = 40) -> str:
    return repr(value if len(value) <= limit else value[: limit - 3] + "...")


def check_text(what: str, value: str | None, limit: int) -> str | None:
    """``value`` if it fits a column of ``limit`` characters and holds no NUL, else
    FlowloopError naming ``what``."""
    if value is None:
        return None
    if len(value) > limit:
        raise FlowloopError(
            f"{what} {shown(value)} is {len(value)} characters long; at most {limit} fit"
        )
    if "\x00" in value:
        raise FlowloopError(f"{what} {shown(value)} contains a NUL character (\\0)")
    return value


MAX_PRIORITY: Final = 2**31 - 1
"""A run's priority is a PostgreSQL ``integer`` (32 bits): the same range on SQLite."""


def check_priority(value: object) -> int:
    """``value`` if it is a whole number a priority column holds (a numpy integer too),
    else FlowloopError (SQLite took 3,000,000,000 that PostgreSQL refused, and gave a
    traceback past 2**63)."""
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        number = None
    if isinstance(value, bool) or number is None or not -MAX_PRIORITY - 1 <= number <= MAX_PRIORITY:
        raise FlowloopError(
            f"priority {value!r} is not a whole number from {-MAX_PRIORITY - 1} to {MAX_PRIORITY}"
        )
    return number


def check_run_at(value: object, now: float) -> float | None:
    """A new run's due time in seconds since the epoch: ``value`` given in those (any real
    number), or as an aware datetime. NaN stored no due time (a run that never ran),
    infinity broke `status` and the dashboard, a datetime reached the driver: refused with
    one line."""
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise FlowloopError(
                f"run_at {value!r} has no time zone: give an aware datetime "
                "(tzinfo=timezone.utc) or seconds since the epoch"
            )
        result = value.timestamp()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            result = float(value)
        except OverflowError:
            result = math.inf
    else:
        raise FlowloopError(
            f"run_at {value!r} is not a time: give seconds since the epoch "
            "(time.time() + 3600) or an aware datetime"
        )
    if not (math.isfinite(result) and 0 <= result <= now + MAX_DURATION_SECONDS):
        shown = value if not isinstance(value, int) or abs(value) < 10**20 else "a huge number"
        raise FlowloopError(
            f"run_at {shown!r} is not a time from the epoch to 10 years from now "
            "(seconds since the epoch)"
        )
    return result


def check_key(what: str, value: str | None) -> str | None:
    return check_text(what, value, MAX_KEY_LENGTH)


_LEAVES: Final = frozenset({str, int, bool, type(None)})
"""Types of JSON values that hold no number to check (most of a context): skipped without a
call (a context is checked once per run it starts)."""


def non_finite(value: object, path: str = "") -> str | None:
    """The path of the first NaN or infinite number in a JSON-like value (``None``: none).
    JSON has no such numbers: stored, they would silently become ``null``."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path or "(the value)"
    if isinstance(value, Mapping):
        for key, item in value.items():
            if type(item) in _LEAVES:
                continue
            found = non_finite(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if type(item) in _LEAVES:
                continue
            found = non_finite(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def _writes_non_finite() -> bool:
    """Whether this pydantic_core writes a NaN and an infinity in plain lists and dicts as
    such (``inf_nan_mode="constants"``), which :func:`check_finite`'s encoding relies on."""
    try:
        encoded = pydantic_core.to_json([float("nan"), {"x": -math.inf}], inf_nan_mode="constants")
    except (ValueError, TypeError):
        return False
    return encoded == b'[NaN,{"x":-Infinity}]'


_ENCODE_FIRST: Final = _writes_non_finite()


def check_finite(what: str, value: object) -> None:
    """FlowloopError naming the field of ``value`` that is NaN or infinite. Encoding
    ``value`` exhausts its iterators (the engine checks a dump of a context once its text
    is made), and reads a dict or list subclass as stored, where the walk (and
    ``json.dumps``) reads it through its own ``items`` or ``__iter__``."""
    if _ENCODE_FIRST:
        try:
            # Encoded in Rust, each NaN or infinity written as such: without one there is
            # nothing to name (a context of 1,000 order lines: ~0.6 ms, the walk ~1.3 ms).
            encoded = pydantic_core.to_json(value, inf_nan_mode="constants")
        except (ValueError, TypeError):
            pass  # a value JSON has no type for, nesting too deep: the walk decides
        else:
            # (``find``, not ``in``: ``bytes in bytes`` first tries its operand as an
            # integer, and formats a TypeError it then drops: ~1 k instructions apiece.)
            if encoded.find(b"NaN") < 0 and encoded.find(b"Infinity") < 0:
                return
    found = non_finite(value)
    if found is not None:
        raise FlowloopError(
            f"{what} field {found} is NaN or infinite: JSON has no such number "
            "(it would be stored as null); give a finite number"
        )
