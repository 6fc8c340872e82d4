"""`flowloop worker` as a real process, with an ``async def`` loop function that swallows
every cancellation and no ``timeout=``: SIGTERM still ends the worker on time."""

from __future__ import annotations

from pathlib import Path

import pytest
from loopkit_proc import WorkerProcess, engine, wait_exists, workers, write_module

pytestmark = pytest.mark.crash

SWALLOWER = """
    import asyncio
    from pathlib import Path

    from flowloop.loops import loop


    @loop(every=60)
    async def swallower(it):
        Path("swallower-started").touch()
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                Path("swallower-cancelled").touch()  # and on
"""


def test_worker__sigterm_with_a_function_swallowing_cancellation_and_no_timeout__exits(
    tmp_path: Path,
) -> None:
    """Before, the drain cancelled the iteration, whose task was the function's own: it went
    on, and asyncio.run waited for it for ever (the worker never exited). Now the function is
    cut off after its grace, the iteration journaled cancelled, the function left behind
    (said), and the worker exits 0."""
    db = tmp_path / "loops.db"
    module = write_module(tmp_path / "swallower.py", SWALLOWER)
    with workers() as running:
        worker = WorkerProcess([module], db, "--grace", "0.3", log=tmp_path / "w.log")
        running.append(worker)
        wait_exists(tmp_path / "swallower-started")
        assert worker.stop() == 0, worker.text()
        assert (tmp_path / "swallower-cancelled").exists()
        assert "its function still runs as the worker stops; left behind" in worker.text()
    with engine(db) as e:
        kinds = [event.kind for event in e.loop_history("swallower")]
        row = e.loop("swallower")
    assert kinds == ["loop_created", "iteration_started", "iteration_cancelled"], kinds
    assert (row.status, row.owner, row.last_result) == ("scheduled", None, "cancelled")
