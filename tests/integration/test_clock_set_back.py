"""A wall clock set back does not stall runs (issue 20, item 11): a retry due in 3 s and a
durable sleep of 3 s still end after about 3 s when the wall clock jumps an hour back right
after they were scheduled (FakeClock: only the wall clock moves). Loops already capped
their waits; runs now keep their due times on the process's monotonic clock too."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel

from flowloop import Engine, Retry, Step, Workflow
from flowloop.clock import FakeClock
from flowloop.executor import Listener
from flowloop.journal import JournalEvent, RunRecord

BACK_S = 3600.0
BOUND_S = 60.0
"""Monotonic seconds the run may take at most: the 3 s delay, not the hour."""


class Ctx(BaseModel):
    tries: int = 0


def set_back_after(clock: FakeClock, kind: str) -> Listener:
    """A listener that steps the wall clock back once, right after a ``kind`` boundary
    with a due time was committed (as NTP might while the run waits)."""
    done: list[bool] = []

    def listener(record: RunRecord, events: Sequence[JournalEvent]) -> None:
        if not done and record.next_run_at and any(e.kind == kind for e in events):
            done.append(True)
            clock.jump_wall(-BACK_S)

    return listener


def test_a_retry_comes_after_its_delay_although_the_wall_clock_went_back(
    sqlite_url: str,
) -> None:
    clock = FakeClock()
    calls: list[float] = []
    wf = Workflow("setback", context=Ctx)

    @wf.step(initial=True, next="done", retry=Retry(attempts=2, backoff="fixed", base=3))
    def flaky(ctx: Ctx) -> None:
        calls.append(clock.monotonic())
        if len(calls) == 1:
            raise RuntimeError("first attempt fails")

    wf.final("done")
    with Engine(sqlite_url, workflows=[wf], clock=clock) as engine:
        engine.listeners.append(set_back_after(clock, "step_failed"))
        info = engine.run(wf, Ctx())
        assert info.status == "succeeded", info
        assert len(calls) == 2
        assert 3.0 <= calls[1] - calls[0] < BOUND_S


def test_a_durable_sleep_ends_on_time_although_the_wall_clock_went_back(
    sqlite_url: str,
) -> None:
    clock = FakeClock()
    wf = Workflow("setback_sleep", context=Ctx)

    @wf.step(initial=True, next="after")
    def nap(ctx: Ctx, step: Step) -> object:
        return step.sleep(3)  # then "after", 3 s later

    @wf.step(next="done")
    def after(ctx: Ctx) -> None:
        ctx.tries += 1

    wf.final("done")
    with Engine(sqlite_url, workflows=[wf], clock=clock) as engine:
        engine.listeners.append(set_back_after(clock, "step_succeeded"))
        run_id = engine.start(wf, Ctx()).id
        started = clock.monotonic()
        engine.run_until_idle()
        assert engine.get(run_id).status == "succeeded"
        assert 3.0 <= clock.monotonic() - started < BOUND_S
