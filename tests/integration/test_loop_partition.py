"""A worker cut off from the database (its writes refused) while another is not — a
partition — gives its loop iteration up by its own clock before its lease ends in the
database: the other worker, recovering the loop, never runs it beside that iteration.

PostgreSQL only: the partition is one worker's session made read-only, while the other
worker writes on. On SQLite every process shares one file and one write lock — no worker
is cut off while another writes — so a lock stops all of them (tests of that outage are
in test_loop_outcome_outage.py)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from loopkit import LoopHarness, SteppedClock, drive, until
from test_loop_runaways import run_bounded

from flowloop.loops import Iteration, Loop

LEASE_S = 3.0
"""The workers' loop lease (real seconds: the database counts it). Its margin (1 s: the fence
comes 1 s before the lease can end) must outlast the event loop's stalls under a loaded
machine: both workers share it, and w2's start blocks it (1.5 s, a 0.5 s margin, failed so)."""


def test_a_partitioned_worker_gives_its_iteration_up_before_another_runs_the_loop(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a worker whose lease renewals failed went on with its iteration for as long
    as the partition lasted: once its lease had ended in the database, the other worker
    recovered the loop and fired it, two calls of the loop running at once. Now the cut-off
    worker abandons its iteration (not recorded) before its lease ends."""
    caplog.set_level(logging.INFO, logger="flowloop.loops")
    live: list[str] = []
    calls: list[str] = []
    most = [0]
    abandoned: list[str] = []

    def function(worker: str):  # type: ignore[no-untyped-def]
        async def fn(it: Iteration) -> None:
            calls.append(f"{worker}:{it.number}")
            live.append(worker)
            most[0] = max(most[0], len(live))
            try:
                if worker == "w1":
                    await asyncio.Event().wait()  # until cut off
            except asyncio.CancelledError:
                abandoned.append(worker)
                raise
            finally:
                live.remove(worker)

        return fn

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(
            pg_url, [Loop("s", function("w1"), every=10)], clock=clock, lease_seconds=LEASE_S
        ) as h1:
            await drive(clock, 1)
            await until(lambda: calls == ["w1:1"], what="w1's iteration")
            store = h1.store
            with store._held() as conn, conn.begin():  # type: ignore[attr-defined]
                conn.exec_driver_sql("SET SESSION default_transaction_read_only = on")
            async with LoopHarness(
                pg_url,
                [Loop("s", function("w2"), every=10)],
                clock=clock,
                worker_id="w2",
                lease_seconds=LEASE_S,
            ) as h2:
                interrupted = h2.store.interrupted_loops
                await until(
                    lambda: [row.name for row in interrupted()] == ["s"],
                    what="w1's lease to end in the database",
                )
                await drive(clock, 12)  # w2's recovery sweep, then the loop's next slot
                await until(lambda: len(calls) >= 2, what="w2's iteration")
                assert most[0] == 1, f"two calls of the loop at once: {calls}"
                assert abandoned == ["w1"], abandoned
                assert "iteration_interrupted" in h2.kinds("s"), h2.kinds("s")
            with store._held() as conn, conn.begin():  # type: ignore[attr-defined]
                conn.exec_driver_sql("SET SESSION default_transaction_read_only = off")

    run_bounded(main)
