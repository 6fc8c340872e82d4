"""A boundary write in flight when the run is fenced off (flowloop/leasethread.py): the
write may still land — the database lease had not ended — but nothing may follow it. Found
by review: the executor checked the fence only before the write, so the next step started
after the self-fencing line, and recovery then ran it a second time."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop import journal as j
from flowloop.store import Boundary

LEASE_S = 3.0
FENCE_WAIT_S = 30.0
"""Bound on waiting for the fence thread (it fences at 5/6 of the lease)."""


class Ctx(BaseModel):
    n: int = 0


def _flow(ran: list[str]) -> Workflow:
    wf = Workflow("fence_gap", context=Ctx)

    @wf.step(initial=True, next="b")
    def a(ctx: Ctx) -> None:
        ctx.n += 1

    @wf.step(next="done")
    def b(ctx: Ctx) -> None:
        ran.append("b")

    wf.final("done")
    return wf


def test_a_write_that_lands_after_the_fence_starts_no_further_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[str] = []
    wf = _flow(ran)
    with Engine(f"sqlite:///{tmp_path / 'gap.db'}", workflows=[wf], lease_seconds=LEASE_S) as e:
        store = e.store
        real_write = store.write
        held: list[bool] = []

        def renewals_fail(**_: Any) -> set[str]:
            raise ConnectionError("renewals fail (the network drops them)")

        def write_once_fenced(boundaries: Sequence[Boundary]) -> list[bool]:
            # a's outcome with b's step_started: sent only once the fence thread has fenced
            # the run, while the database still holds its lease (3 s; fenced at 2.5 s).
            if not held and any(ev.kind == j.STEP_SUCCEEDED for b in boundaries for ev in b.events):
                executor = e._executor()  # (on the thread of the call that drives the run)
                run_id = boundaries[0].run_id
                until = time.monotonic() + FENCE_WAIT_S
                while not executor.leases.fenced(run_id) and time.monotonic() < until:
                    time.sleep(0.01)
                held.append(executor.leases.fenced(run_id))
            return real_write(boundaries)

        monkeypatch.setattr(store, "renew", renewals_fail)
        monkeypatch.setattr(store, "write", write_once_fenced)
        info = e.run(wf, Ctx())
        kinds = [event.kind for event in e.history(info.id)]

    assert held == [True], "the write was not held until the fence"
    # The write landed (b's start is journaled) but b was never called.
    assert kinds.count(j.STEP_STARTED) == 2, kinds
    assert ran == []
