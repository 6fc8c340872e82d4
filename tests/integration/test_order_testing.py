"""workflows/order.py tested through flowloop.testing, as a user would test it: the 2-day
approval timeout in milliseconds, approval in time, a crash at every journal point (with and
without the approval), a retry backoff of minutes skipped.

The expected paths are read from the definition and from an uninterrupted run rather than
spelled out state by state, so the tests hold while the example grows (compensation, …).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from kitflows import instants

from flowloop import Retry, Workflow
from flowloop import journal as j
from flowloop.lifecycle import FINISHED
from flowloop.loader import load_paths
from flowloop.testing import (
    TestEngine,
    assert_crash_safe,
    attempts,
    describe,
)

ORDER_FILE = Path(__file__).resolve().parents[2] / "workflows" / "order.py"
SMALL = {"order_id": "A1", "items": [{"sku": "book", "qty": 2}]}
"""25.00: no approval needed; the flaky payment provider makes charge retry once."""
LARGE = {"order_id": "A2", "items": [{"sku": "lamp", "qty": 20}]}
"""780.00: above the approval threshold, so it waits for a person (2 days at most)."""


@pytest.fixture(scope="module")
def workflows() -> dict[str, Workflow]:
    return dict(load_paths([ORDER_FILE]).workflows)


@pytest.fixture
def order(workflows: dict[str, Workflow]) -> Workflow:
    return workflows["order"]


@pytest.fixture
def engine(flowloop_engine: TestEngine, workflows: dict[str, Workflow]) -> Iterator[TestEngine]:
    flowloop_engine.register(*workflows.values())
    yield flowloop_engine


def test_order__two_day_approval_timeout_in_milliseconds(
    engine: TestEngine, order: Workflow
) -> None:
    wait = order.waits["awaiting_approval"]
    assert wait.timeout == 2 * 86_400.0
    start = engine.clock.now()
    run = engine.start(order, LARGE)
    engine.run_until_idle()
    info = engine.get(run.id)
    states = engine.path(run)
    assert info.status in FINISHED
    assert states[states.index("awaiting_approval") + 1] == wait.on_timeout
    timeout = next(e for e in engine.history(run.id) if e.kind == j.EVENT_RECEIVED)
    assert (timeout.event, timeout.at) == ("timeout", start + wait.timeout)
    # Two days skipped, not waited: the fake clock jumped from the wait's entry straight to
    # its timeout, and the run wrote nothing in between. (Wall time: bench/testing_kit.py.)
    assert engine.clock.now() == start + wait.timeout
    assert instants(engine, run.id, start)[:2] == [0.0, wait.timeout]


def test_order__approved_within_the_timeout_is_charged_and_shipped(
    engine: TestEngine, order: Workflow
) -> None:
    run = engine.start(order, LARGE)
    engine.advance(timedelta(days=1, hours=23))
    assert engine.get(run.id).state == "awaiting_approval"
    engine.send(run.id, "approve", {"by": "ann"})
    engine.run_until_idle()
    info = engine.get(run.id)
    assert info.status == "succeeded"
    assert info.context.approved_by == "ann"  # type: ignore[union-attr]
    states = engine.path(run)
    assert states[states.index("awaiting_approval") + 1] == "charge"


def test_order__retry_backoff_of_minutes_skipped(engine: TestEngine, order: Workflow) -> None:
    five_minutes = Retry(attempts=5, backoff="fixed", base=300, cap=300, on=(ConnectionError,))
    with engine.override(order, "charge", retry=five_minutes):
        start = engine.clock.now()
        run = engine.start(order, SMALL)
        engine.run_until_idle()
    first, second = attempts(engine, run, "charge")
    assert (first.outcome, first.error_type) == (j.STEP_FAILED, "ConnectionError")
    assert second.outcome == j.STEP_SUCCEEDED
    assert second.started_at - first.ended_at == 300.0  # type: ignore[operator]
    assert engine.get(run.id).status == "succeeded"
    # The five minutes were one jump of the fake clock to the retry's due time.
    assert engine.clock.now() == start + 300.0
    assert instants(engine, run.id, start) == [0.0, 300.0]


def test_order__crash_at_every_journal_point(
    order: Workflow, workflows: dict[str, Workflow], tmp_path: Path
) -> None:
    others = [wf for name, wf in workflows.items() if name != "order"]
    sweep = assert_crash_safe(order, SMALL, workflows=others, directory=tmp_path)
    print(describe(sweep))
    assert sweep.baseline.status == "succeeded"
    assert len(sweep.commits) >= 5  # created, reserve, charge twice, ship
    assert len(sweep.outcomes) == 2 * len(sweep.commits)
    # ship is not idempotent: a crash between its start and its outcome fails the run as
    # interrupted, and only an operator's retry (which the sweep makes) finishes it.
    if any(not spec.idempotent for spec in order.steps.values()):
        assert any(outcome.operator_retried for outcome in sweep.outcomes)


def test_order__crash_at_every_journal_point_with_an_approval(
    order: Workflow, workflows: dict[str, Workflow], tmp_path: Path
) -> None:
    def approve(engine: TestEngine, run_id: str) -> None:
        engine.send(run_id, "approve", {"by": "ann"}, dedupe_key="approval-1")

    others = [wf for name, wf in workflows.items() if name != "order"]
    sweep = assert_crash_safe(order, LARGE, actions=[approve], workflows=others, directory=tmp_path)
    assert sweep.baseline.context["approved_by"] == "ann"
    assert any(c.call == "deliver" for c in sweep.commits)  # the approval is a crash point too
