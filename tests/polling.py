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


def wait_until_blocked_by(
    url: str, pid: int, *, still_going: Callable[[], bool], timeout: float = 30.0
) -> int:
    """PostgreSQL: wait (bounded) until a backend waits for a lock the backend ``pid``
    holds, or ``still_going()`` says the one expected to wait has ended. How many wait
    then (0: it ended without waiting, or the time ran out)."""
    import sqlalchemy as sa

    watcher = sa.create_engine(url)
    deadline = time.monotonic() + timeout
    try:
        with watcher.connect() as look:
            while True:
                blocked = int(
                    look.execute(
                        sa.text(
                            "SELECT count(*) FROM pg_stat_activity"
                            " WHERE :pid = ANY(pg_blocking_pids(pid))"
                        ),
                        {"pid": pid},
                    ).scalar_one()
                )
                if blocked or not still_going() or time.monotonic() > deadline:
                    return blocked
                time.sleep(0.01)
    finally:
        watcher.dispose()
