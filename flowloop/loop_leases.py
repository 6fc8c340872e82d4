"""The loop leases a worker holds, renewed off its event loop and enforced on its own clock.

A worker cut off from the database while another is not (a partition) must give its
iterations up before their leases end there: else another worker, recovering the loop,
fires it beside them. So each running loop has a *fence*: a timer on the event loop at

    (when the last fire or renewal that worked was sent) + lease - margin

moved on by each renewal that works; when it fires, the iteration is abandoned (cancelled,
nothing recorded; recovery journals it interrupted), whatever the renewals are doing. The
database set the lease at or after the request was sent, so it ends no earlier than that
plus the lease by any clock that runs at the same rate.

The renewals run in a thread of their own (the store's calls are thread-safe: its lock
serializes them with the loop's writes): a renewal that fails slowly (a silent network, a
lock not granted) blocks no timer. They go every lease/3; after one failed, sooner (a third
of the time left before the first fence, :data:`RETRY_FRACTION`), so that one transient
failure does not cost a healthy iteration (the fence decides, not the failure).

The margin is :data:`~flowloop.loop_calls.CUT_OFF_GRACE_SECONDS` (the cancelled function's
time to end) plus a twelfth of the lease (the timer's lateness on a busy event loop, the
clocks' rates), at most a third of the lease (for leases under 4 s the function's grace
does not fit whole: one that ends at once on its cancellation still does). Not covered: a
database call of the scheduler on the event loop (a fire, an outcome's write; each bounded
by the store's timeouts, which the lease sets) delays the fence's timer while it blocks —
and first waits for the store's lock while this thread holds it in a renewal that fails
slowly: up to about two store timeouts; the function does not run meanwhile either, but
may take one step when the loop runs again before the timer's cancellation reaches it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import TYPE_CHECKING, Final

from flowloop import loop_calls, outagelog
from flowloop.errors import error_line

if TYPE_CHECKING:
    from flowloop.scheduler import Scheduler

log = logging.getLogger("flowloop.loops")

RENEW_FRACTION: Final = 1 / 3
"""Of the lease, between two renewals."""
ALLOWANCE_FRACTION: Final = 1 / 12
"""Of the lease, added to the function's grace in the margin (timer lateness, clock rates)."""
MARGIN_CAP_FRACTION: Final = 1 / 3
"""Of the lease, the most the margin takes (short leases)."""
RETRY_FRACTION: Final = 1 / 3
"""Of the time left before the first fence, before a failed renewal is tried again."""
FENCED: Final = "its lease could not be renewed in time; abandoning the iteration (self-fencing)"
"""The reason given to the lease-lost hooks for an iteration fenced off."""


def margin_for(lease_seconds: float) -> float:
    """How long before its lease can end in the database an iteration is given up."""
    wanted = loop_calls.CUT_OFF_GRACE_SECONDS + lease_seconds * ALLOWANCE_FRACTION
    return min(wanted, lease_seconds * MARGIN_CAP_FRACTION)


class LoopLeases:
    """When each loop lease of this worker was last sent (a fire, a renewal that worked),
    by the event loop's (monotonic) clock, and the fence timer of each."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.lease_seconds = scheduler.lease_seconds
        self.period = max(0.05, self.lease_seconds * RENEW_FRACTION)
        self._sent: dict[str, float] = {}
        self._fences: dict[str, asyncio.TimerHandle] = {}
        self._fenced: set[str] = set()

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    def deadline(self, name: str) -> float | None:
        """When loop ``name``'s iteration is given up (the event loop's clock)."""
        sent = self._sent.get(name)
        return None if sent is None else sent + self.lease_seconds - margin_for(self.lease_seconds)

    def held(self, names: set[str] | list[str], sent: float) -> None:
        """A request sent at ``sent`` (a fire, a renewal) set the lease of each of ``names``:
        their fences move on (never back; a fenced one stays fenced)."""
        loop = asyncio.get_running_loop()
        for name in names:
            if name in self._fenced or sent <= self._sent.get(name, -1.0):
                continue
            self._sent[name] = sent
            old = self._fences.pop(name, None)
            if old is not None:
                old.cancel()
            deadline = self.deadline(name)
            assert deadline is not None
            self._fences[name] = loop.call_at(deadline, self._fence, name)

    def fired(self, name: str, sent: float) -> None:
        """Loop ``name`` was fired by a request sent at ``sent``: a new iteration's fence."""
        self.forget(name)
        self.held([name], sent)

    def only(self, names: set[str] | list[str]) -> None:
        """Forget the leases not among ``names`` (their iterations ended)."""
        wanted = set(names)
        for name in [name for name in self._sent if name not in wanted]:
            self.forget(name)

    def forget(self, name: str) -> None:
        self._sent.pop(name, None)
        self._fenced.discard(name)
        fence = self._fences.pop(name, None)
        if fence is not None:
            fence.cancel()

    def close(self) -> None:
        for name in list(self._sent):
            self.forget(name)

    def retry_in(self) -> float:
        """After a failed renewal: how soon to try again."""
        deadlines = [self.deadline(name) for name in self._sent if name not in self._fenced]
        left = min((d for d in deadlines if d is not None), default=None)
        if left is None:
            return self.period
        soon = (left - self.now()) * RETRY_FRACTION
        return min(self.period, max(self.period / 10, soon))

    def _fence(self, name: str) -> None:
        self._fences.pop(name, None)
        self._fenced.add(name)
        running = self.scheduler._running.get(name)
        if running is None or running.lease_lost:
            return  # (its iteration ended: an outcome left to write is fenced in the database)
        since = self.now() - self._sent.get(name, self.now())
        log.warning(
            "loop %s: its lease not renewed for %.2fs (lease %gs, margin %.2fs): abandoning "
            "the iteration before the lease can end in the database (self-fencing)",
            name,
            since,
            self.lease_seconds,
            margin_for(self.lease_seconds),
            extra={"loop": name, "event": "lease_lost", "self_fenced": True},
        )
        lose(self.scheduler, name, FENCED)


