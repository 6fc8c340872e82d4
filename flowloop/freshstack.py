"""Calls whose cost does not depend on how deep the caller's stack is.

CPython (3.11 and later) keeps the frames of Python functions in per-thread chunks of
16 KiB. A call that does not fit in what is left of the current chunk maps a new one, and
its return unmaps it. A loop that goes back and forth across the end of a chunk therefore
maps, faults in and unmaps memory at every crossing (CPython issue gh-142183; its fix,
which keeps one freed chunk per thread, went into the 3.13 and 3.14 branches in March
2026, and 3.14.4 lists it; 3.11, 3.12 and the releases before the fix do not have it).
An event loop is such a loop: each step of a run goes down and up the same frames.
Measured on the 2-core test machine (Python 3.11.7, ``bench/stack_depth.py``): from 14
of 140 caller depths a 10-step ``Engine.run`` took 4 or more page faults, at the worst
256, and its steps then took 3.4 times the CPU; from the other depths, less than one.

:func:`on_fresh_stack` calls through a frame that reserves more stack than a 16 KiB chunk
has room for (its code object says so; the reserve is never written). CPython then starts
a chunk of 32 KiB for that frame, and everything the call does lives in the ~16 KiB after
it: the same room at any caller depth. That costs a map, an unmap and a page fault per
page the call's frames reach (two for a run): ~5 % of a 10-step run's steps/s here (~4 %
of its CPU), so :func:`steady_call` pays it only where it is needed.
It reads the thread's page faults around each call and takes the fresh chunk once
:data:`STRIKES` calls in a row faulted, the thrash's signature (a steady call faults none;
a thread's first call and a growing heap or cache fault for a call or two); it then makes
every :data:`PROBE_EVERY`-th call plainly, and goes back to plain calls when that one does
not fault. What it learns is the thread's, not a call site's: a thread that calls from a
thrashing and a quiet place in turn may never see STRIKES faulting calls in a row, and a
probe from the quiet place sends it back to plain calls.

Where a thread's page faults cannot be read (not Linux, not CPython, or ``getrusage``
refused), :func:`steady_call` calls plainly. When the current chunk is larger than 16 KiB
(a frame with a very large stack made it), the reserving frame may fit where it is, and
the call runs as it would have without it; so does a run whose own frames reach more than
~16 KiB below it. A traceback through the reserving frame holds a frame object of its
size (~16 KiB) for as long as the traceback is kept.
"""

from __future__ import annotations

import logging
import struct
import sys
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 1024
"""CPython's data-stack chunk (``DATA_STACK_CHUNK_SIZE``, unchanged from 3.11 to 3.14)."""

RESERVED_SLOTS = CHUNK_BYTES // struct.calcsize("P") + 8
"""The stack slots (pointers) the calling frame reserves: more than any 16 KiB chunk has
left."""

THRASH_FAULTS = 4
"""Page faults of one call that may be the thrash (it faults once per crossing)."""

STRIKES = 4
"""Calls in a row with :data:`THRASH_FAULTS` or more before a thread's calls take a fresh
chunk: more than the call or two that fault for other reasons (a thread's first call
makes its event loop; a heap or a database cache grows)."""

PROBE_EVERY = 256
"""A thread whose calls take the fresh chunk makes every this-many-th call plainly, to
see whether it still faults: a caller that moved, or calls that faulted for another
reason, go back to plain calls (at a thrashing depth that probe costs ~1 % of the calls'
time; a fresh chunk, ~5 % of a 10-step run's steps/s)."""


def on_fresh_stack(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)``, its frames on a data-stack chunk of their own (see the
    module's docstring)."""
    return fn(*args, **kwargs)


if sys.implementation.name == "cpython":
    # A larger stack than the code needs is safe (the reserve is never touched), and
    # CodeType.replace recomputes the frame's size from it.
    on_fresh_stack.__code__ = on_fresh_stack.__code__.replace(co_stacksize=RESERVED_SLOTS)


def _fault_counter() -> Callable[[], int | None] | None:
    """This thread's minor page faults so far, when they can be read (``None`` from a
    read that is refused: that call is not judged)."""
    if sys.implementation.name != "cpython" or not sys.platform.startswith("linux"):
        return None
    import resource

    def faults() -> int | None:
        try:
            return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        except OSError:
            return None

    try:
        resource.getrusage(resource.RUSAGE_THREAD)
    except (OSError, AttributeError):  # a sandbox that refuses it; no RUSAGE_THREAD
        return None
    return faults


thread_faults = _fault_counter()
"""This thread's page faults so far (``None``: not readable here)."""


class _Watch(threading.local):
    """Per thread: whether its calls take a fresh chunk, the faulting calls in a row (plain
    calls), and the calls since the last probe (fresh ones)."""

    fresh = False
    strikes = 0
    since_probe = 0


_watch = _Watch()


def steady_call(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)``, through :func:`on_fresh_stack` while this thread's plain
    calls keep faulting (see the module's docstring and :data:`PROBE_EVERY`). Used where
    ``Engine.run`` and ``Engine.run_until_idle`` enter their event loop."""
    faults = thread_faults
    if faults is None:
        return fn(*args, **kwargs)
    watch = _watch
    if watch.fresh:
        watch.since_probe += 1
        if watch.since_probe < PROBE_EVERY:
            return on_fresh_stack(fn, *args, **kwargs)
        watch.since_probe = 0  # this one plainly: does it still fault?
    before = faults()
    try:
        return fn(*args, **kwargs)
    finally:
        after = faults()
        if before is not None and after is not None:
            _judge(watch, after - before >= THRASH_FAULTS)


def _judge(watch: _Watch, faulted: bool) -> None:
    """After a plain call: a fresh thread's probe keeps it fresh only if it faulted; a
    plain thread's STRIKES-th faulting call in a row makes it fresh."""
    if watch.fresh:
        watch.fresh = faulted
        if not faulted:
            log.debug("a plain call no longer page-faults: this thread's calls run plainly")
        return
    watch.strikes = watch.strikes + 1 if faulted else 0
    if watch.strikes >= STRIKES:
        watch.fresh = True
        watch.strikes = 0
        log.debug(
            "%d calls in a row page-faulted: this thread's calls now start on a fresh "
            "data-stack chunk",
            STRIKES,
        )


def fresh_on_this_thread() -> bool:
    """Whether :func:`steady_call` takes a fresh chunk for this thread's calls."""
    return _watch.fresh


def reset_thread() -> None:
    """Forget what :func:`steady_call` learnt on this thread (for tests)."""
    _watch.fresh = False
    _watch.strikes = 0
    _watch.since_probe = 0
