"""Leases of the runs an executor drives: renewed by a heartbeat, and given up in time.

A worker holds each run it drives under a lease the database grants; the heartbeat renews
them every lease/3 and picks up pause/stop requests. A run whose lease could not be renewed
is abandoned (self-fencing) before the lease can end, so this worker never steps a run that
another worker may already have taken over.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from flowloop.errors import error_line

if TYPE_CHECKING:
    from flowloop.executor import Executor

log = logging.getLogger("flowloop")


def new_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def owner_is_dead_here(owner: str) -> bool:
    """A worker on this host whose process is gone: its leases need not run out first."""
    host, _, rest = owner.partition(":")
    pid_text = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class LeaseKeeper:
    """The lease side of one :class:`~flowloop.executor.Executor`.

    Lease arithmetic uses the real monotonic clock (a test's fake clock does not move the
    database's): the lease was set by the database at or after the local instant noted
    before the request that set it, so it ends no earlier than that + lease."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.until: dict[str, float] = {}
        """Per driven run: by this process's monotonic clock, the earliest its lease can end
        (the time just before the claim, renewal or owned write that set it, plus the lease)."""
        self.given_up: set[str] = set()
        """Runs this worker abandoned (lost lease): recovering one later says so."""
        self.hooks: list[Callable[[str, str], None]] = []
        """Called with (run id, why) when this worker stops driving a run it lost."""

    def held_from(self, run_id: str, instant: float) -> None:
        """The run's lease was set (claimed, renewed, written) just after ``instant``."""
        self.until[run_id] = instant + self.executor.lease_seconds

    def renewed_by_write(self, run_id: str, instant: float) -> None:
        """An owned write renews the lease too (of a run still driven here)."""
        if run_id in self.until:
            self.held_from(run_id, instant)

    def forget(self, run_id: str) -> None:
        self.until.pop(run_id, None)

    async def heartbeat(self) -> None:
        """Renew held leases every lease/3, pick up pause/stop requests every poll, and fence
        this worker off every run whose lease it could not renew in time."""
        executor = self.executor
        # Ticks at most lease/12 apart: a run is fenced off with lease/6 to spare at the
        # latest one tick (lease/12) after that point, so with lease/12 left at worst.
        tick = max(0.01, min(executor.poll_seconds, executor.lease_seconds / 12))
        self._watch_loop_while_beating()
        last_renewal = last_poll = time.monotonic()
        failing = False
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            try:
                called = False
                if now - last_poll >= executor.poll_seconds or failing:
                    executor.poll_controls()
                    last_poll, called = now, True
                if now - last_renewal >= executor.lease_seconds / 3:
                    self.renew()
                    last_renewal, called = now, True
                if failing and called:
                    log.info("heartbeat: database reachable again")
                    failing = False
            except Exception as error:  # keep beating (retrying every tick) through a hiccup
                if not failing:
                    log.warning("heartbeat failed (retrying): %s", error_line(error))
                failing = True
            self.fence_expiring()

    def _watch_loop_while_beating(self) -> None:
        """The loop watchdog (flowloop/watchdog.py) runs as long as a heartbeat does."""
        beating = asyncio.current_task()
        if beating is not None:
            watchdog = self.executor.watchdog
            watchdog.start()
            beating.add_done_callback(lambda _: watchdog.stop())

    def renew(self) -> None:
        executor = self.executor
        released = executor.committer.released
        held = [run_id for run_id in executor.driven() if run_id not in released]
        if not held:
            return
        before = time.monotonic()
        kept = executor.store.renew(
            worker=executor.worker_id, run_ids=held, lease_seconds=executor.lease_seconds
        )
        for run_id in kept:
            self.held_from(run_id, before)
        for run_id in set(held) - kept:
            if run_id in released:  # let go meanwhile (cannot happen while renew blocks)
                continue
            self.abandon(run_id, "lost its lease (expired, or taken over by another worker)")

    def fence_expiring(self) -> None:
        """Self-fencing: a run whose lease could not be renewed is abandoned when a sixth of
        the lease is left (a twelfth at worst, given the heartbeat's tick), so this worker
        never steps a run that another worker may already have taken over."""
        executor = self.executor
        limit = time.monotonic() + executor.lease_seconds / 6
        driven = set(executor.driven())
        for run_id, until in list(self.until.items()):
            if (
                until <= limit
                and run_id in driven
                and run_id not in executor.committer.released
                and not executor.lost(run_id)
            ):
                late = time.monotonic() - until
                self.abandon(
                    run_id,
                    "could not renew its lease in time; abandoning it before "
                    "the lease ends (self-fencing)"
                    if late < 0
                    else "could not renew its lease in time and was blocked past its end "
                    f"({late:.1f}s, in a database call); abandoning it (self-fencing)",
                )

    def abandon(self, run_id: str, why: str) -> None:
        """Stop driving a run this worker no longer (surely) holds; write nothing more for it."""
        log.warning("run %s: %s", run_id, why, extra={"run": run_id, "event": "lease_lost"})
        self.given_up.add(run_id)
        self.executor.stats.lost_leases += 1
        self.tell_lost(run_id, why)
        self.until.pop(run_id, None)
        self.executor.cancel_lost(run_id)

    def tell_lost(self, run_id: str, why: str) -> None:
        for hook in self.hooks:
            try:
                hook(run_id, why)
            except Exception:  # a hook must never break the worker
                log.exception("lease-lost hook failed")
