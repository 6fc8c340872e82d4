"""The limit slots held by the runs whose steps are calling this code.

A workflow's ``max_concurrency`` and ``key_limit`` are the cluster's, and a running run
counts against them while its step runs. So a step that starts a run of a limited workflow
and waits for it (``engine.run``, ``await engine.arun``) waits for ever when the slots
that run needs are all held by the very runs waiting for it: the step's own run, and the
runs whose steps called it. The executor notes each limited run it drives in the context
of the run's task (copied into its steps, their threads and the runs they start), and a
call that would wait so is refused at once, before anything is written.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowloop.errors import HeldBack

if TYPE_CHECKING:
    from flowloop.definition import Workflow


@dataclass(frozen=True, slots=True)
class Held:
    """A slot a running run holds: of its workflow, and of its key when it has one."""

    database: str
    workflow: str
    limit_key: str | None


HELD: contextvars.ContextVar[tuple[Held, ...]] = contextvars.ContextVar(
    "flowloop_held_slots", default=()
)
"""The slots held by the runs driving this task's code, the innermost last."""


def database_of(store: Any) -> str:
    """What tells one database from another here: its URL as the store was given it."""
    return str(getattr(store, "url", id(store)))


def context_holding(slot: Held) -> contextvars.Context:
    """A copy of this context in which ``slot`` is held too (a run task's context)."""
    context = contextvars.copy_context()
    context.run(HELD.set, (*HELD.get(), slot))
    return context


def refuse_held_back(database: str, workflow: Workflow, limit_key: str | None) -> None:
    """Raise :class:`HeldBack` when a new run of ``workflow`` (with ``limit_key``) cannot
    be claimed before the runs calling this code end: their slots fill its limit."""
    held = [h for h in HELD.get() if h.database == database and h.workflow == workflow.name]
    limit = workflow.max_concurrency
    if limit is not None and len(held) >= limit:
        raise HeldBack(
            f"a run of {workflow.name!r} waited for from a step of a {workflow.name!r} run "
            f"would wait for ever: its max_concurrency={limit} is held by the calling "
            f"run(s); start it with engine.start() and let the step end, or raise the limit"
        )
    key_limit = workflow.key_limit
    if limit_key is None or key_limit is None:
        return
    if sum(h.limit_key == limit_key for h in held) >= key_limit:
        raise HeldBack(
            f"a run of {workflow.name!r} with key {limit_key!r} waited for from a step of a "
            f"run with that key would wait for ever: its key_limit={key_limit} is held by "
            f"the calling run(s); start it with engine.start() and let the step end, or "
            f"raise the limit"
        )
