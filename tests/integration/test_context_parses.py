"""How often a run's context is validated: once where it starts, once by the worker's check
of the stored run (which its first step then takes as it is), once per step (the check of
what the step stored — what a resume would load — which the next step takes as its own
copy, and ``engine.run``'s RunInfo after the last). A large context costs its parse once
per step, not twice; the first step and the RunInfo used to parse the same texts again."""

from __future__ import annotations

from typing import ClassVar

import pytest
from pydantic import BaseModel, field_validator

from flowloop import Engine, Workflow


class Counted(BaseModel):
    validated: ClassVar[list[int]] = []
    n: int = 0

    @field_validator("n")
    @classmethod
    def _count(cls, value: int) -> int:
        cls.validated.append(value)
        return value


def chain(steps: int) -> Workflow:
    wf = Workflow(f"parses{steps}", context=Counted)
    for i in range(steps):

        async def step(ctx: Counted) -> None:
            ctx.n += 1

        wf.step(name=f"s{i}", initial=i == 0, next=f"s{i + 1}" if i + 1 < steps else "done")(step)
    wf.final("done")
    return wf


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_a_run_validates_its_context_once_per_step_and_twice_more(
    store_url: str, steps: int
) -> None:
    wf = chain(steps)
    with Engine(store_url, workflows=[wf]) as engine:
        Counted.validated.clear()
        info = engine.run(wf, {"n": 0})
        assert isinstance(info.context, Counted) and info.context.n == steps
        # the start, the check (taken by the first step), each step's stored context (the
        # last one's taken by the RunInfo)
        assert Counted.validated == [0, 0, *range(1, steps + 1)]


def test_a_claimed_run_s_first_step_takes_the_checked_context(store_url: str) -> None:
    """A run started by one engine and executed by another's worker: the same count."""
    wf = chain(2)
    with Engine(store_url, workflows=[wf]) as engine:
        run_id = engine.start(wf, {"n": 5}).id
        Counted.validated.clear()
        engine.run_until_idle()
        assert engine.get(run_id).context.n == 7  # type: ignore[union-attr]
    # the worker's check, then each step's stored context; then the get above
    assert Counted.validated == [5, 6, 7, 7]
