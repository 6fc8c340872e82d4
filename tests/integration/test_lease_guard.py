"""Leases kept by the worker's own clock, whatever the event loop is doing (issue 20, item
13; flowloop/leasethread.py): the renewals and the fence watch run in threads of their
own, so a database call holding the loop — the committer's flush on a silent network —
delays neither the renewal nor the self-fencing at the deadline."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import sqlalchemy as sa
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.leasethread import FENCED, LeaseGuard, Renewal, renewer
from flowloop.store.sql import SQLStore

LEASE_S = 1.2
SLACK_S = 1.0
"""Beyond the deadline, for a loaded 2-core machine to wake the fence thread."""


def test_a_blocked_loop_does_not_delay_the_fence() -> None:
    """The loop is held (as by a database call that does not return) while renewals fail:
    the run is fenced off at its deadline — logged then, from the fence thread — and the
    loop, once free, learns it before anything else it had to do."""
    fenced = threading.Event()
    order: list[str] = []
    lines: list[str] = []

    class Fenced(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())
            if getattr(record, "self_fenced", False):
                fenced.set()

    def renew(_run_ids: Sequence[str]) -> set[str]:
        raise ConnectionError("the network drops every packet")

    def no_controls() -> Mapping[str, str]:
        return {}

    handler = Fenced()
    logging.getLogger("flowloop").addHandler(handler)

    async def main() -> tuple[float, float, bool]:
        guard = LeaseGuard(
            lease_seconds=LEASE_S,
            poll_seconds=0.1,
            renew=renew,
            poll=no_controls,
            lost=lambda run_id, why: order.append(f"lost {run_id}: {why}"),
            controls=lambda _requests: None,
        )
        guard.start(asyncio.get_running_loop())
        try:
            claimed = time.monotonic()
            guard.hold("r1", claimed)
            asyncio.get_running_loop().call_soon(lambda: order.append("queued before"))
            # The loop is blocked from here on, as by a call that hangs (no await).
            seen = fenced.wait(timeout=LEASE_S + SLACK_S + 30)
            at = time.monotonic()
            was_fenced = guard.fenced("r1")
            await asyncio.sleep(0)  # the loop runs again
            await asyncio.sleep(0)
            return claimed, at if seen else float("inf"), was_fenced
        finally:
            guard.stop(asyncio.get_running_loop())
            guard.close()

    try:
        claimed, fenced_at, was_fenced = asyncio.run(main())
    finally:
        logging.getLogger("flowloop").removeHandler(handler)
    deadline = claimed + LEASE_S - LEASE_S / 6
    assert fenced_at < claimed + LEASE_S + SLACK_S, "not fenced while the loop was blocked"
    assert fenced_at >= deadline, "fenced before its deadline"
    assert was_fenced
    assert order == ["queued before", f"lost r1: {FENCED}"], order
    # Read from the handler: the test may get here before caplog's (root) handler has it.
    assert any("lease deadline passed, abandoning it (self-fencing)" in line for line in lines)
    assert "heartbeat failed (retrying): the network drops every packet" in lines


class Ctx(BaseModel):
    n: int = 0


def idle_flow() -> Workflow:
    wf = Workflow("guarded", context=Ctx)

    @wf.step(initial=True, next="done")
    def only(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


def test_renewals_from_the_thread_keep_a_run_while_the_writer_is_held(store_url: str) -> None:
    """Against the real store: the thread's renewals keep a claimed run for several leases;
    on PostgreSQL through a connection of their own, so they go on while another thread
    holds the store's writer (as a call of the loop stuck on a silent network would)."""
    wf = idle_flow()
    lease = 1.5
    with Engine(store_url, workflows=[wf], lease_seconds=lease) as engine:
        store = engine.store
        assert isinstance(store, SQLStore)
        run_id = engine.start(wf, Ctx()).id
        before = time.monotonic()
        # Due at its creation by this process's clock; the database's clock (SQLite's
        # julianday: milliseconds) may read a hair earlier: claim once it says it is due.
        (claimed,) = poll(
            lambda: store.claim(
                worker="guard-test",
                now=store.db_now(),
                limit=1,
                lease_seconds=lease,
                workflows=["guarded"],
                run_ids=[run_id],
            ),
            timeout=10,
            what="the new run to be due by the database's clock",
            every=0.005,
        )
        lost: list[str] = []
        release = threading.Event()
        holding = threading.Event()
        on_pg = store.engine.dialect.name == "postgresql"

        def hold_the_writer() -> None:
            with store._lock:  # the loop's writer, stuck in a call
                holding.set()
                release.wait(60)

        holder = threading.Thread(target=hold_the_writer, daemon=True)
        if on_pg:
            holder.start()
            assert holding.wait(10)

        async def main() -> int:
            guard = LeaseGuard(
                lease_seconds=lease,
                poll_seconds=0.1,
                renew=renewer(store, worker="guard-test", lease_seconds=lease),
                poll=dict,
                lost=lambda run_id, why: lost.append(why),
                controls=lambda _requests: None,
            )
            guard.start(asyncio.get_running_loop())
            guard.hold(run_id, before)
            try:
                # Three leases' worth of renewals (every lease/3), bounded.
                waited = 0.0
                while guard.renewals < 9 and waited < 60 and not lost:
                    await asyncio.sleep(0.05)
                    waited += 0.05
                assert not guard.fenced(run_id), lost
                return guard.renewals
            finally:
                guard.stop(asyncio.get_running_loop())
                guard.close()

        try:
            renewals = asyncio.run(main())
        finally:
            release.set()
            if on_pg:
                holder.join(10)
        assert not lost and renewals >= 9, (lost, renewals)
        row = store.get_run(run_id)
        assert row is not None and row.owner == "guard-test"
        assert row.lease_epoch == claimed.lease_epoch
        assert (row.lease_expires_at or 0) > store.db_now()  # still held, by the db's clock


