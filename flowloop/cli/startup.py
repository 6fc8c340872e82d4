"""Opening the engine for the commands that run steps (``worker``, ``resume``) when the
database is out at start-up: they wait for it, as their main loops wait through an outage.

Before, the store's first connection (or the definitions' first write) failing with an
outage ended the process with one line — a worker started while PostgreSQL refused
connections, or whose new connection an administrator ended, exited 1 and left the fleet a
worker short (fault audit). A mistake (no such database, a wrong password, a file that is
not a flowloop database) is still one line at once: it does not fix itself.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Final

from flowloop.errors import StoreError

if TYPE_CHECKING:
    from flowloop.engine import Engine

log = logging.getLogger("flowloop")

FIRST_WAIT_SECONDS: Final = 0.5
MAX_WAIT_SECONDS: Final = 5.0


REMINDER_SECONDS: Final = 60.0
"""A wait says again that it waits (a lone line an hour ago reads like a hang)."""


class StoppedWaiting(Exception):
    """SIGTERM (exit 0) or Ctrl-C (exit 130) while waiting for the database at start-up:
    nothing was started."""

    def __init__(self, exit_code: int = 0) -> None:
        super().__init__("stopped while waiting for the database; nothing was started")
        self.exit_code = exit_code


def cause_is_outage(error: BaseException) -> bool:
    """Whether ``error`` (a StoreError, or what it wraps) is an outage: retry later."""
    from flowloop.store import outage

    seen: BaseException | None = error
    while seen is not None:
        if not isinstance(seen, StoreError) and outage.is_outage(seen):
            return True
        seen = seen.__cause__
    return False


def when_reachable(
    open_it: Callable[[], Engine],
    url: str,
    *,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> Engine:
    """``open_it()`` again and again, backing off (0.5 s doubling to 5 s), while it fails
    with an outage; said once as a warning, and when the database answers again. Raises
    :class:`StoppedWaiting` on SIGTERM (Ctrl-C: KeyboardInterrupt, as ever)."""
    from flowloop.store import outage

    delay, began, said_at = FIRST_WAIT_SECONDS, monotonic(), None
    with _stop_on_sigterm():
        while True:
            try:
                engine = open_it()
            except StoreError as error:
                if not cause_is_outage(error):
                    raise
                now = monotonic()
                if said_at is None or now - said_at >= REMINDER_SECONDS:
                    log.warning(
                        "cannot use the database yet (%s); waiting for it%s (Ctrl-C to stop)",
                        outage.describe(error.__cause__ or error, url),
                        "" if said_at is None else f", {now - began:.0f}s so far",
                    )
                    said_at = now
                try:
                    sleep(delay)
                except KeyboardInterrupt:
                    raise StoppedWaiting(exit_code=130) from None
                delay = min(delay * 2, MAX_WAIT_SECONDS)
                continue
            if said_at is not None:
                log.warning("the database answers again; starting")
            return engine


@contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """SIGTERM ends the wait (the worker's own handlers come later, once it runs)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(_signum: int, _frame: Any) -> None:
        raise StoppedWaiting()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
