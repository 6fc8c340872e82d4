"""Leases kept by the worker's own clock, whatever its event loop is doing.

The event loop makes blocking database calls (claims, the committer's flush, recovery):
on a silent network one of them can hold the loop for seconds, longer than a short
lease. Renewing from the loop and fencing from the loop would then both wait for it, and
a run would be stepped after another worker may have taken it over. So the lease work
runs in two threads of its own:

* the **renewer** renews the held leases every lease/3 on a connection of its own (not
  the loop's held writer, which a stuck call may hold) and reads pending pause/stop
  requests every poll; it hands what it learnt to the loop (``call_soon_threadsafe``);
* the **fence watch** never touches the database: by the monotonic clock, a run whose
  lease could not be renewed is *fenced* when a sixth of the lease is left — it is marked
  at once (no boundary of it is written from then on, see :meth:`LeaseGuard.fenced`),
  logged with the times, and the loop is asked to cancel its task (an async step is
  cancelled; a thread step is abandoned and its result discarded, flowloop.steppool).

Renewing whatever the loop does must not keep a *wedged* loop's runs for ever (an async
step spinning, or blocking with no timeout: its step timeout cannot fire either). So the
renewer renews only while the loop has ticked (the loop watchdog's ticker,
flowloop/watchdog.py) within :func:`stall_bound`: longer than any database call of the
loop can take under the connection timeouts, so a slow call keeps the leases; a loop held
longer is wedged — renewals stop (one WARNING), the fence fences its runs at their
deadlines, and another worker takes them over.

On PostgreSQL the renewer locks the rows it renews in id order and skips any row locked
by another transaction (:func:`flowloop.store.leases.renew_skip_locked`): the store's
group commit updates run rows in its own order, and waiting on each other could deadlock.
A row skipped is being written by this worker's loop (or taken over, if its lease ended):
its lease is neither extended nor given up (*unknown*); the write, when applied, extends
it, and the fence keeps the deadline either way.

A lease is counted from the monotonic instant noted *before* the request that set it
(claim, renewal or owned write): the database set it at or after that instant, so it ends
no earlier than that + lease by any clock that runs at the same rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Final

from flowloop import outagelog
from flowloop.store import Store

log = logging.getLogger("flowloop")

MARGIN_FRACTION: Final = 1 / 6
"""Of the lease, left when an unrenewed run is fenced off (clock-rate differences between
this host and the database server, and the time to stop a step, must fit in it)."""
RENEW_FRACTION: Final = 1 / 3
"""Of the lease, between two renewals (two more renewals can fail before the fence)."""

QUIET_POLLS_HANDED: Final = 3
"""Polls that find no request, after one that found some, whose (empty) requests are still
handed to the loop: the loop drops a pause withdrawn meanwhile (Executor.apply_controls),
even when a hand-over is lost (queued to a nested ``Engine.run``'s loop as it closed). An
overtaken one is ignored (LeaseGuard._hand_controls)."""

FENCED: Final = "its lease deadline passed without a renewal; abandoned (self-fencing)"
"""The reason given to the loop (and the lease-lost hooks) for a run fenced off."""

IDLE_AFTER: Final = 2.0
"""Seconds without a user (no :meth:`LeaseGuard.start` running) after which the threads
stop ticking and sleep until the next start rings them."""
IDLE_WAIT: Final = 1.0
"""The longest an idle thread sleeps before looking again (a missed ring costs this)."""

STALL_LEASES: Final = 3
"""A loop that has not ticked for this many leases (at least; see :func:`stall_bound`) is
wedged: its leases are no longer renewed."""


@dataclass(frozen=True)
class Renewal:
    """What a renewal learnt: runs whose leases it extended, and runs it could not tell
    (their rows were locked by another transaction: neither extended nor lost)."""

    kept: set[str]
    unknown: set[str] = field(default_factory=set)


Renew = Callable[[Sequence[str]], "set[str] | Renewal"]
"""Renews the leases of these runs; returns those still held (a set), or a
:class:`Renewal`; any other run is lost (called in the renewer)."""
LastTick = Callable[[], "float | None"]
"""When (monotonic) the event loop last showed it runs; None: unknown (renew anyway)."""
Poll = Callable[[], Mapping[str, str]]
"""Pending control requests (run id → one of lifecycle.CONTROLS) of this worker (in the
renewer)."""


@dataclass
class _Held:
    until: float
    """By the monotonic clock, the earliest the run's lease can end."""
    renewed: float
    """When the request that set ``until`` was sent (monotonic)."""


class LeaseGuard:
    """The leases of the runs one executor drives, renewed and enforced off its loop.

    The loop calls :meth:`hold` (a claim), :meth:`extend` (an owned write was applied)
    and :meth:`drop` (the run is done here); :meth:`start` starts the threads, :meth:`stop`
    ends them. ``lost(run_id, why)`` and ``controls(requests)`` are called on the loop."""

    def __init__(
        self,
        *,
        lease_seconds: float,
        poll_seconds: float,
        renew: Renew,
        poll: Poll,
        lost: Callable[[str, str], None],
        controls: Callable[[Mapping[str, str]], None],
        released: Callable[[str], bool] = lambda _run_id: False,
        last_tick: LastTick = lambda: None,
        stall_seconds: float | None = None,
    ) -> None:
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.margin = lease_seconds * MARGIN_FRACTION
        self.tick = max(0.01, min(poll_seconds, lease_seconds / 12))
        self._renew = renew
        self._poll = poll
        self._lost = lost
        self._controls = controls
        self._released = released
        self._last_tick = last_tick
        default_stall = STALL_LEASES * lease_seconds
        self.stall_seconds = default_stall if stall_seconds is None else stall_seconds
        """A loop that has not ticked for this long is wedged: renewals stop."""
        self._wedged_since: float | None = None
        """The loop's last tick when renewals stopped for it (one warning per stall)."""
        # Reentrant: a coroutine finalized by the GC inside a section holding it may end a
        # start (LeaseKeeper.end in its ``finally``), which takes it again on this thread.
        self._lock = threading.RLock()
        self._held: dict[str, _Held] = {}
        self._fenced: set[str] = set()
        # Changed in place only, never rebound: fenced_runs (read by the executor and the
        # committer at every boundary) is this very set.
        self.fenced_runs: AbstractSet[str] = self._fenced
        """:meth:`fenced`'s set, to read: a membership test is atomic under the GIL."""
        self._active = threading.Event()
        """The threads' doorbell out of idling: set by :meth:`start`, cleared by a thread
        that found no user for ``IDLE_AFTER`` seconds. Whether they work is ``_users``."""
        self._closed = threading.Event()
        self._started = False
        self._changed = threading.Event()
        self._users = 0
        self._idle_since = time.monotonic()
        self._watch_wake = math.inf
        """When the fence thread wakes next (monotonic): a hold whose deadline comes
        before it wakes it (else no wake-up: a thread switch costs more than a step)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loops: list[asyncio.AbstractEventLoop] = []
        """The loops of the starts not stopped yet, the latest last (under ``_lock``): when
        a nested ``Engine.run`` (in a plain ``def`` step, on a loop of its own) stops,
        calls go to a loop still started, not to its own. (Each thread calling
        ``Engine.run`` has an executor, and so a guard, of its own: Engine._executor.)"""
        self._polls_handed = 0
        """The last poll whose requests reached the loop (only the loops' thread sets it)."""
        self.renewals = 0
        """Renewals that returned (for tests and metrics)."""
        self.handed = 0
        self._handed_lock = threading.Lock()
        """Calls handed to the loop so far (lost leases, control requests), each counted
        once it is queued there."""

    # -- the loop's side -------------------------------------------------------------------

    def hold(self, run_id: str, since: float) -> None:
        """``run_id`` was claimed by a request sent at ``since`` (monotonic)."""
        with self._lock:
            self._held[run_id] = _Held(since + self.lease_seconds, since)
            self._fenced.discard(run_id)
        if self._users:
            self._start_threads()
        if since + self.lease_seconds - self.margin < self._watch_wake:
            self._changed.set()

    def extend(self, run_id: str, since: float) -> None:
        """An owned write sent at ``since`` was applied: it renewed the lease. A fenced run
        stays fenced (its task is being cancelled)."""
        with self._lock:
            held = self._held.get(run_id)
            if held is not None and run_id not in self._fenced and since > held.renewed:
                held.until, held.renewed = since + self.lease_seconds, since

    def drop(self, run_id: str) -> None:
        """The run is no longer driven here (finished, released, abandoned)."""
        with self._lock:
            self._held.pop(run_id, None)
            self._fenced.discard(run_id)

    def give_up(self, run_id: str) -> None:
        """The loop abandons the run (its lease is lost): fenced, no longer renewed."""
        with self._lock:
            if run_id in self._held:
                self._fenced.add(run_id)

    def fenced(self, run_id: str) -> bool:
        """Whether the run's lease may have ended: write nothing more for it."""
        # Read without the lock (asked before and after every write): a set's membership
        # test is atomic under the GIL, and the lock orders only the updates.
        return run_id in self._fenced

    def lease_until(self, run_id: str) -> float | None:
        with self._lock:
            held = self._held.get(run_id)
            return None if held is None else held.until

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin keeping the leases, telling ``loop``. Calls nest: each :meth:`start`
        needs its :meth:`stop`. The threads are started at the first lease held and kept
        (until :meth:`close`): ``Engine.run`` starts and stops a heartbeat per run."""
        with self._lock:
            self._users += 1
            self._loops.append(loop)
            self._loop = loop
        if not self._active.is_set():
            # (Setting an Event takes its condition's lock, per run. A thread that clears
            # it looks at ``_users`` after, so this start is seen either way.)
            self._active.set()
        with self._lock:
            holding = bool(self._held)
        if holding:
            self._start_threads()

    def _start_threads(self) -> None:
        # Not before the first lease: a worker with nothing to drive (10,000 waiting runs)
        # holds no thread for it.
        if self._started:
            return
        self._started = True
        for target, name in (
            (self._watch, "flowloop-fence"),
            (self._renew_loop, "flowloop-lease"),
        ):
            threading.Thread(target=target, name=name, daemon=True).start()

    def stop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """End one :meth:`start` of ``loop`` (``None``: the latest start, for a coroutine
        finalized outside its loop); calls then go to the loop started latest of those
        still started. After the last, the threads renew, poll and fence nothing (they see
        it at their next tick, without being woken: ``Engine.run`` stops and starts a
        heartbeat per run) and idle after ``IDLE_AFTER`` seconds without a user."""
        with self._lock:
            self._users = max(0, self._users - 1)
            loops = self._loops
            if loop is not None and loop in loops:
                del loops[len(loops) - 1 - loops[::-1].index(loop)]
            elif loops:
                loops.pop()
            if loops:
                self._loop = loops[-1]
        if not self._users:
            self._idle_since = time.monotonic()

    def close(self) -> None:
        """Let the threads end (the renewer when a call it is in returns)."""
        self._users = 0
        self._closed.set()
        self._active.set()  # rings idle threads: they see the close
        self._changed.set()

    def _hand_controls(self, poll: int, requests: Mapping[str, str]) -> None:
        """On the loop: the requests that poll number ``poll`` read, unless a later poll's
        came first (one queued to an outer loop while a nested ``Engine.run`` drove its
        own is overtaken: applied after them, it would bring back a withdrawn pause)."""
        if poll <= self._polls_handed:
            return
        self._polls_handed = poll
        self._controls(requests)

    # -- the threads -----------------------------------------------------------------------

    def _to_loop(self, callback: Callable[..., None], *args: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to tell
            loop.call_soon_threadsafe(callback, *args)
        # Counted once queued (under a lock: two threads hand calls over): a loop thread
        # that sees the count move takes a turn, which runs every call counted before it
        # (Executor._take_a_turn; runs going from step to step without one otherwise).
        with self._handed_lock:
            self.handed += 1

    def _watch(self) -> None:
        """Fence off runs whose deadline passed; sleep until the next deadline."""
        while not self._closed.is_set():
            if not self._users:
                self._idle(self._changed, watcher=True)
                self._changed.clear()
                continue
            now = time.monotonic()
            due: list[tuple[str, _Held]] = []
            wait = self.tick
            with self._lock:
                for run_id, held in self._held.items():
                    if run_id in self._fenced:
                        continue
                    left = held.until - self.margin - now
                    if left <= 0:
                        due.append((run_id, held))
                        self._fenced.add(run_id)
                    else:
                        wait = min(wait, left)
            for run_id, held in due:
                self._fence(run_id, held, now)
            self._watch_wake = time.monotonic() + wait
            self._changed.wait(wait)
            self._watch_wake = math.inf
            self._changed.clear()

    def _idle(self, bell: threading.Event, *, watcher: bool) -> None:
        """No user: tick (a start is seen at the next tick), and after ``IDLE_AFTER``
        seconds sleep on the doorbell instead (an idle worker holds no busy thread)."""
        wait = self.tick
        if time.monotonic() - self._idle_since >= IDLE_AFTER:
            self._active.clear()
            if self._users:  # a start came in between: it may have rung already
                return
            bell, wait = self._active, IDLE_WAIT
        if watcher:
            self._watch_wake = time.monotonic() + wait
        bell.wait(wait)
        if watcher:
            self._watch_wake = math.inf

    def _fence(self, run_id: str, held: _Held, now: float) -> None:
        if self._released(run_id):
            return  # let go of meanwhile: its lease no longer matters
        since = now - held.renewed
        self._to_loop(self._lost, run_id, FENCED)  # first: queued before the line is out
        log.warning(
            "run %s: lease not renewed for %.2fs (lease %gs; it ends in %.2fs at the earliest); "
            "lease deadline passed, abandoning it (self-fencing)",
            run_id,
            since,
            self.lease_seconds,
            held.until - now,
            extra={
                "run": run_id,
                "event": "lease_lost",
                "self_fenced": True,
                "since_renewal": round(since, 3),
                "fenced_at": round(now, 3),
                "lease_until": round(held.until, 3),
            },
        )

    def _renew_loop(self) -> None:
        last_renewal = last_poll = time.monotonic()
        failing = False
        heartbeat = outagelog.Part("heartbeat")
        quiet_to_hand = 0  # polls without requests still to hand over (see the constant)
        polls = 0
        while not self._closed.wait(self.tick):
            if not self._users:
                self._idle(self._closed, watcher=False)
                continue
            now = time.monotonic()
            try:
                renewed = False
                if now - last_renewal >= self.lease_seconds * RENEW_FRACTION or failing:
                    renewed = self._renew_held()
                    last_renewal = now
                if (now - last_poll >= self.poll_seconds or failing) and self._holding():
                    requests = self._poll()
                    last_poll, polls = now, polls + 1
                    # Handed over after requests even when empty: the loop drops a pause
                    # that was withdrawn meanwhile (an operator's unpause of a running run).
                    if requests or quiet_to_hand:
                        self._to_loop(self._hand_controls, polls, dict(requests))
                    quiet_to_hand = QUIET_POLLS_HANDED if requests else max(0, quiet_to_hand - 1)
                # Only a renewal (a write) that answered ends the heartbeat's outage: with
                # every run fenced off there is none to make, and a poll (a read) answers
                # from a read-only database too.
                if failing and renewed:
                    heartbeat.answered()
                    failing = False
            except Exception as error:  # keep beating (retrying every tick) through a hiccup
                # Each failure told at the outage's level (WARNING first, then once a minute):
                # logged only when not failing yet, an outage that came while the heartbeat
                # still waited for an answer to end the last one (it held nothing to renew)
                # was never said at all.
                text = str(error).strip().splitlines()
                log.log(
                    heartbeat.failed(),
                    "heartbeat failed (retrying): %s",
                    text[0] if text else type(error),
                )
                failing = True

    def _holding(self) -> bool:
        """Runs are held: pause/stop requests concern only runs driven here."""
        with self._lock:
            return bool(self._held)

    def _loop_wedged(self, held: int) -> bool:
        """Whether the loop has not ticked for :attr:`stall_seconds` (warned once a stall).
        Its runs are then left to the fence: a loop that cannot step them must not keep
        them from another worker."""
        tick = self._last_tick()
        if tick is None:
            return False
        blocked = time.monotonic() - tick
        if blocked < self.stall_seconds:
            if self._wedged_since is not None:
                log.info("event loop runs again: lease renewals resumed")
                self._wedged_since = None
            return False
        if self._wedged_since != tick:
            self._wedged_since = tick
            log.warning(
                "event loop blocked for %.1fs (bound %.1fs): no longer renewing the leases of "
                "its %d run(s), another worker will take them over — a step blocks the loop "
                "(a blocking call in `async def`?)",
                blocked,
                self.stall_seconds,
                held,
                extra={"event": "loop_wedged", "blocked": round(blocked, 3)},
            )
        return True

    def _renew_held(self) -> bool:
        """Renew the leases of the runs held here; whether the database was asked."""
        with self._lock:
            held = [run_id for run_id in self._held if run_id not in self._fenced]
        held = [run_id for run_id in held if not self._released(run_id)]
        if not held or self._loop_wedged(len(held)):
            return False
        before = time.monotonic()
        result = self._renew(held)
        kept, unknown = (
            (result.kept, result.unknown) if isinstance(result, Renewal) else (result, set())
        )
        self.renewals += 1
        with self._lock:
            for run_id in kept:
                entry = self._held.get(run_id)
                if entry is not None and run_id not in self._fenced and before > entry.renewed:
                    entry.until, entry.renewed = before + self.lease_seconds, before
        for run_id in set(held) - kept - unknown:
            # The loop decides (a run released meanwhile is not lost): it has the truth.
            self._to_loop(
                self._lost, run_id, "lost its lease (expired, or taken over by another worker)"
            )
        return True


# -- the database calls of the renewer ------------------------------------------------------


def stall_bound(store: Store, lease_seconds: float) -> float:
    """How long the loop may go without a tick before its leases stop being renewed:
    :data:`STALL_LEASES` leases, and at least the longest a database call of the loop can
    hold it under the connection timeouts (flowloop.store.dialect.set_lease_bounds), plus
    a renewal period — so a slow call keeps the leases.

    On PostgreSQL the longest call is a statement timing out, or, on a silent network, a
    call failed by ``tcp_user_timeout`` (which the kernel checks coarsely: up to 3 times
    it) and then the reconnect's ``connect_timeout``; on SQLite the busy timeout. For the
    0.6 s leases of the tests: 1.8 s on SQLite, 5.2 s on PostgreSQL (the timeouts' floors);
    for a 30 s lease: 90 s on both. A wedged loop's run is fenced within the bound and a
    lease more after its last tick, and taken over once its lease has ended in the database.
    """
    from flowloop.store import dialect
    from flowloop.store.sql import SQLStore

    bound = STALL_LEASES * lease_seconds
    period = lease_seconds * RENEW_FRACTION
    if isinstance(store, SQLStore) and store.engine.dialect.name == "postgresql":
        connect = dialect.pg_connect_params(lease_seconds)
        network = 3 * connect["tcp_user_timeout"] / 1000 + connect["connect_timeout"]
        statement = dialect.pg_statement_timeout_ms(lease_seconds) / 1000
        return max(bound, max(network, statement) + period)
    return max(bound, dialect.busy_timeout_ms(lease_seconds) / 1000 + period)


def renewer(store: Store, *, worker: str, lease_seconds: float) -> Renew:
    """How the renewer renews: on PostgreSQL through a pooled connection of its own, so a
    call of the loop stuck on the store's held writer (and its lock) cannot hold the
    renewals up, skipping rows another transaction has locked (the group commit writing
    them: never wait on it, see :func:`flowloop.store.leases.renew_skip_locked`); on SQLite
    through the store (its lock serializes the renewal with the
    loop's writes, which the busy timeout bounds: one writer at a time either way)."""
    from flowloop.store import leases
    from flowloop.store.schema import runs
    from flowloop.store.sql import SQLStore

    if isinstance(store, SQLStore) and store.engine.dialect.name == "postgresql":
        engine, now_sql = store.engine, store.now_sql

        def renew_apart(run_ids: Sequence[str]) -> Renewal:
            with engine.connect() as conn, conn.begin():
                kept, unknown = leases.renew_skip_locked(
                    conn,
                    runs,
                    runs.c.id,
                    now_sql=now_sql,
                    worker=worker,
                    keys=run_ids,
                    lease_seconds=lease_seconds,
                )
                return Renewal(kept, unknown)

        return renew_apart
    return lambda run_ids: store.renew(worker=worker, run_ids=run_ids, lease_seconds=lease_seconds)


def poller(store: Store, *, worker: str) -> Poll:
    """How the renewer reads control requests: a read on a pooled connection (in memory,
    where the one connection is the loop's writer, the store's reads take its lock)."""
    return lambda: store.pending_controls(worker=worker)