def test_renewals_stop_while_the_loop_does_not_tick() -> None:
    """The loop's last tick is frozen (a wedged loop): renewals that would all succeed
    stop after the stall bound, one WARNING says why, and the run is fenced off at its
    deadline; while the loop ticks, they go on."""
    lease, stall = 0.6, 0.9
    tick = [time.monotonic()]
    ticking = threading.Event()
    ticking.set()
    calls: list[float] = []
    lines: list[str] = []
    fenced = threading.Event()

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())
            if getattr(record, "self_fenced", False):
                fenced.set()

    def renew(run_ids: Sequence[str]) -> set[str]:
        calls.append(time.monotonic())
        return set(run_ids)  # the database would renew for ever

    def last_tick() -> float:
        if ticking.is_set():
            tick[0] = time.monotonic()
        return tick[0]

    handler = Lines()
    logging.getLogger("flowloop").addHandler(handler)

    async def main() -> tuple[int, bool, float]:
        guard = LeaseGuard(
            lease_seconds=lease,
            poll_seconds=0.1,
            renew=renew,
            poll=dict,
            lost=lambda _run_id, _why: None,
            controls=lambda _requests: None,
            last_tick=last_tick,
            stall_seconds=stall,
        )
        guard.start(asyncio.get_running_loop())
        try:
            guard.hold("r1", time.monotonic())
            waited = 0.0
            while guard.renewals < 3 and waited < 30:  # a live loop keeps its lease
                await asyncio.sleep(0.05)
                waited += 0.05
            alive_renewals = guard.renewals
            ticking.clear()  # wedged from here on (the thread sees no tick)
            frozen = tick[0]
            seen = await asyncio.to_thread(fenced.wait, stall + lease + SLACK_S + 30)
            return alive_renewals, seen and guard.fenced("r1"), frozen
        finally:
            guard.stop(asyncio.get_running_loop())
            guard.close()

    try:
        alive_renewals, was_fenced, frozen = asyncio.run(main())
    finally:
        logging.getLogger("flowloop").removeHandler(handler)
    assert alive_renewals >= 3
    assert was_fenced, "a run of a wedged loop was renewed on"
    # No renewal was sent once the loop had been still for the bound (one period of slack:
    # a renewal decided just before it).
    assert all(at < frozen + stall + lease / 3 + SLACK_S for at in calls), (frozen, calls)
    wedged = [line for line in lines if "no longer renewing the leases" in line]
    assert len(wedged) == 1, lines


def test_an_unknown_renewal_is_neither_kept_nor_lost() -> None:
    """A renewal that could not tell (the run's row was locked by another transaction)
    does not give the run up, nor extend its lease: the fence keeps the deadline."""
    lost: list[str] = []
    done = threading.Event()

    def renew(run_ids: Sequence[str]) -> Renewal:
        return Renewal(kept=set(), unknown=set(run_ids))

    def record(run_id: str, why: str) -> None:
        lost.append(why)
        done.set()

    async def main() -> tuple[float, float]:
        guard = LeaseGuard(
            lease_seconds=LEASE_S,
            poll_seconds=0.1,
            renew=renew,
            poll=dict,
            lost=record,
            controls=lambda _requests: None,
        )
        guard.start(asyncio.get_running_loop())
        try:
            claimed = time.monotonic()
            guard.hold("r1", claimed)
            assert await asyncio.to_thread(done.wait, LEASE_S + SLACK_S + 30)
            await asyncio.sleep(0)
            return claimed, time.monotonic()
        finally:
            guard.stop(asyncio.get_running_loop())
            guard.close()

    claimed, at = asyncio.run(main())
    assert lost[0] == FENCED, lost  # the deadline, not "lost its lease"
    assert at < claimed + LEASE_S + SLACK_S, "an unknown renewal extended the lease"
    assert all(why == FENCED for why in lost), lost


