"""The threads that run sync steps, and what a step that hangs past its timeout costs.

A thread cannot be killed: a sync step cut off by its timeout (or by a stop, a lost lease,
the end of a grace period) goes on running in its thread. Its attempt is journaled already
and its late result is discarded, but the thread is not free. A fixed pool of
``max_concurrency`` threads would thus run no sync step again after that many hung
attempts, while the runs it holds keep their leases.

:class:`StepThreads` starts a thread when a step is submitted and none is idle, up to
``size`` threads doing work plus one per *abandoned* thread (still running a step that was
given up on), at most ``spare`` of them: a hung step costs its own slot for its timeout
and no more. The threads are daemon threads, so a process that is done (``flowloop run``,
a script) exits even while an abandoned step still runs; every such step's outcome is in
the journal already. When ``spare`` abandoned threads are reached the pool is *exhausted*:
the caller is told (the worker then stops gracefully and exits with code 3, so that its
supervisor starts a fresh process, see README "Operating").
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final

log = logging.getLogger("flowloop")

THREAD_NAME: Final = "flowloop-step"

_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class StepThreads:
    """An on-demand pool of daemon threads for sync steps that tolerates hung steps."""

    def __init__(self, size: int, *, spare: int | None = None, name: str = THREAD_NAME) -> None:
        if size < 1:
            raise ValueError("a step pool needs at least one thread")
        self.size = size
        self.spare = size if spare is None else spare
        """How many abandoned threads the pool replaces (its bound is ``size + spare``)."""
        self.name = name
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._idle = 0
        self._queued = 0
        self._abandoned: set[Future[Any]] = set()
        self._timed_out: set[Future[Any]] = set()
        self._cut_off_at: dict[Future[Any], float] = {}
        """When each thread of a step cut off (not timed out) was abandoned (monotonic)."""
        self._closed = False
        self._count = 0

    # -- state -----------------------------------------------------------------------------

    @property
    def abandoned(self) -> int:
        """Threads still running a step that was given up on (timed out, cut off)."""
        with self._lock:
            return len(self._abandoned)

    @property
    def timed_out(self) -> int:
        """Of :attr:`abandoned`, the threads of steps given up on for their timeout (hung
        past it, not cut off: a step cut off by a lost lease or a stop may end soon)."""
        with self._lock:
            return len(self._timed_out)

    def hung(self, grace: float) -> int:
        """Of :attr:`abandoned`, the threads taken for good: a timed-out step's, and a cut-off
        one's still running ``grace`` seconds after it was cut off."""
        since = time.monotonic() - grace
        with self._lock:
            old = sum(1 for at in self._cut_off_at.values() if at <= since)
            return len(self._timed_out) + old

    def next_hung(self, grace: float, bound: int) -> float | None:
        """When (monotonic) :meth:`hung` reaches ``bound`` should the threads now abandoned
        all still run then; ``None``: they are too few."""
        with self._lock:
            needed = bound - len(self._timed_out)
            cut_offs = sorted(self._cut_off_at.values())
        if needed <= 0:
            return time.monotonic()
        return cut_offs[needed - 1] + grace if len(cut_offs) >= needed else None

    @property
    def exhausted(self) -> bool:
        """Whether the abandoned threads reached the bound: each further one takes a slot."""
        return self.abandoned >= self.spare

    @property
    def threads(self) -> int:
        with self._lock:
            return len(self._threads)

    def _limit(self) -> int:
        return self.size + min(len(self._abandoned), self.spare)

    # -- use -------------------------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` in a pool thread; its future."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the step pool is shut down")
            self._queue.put((future, fn, args))
            self._queued += 1
            self._grow()
        return future

    def abandon(self, future: Future[Any], *, timed_out: bool = True) -> bool:
        """The caller gave up on ``future``'s step (``timed_out``: for its timeout, else cut
        off). Not started yet: it never runs. Running: its thread counts as abandoned until
        the step returns, and a thread is started in its place (within the bound). Returns
        whether the thread was abandoned."""
        if future.cancel():
            return False
        if future.done():
            return False
        with self._lock:
            self._abandoned.add(future)
            if timed_out:
                self._timed_out.add(future)
            else:
                self._cut_off_at[future] = time.monotonic()
            self._grow()
        future.add_done_callback(self._returned)
        return True

    def _returned(self, future: Future[Any]) -> None:
        with self._lock:
            self._abandoned.discard(future)
            self._timed_out.discard(future)
            self._cut_off_at.pop(future, None)

    def _grow(self) -> None:
        # Under the lock: start a thread for queued work no idle thread will take.
        while self._queued > self._idle and len(self._threads) < self._limit():
            self._count += 1
            thread = threading.Thread(
                target=self._work, name=f"{self.name}_{self._count}", daemon=True
            )
            self._threads.add(thread)
            self._idle += 1
            thread.start()

    def _work(self) -> None:
        me = threading.current_thread()
        try:
            while True:
                item = self._queue.get()
                with self._lock:
                    self._idle -= 1
                    if item is not None:
                        self._queued -= 1
                if item is None:
                    return
                future, fn, args = item
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(*args)
                    except BaseException as error:
                        future.set_exception(error)
                    else:
                        future.set_result(result)
                del item, future, fn, args
                with self._lock:
                    if self._closed or len(self._threads) > self._limit():
                        return  # an abandoned thread came back: the pool shrinks again
                    self._idle += 1
        finally:
            with self._lock:
                self._threads.discard(me)

    def shutdown(self) -> None:
        """Cancel queued steps and let idle threads end (busy ones end after their step)."""
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            with contextlib.suppress(Exception):
                self._queue.put(None)


def late_result(run_id: str, state: str, abandoned: list[bool], work: Future[Any]) -> None:
    # A thread cannot be killed: when a timed-out or cut-off sync step finishes anyway, its
    # result is discarded (that attempt's outcome is already in the journal) and logged.
    if abandoned and not work.cancelled():
        log.warning(
            "run %s: step %s finished after its timeout or cancellation; result discarded",
            run_id,
            state,
        )
