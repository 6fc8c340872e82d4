"""Leases of the runs an executor drives: renewed by a heartbeat, and given up in time.

A worker holds each run it drives under a lease the database grants; the heartbeat renews
them every lease/3 and picks up pause/stop requests. A run whose lease could not be renewed
is abandoned (self-fencing) before the lease can end, so this worker never steps a run that
another worker may already have taken over.

The renewals and the deadline are kept off the event loop, by threads of their own
(flowloop/leasethread.py): a database call holding the loop (a silent network) delays
neither — but a loop that has not ticked for longer than any database call can take is
wedged (an async step blocking it): its leases are no longer renewed, so another worker
takes its runs over. What the threads learn is acted on here, on the loop: a fenced run's task is
cancelled (an async step with it; a thread step is abandoned, its result discarded), and
nothing more is written for it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from flowloop.leasethread import FENCED, LeaseGuard, poller, renewer, stall_bound
from flowloop.workerids import new_worker_id, owner_is_dead_here

__all__ = ["LeaseKeeper", "new_worker_id", "owner_is_dead_here"]

if TYPE_CHECKING:
    from flowloop.executor import Executor

log = logging.getLogger("flowloop")


class LeaseKeeper:
    """The lease side of one :class:`~flowloop.executor.Executor`.

    Lease arithmetic uses the real monotonic clock (a test's fake clock does not move the
    database's): the lease was set by the database at or after the local instant noted
    before the request that set it, so it ends no earlier than that + lease."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.given_up: dict[str, int] = {}
        """Runs this worker abandoned (lost lease), each with the lease epoch it held then:
        recovering one later says so, when nobody claimed the run in between."""
        self.hooks: list[Callable[[str, str], None]] = []
        """Called with (run id, why) when this worker stops driving a run it lost."""
        store, worker = executor.store, executor.worker_id
        self.guard = LeaseGuard(
            lease_seconds=executor.lease_seconds,
            poll_seconds=executor.poll_seconds,
            renew=renewer(store, worker=worker, lease_seconds=executor.lease_seconds),
            poll=poller(store, worker=worker),
            lost=self.lost,
            controls=executor.apply_controls,
            released=executor.committer.released.__contains__,
            # A wedged loop (an async step blocking it) loses its leases: renewals need
            # its ticks (the watchdog's, which runs exactly while the heartbeat does).
            last_tick=executor.watchdog.last_tick,
            stall_seconds=stall_bound(store, executor.lease_seconds),
        )
        self.fenced_runs: AbstractSet[str] = self.guard.fenced_runs
        """The runs whose lease may have ended (:meth:`fenced`), the lease threads' own set
        (read, never changed, here: the executor asks it before and after every write)."""

    def held_from(self, run_id: str, instant: float) -> None:
        """The run's lease was set (claimed) by a request sent at ``instant``."""
        self.guard.hold(run_id, instant)

    def renewed_by_write(self, run_id: str, instant: float) -> None:
        """An owned write sent at ``instant`` renewed the lease too (of a run still driven
        here and not fenced off)."""
        self.guard.extend(run_id, instant)

    def forget(self, run_id: str) -> None:
        self.guard.drop(run_id)

    @property
    def handed(self) -> int:
        """How many calls the lease threads have handed to the loop (a lost lease, a
        control request), each counted once it is queued there."""
        return self.guard.handed

    def fenced(self, run_id: str) -> bool:
        """The run's lease may have ended (deadline passed unrenewed): write nothing for it."""
        return run_id in self.fenced_runs

    async def heartbeat(self) -> None:
        """Run the lease threads (renewals every lease/3, control requests every poll, the
        fence watch) for as long as this task runs."""
        self.begin()
        try:
            await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self.end()

    def begin(self) -> None:
        """On the loop: start what :meth:`heartbeat` runs — the lease threads, and the loop
        watchdog (flowloop/watchdog.py) whose ticks tell them the loop is alive — until
        :meth:`end`. Calls nest. ``Engine.run`` calls them around its one run instead of
        running a heartbeat task (its start, cancellation and wait cost two event-loop
        turns per run)."""
        self.executor.watchdog.start()
        self.guard.start(asyncio.get_running_loop())

    def end(self) -> None:
        """End one :meth:`begin`."""
        # (No running loop: a coroutine finalized by the GC after its loop was closed.)
        self.guard.stop(asyncio.events._get_running_loop())
        self.executor.watchdog.stop()

    def close(self) -> None:
        """Let the lease threads end."""
        self.guard.close()

    def lost(self, run_id: str, why: str) -> None:
        """On the loop: the lease threads say the run's lease is (or may be) gone — the
        renewal found it expired or taken over, or its deadline passed unrenewed (then the
        fence thread has fenced and logged it already). A run released or finished
        meanwhile is not lost."""
        executor = self.executor
        if (
            run_id not in set(executor.driven())
            or run_id in executor.committer.released
            or executor.lost(run_id)
        ):
            return
        self.abandon(run_id, why, logged=why == FENCED)

    def abandon(self, run_id: str, why: str, *, logged: bool = False) -> None:
        """Stop driving a run this worker no longer (surely) holds; write nothing more for it."""
        if not logged:
            log.warning("run %s: %s", run_id, why, extra={"run": run_id, "event": "lease_lost"})
        active = self.executor._active.get(run_id)
        if active is not None:  # the epoch it held: its recovery tells its own loss
            self.given_up[run_id] = active.epoch
        self.executor.stats.lost_leases += 1
        self.tell_lost(run_id, why)
        self.guard.give_up(run_id)  # fenced until its task ends (nothing more is written)
        self.executor.cancel_lost(run_id)

    def tell_lost(self, run_id: str, why: str) -> None:
        for hook in self.hooks:
            try:
                hook(run_id, why)
            except Exception:  # a hook must never break the worker
                log.exception("lease-lost hook failed")
