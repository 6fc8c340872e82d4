"""A workflow's steps in a plain loop, with no journal: nothing survives a crash. The
reference for benchmarks (the cost of checkpointing) and tests (flowloop gives the same)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from flowloop.definition import Step, Workflow


def run_plain(
    workflow: Workflow, context: Mapping[str, Any] | BaseModel, *, run_id: str = "plain"
) -> Any:
    """Run ``workflow``'s steps from its initial state to a final one, in this thread, and
    return the context. Only step states (no waits, no child runs)."""
    ctx = workflow.parse_context(context)
    state, visits = workflow.initial, {workflow.initial: 1}
    while not workflow.is_final(state):
        spec = workflow.steps[state]
        step = Step(
            run_id=run_id,
            workflow=workflow.name,
            state=state,
            attempt=1,
            visit=visits[state],
            seq=0,
            worker="plain",
        )
        returned = spec.fn(ctx, step)
        state = workflow.next_state(state, workflow.event_for(state, returned))
        visits[state] = visits.get(state, 0) + 1
    return ctx
