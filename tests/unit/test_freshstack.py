"""flowloop.freshstack: a call through a frame that starts a fresh data-stack chunk, and
the per-thread rule that takes it once calls keep page-faulting (CPython gh-142183)."""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import pytest

from flowloop import freshstack
from flowloop.freshstack import (
    CHUNK_BYTES,
    STRIKES,
    THRASH_FAULTS,
    on_fresh_stack,
    reset_thread,
    steady,
)

CPYTHON_ON_LINUX = sys.implementation.name == "cpython" and sys.platform.startswith("linux")


@pytest.fixture(autouse=True)
def fresh_watch() -> Iterator[None]:
    reset_thread()
    yield
    reset_thread()


def caller_code_name() -> str:
    """The name of the function that called this one."""
    frame: FrameType = sys._getframe(1)
    return frame.f_code.co_name


def test_on_fresh_stack__passes_arguments_and_returns_or_raises() -> None:
    assert on_fresh_stack(divmod, 7, 2) == (3, 1)
    assert on_fresh_stack(int, "ff", base=16) == 255
    with pytest.raises(ZeroDivisionError):
        on_fresh_stack(divmod, 1, 0)


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's data stack")
def test_on_fresh_stack__reserves_more_than_a_chunk_holds() -> None:
    code = on_fresh_stack.__code__
    assert code.co_stacksize * 8 > CHUNK_BYTES


def faults_of(script: list[int]) -> Callable[[], int]:
    """A page-fault counter that grows by the script's counts, one per call of ``steady``
    (each call reads it twice: before and after)."""
    total = [0]
    reads = [0]

    def faults() -> int:
        reads[0] += 1
        if reads[0] % 2 == 0:  # the read after a call: that call's faults
            total[0] += script[reads[0] // 2 - 1]
        return total[0]

    return faults


def through(monkeypatch: pytest.MonkeyPatch, script: list[int]) -> list[str]:
    """``steady`` called once per script entry; per call, the code that called the
    function (``on_fresh_stack`` when the fresh chunk was taken)."""
    monkeypatch.setattr(freshstack, "thread_faults", faults_of(script))
    return [steady(caller_code_name) for _ in script]


def test_steady__takes_the_fresh_chunk_after_strikes_in_a_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = [THRASH_FAULTS] * STRIKES + [0, 0]
    callers = through(monkeypatch, script)
    assert callers[:STRIKES] == ["steady"] * STRIKES
    assert callers[STRIKES:] == ["on_fresh_stack", "on_fresh_stack"]


def test_steady__a_clean_call_resets_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    # Faulting calls, but never STRIKES of them in a row: a first call making its event
    # loop, a heap that grows now and then.
    script = ([THRASH_FAULTS * 10] * (STRIKES - 1) + [THRASH_FAULTS - 1]) * 3 + [0]
    assert set(through(monkeypatch, script)) == {"steady"}


def test_steady__is_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    through(monkeypatch, [THRASH_FAULTS] * STRIKES)
    assert steady(caller_code_name) == "on_fresh_stack"
    elsewhere: list[str] = []
    monkeypatch.setattr(freshstack, "thread_faults", faults_of([0]))
    thread = threading.Thread(target=lambda: elsewhere.append(steady(caller_code_name)))
    thread.start()
    thread.join()
    assert elsewhere == ["steady"]


def test_steady__counts_a_call_that_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freshstack, "thread_faults", faults_of([THRASH_FAULTS] * STRIKES))
    for _ in range(STRIKES):
        with pytest.raises(ZeroDivisionError):
            steady(divmod, 1, 0)
    assert steady(caller_code_name) == "on_fresh_stack"


def test_steady__without_a_fault_counter_calls_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(freshstack, "thread_faults", None)
    assert steady(caller_code_name) == "steady"
    assert steady(divmod, 7, 2) == (3, 1)


@pytest.mark.skipif(not CPYTHON_ON_LINUX, reason="a thread's page faults: Linux, CPython")
def test_thread_faults__counts_this_threads_page_faults() -> None:
    counter = freshstack.thread_faults
    assert counter is not None
    with mmap.mmap(-1, 64 * mmap.PAGESIZE) as fresh:  # pages never touched
        before = counter()
        for page in range(0, len(fresh), mmap.PAGESIZE):
            fresh[page] = 1  # each write faults a page in
        assert counter() - before >= 64
