"""An outcome's log line, said once the journal holds the outcome.

A step's outcome (and a compensation's, and an interruption recovery journals) is logged
when the boundary holding its entry is committed, not when the function returns: the run
may have been fenced off meanwhile, or its write refused, and then the outcome is not
written (README, "Scaling out"). The log said "succeeded" for attempts the journal shows cut off
and run again by another worker (fault audit: 359 "succeeded in" lines for 350 successes).
An outcome that is not written gets a line saying so instead, at most a warning.

The executor holds the line (:meth:`OutcomeLog.hold`) with the seq of its entry, says it
when a boundary holding that seq is committed (``Executor._notify``), and settles it once
the commit meant to hold it is over (:meth:`OutcomeLog.settle`): still held, the outcome
was not written. A success's line is held only when INFO is enabled: with it off, the
hot path of a step costs nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping
from typing import TYPE_CHECKING, Any, Final

from flowloop.store import Boundary

if TYPE_CHECKING:
    from flowloop.journal import RunRecord

log = logging.getLogger("flowloop")

NOT_WRITTEN: Final = (
    "not journaled: the run was no longer this worker's (its lease lost, or the write refused)"
)
"""The end of the line an outcome that was not written gets."""

SUCCEEDED: Final = "run %s seq %d: %s attempt %d succeeded in %.1f ms (%s -> %s)"
SUCCEEDED_UNWRITTEN: Final = (
    "run %s seq %d: %s attempt %d ended in %.1f ms (%s -> %s), its outcome " + NOT_WRITTEN
)
FAILED: Final = "run %s seq %d: %s attempt %d %s in %.1f ms: %s: %s"
"""A step's failure (the fifth ``%s``: failed, retried or timed_out)."""
FAILED_UNWRITTEN: Final = (
    "run %s seq %d: %s attempt %d ended (outcome %s) in %.1f ms: %s: %s; " + NOT_WRITTEN
)
COMPENSATED: Final = "run %s: compensation of %s succeeded"
COMPENSATED_UNWRITTEN: Final = "run %s: compensation of %s ended, its outcome " + NOT_WRITTEN
UNDO_FAILED: Final = "run %s: compensation of %s attempt %d failed: %s"
UNDO_FAILED_UNWRITTEN: Final = (
    "run %s: compensation of %s attempt %d ended (failed: %s), its outcome " + NOT_WRITTEN
)
INTERRUPTED: Final = "run %s seq %d: %s attempt %d interrupted: %s"
INTERRUPTED_UNWRITTEN: Final = "run %s seq %d: %s attempt %d found cut off (%s), " + NOT_WRITTEN

_Held = tuple[int, int, str, str, tuple[Any, ...], Mapping[str, Any]]
"""The seq of the entry; the level, message and message if not written, its arguments
(for either), and the ``extra=`` fields."""


class OutcomeLog:
    """The outcome lines of one executor's runs, held until their entry is written."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held: dict[str, _Held] = {}
        """By run id (a drive has one outcome in flight at a time)."""

    def hold(
        self,
        run_id: str,
        seq: int,
        level: int,
        message: str,
        unwritten: str,
        args: tuple[Any, ...],
        extra: Mapping[str, Any],
    ) -> None:
        """Say ``message % args`` once the entry ``seq`` of the run is committed; if it is
        not, ``unwritten % args`` instead (see :meth:`settle`)."""
        self.held[run_id] = (seq, level, message, unwritten, args, extra)

    def written(self, boundary: Boundary) -> None:
        """``boundary`` was committed: say the line held for its run if it holds the entry."""
        held = self.held.get(boundary.run_id)
        events = boundary.events
        if held is not None and events and events[0].seq <= held[0] <= events[-1].seq:
            del self.held[boundary.run_id]
            log.log(held[1], held[2], *held[4], extra=held[5])

    def settle(self, run_id: str) -> None:
        """The commit that would have held the run's outcome is over: a line still held
        was not written, and says so."""
        held = self.held.pop(run_id, None)
        if held is None:
            return
        _, level, _, unwritten, args, extra = held
        was = extra.get("outcome", extra.get("event"))
        fields = {**extra, "event": "outcome_not_written", "outcome": was}
        log.log(min(level, logging.WARNING), unwritten, *args, extra=fields)

    def drop(self, run_id: str) -> None:
        """The drive was cut off while committing: whether the outcome was written is not
        known here (a queued boundary may still be), so nothing is said."""
        self.held.pop(run_id, None)

    async def said(self, run_id: str, commit: Awaitable[bool]) -> bool:
        """Whether ``commit`` (of the boundary meant to hold the run's outcome) was
        applied; the line held for it is then said, or says it was not written."""
        try:
            applied = await commit
        except BaseException:  # cut off or failed: whether it was written is not known
            self.drop(run_id)
            raise
        self.settle(run_id)
        return applied


def step_fields(workflow: str, record: RunRecord) -> dict[str, Any]:
    """The ``extra=`` fields of a step's log lines (keys of a JSON log line)."""
    return {
        "workflow": workflow,
        "run": record.id,
        "seq": record.last_seq,
        "state": record.state,
        "attempt": record.attempt,
    }
