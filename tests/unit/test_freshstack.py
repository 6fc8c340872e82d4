"""flowloop.freshstack: a call through a frame that starts a fresh data-stack chunk, and
the per-thread rule that takes it once calls keep page-faulting (CPython gh-142183)."""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Callable
from types import FrameType

import pytest

from flowloop import freshstack
from flowloop.freshstack import (
    STRIKES,
    THRASH_FAULTS,
    fresh_on_this_thread,
    on_fresh_stack,
    steady_call,
)

CPYTHON_ON_LINUX = sys.implementation.name == "cpython" and sys.platform.startswith("linux")


def caller_code_name() -> str:
    """The name of the function that called this one."""
    frame: FrameType = sys._getframe(1)
    return frame.f_code.co_name


def test_on_fresh_stack__passes_arguments_and_returns_or_raises() -> None:
    assert on_fresh_stack(divmod, 7, 2) == (3, 1)
    assert on_fresh_stack(int, "ff", base=16) == 255
    with pytest.raises(ZeroDivisionError):
        on_fresh_stack(divmod, 1, 0)


def in_a_new_thread(fn: Callable[[], int]) -> int:
    """``fn()`` in a thread of its own (a fresh data stack): its result."""
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def nothing() -> None:
    return None


@pytest.mark.skipif(
    not CPYTHON_ON_LINUX or sys.version_info >= (3, 13),
    reason="a thread's page faults, on a CPython that does not keep a freed chunk",
)
def test_on_fresh_stack__maps_a_fresh_chunk_per_call() -> None:
    """A call through it faults in fresh pages every time (its chunk is mapped for it and
    unmapped after); the same call made plainly, none."""
    counter = freshstack.thread_faults
    assert counter is not None

    def faults_of_calls(call: Callable[[], None]) -> int:
        call()  # (the thread's first call of it)
        before = counter()
        for _ in range(20):
            call()
        return counter() - before

    assert in_a_new_thread(lambda: faults_of_calls(nothing)) < 10
    assert in_a_new_thread(lambda: faults_of_calls(lambda: on_fresh_stack(nothing))) >= 20


def faults_of(script: list[int]) -> Callable[[], int]:
    """A page-fault counter that grows by the script's counts, one per plain call of
    ``steady_call`` (which reads it twice: before and after the call; a fresh call reads it
    only when it probes)."""
    total = [0]
    reads = [0]

    def faults() -> int:
        reads[0] += 1
        if reads[0] % 2 == 0:  # the read after a plain call: that call's faults
            total[0] += script[reads[0] // 2 - 1]
        return total[0]

    return faults


def through(monkeypatch: pytest.MonkeyPatch, script: list[int], calls: int) -> list[str]:
    """``calls`` calls of ``steady_call``, the plain ones faulting as the script says; per
    call, the function that called its function (``on_fresh_stack`` for a fresh call)."""
    monkeypatch.setattr(freshstack, "thread_faults", faults_of(script))
    return [steady_call(caller_code_name) for _ in range(calls)]


def test_steady_call__takes_the_fresh_chunk_after_strikes_in_a_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    callers = through(monkeypatch, [THRASH_FAULTS] * STRIKES, STRIKES + 2)
    assert callers == ["steady_call"] * STRIKES + ["on_fresh_stack"] * 2
    assert fresh_on_this_thread()


def test_steady_call__a_clean_call_resets_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Faulting calls, but never STRIKES of them in a row: a first call making its event
    # loop, a heap that grows now and then.
    script = ([THRASH_FAULTS * 10] * (STRIKES - 1) + [THRASH_FAULTS - 1]) * 3 + [0]
    assert set(through(monkeypatch, script, len(script))) == {"steady_call"}
    assert not fresh_on_this_thread()


def test_steady_call__probes_plainly_and_stays_fresh_while_the_probe_faults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(freshstack, "PROBE_EVERY", 3)
    # STRIKES plain calls fault; then fresh, fresh, a probe (faults), fresh, fresh, a
    # probe that does not fault, and plain calls from then on.
    script = [THRASH_FAULTS] * STRIKES + [THRASH_FAULTS, 0, 0, 0]
    callers = through(monkeypatch, script, STRIKES + 8)
    fresh, plain = "on_fresh_stack", "steady_call"
    assert callers[STRIKES:] == [fresh, fresh, plain, fresh, fresh, plain, plain, plain]
    assert not fresh_on_this_thread()


def test_steady_call__back_to_plain_calls_it_needs_strikes_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(freshstack, "PROBE_EVERY", 2)
    # Fresh after STRIKES; a fresh call, a probe that does not fault (plain again); then
    # STRIKES - 1 faulting calls stay plain, and one more makes the thread fresh again.
    script = [THRASH_FAULTS] * STRIKES + [0] + [THRASH_FAULTS] * STRIKES
    callers = through(monkeypatch, script, 2 * STRIKES + 3)
    fresh, plain = "on_fresh_stack", "steady_call"
    assert callers[STRIKES:] == [fresh, plain] + [plain] * STRIKES + [fresh]


def test_steady_call__a_refused_read_judges_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = iter([None, 10**6] * STRIKES)  # a refused read, then a huge count: no strike
    monkeypatch.setattr(freshstack, "thread_faults", lambda: next(reads))
    assert [steady_call(caller_code_name) for _ in range(STRIKES)] == ["steady_call"] * STRIKES
    assert not fresh_on_this_thread()


def test_steady_call__without_a_counter_calls_plainly_even_when_fresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    through(monkeypatch, [THRASH_FAULTS] * STRIKES, STRIKES)
    assert fresh_on_this_thread()
    monkeypatch.setattr(freshstack, "thread_faults", None)
    assert steady_call(caller_code_name) == "steady_call"


def test_steady_call__is_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    through(monkeypatch, [THRASH_FAULTS] * STRIKES, STRIKES)
    assert steady_call(caller_code_name) == "on_fresh_stack"
    elsewhere: list[str] = []
    monkeypatch.setattr(freshstack, "thread_faults", faults_of([0]))
    thread = threading.Thread(target=lambda: elsewhere.append(steady_call(caller_code_name)))
    thread.start()
    thread.join()
    assert elsewhere == ["steady_call"]


def test_steady_call__counts_a_call_that_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freshstack, "thread_faults", faults_of([THRASH_FAULTS] * STRIKES))
    for _ in range(STRIKES):
        with pytest.raises(ZeroDivisionError):
            steady_call(divmod, 1, 0)
    assert steady_call(caller_code_name) == "on_fresh_stack"


def test_steady_call__without_a_fault_counter_calls_plainly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(freshstack, "thread_faults", None)
    assert steady_call(caller_code_name) == "steady_call"
    assert steady_call(divmod, 7, 2) == (3, 1)


@pytest.mark.skipif(not CPYTHON_ON_LINUX, reason="a thread's page faults: Linux, CPython")
def test_thread_faults__counts_this_threads_page_faults_only() -> None:
    counter = freshstack.thread_faults
    assert counter is not None

    def touch_fresh_pages() -> int:
        with mmap.mmap(-1, 64 * mmap.PAGESIZE) as fresh:  # pages never touched
            for page in range(0, len(fresh), mmap.PAGESIZE):
                fresh[page] = 1  # each write faults a page in
        return 64

    before = counter()
    touch_fresh_pages()
    assert counter() - before >= 64
    before = counter()
    in_a_new_thread(touch_fresh_pages)  # another thread's faults: not this one's
    assert counter() - before < 32
