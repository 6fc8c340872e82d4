"""Drives that ended with an error nothing handled: a write the database refused for no
outage (outages are waited out: flowloop/committer.py), or a defect. The run keeps its
lease until it runs out (its writes failed: nothing else can be written about it), then
recovery takes it again. Such an error was only "never retrieved" by asyncio, and an idle
call (``run_until_idle``) waited out the lease, then the next drive's failure, for ever:
it is logged with its traceback, and the idle call driving the run raises it."""

from __future__ import annotations

import logging
from collections.abc import Collection

from flowloop.errors import error_line

log = logging.getLogger("flowloop")


class FailedDrives:
    """The unhandled errors of this executor's drives, by run, until raised or retried."""

    def __init__(self) -> None:
        self._errors: dict[str, Exception] = {}

    def note(self, run_id: str, error: BaseException) -> None:
        """A drive nobody awaits ended with ``error``: logged, kept for an idle call."""
        log.error(
            "run %s: its drive failed (%s); the run is taken again once its lease runs out",
            run_id,
            error_line(error) if isinstance(error, Exception) else repr(error),
            exc_info=error,
        )
        if isinstance(error, Exception):  # (a KeyboardInterrupt went out of the loop itself)
            self._errors.setdefault(run_id, error)

    def forget(self, run_id: str) -> None:
        """The run is driven again (claimed anew): its old error is no longer its state."""
        self._errors.pop(run_id, None)

    def raise_any(self, scope: Collection[str] | None) -> None:
        """Raise the error of a run of ``scope`` (None: any run), forgetting it."""
        for run_id in self._errors:
            if scope is None or run_id in scope:
                raise self._errors.pop(run_id)
