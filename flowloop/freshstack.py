"""Calls whose cost does not depend on how deep the caller's stack is.

CPython (3.11 and later) keeps the frames of Python functions in per-thread chunks of
16 KiB. A call that does not fit in what is left of the current chunk maps a new one, and
its return unmaps it. A loop that goes back and forth across the end of a chunk therefore
maps, faults in and unmaps memory at every crossing (CPython issue gh-142183; since March
2026 the 3.13 and 3.14 branches keep one freed chunk per thread, 3.11 and 3.12 do not). An
event loop is such a loop: each step of a run goes down and up the same frames. Measured
on the 2-core test machine (Python 3.11.7): at about one caller depth in twenty, a
10-step ``Engine.run`` took 19 to 340 page faults, and at the worst its steps cost twice
as much CPU (173 µs against 84 µs per step); at the other depths it takes none.

:func:`on_fresh_stack` calls through a frame that reserves more stack than a 16 KiB chunk
has room for (its code object says so; the reserve is never written). CPython then starts
a chunk of 32 KiB for that frame, and everything the call does lives in the ~16 KiB after
it: the same room at any caller depth. That costs a map, an unmap and two page faults per
call, ~3 % of a 10-step run here — paid only where it is needed: :func:`steady` watches
the thread's page faults and takes the fresh chunk once calls keep faulting
(:data:`STRIKES` in a row), the thrash's signature. A steady call faults none; a thread's
first call (its event loop made) and a growing heap fault for one call or two.

Where a thread's page faults cannot be read (not Linux, or not CPython), :func:`steady`
calls plainly. When the current chunk is larger than 16 KiB (a frame with a very large
stack made it), the reserving frame may fit where it is, and the call runs as it would
have without it.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 1024
"""CPython's data-stack chunk (``DATA_STACK_CHUNK_SIZE``, unchanged from 3.11 to 3.14)."""

RESERVED_SLOTS = CHUNK_BYTES // 8 + 8
"""The stack slots the calling frame reserves: more than any 16 KiB chunk has left."""

THRASH_FAULTS = 4
"""Page faults of one call that may be the thrash (it faults once per crossing)."""

STRIKES = 3
"""Calls in a row with :data:`THRASH_FAULTS` or more before a thread's calls take a fresh
chunk: more than the one or two calls that fault for other reasons."""


def on_fresh_stack(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)``, its frames on a data-stack chunk of their own (see the
    module's docstring)."""
    return fn(*args, **kwargs)


if sys.implementation.name == "cpython":
    # A larger stack than the code needs is safe (the reserve is never touched), and
    # CodeType.replace recomputes the frame's size from it.
    on_fresh_stack.__code__ = on_fresh_stack.__code__.replace(co_stacksize=RESERVED_SLOTS)


def _fault_counter() -> Callable[[], int] | None:
    """This thread's minor page faults so far, when they can be read."""
    if sys.implementation.name != "cpython" or not sys.platform.startswith("linux"):
        return None
    import resource

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt

    return faults


thread_faults = _fault_counter()
"""This thread's page faults so far (``None``: not readable here)."""


class _Watch(threading.local):
    """Per thread: whether its calls take a fresh chunk, and the faulting calls in a row."""

    fresh = False
    strikes = 0


_watch = _Watch()


def steady(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)``, through :func:`on_fresh_stack` once this thread's calls
    have kept faulting (see the module's docstring). Used where ``Engine.run`` and
    ``Engine.run_until_idle`` enter their event loop."""
    watch = _watch
    if watch.fresh:
        return on_fresh_stack(fn, *args, **kwargs)
    faults = thread_faults
    if faults is None:
        return fn(*args, **kwargs)
    before = faults()
    try:
        return fn(*args, **kwargs)
    finally:
        if faults() - before < THRASH_FAULTS:
            watch.strikes = 0
        else:
            watch.strikes += 1
            if watch.strikes >= STRIKES:
                watch.fresh = True
                log.debug(
                    "%d calls in a row page-faulted: this thread's calls now start on a "
                    "fresh data-stack chunk",
                    STRIKES,
                )


def fresh_on_this_thread() -> bool:
    """Whether :func:`steady` takes a fresh chunk for this thread's calls."""
    return _watch.fresh


def reset_thread() -> None:
    """Forget what :func:`steady` learnt on this thread (for tests)."""
    _watch.fresh = False
    _watch.strikes = 0
