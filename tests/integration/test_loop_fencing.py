"""A loop worker that lost its lease writes nothing for the iteration it held.

The lease is lost for real: while the iteration runs, its lease is ended in the database
(``expire_loop_leases``, as if the worker had been frozen past it). Either the heartbeat
finds it gone and abandons the iteration, or the iteration ends first and its outcome
write is refused by the fence — even though no other worker has taken the loop over yet.
Then recovery (here the fenced worker's own) journals the iteration ``iteration_interrupted``
as a lost lease: never "worker shutting down", never an outcome the worker could not own.
"""

from __future__ import annotations

import asyncio

from loopkit import T0, LoopHarness, SteppedClock, describe, drive, settle, until

from flowloop import Engine
from flowloop.loops import Iteration, Loop
from flowloop.scheduler import RECOVERY_EVERY_SECONDS
from flowloop.store.loops import LoopEvent, LoopStoreMixin

HEARTBEAT_LEASE_S = 1.5
"""A lease whose heartbeat (every lease/3, real time) comes within the test's wait."""


def losses(h: LoopHarness) -> list[tuple[str, str]]:
    """What the scheduler reports as lost leases (the alerts and metrics hook), from its
    start on."""
    lost: list[tuple[str, str]] = []
    h.scheduler.lease_lost.append(lambda name, why: lost.append((name, why)))
    return lost


def settled_as_lease_lost(h: LoopHarness) -> None:
    """The fenced iteration was settled by recovery as a lost lease, and nothing else was
    journaled for it: no outcome, no cancellation."""
    events = h.journal("tick")
    kinds = [e.kind for e in events]
    assert kinds[:3] == ["loop_created", "iteration_started", "iteration_interrupted"], describe(
        events
    )
    interrupted = events[2]
    assert interrupted.slot == events[1].slot
    message = interrupted.error_message or ""
    assert "lost its lease" in message and "self-fenced" in message, message
    assert "died" not in message and "not run twice" in message, message
    assert not any("shutting down" in (e.error_message or "") for e in events)
    assert "iteration_cancelled" not in kinds


def test_loop_lease_lost_mid_iteration__abandoned_without_a_write(store_url: str) -> None:
    """The heartbeat finds the lease gone while the iteration runs: the iteration is
    abandoned and nothing is written for it (it was journaled as cancelled, "worker shutting
    down", when no other worker had settled the loop yet)."""

    async def main() -> None:
        clock = SteppedClock()
        entered = asyncio.Event()

        async def fn(it: Iteration) -> None:
            if it.number == 1:
                entered.set()
                await clock.sleep(3600)  # fenced off while here

        lp = Loop("tick", fn, every=10)
        h = LoopHarness(
            store_url, [lp], clock=clock, worker_id="a", lease_seconds=HEARTBEAT_LEASE_S
        )
        lost = losses(h)
        async with h:
            await until(entered.is_set, what="the first iteration")
            fired = h.row("tick")
            h.store.expire_loop_leases(["a"])
            await until(lambda: lost, what="the heartbeat to find the lease lost")
            await until(lambda: not h.scheduler.running, what="the iteration to be abandoned")
            await settle()
            # One loss, said once; the row and the journal as the fire left them.
            assert lost == [("tick", "lost its lease; abandoning the iteration")]
            row = h.row("tick")
            assert (row.status, row.owner, row.last_seq) == ("running", "a", fired.last_seq)
            assert h.kinds("tick") == ["loop_created", "iteration_started"]
            # The lease is over: recovery settles the iteration, and the loop goes on.
            await drive(clock, RECOVERY_EVERY_SECONDS)
            settled_as_lease_lost(h)
            assert h.row("tick").status in ("scheduled", "running")

    asyncio.run(main())


def test_loop_outcome_after_the_lease_ran_out__refused_by_the_fence(store_url: str) -> None:
    """The iteration ends after its lease ran out, before any heartbeat noticed: its
    outcome write is refused by the database (it was recorded as succeeded, since no other
    worker had moved the loop on)."""

    async def main() -> None:
        clock = SteppedClock()
        holder: list[LoopHarness] = []

        async def fn(it: Iteration) -> None:
            if it.number == 1:  # frozen past the lease in the middle of the iteration
                holder[0].store.expire_loop_leases(["a"])

        lp = Loop("tick", fn, every=10)
        h = LoopHarness(store_url, [lp], clock=clock, worker_id="a")
        holder.append(h)
        lost = losses(h)
        async with h:  # the first slot is due at once
            await until(lambda: lost, what="the outcome write to be refused")
            assert lost == [("tick", "lost its lease; the outcome was not recorded")]
            assert h.kinds("tick") == ["loop_created", "iteration_started"]
            await drive(clock, RECOVERY_EVERY_SECONDS)
            settled_as_lease_lost(h)
            # The next slot is run and recorded as usual (a fresh lease).
            events = h.journal("tick")
            assert [e.kind for e in events][3:5] == ["iteration_started", "iteration_succeeded"]

    asyncio.run(main())


def test_loop_owner_write__needs_an_unexpired_lease(store_url: str) -> None:
    """The store's fence: the owner's write applies only while its lease is unexpired by
    the database's clock, whether or not another worker has taken the loop yet; a
    recovery write then applies."""
    engine = Engine(store_url, clock=SteppedClock())
    try:
        store = engine.store
        assert isinstance(store, LoopStoreMixin)
        row = store.sync_loop(name="l", schedule="every 10s", first_slot=T0, at=T0, worker="a")

        def fire(slot: float, follows: int, lease: float) -> int:
            started = LoopEvent(loop="l", kind="iteration_started", at=slot, slot=slot)
            fired = store.fire_loop(
                name="l",
                follows_seq=follows,
                worker="a",
                lease_seconds=lease,
                events=[started],
                changes={"last_slot": slot, "next_fire_at": None},
            )
            assert fired is not None
            return fired.lease_epoch

        def finish(epoch: int, follows: int, owner: str | None) -> bool:
            done = LoopEvent(loop="l", kind="iteration_succeeded", at=T0, slot=T0)
            return store.write_loop(
                name="l",
                owner=owner,
                epoch=epoch,
                follows_seq=follows,
                changes={"status": "scheduled", "next_fire_at": T0 + 10},
                events=[done],
            )

        epoch = fire(T0, row.last_seq, lease=-1.0)  # a lease already over
        before = store.get_loop("l")
        assert not finish(epoch, row.last_seq + 1, owner="a")
        assert store.get_loop("l") == before
        assert [e.kind for e in store.loop_journal("l")] == ["loop_created", "iteration_started"]
        assert finish(epoch, row.last_seq + 1, owner=None)  # what recovery may write
        live = fire(T0 + 10, row.last_seq + 2, lease=30.0)
        assert finish(live, row.last_seq + 3, owner="a")
    finally:
        engine.close()
