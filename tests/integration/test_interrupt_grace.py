"""A first signal to a foreground drive (`flowloop resume`, the children `flowloop run`
drives) lets the steps in flight finish however long they take: the second signal is
what cuts them off. Before, the drive's until-idle call drained within the executor's
default grace period (30 s), and a longer non-idempotent step was cut off on one signal
(journaled ``step_interrupted``, its run failed) though the message said it had
finished. The default is made 0.2 s here: a drive that still used it would cut the
step off at once."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.executor import Executor
from flowloop.interrupt import Interrupted, resume_interruptibly, run_interruptibly

WAIT_S = 30.0
CUT_OFF_WATCH_S = 1.5
"""How long the test watches for a cut-off that must not come (five times the grace
period it would have come within)."""


class Ctx(BaseModel):
    shipped: bool = False


def _shipping(started: threading.Event, gate: threading.Event) -> Workflow:
    parcel = Workflow("parcel", context=Ctx)

    @parcel.step(initial=True, next="done", idempotent=False)
    def ship(ctx: Ctx) -> None:
        started.set()
        assert gate.wait(WAIT_S)
        ctx.shipped = True

    parcel.final("done")
    return parcel


def _signal_then_open(
    engine: Engine,
    started: threading.Event,
    gate: threading.Event,
    notices: list[str],
    cut_off: list[bool],
) -> threading.Thread:
    """A thread that sends SIGINT once the step has started, watches (bounded) for the
    cut-off that must not come, notes whether it came, then lets the step finish."""

    def act() -> None:
        assert started.wait(WAIT_S)
        os.kill(os.getpid(), signal.SIGINT)
        poll(lambda: notices, timeout=WAIT_S, what="the notice", every=0.01)
        try:
            poll(
                lambda: any(
                    event.kind == "step_interrupted"
                    for run in engine.runs()
                    for event in engine.history(run.id)
                ),
                timeout=CUT_OFF_WATCH_S,
                what="a cut-off",
                every=0.05,
            )
            cut_off.append(True)
        except AssertionError:
            cut_off.append(False)
        gate.set()

    thread = threading.Thread(target=act)
    thread.start()
    return thread


@pytest.fixture(autouse=True)
def short_default_grace(monkeypatch: pytest.MonkeyPatch) -> None:
    """The executor's default grace period made 0.2 s: a drive that used it cuts off."""
    defaults = {**(Executor.run.__kwdefaults__ or {}), "grace": 0.2}
    monkeypatch.setattr(Executor.run, "__kwdefaults__", defaults)


@pytest.mark.usefixtures("python_sigint")
def test_run__a_childs_step_longer_than_the_grace_period_finishes_after_one_signal(
    sqlite_url: str,
) -> None:
    """`flowloop run` of a parent whose call state's child is in its step."""
    started, gate = threading.Event(), threading.Event()
    child = _shipping(started, gate)
    parent = Workflow("order", context=Ctx)
    parent.call(
        "shipping", child=child, context=lambda ctx: Ctx(), on={"succeeded": "done"}, initial=True
    )
    parent.final("done")
    notices: list[str] = []
    cut_off: list[bool] = []
    with Engine(sqlite_url, workflows=[parent, child]) as engine:
        helper = _signal_then_open(engine, started, gate, notices, cut_off)
        outcome = run_interruptibly(engine, parent, Ctx(), notice=notices.append)
        helper.join(WAIT_S)
        (kid,) = engine.runs(workflow="parcel")
    assert cut_off == [False]
    assert isinstance(outcome, Interrupted) and outcome.signals == 1
    assert (kid.status, kid.context.shipped) == ("succeeded", True)  # type: ignore[attr-defined]


@pytest.mark.usefixtures("python_sigint")
def test_resume__a_step_longer_than_the_grace_period_finishes_after_one_signal(
    sqlite_url: str,
) -> None:
    started, gate = threading.Event(), threading.Event()
    parcel = _shipping(started, gate)
    notices: list[str] = []
    cut_off: list[bool] = []
    with Engine(sqlite_url, workflows=[parcel]) as engine:
        run_id = engine.start(parcel, Ctx()).id
        helper = _signal_then_open(engine, started, gate, notices, cut_off)
        stats, signals = resume_interruptibly(engine, notice=notices.append)
        helper.join(WAIT_S)
        info = engine.get(run_id)
        kinds = [event.kind for event in engine.history(run_id)]
    assert cut_off == [False], kinds
    assert signals == [signal.SIGINT] and stats.steps == 1
    assert notices[0].startswith("interrupt: letting the step in flight finish")
    assert (info.status, info.state, info.context.shipped) == ("succeeded", "done", True)  # type: ignore[attr-defined]
    assert "step_interrupted" not in kinds
