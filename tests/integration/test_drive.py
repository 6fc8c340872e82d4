"""``Engine.drive(run_id)``: one run (and its children) driven here until it finishes or
waits, other due runs left alone; on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow


class Job(BaseModel):
    n: int = 0
    other: str = ""


def jobs() -> Workflow:
    wf = Workflow("driven_job", context=Job)

    @wf.step(initial=True, next="done")
    def work(ctx: Job) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


def waiting() -> Workflow:
    wf = Workflow("driven_wait", context=Job)
    wf.wait(
        "hold", on={"go": "done"}, timeout=timedelta(seconds=4), on_timeout="late", initial=True
    )
    wf.final("done", "late")
    return wf


def test_drive_runs_that_run_and_leaves_the_others(store_url: str) -> None:
    with Engine(store_url, workflows=[jobs()]) as engine:
        mine, other = (engine.start(engine.workflow("driven_job"), Job()).id for _ in range(2))
        info = engine.drive(mine)
        assert (info.status, info.context.n) == ("succeeded", 1)  # type: ignore[attr-defined]
        assert engine.get(other).status == "scheduled"


def test_drive_returns_at_once_for_a_run_that_waits(store_url: str) -> None:
    """It waited out the wait's timeout (up to 5 minutes) and fired it itself (review):
    `flowloop retry` of a run stopped in a wait state blocked so."""
    import threading

    clock = FakeClock(auto_advance=False)
    with Engine(store_url, workflows=[waiting()], clock=clock) as engine:
        run_id = engine.start(engine.workflow("driven_wait"), Job()).id
        driven: list[Any] = []
        # (In a thread, bounded: a drive that waits would otherwise hang the suite.)
        driver = threading.Thread(target=lambda: driven.append(engine.drive(run_id)))
        driver.start()
        driver.join(30)
        assert not driver.is_alive()
        (info,) = driven
        assert (info.status, info.state) == ("scheduled", "hold")
        clock.advance(5)  # (had drive waited, it would have fired the timeout)
        assert (engine.get(run_id).status, engine.get(run_id).state) == ("scheduled", "hold")


def test_drive_from_a_def_step(store_url: str) -> None:
    """A plain ``def`` step of a run ``engine.run`` drives calls ``engine.drive``: it raised
    "This event loop is already running" (review)."""
    with Engine(store_url) as engine:
        inner = jobs()
        outer = Workflow("driving_outer", context=Job)

        @outer.step(initial=True, next="done")
        def drive_another(ctx: Job) -> None:
            run_id = engine.start(inner, Job()).id
            ctx.other = engine.drive(run_id).status

        outer.final("done")
        engine.register(inner, outer)
        info: Any = engine.run(outer, Job())
        assert (info.status, info.context.other) == ("succeeded", "succeeded")


def test_drive_of_a_run_its_caller_holds_back_is_refused(store_url: str) -> None:
    """A step of a workflow with ``max_concurrency=1`` drives another run of it: the slot
    is its own run's, so that run can never be claimed — ``engine.run`` refuses it
    (HeldBack), ``engine.drive`` polled for ever (review)."""
    from flowloop.errors import HeldBack

    with Engine(store_url) as engine:
        limited = Workflow("driven_limited", context=Job, max_concurrency=1)
        refused: list[str] = []

        @limited.step(initial=True, next="done")
        def work(ctx: Job) -> None:
            if ctx.n == 0:
                queued_id = engine.start(limited, Job(n=1)).id
                try:
                    engine.drive(queued_id)
                except HeldBack as error:
                    refused.append(str(error))

        limited.final("done")
        engine.register(limited)
        assert engine.run(limited, Job()).status == "succeeded"
        assert len(refused) == 1 and "max_concurrency=1 is held by the calling run" in refused[0]
