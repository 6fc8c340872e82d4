"""Drives that ended with an error nothing handled: a write the database refused for no
outage (outages are waited out: flowloop/committer.py), or a defect. The run keeps its
lease until it runs out (its writes failed: nothing else can be written about it), then
recovery takes it again. Such an error was only "never retrieved" by asyncio, and an idle
call (``run_until_idle``) waited out the lease, then the next drive's failure, for ever:
it is logged with its traceback, and the idle call driving the run stops claiming, lets
the other runs' steps in flight finish (drained, not cut off), and raises it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Final

from flowloop.errors import error_line

log = logging.getLogger("flowloop")


KEPT_AT_MOST: Final = 100
"""Errors kept for an idle call at most (a worker makes none: what it keeps is only freed
when this executor claims the run again)."""


class FailedDrives:
    """The unhandled errors of this executor's drives, by run, until raised or retried."""

    def __init__(self) -> None:
        self._errors: dict[str, Exception] = {}

    def ended(self, run_id: str, task: asyncio.Task[None], current: bool) -> None:
        """A drive nobody awaits ended: its error, if any, logged and kept for an idle call
        (``current``: the run's latest drive here, not an older one a step kept alive after
        the run was claimed again). (A KeyboardInterrupt or SystemExit left the loop.)"""
        error = None if task.cancelled() else task.exception()
        if not isinstance(error, Exception):
            return
        log.error(
            "run %s: its drive failed (%s); the run is taken again once its lease runs out",
            run_id,
            error_line(error),
            exc_info=error,
        )
        if current and len(self._errors) < KEPT_AT_MOST:
            self._errors.setdefault(run_id, error)

    def forget(self, run_id: str) -> None:
        """The run is driven again (claimed anew): its old error is no longer its state."""
        self._errors.pop(run_id, None)

    def pending(self, scope: Collection[str] | None) -> bool:
        """Whether a run of ``scope`` (None: any run) has an error to raise."""
        return any(scope is None or run_id in scope for run_id in self._errors)

    def raise_any(self, scope: Collection[str] | None) -> None:
        """Raise the error of a run of ``scope`` (None: any run), forgetting it."""
        for run_id in self._errors:
            if scope is None or run_id in scope:
                raise self._errors.pop(run_id)
