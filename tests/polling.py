"""The one bounded poll the tests share: ask until the answer is truthy, fail at a deadline
with what was awaited (and, optionally, what the watched processes said)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    every: float,
    describe: Callable[[], str] | None = None,
) -> T:
    """``probe()`` every ``every`` seconds until it returns something truthy (returned);
    AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f"\n{describe()}" if describe is not None else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{detail}")
        time.sleep(every)
