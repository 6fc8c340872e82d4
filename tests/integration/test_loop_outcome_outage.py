"""A database outage during the write of a loop iteration's outcome (another connection
holding the lock it needs: SQLite's write lock, a PostgreSQL row lock) does not lose the
outcome: the worker keeps the loop and writes it again at its next poll. On SQLite and
PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from loopkit import LoopHarness, SteppedClock, drive, settle, until
from test_loop_runaways import Stubborn, run_bounded

from flowloop import loop_calls
from flowloop.loops import Iteration, Loop
from flowloop.store import dialect


@contextlib.contextmanager
def outage(url: str, store: Any) -> Iterator[None]:
    """The loop row's write blocked by another connection until the block ends: the
    store's write gives up after its busy timeout (SQLite, made 0.2 s) or its statement
    timeout (PostgreSQL, 2 s for a 6 s write lease) — an outage to the worker."""
    if url.startswith("sqlite"):
        store.set_write_lease(30.0)  # drops the held write connection (the old timeout)
        dialect.set_busy_timeout(store.engine, 200)
        holder = sqlite3.connect(Path(url.removeprefix("sqlite:///")), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        return
    store.set_write_lease(6.0)  # statement_timeout 2 s
    plain = sa.create_engine(url)
    try:
        with plain.connect() as conn:
            tx = conn.begin()
            conn.execute(sa.text("SELECT name FROM flowloop_loops WHERE name = 's' FOR UPDATE"))
            try:
                yield
            finally:
                tx.rollback()
    finally:
        plain.dispose()


def test_an_outage_during_the_outcome_write__written_at_the_next_poll(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the failed write was logged and forgotten: the loop's lease was no longer
    renewed, and once it ran out recovery journaled the iteration — which had succeeded —
    ``iteration_interrupted`` (the loop running, fired by nobody, until then). Now the
    outcome is kept (the lease renewed meanwhile) and written at the next poll."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    release = asyncio.Event()

    async def fn(it: Iteration) -> None:
        if it.number == 1:
            await release.wait()

    def failed() -> bool:
        return any("could not record the iteration" in r.getMessage() for r in caplog.records)

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [Loop("s", fn, every=10)], clock=clock) as h:
            await drive(clock, 1)
            assert h.row("s").status == "running"
            with outage(store_url, h.store):
                release.set()
                await until(failed, what="the outcome's write to fail")
                await settle()
            assert h.row("s").status == "running"  # (not written yet)
            await drive(clock, 2)  # the next poll
            await until(lambda: h.row("s").status == "scheduled", what="the outcome written")
            kinds = h.kinds("s")
            assert "iteration_succeeded" in kinds, kinds
            assert "iteration_interrupted" not in kinds, kinds
            assert h.row("s").owner is None

    run_bounded(main)


def test_an_outage_during_the_held_note__bounded_and_still_alerted(
    store_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The note of a held loop is written on the event loop, as every database call of the
    scheduler is: during an outage it gives up within the store's timeouts (the busy
    timeout, the statement timeout), says so, and the critical alert is raised all the
    same; the loop ends as usual once its function does."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    monkeypatch.setattr(loop_calls, "CUT_OFF_GRACE_SECONDS", 0.05)
    fn = Stubborn()

    def not_noted() -> bool:
        return any("could not note that it is held" in r.getMessage() for r in caplog.records)

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            store_url, [Loop("s", fn, every=10, timeout=0.05)], clock=clock
        ) as h:
            with outage(store_url, h.store):
                await until(lambda: fn.inside, what="the iteration to start")
                await until(not_noted, what="the note's write to give up")
            assert [(a.level, a.what, a.subject) for a in h.alerts] == [
                ("critical", "loop held", "s")
            ]
            assert h.row("s").status == "running"
            fn.release.set()
            await drive(clock, 2)
            await until(lambda: h.row("s").status == "scheduled", what="the outcome")
            assert "iteration_failed" in h.kinds("s"), h.kinds("s")

    run_bounded(main)
