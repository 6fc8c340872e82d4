"""A loop worker frozen (SIGSTOP) past its loop lease, as a real process: once resumed, it
writes nothing for the iteration it held — no outcome, no "worker shutting down" — even
though no other worker has taken the loop over; its own recovery then journals the
iteration ``iteration_interrupted`` as a lost lease, and the loop goes on.

Waits are bounded polls of the database, the worker's log or files the loop writes.
"""

from __future__ import annotations

import signal
from functools import partial
from pathlib import Path

import pytest
from loopkit import describe, wait_for
from loopkit_proc import WorkerProcess, engine, report, wait_exists, workers, write_module

from flowloop.store.loops import LoopEvent
from flowloop.store.sql import SQLStore

pytestmark = pytest.mark.crash

SLOW = """
    import time
    from pathlib import Path

    from flowloop.loops import loop


    @loop(every=60)
    def slow(it):
        if it.number == 1:
            Path("slow-entered").touch()
            while not Path("slow-release").exists():  # frozen in here
                time.sleep(0.01)
"""


def journal(db: Path) -> list[LoopEvent]:
    with engine(db) as e:
        return e.loop_history("slow")


def lease_over(db: Path) -> bool:
    """The loop's lease has run out by the database's clock (what the fence judges by)."""
    with engine(db) as e:
        row = e.loop("slow")
        store = e.store
        assert isinstance(store, SQLStore)
        return row.lease_expires_at is not None and store.db_now() > row.lease_expires_at


def test_frozen_loop_worker_writes_nothing_for_the_iteration(tmp_path: Path) -> None:
    db = tmp_path / "loops.db"
    module = write_module(tmp_path / "slow.py", SLOW)
    with workers() as started:
        a = WorkerProcess([module], db, "--lease", "1s", log=tmp_path / "a.log")
        started.append(a)
        logs = partial(report, started)
        wait_exists(tmp_path / "slow-entered")
        a.signal(signal.SIGSTOP)
        wait_for(partial(lease_over, db), what="the lease to run out", describe=logs)
        (tmp_path / "slow-release").touch()  # the iteration ends as soon as a runs again
        a.signal(signal.SIGCONT)
        wait_for(
            lambda: "lost its lease" in a.text() or len(journal(db)) > 2,
            what="a to find its lease lost (or to write)",
            describe=logs,
        )
        assert [e.kind for e in journal(db)][2:] in ([], ["iteration_interrupted"]), describe(
            journal(db)
        )
        wait_for(
            lambda: "iteration_interrupted" in [e.kind for e in journal(db)],
            what="the iteration to be recovered",
            timeout=30,
            describe=logs,
        )
        assert a.stop() == 0, a.text()
    events = journal(db)
    kinds = [e.kind for e in events]
    assert kinds[:3] == ["loop_created", "iteration_started", "iteration_interrupted"], describe(
        events
    )
    message = events[2].error_message or ""
    assert "lost its lease" in message and "self-fenced" in message, describe(events)
    assert not any("shutting down" in (e.error_message or "") for e in events), describe(events)
    assert events[2].slot == events[1].slot
    # Nothing else was journaled for that slot: the loop went on with the next one.
    slot = events[1].slot
    assert [e.kind for e in events if e.slot == slot and e.kind.startswith("iteration_")] == [
        "iteration_started",
        "iteration_interrupted",
    ], describe(events)
