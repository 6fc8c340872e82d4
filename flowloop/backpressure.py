"""Backpressure: bounds on what piles up, each with a declared overflow policy (pure).

Two bounds, declared on the workflow:

* ``max_inbox`` — events kept for one run (sent with ``buffer=True`` or while a worker holds
  the run) that it has not taken yet;
* ``max_queued`` — runs of the workflow created but not yet started (status ``scheduled``,
  nothing but ``run_created`` in their journal).

And what happens to the one that does not fit (``inbox_overflow`` / ``queue_overflow``):

* ``"reject_newest"`` (default): the sender or starter gets :class:`InboxFull` /
  :class:`QueueFull` naming the bound; nothing is written.
* ``"drop_oldest"``: the oldest waiting one makes room — a kept event is marked taken by an
  ``event_dropped`` entry in its run's journal; a queued run is stopped (``run_stopped``,
  reason ``dropped``) — and the new one is kept.
* ``"block"``: the producer waits (polling) up to ``overflow_timeout`` seconds for room,
  then gets the same error as ``reject_newest``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, Literal

from flowloop.errors import EXIT_FAILURE, DefinitionError, FlowloopError

Overflow = Literal["reject_newest", "drop_oldest", "block"]
OVERFLOWS: Final[tuple[Overflow, ...]] = ("reject_newest", "drop_oldest", "block")
DEFAULT_OVERFLOW_TIMEOUT_SECONDS: Final = 10.0
BLOCK_POLL_SECONDS: Final = 0.05
"""How often a blocked producer looks for room again."""


class InboxFull(FlowloopError):
    """A run's inbox of kept events is at its bound: send later, or raise ``max_inbox``."""

    exit_code = EXIT_FAILURE


class QueueFull(FlowloopError):
    """A workflow's queue of runs not yet started is at its bound: start later, add workers,
    or raise ``max_queued``."""

    exit_code = EXIT_FAILURE


@dataclass(frozen=True)
class Bounds:
    max_inbox: int | None = None
    inbox_overflow: Overflow = "reject_newest"
    max_queued: int | None = None
    queue_overflow: Overflow = "reject_newest"
    overflow_timeout: float = DEFAULT_OVERFLOW_TIMEOUT_SECONDS

    @classmethod
    def of(
        cls,
        workflow: str,
        *,
        max_inbox: int | None,
        inbox_overflow: str,
        max_queued: int | None,
        queue_overflow: str,
        overflow_timeout: float | timedelta,
    ) -> Bounds:
        """Checked bounds; a wrong one is a :class:`DefinitionError` naming it."""
        for label, bound in (("max_inbox", max_inbox), ("max_queued", max_queued)):
            if bound is not None and (
                isinstance(bound, bool) or not isinstance(bound, int) or bound < 1
            ):
                raise DefinitionError(workflow, f"{label}={bound!r} must be an integer >= 1")
        for label, policy in (
            ("inbox_overflow", inbox_overflow),
            ("queue_overflow", queue_overflow),
        ):
            if policy not in OVERFLOWS:
                raise DefinitionError(
                    workflow, f"{label}={policy!r} must be one of {', '.join(OVERFLOWS)}"
                )
        timeout = (
            overflow_timeout.total_seconds()
            if isinstance(overflow_timeout, timedelta)
            else overflow_timeout
        )
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout < 0
        ):
            raise DefinitionError(
                workflow, f"overflow_timeout={overflow_timeout!r} must be a duration >= 0"
            )
        return cls(
            max_inbox,
            inbox_overflow,  # type: ignore[arg-type]
            max_queued,
            queue_overflow,  # type: ignore[arg-type]
            float(timeout),
        )


def inbox_full(run_id: str, bounds: Bounds, *, waited: float | None = None) -> InboxFull:
    assert bounds.max_inbox is not None
    how = f"; waited {waited:g}s for room" if waited is not None else ""
    return InboxFull(
        f"run {run_id}: its inbox holds {bounds.max_inbox} kept events (max_inbox="
        f"{bounds.max_inbox}, inbox_overflow={bounds.inbox_overflow!r}){how}; the event was "
        "not kept: send it again later"
    )


def queue_full(workflow: str, bounds: Bounds, *, waited: float | None = None) -> QueueFull:
    assert bounds.max_queued is not None
    how = f"; waited {waited:g}s for room" if waited is not None else ""
    return QueueFull(
        f"workflow {workflow!r}: {bounds.max_queued} runs wait to start (max_queued="
        f"{bounds.max_queued}, queue_overflow={bounds.queue_overflow!r}){how}; the run was not "
        "created: start it again later or add workers"
    )


DROPPED_REASON: Final = "dropped: max_queued="
"""How the reason of a run stopped for ``max_queued`` begins (the bound follows)."""


def usage_by_workflow(
    queued: Iterable[Any],
    kept: Iterable[Any],
    dropped_events: Iterable[Any],
    dropped_runs: Iterable[Any],
) -> dict[str, dict[str, int]]:
    """``flowloop status``'s backpressure per workflow from four counts, each as rows of
    ``(workflow, count)`` (``kept``: one row per run with kept events): ``queued`` runs not
    yet started, ``kept`` events and ``kept_max`` on one run, ``dropped_events`` and
    ``dropped_runs``. Only workflows with something to count appear."""
    usage: dict[str, dict[str, int]] = {}

    def put(workflow: str, name: str, value: int) -> None:
        entry = usage.setdefault(
            workflow,
            {"queued": 0, "kept": 0, "kept_max": 0, "dropped_events": 0, "dropped_runs": 0},
        )
        entry[name] = max(entry[name], value) if name == "kept_max" else entry[name] + value

    for workflow, count in queued:
        put(workflow, "queued", int(count))
    for workflow, count in kept:
        put(workflow, "kept", int(count))
        put(workflow, "kept_max", int(count))
    for workflow, count in dropped_events:
        put(workflow, "dropped_events", int(count))
    for workflow, count in dropped_runs:
        put(workflow, "dropped_runs", int(count))
    return usage