def test_a_renewal_skips_a_row_the_group_commit_holds(pg_url: str) -> None:
    """PostgreSQL: while another transaction holds a run's row locked (as the store's group
    commit does while it writes it), a renewal neither waits for it (lock-order deadlocks)
    nor reports the run lost; the other runs are renewed, an expired one is lost."""
    wf = idle_flow()
    lease = 3.0
    with Engine(pg_url, workflows=[wf], lease_seconds=lease) as engine:
        store = engine.store
        assert isinstance(store, SQLStore)
        ids = [engine.start(wf, Ctx()).id for _ in range(3)]
        locked, free, expired = ids
        claimed = store.claim(
            worker="guard-test",
            now=store.db_now(),
            limit=3,
            lease_seconds=lease,
            workflows=["guarded"],
            run_ids=ids,
        )
        assert len(claimed) == 3
        renew = renewer(store, worker="guard-test", lease_seconds=lease)
        # A plain engine: the store's sessions end an idle transaction after lease/3.
        plain = sa.create_engine(pg_url)
        with plain.connect() as holder:
            holder.execute(
                sa.text("UPDATE flowloop_runs SET lease_expires_at = 0 WHERE id = :id"),
                {"id": expired},
            )
            holder.commit()
            tx = holder.begin()
            holder.execute(
                sa.text("SELECT id FROM flowloop_runs WHERE id = :id FOR UPDATE"), {"id": locked}
            )
            box: list[object] = []
            thread = threading.Thread(target=lambda: box.append(_call(renew, ids)), daemon=True)
            started = time.monotonic()
            thread.start()
            thread.join(30)
            took = time.monotonic() - started
            tx.rollback()
        plain.dispose()
        assert not thread.is_alive(), "the renewal waited for the locked row"
        (result,) = box
        assert isinstance(result, Renewal), result
        assert result.kept == {free} and result.unknown == {locked}, (result, ids)
        # Well under the statement timeout (lease/3, at least 2 s) an old wait would hit.
        assert took < 2.0, took


def _call(renew: Callable[[Sequence[str]], object], ids: Sequence[str]) -> object:
    try:
        return renew(ids)
    except Exception as error:  # shown by the assertion on the result
        return error


def _loop_in_a_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def _told_after(
    started: Sequence[asyncio.AbstractEventLoop], stopped: asyncio.AbstractEventLoop
) -> asyncio.AbstractEventLoop:
    """The loop a stop request is handed to by a guard that ``started`` on each loop and
    then stopped on ``stopped``."""
    told: list[asyncio.AbstractEventLoop] = []
    arrived = threading.Event()
    asked: dict[str, str] = {}

    def controls(_requests: Mapping[str, str]) -> None:
        told.append(asyncio.get_running_loop())
        arrived.set()

    guard = LeaseGuard(
        lease_seconds=LEASE_S,
        poll_seconds=0.01,
        renew=lambda run_ids: set(run_ids),
        poll=lambda: dict(asked),
        lost=lambda run_id, why: None,
        controls=controls,
    )
    for loop in started:
        guard.start(loop)
    guard.hold("r1", time.monotonic())
    guard.stop(stopped)
    asked["r1"] = "stop"  # the poller finds the request: handed to a loop
    try:
        assert arrived.wait(timeout=30), "the request reached no running loop"
        return told[0]
    finally:
        guard.close()


def test_calls_go_to_a_loop_still_started_whichever_stops_first() -> None:
    """Two loops keep leases with one guard (``Engine.run`` from two threads, or a nested
    ``Engine.run`` on a loop of its own inside the outer's): when one of them stops, what
    the lease threads hand over goes to the other, whichever started first."""
    loops = [_loop_in_a_thread() for _ in range(2)]
    (first, _), (second, _) = loops
    try:
        assert _told_after([first, second], stopped=first) is second
        assert _told_after([first, second], stopped=second) is first
    finally:
        for loop, thread in loops:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()


def test_requests_handed_over_out_of_order_do_not_undo_a_later_polls() -> None:
    """Two polls' requests reach the loop out of order (the earlier one was queued to an
    outer loop while a nested ``Engine.run`` drove its own): the earlier is ignored, so a
    pause withdrawn between the two polls does not come back."""
    received: list[Mapping[str, str]] = []
    guard = LeaseGuard(
        lease_seconds=LEASE_S,
        poll_seconds=0.01,
        renew=lambda run_ids: set(run_ids),
        poll=dict,
        lost=lambda run_id, why: None,
        controls=received.append,
    )
    try:
        guard._hand_controls(2, {})
        guard._hand_controls(1, {"r1": "pause"})  # overtaken
        guard._hand_controls(3, {"r1": "stop"})
        assert received == [{}, {"r1": "stop"}]
    finally:
        guard.close()
