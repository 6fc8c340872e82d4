"""Why a step ended without an outcome, said the same way in the journal, the log and the CLI.

A ``step_interrupted`` entry carries ``data["cause"]`` (one of :data:`CAUSES`) and a message
built by :func:`message`, so ``history`` and ``status`` say what happened (cut off by a
shutdown, a lease this worker gave up, a worker that went away) rather than guessing.
A run handed back on shutdown after its step finished gets a ``run_released`` entry with
``data["reason"] == RELEASED_ON_SHUTDOWN``.
"""

from __future__ import annotations

from typing import Final

CUT_OFF: Final = "cut_off"
"""This process cancelled the step: a shutdown's grace ran out, a second Ctrl-C, or the
caller cancelled the task driving the run."""
LEASE_LOST: Final = "lease_lost"
"""This worker gave the run up (it could not renew the lease in time: self-fencing, or a
write was refused) and found it again when recovering."""
WORKER_GONE: Final = "worker_gone"
"""Found later: the worker holding the step stopped renewing its lease (process killed,
crashed, frozen, or cut off from the database)."""
CAUSES: Final = (CUT_OFF, LEASE_LOST, WORKER_GONE)

RELEASED_ON_SHUTDOWN: Final = "released on shutdown"
"""``run_released`` reason: the step in flight finished and was journaled, then the run was
handed back (SIGTERM to a worker, a first Ctrl-C in ``flowloop run``)."""

_WHAT: Final = {
    CUT_OFF: "cut off by shutdown (or cancelled) during this step",
    LEASE_LOST: "this worker lost its lease during this step (self-fenced)",
    WORKER_GONE: "its worker went away during this step (killed, crashed, or lost its lease)",
}


def message(cause: str, *, idempotent: bool, attempts_left: bool, attempt: int) -> str:
    """The ``step_interrupted`` message: what happened, then what becomes of the step."""
    what = _WHAT.get(cause, _WHAT[WORKER_GONE])
    if idempotent and attempts_left:
        return f"{what}; it runs again"
    if idempotent:
        return f"{what}; interrupted {attempt} time(s), no attempts left"
    return f"{what}; not idempotent, so not re-run: check its effect, then retry"
