"""A convergence loop: Newton's method for a square root, one iteration per step.

``improve`` loops back to itself until the estimate is good enough. Two guards end it
otherwise: ``max_visits`` caps the iterations (a run can never spin forever), and a
*patience* counter in the context ends the run in ``stalled`` when the error has not
improved for ``patience`` iterations in a row (floating point has a floor: asking for
``tolerance=0`` stalls instead of looping until ``max_visits``).

Every iteration is one journaled step, so ``flowloop history RUN`` shows the estimate
converging, and ``flowloop replay RUN --at SEQ`` shows the context at any iteration.

Run it (every field has a default, so ``--context '{}'`` finds the square root of 2):

    flowloop run workflows/converge.py --context '{}'
    flowloop run workflows/converge.py --context '{"target": 10, "estimate": 3}'
    flowloop run workflows/converge.py --context '{"tolerance": 0, "patience": 2}'   # stalls
"""

from __future__ import annotations

from typing import Final

from pydantic import BaseModel, Field

from flowloop import Workflow

MAX_ITERATIONS: Final = 100
"""``max_visits`` of the looping state: Newton needs a handful; this is the safety net."""


class Convergence(BaseModel):
    target: float = Field(2.0, ge=0)
    """Find the square root of this."""
    estimate: float = Field(1.0, gt=0)
    """The starting guess, then the current estimate."""
    tolerance: float = Field(1e-12, ge=0)
    """Converged when ``|estimate² - target| <= tolerance``."""
    patience: int = Field(3, ge=1)
    """Give up after this many iterations in a row without a smaller error."""
    best_error: float | None = None
    stale: int = 0
    """Iterations in a row without improvement (the patience counter)."""
    iterations: int = 0
    errors: list[float] = []


def error(ctx: Convergence) -> float:
    return abs(ctx.estimate * ctx.estimate - ctx.target)


converge = Workflow(
    "converge", context=Convergence, description="Newton's method with a patience counter"
)


@converge.step(initial=True, next="improve")
def start(ctx: Convergence) -> None:
    ctx.best_error = error(ctx)
    ctx.errors = [ctx.best_error]


@converge.step(
    on={"again": "improve", "converged": "converged", "stalled": "stalled"},
    max_visits=MAX_ITERATIONS,
)
def improve(ctx: Convergence) -> str:
    ctx.estimate = (ctx.estimate + ctx.target / ctx.estimate) / 2
    ctx.iterations += 1
    current = error(ctx)
    ctx.errors.append(current)
    if current <= ctx.tolerance:
        return "converged"
    if ctx.best_error is None or current < ctx.best_error:
        ctx.best_error, ctx.stale = current, 0
        return "again"
    ctx.stale += 1
    return "stalled" if ctx.stale >= ctx.patience else "again"


converge.final("converged", "stalled")
