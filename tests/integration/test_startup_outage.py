"""A worker or ``resume`` that starts while the database refuses writes waits for it like
the main loop does (issue 20, item 4) — the first recovery used to run outside the outage
handling and end the process with "database is locked"."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import faultkit
import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow

LEASE_S = 1.2
"""SQLite's busy timeout is a sixth of the lease (0.2 s): a longer lock is an outage."""
LOCKED_S = 1.5
FINISH_BOUND_S = 30.0


class Ctx(BaseModel):
    n: int = 0


def flow() -> Workflow:
    wf = Workflow("startup", context=Ctx)

    @wf.step(initial=True, next="done")
    def work(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


def test_resume_started_on_a_locked_database_waits_and_finishes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "flowloop.db"
    wf = flow()
    caplog.set_level(logging.WARNING, logger="flowloop")
    with Engine(f"sqlite:///{db}", workflows=[wf], lease_seconds=LEASE_S) as engine:
        run_id = engine.start(wf, Ctx()).id
        lock = faultkit.SqliteLock(db, tmp_path / "unlock")
        errors: list[BaseException] = []
        done = threading.Event()

        def resume() -> None:
            try:
                engine.resume()
            except BaseException as error:
                errors.append(error)
            done.set()

        thread = threading.Thread(target=resume)
        thread.start()
        try:
            # The lock outlasts the busy timeout (the time is the fault itself).
            assert not done.wait(LOCKED_S), errors
        finally:
            lock.release()
        assert done.wait(FINISH_BOUND_S), "resume did not finish after the lock ended"
        thread.join(10)
        assert errors == []
        assert engine.get(run_id).status == "succeeded"
    assert "claims: database locked" in caplog.text  # (a lock, said as one)


def test_an_in_memory_database_survives_the_lease_setting() -> None:
    """Setting the lease bounds the busy timeout by emptying the pool of file databases;
    an in-memory one is its single connection and must keep its schema."""
    wf = flow()
    with Engine("sqlite://", workflows=[wf], lease_seconds=LEASE_S) as engine:
        assert engine.run(wf, Ctx()).status == "succeeded"
