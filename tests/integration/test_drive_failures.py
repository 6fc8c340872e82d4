"""A drive that ends with an error nothing handles — a write the database refuses for no
outage (outages are waited out), or a defect — on SQLite and PostgreSQL: the error was
only "never retrieved" by asyncio, and ``run_until_idle`` waited out the run's lease, then
the next drive's failure, for ever. Now it is logged with its traceback and raised by the
idle call; the run is taken again once the cause is gone."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow

BOUND_S = 60.0  # (a hang is the failure: the call returns in well under a second)
LEASE_S = 1.0  # (the runs a failed drive leaves are taken again once it runs out)


class Count(BaseModel):
    n: int = 0


def counting() -> Workflow:
    wf = Workflow("drive_failures", context=Count)

    @wf.step(initial=True, next="second")
    async def first(ctx: Count) -> None:
        ctx.n += 1

    @wf.step(next="done")
    async def second(ctx: Count) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


class Refusing:
    """``store.write`` refusing every batch with an error that is no outage, while on."""

    def __init__(self, engine: Engine) -> None:
        self.real = engine.store.write
        self.on = True
        engine.store.write = self  # type: ignore[method-assign]

    def __call__(self, boundaries: Any) -> Any:
        if self.on:
            raise TypeError("a value the driver cannot bind")
        return self.real(boundaries)


def within_bound(call: Any) -> Any:
    """``call()``'s result or error, from a thread; fails if it has not returned."""
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(("returned", call()))
        except Exception as error:
            outcome.append(("raised", error))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), "the call hung"
    return outcome[0]


def test_run_until_idle_raises_a_drives_unhandled_error(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    wf = counting()
    with Engine(store_url, workflows=[wf], clock=FakeClock(), lease_seconds=LEASE_S) as engine:
        ids = [engine.start(wf, Count()).id for _ in range(3)]
        refusing = Refusing(engine)
        with caplog.at_level(logging.ERROR, logger="flowloop"):
            how, error = within_bound(engine.run_until_idle)
        assert (how, type(error), str(error)) == (
            "raised",
            TypeError,
            "a value the driver cannot bind",
        )
        failed = [r for r in caplog.records if "its drive failed" in r.getMessage()]
        assert failed and failed[0].exc_info is not None
        # The cause gone, the runs are taken again once their leases ran out.
        refusing.on = False
        how, _ = within_bound(engine.run_until_idle)
        assert how == "returned"
        assert {engine.get(run_id).status for run_id in ids} == {"succeeded"}


def test_an_error_engine_run_raised_is_not_raised_again_later(store_url: str) -> None:
    wf = counting()
    with Engine(store_url, workflows=[wf], clock=FakeClock(), lease_seconds=LEASE_S) as engine:
        refusing = Refusing(engine)
        with pytest.raises(TypeError):
            engine.run(wf, Count())
        refusing.on = False
        # (Not that error again: its run is still leased, and the call finds nothing due.)
        assert within_bound(engine.run_until_idle)[0] == "returned"


def test_the_other_runs_steps_in_flight_finish_before_it_is_raised(store_url: str) -> None:
    """Raised at once, the call cut off the steps of the other runs in flight: journaled
    interrupted, and called again (a non-idempotent step's effect twice)."""
    wf = Workflow("drive_failures_slow", context=Count)

    @wf.step(initial=True, next="done")
    async def work(ctx: Count) -> None:
        if ctx.n:  # the slow run: still in its step when the other's write is refused
            await asyncio.sleep(0.3)

    wf.final("done")
    with Engine(store_url, workflows=[wf], clock=FakeClock(), lease_seconds=LEASE_S) as engine:
        slow = engine.start(wf, Count(n=1)).id
        bad = engine.start(wf, Count()).id
        real = engine.store.write

        def refusing(boundaries: Any) -> Any:
            if any(b.run_id == bad and b.release for b in boundaries):
                raise TypeError("a value the driver cannot bind")
            return real(boundaries)

        engine.store.write = refusing  # type: ignore[method-assign]
        how, error = within_bound(engine.run_until_idle)
        assert (how, str(error)) == ("raised", "a value the driver cannot bind")
        kinds = [e.kind for e in engine.history(slow)]
    assert "step_interrupted" not in kinds
    assert kinds.count("step_succeeded") == 1, kinds
