"""``Engine.run`` driving one run writes each boundary at once (Committer.write_now, no
future); when the database refuses that write for an outage, the boundary is kept and
retried like any other, and the run goes on once the database is back: nothing lost,
nothing run twice.

The outage is real: another process holds ``BEGIN EXCLUSIVE`` on the SQLite file (longer
than the engine's busy timeout, a sixth of its lease) until the engine has said that it
keeps the boundary and retries it."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import faultkit
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop import journal as j

LEASE_S = 6.0
"""A busy timeout of 1 s; the run's lease is fenced off 5 s after it was last set."""


class C(BaseModel):
    n: int = 0


class _ReleaseOnRetry(logging.Handler):
    """Lets the lock go once the engine has logged that it keeps a boundary to retry."""

    def __init__(self, lock: faultkit.SqliteLock) -> None:
        super().__init__(logging.WARNING)
        self.held = lock
        self.kept = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "kept, retrying" in record.getMessage() and not self.kept.is_set():
            self.kept.set()
            threading.Thread(target=self.held.release, daemon=True).start()


def test_engine_run__a_boundary_refused_by_an_outage_is_kept_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    db = tmp_path / "o.db"
    effects: list[str] = []
    handlers: list[_ReleaseOnRetry] = []
    wf = Workflow("outage", context=C)

    @wf.step(initial=True, next="b")
    async def a(ctx: C) -> None:
        effects.append("a")
        ctx.n += 1

    @wf.step(next="c")
    async def b(ctx: C) -> None:
        effects.append("b")
        # The database goes away while this step runs: its outcome cannot be written.
        handler = _ReleaseOnRetry(faultkit.SqliteLock(db, tmp_path / "unlock"))
        logging.getLogger("flowloop").addHandler(handler)
        handlers.append(handler)
        ctx.n += 1

    @wf.step(next="done")
    async def c(ctx: C) -> None:
        effects.append("c")
        ctx.n += 1

    wf.final("done")
    with Engine(f"sqlite:///{db}", lease_seconds=LEASE_S) as engine:
        try:
            info = engine.run(wf, C())
        finally:
            for handler in handlers:
                logging.getLogger("flowloop").removeHandler(handler)
        assert handlers and handlers[0].kept.is_set(), "the boundary was never kept to retry"
        assert info.status == "succeeded" and info.context == C(n=3)
        assert effects == ["a", "b", "c"]  # each step once
        kinds = [(e.kind, e.state) for e in engine.history(info.id)]
        assert kinds.count((j.STEP_SUCCEEDED, "b")) == 1
        assert [k for k in kinds if k[0] == j.STEP_SUCCEEDED] == [
            (j.STEP_SUCCEEDED, "a"),
            (j.STEP_SUCCEEDED, "b"),
            (j.STEP_SUCCEEDED, "c"),
        ]
        assert engine.replay(info.id).matches