def lose(scheduler: Scheduler, name: str, why: str) -> None:
    """Loop ``name``'s running iteration is given up (a renewal found its lease gone, or its
    fence came: the lease may end soon): cancelled, its function given
    :data:`~flowloop.loop_calls.CUT_OFF_GRACE_SECONDS`, nothing recorded for it."""
    running = scheduler._running.get(name)
    if running is None or running.lease_lost:
        return
    scheduler._notify_lease_lost(name, why)
    running.lease_lost = True  # before the cancel: _iterate must not record it
    scheduler._timed.cancelling(name, stop=False)
    scheduler._timed.cut_short(name)  # (a function already ending after a stop, the drain)
    running.task.cancel()


async def heartbeat(scheduler: Scheduler) -> None:
    """Renew the leases of the loops this worker holds (running, or an outcome left to
    write), in a thread of its own, every lease/3 (sooner after a failure)."""
    leases = scheduler._leases
    outage = outagelog.Part("loop leases")
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flowloop-loop-lease")
    loop = asyncio.get_running_loop()
    wait = leases.period
    try:
        while True:
            await asyncio.sleep(wait)
            wait = leases.period
            held = {**scheduler._running, **scheduler._unrecorded}
            leases.only(list(held))
            if not held:
                continue
            sent = leases.now()
            renewal = loop.run_in_executor(executor, _renew, scheduler, list(held))
            try:
                kept = await asyncio.shield(renewal)
            except asyncio.CancelledError:
                await asyncio.wait([renewal])  # (bounded by the store's timeouts)
                if not renewal.cancelled():
                    renewal.exception()  # (retrieved: the worker stops, it no longer matters)
                raise
            except Exception as error:
                wait = leases.retry_in()
                log.log(
                    outage.failed(),
                    "could not renew loop leases (trying again in %.2fs): %s",
                    wait,
                    error_line(error),
                )
                continue
            outage.answered()
            wait = max(0.0, leases.period - (leases.now() - sent))
            leases.held(kept, sent)
            for name in set(held) - kept:
                _lost(scheduler, name, held[name])
    finally:
        executor.shutdown(wait=False)


def _renew(scheduler: Scheduler, names: list[str]) -> set[str]:
    return scheduler.store.renew_loops(
        worker=scheduler.worker_id, names=names, lease_seconds=scheduler.lease_seconds
    )


def _lost(scheduler: Scheduler, name: str, was: object) -> None:
    """The renewal found loop ``name``'s lease gone, ``was`` (its iteration, or its outcome
    left to write) being held as it was sent: unless that ended meanwhile, given up."""
    write_again = scheduler._unrecorded.get(name)
    if write_again is not None and write_again is was:
        # Written once more, refused: loop_outcomes.lost looks in the journal (the write
        # that raised may have committed, releasing the lease: "written after all", no
        # lease-lost hooks) and arms the loop again. Before, it was dropped as a lost
        # lease and the loop never fired again on this worker.
        del scheduler._unrecorded[name]
        write_again()
        return
    running = scheduler._running.get(name)
    if running is not was or running is None or running.lease_lost:
        return  # (ended, or fired again, while the renewal ran)
    log.warning(
        "loop %s: lost its lease; abandoning the iteration",
        name,
        extra={"loop": name, "event": "lease_lost"},
    )
    lose(scheduler, name, "lost its lease; abandoning the iteration")
