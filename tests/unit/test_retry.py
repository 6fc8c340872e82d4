"""Retry policy: pure delay and should-retry arithmetic."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from flowloop import Retry
from flowloop.errors import FlowloopError, StepTimeout
from flowloop.retry import DEFAULT_RETRY, NO_RETRY, seconds


@pytest.mark.parametrize(
    ("backoff", "expected"),
    [
        ("fixed", [2.0, 2.0, 2.0, 2.0, 2.0]),
        ("linear", [2.0, 4.0, 6.0, 8.0, 10.0]),
        ("exponential", [2.0, 4.0, 8.0, 16.0, 32.0]),
    ],
)
def test_delay__backoff_shapes(backoff: str, expected: list[float]) -> None:
    policy = Retry(attempts=10, backoff=backoff, base=2, cap=1000)  # type: ignore[arg-type]
    assert [policy.delay(n) for n in range(1, 6)] == expected


@pytest.mark.parametrize("backoff", ["fixed", "linear", "exponential"])
def test_delay__capped(backoff: str) -> None:
    policy = Retry(attempts=10, backoff=backoff, base=10, cap=25)  # type: ignore[arg-type]
    assert max(policy.delay(n) for n in range(1, 10)) <= 25.0
    assert policy.delay(9) == (10.0 if backoff == "fixed" else 25.0)


def test_delay__huge_attempt_does_not_overflow() -> None:
    assert Retry(base=1, cap=300).delay(10_000) == 300.0


def test_delay__attempt_below_one_treated_as_first() -> None:
    assert Retry(base=3, backoff="linear").delay(0) == 3.0


def test_delay__timedelta_base_and_cap() -> None:
    policy = Retry(
        backoff="exponential", base=timedelta(milliseconds=500), cap=timedelta(seconds=3)
    )
    assert [policy.delay(n) for n in range(1, 5)] == [0.5, 1.0, 2.0, 3.0]


def test_delay__jitter_stays_within_bounds_and_varies() -> None:
    policy = Retry(backoff="fixed", base=10, cap=10, jitter=0.2)
    rand = random.Random(7)
    samples = [policy.delay(1, rand) for _ in range(2000)]
    assert min(samples) >= 8.0 and max(samples) <= 12.0
    assert min(samples) < 8.5 and max(samples) > 11.5  # it really spreads
    assert len(set(samples)) > 1000


def test_delay__jitter_applies_after_the_cap() -> None:
    policy = Retry(backoff="exponential", base=1, cap=4, jitter=0.5)
    rand = random.Random(1)
    samples = [policy.delay(10, rand) for _ in range(500)]
    assert all(2.0 <= s <= 6.0 for s in samples)


def test_delay__full_jitter_never_negative() -> None:
    policy = Retry(backoff="fixed", base=1, cap=1, jitter=1.0)
    rand = random.Random(3)
    assert all(0.0 <= policy.delay(1, rand) <= 2.0 for _ in range(500))


def test_delay__zero_base_means_at_once() -> None:
    assert Retry(base=0, jitter=0.5).delay(3) == 0.0


def test_should_retry__counts_every_attempt_including_the_first() -> None:
    policy = Retry(attempts=3)
    error = RuntimeError("x")
    assert [policy.should_retry(error, n) for n in (1, 2, 3, 4)] == [True, True, False, False]
    assert not NO_RETRY.should_retry(error, 1)
    assert DEFAULT_RETRY.attempts == 3
    assert policy.has_attempts_left(2) and not policy.has_attempts_left(3)


def test_should_retry__only_listed_errors_and_their_subclasses() -> None:
    policy = Retry(attempts=5, on=(ConnectionError, TimeoutError))
    assert policy.should_retry(ConnectionError(), 1)
    assert policy.should_retry(ConnectionResetError(), 1)  # a subclass
    assert policy.should_retry(StepTimeout("slow"), 1)  # timeouts are TimeoutErrors
    assert not policy.should_retry(ValueError(), 1)


def test_should_retry__giving_up_on_wins_over_on() -> None:
    policy = Retry(attempts=5, on=(OSError,), giving_up_on=(PermissionError,))
    assert policy.should_retry(OSError(), 1)
    assert not policy.should_retry(PermissionError(), 1)
    assert not policy.is_retryable(PermissionError())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attempts": 0}, "attempts must be at least 1"),
        ({"backoff": "random"}, "backoff must be one of fixed, linear, exponential"),
        ({"base": -1}, "must not be negative"),
        ({"cap": timedelta(seconds=-1)}, "must not be negative"),
        ({"jitter": 1.5}, "jitter is a fraction"),
        ({"jitter": -0.1}, "jitter is a fraction"),
        # Refused when declared: each failed only when a step raised, and took the worker
        # down with a traceback, the run left running (new-user audit).
        ({"jitter": "0.1"}, "jitter is a fraction"),
        ({"attempts": "3"}, "attempts must be an integer"),
        ({"attempts": True}, "attempts must be an integer"),
        ({"on": ("ValueError",)}, r"on takes exception classes"),
        ({"on": (ValueError(),)}, r"on takes exception classes"),
        ({"giving_up_on": "KeyError"}, r"giving_up_on takes exception classes"),
        ({"on": (int,)}, r"on takes exception classes"),
    ],
)
def test_retry__invalid_policy_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(FlowloopError, match=message):
        Retry(**kwargs)  # type: ignore[arg-type]


def test_describe__compact_summary() -> None:
    assert NO_RETRY.describe() == "no retry"
    # Counted as attempts (every try), never as "retry 3x", which reads as 1 + 3 tries.
    assert Retry(attempts=4, backoff="fixed", base=2, cap=60).describe() == "4 attempts, 2s apart"
    assert Retry(attempts=5, base=0.5, cap=30).describe() == "5 attempts, exponential 0.5s..30s"
    assert Retry(attempts=2, backoff="linear", base=1, cap=9, jitter=0.1).describe() == (
        "2 attempts, linear 1s..9s ±10%"
    )


def test_seconds__numbers_and_timedeltas() -> None:
    assert seconds(None) is None
    assert seconds(3) == 3.0
    assert seconds(timedelta(minutes=1)) == 60.0


def test_retry__cap_left_out_is_at_least_base() -> None:
    """``Retry(base=600)`` waited 300 s (the default cap cut it silently: new-user audit);
    a cap left out is now 5 minutes or ``base``, whichever is longer."""
    assert Retry(backoff="fixed", base=600).delay(1) == 600.0
    assert Retry(backoff="fixed", base=600).describe() == "3 attempts, 10m apart"
    assert Retry(base=1).delay(10_000) == 300.0  # (the default cap as before)


def test_retry__a_cap_given_below_base_is_refused_but_zero() -> None:
    """A cap below base cut every delay silently (a 10-minute base waited 5); ``cap=0``
    still retries at once whatever the base (review)."""
    with pytest.raises(FlowloopError, match=r"Retry\(base=10m, cap=5m\): cap is below base"):
        Retry(backoff="fixed", base=600, cap=300)
    assert Retry(attempts=5, cap=0).delay(3) == 0.0


def test_retry__one_exception_class_is_taken_as_a_tuple_of_one() -> None:
    policy = Retry(on=ValueError, giving_up_on=[KeyError])  # type: ignore[arg-type]
    assert (policy.on, policy.giving_up_on) == ((ValueError,), (KeyError,))
    assert policy.should_retry(ValueError(), 1) and not policy.should_retry(KeyError(), 1)


def test_retry__takes_what_isinstance_takes() -> None:
    """Unions and nested tuples worked before the check and must still (review)."""
    network = (ConnectionError, TimeoutError)
    for on in (ValueError | KeyError, (network, OSError), [ValueError, (KeyError,)]):
        policy = Retry(on=on)  # type: ignore[arg-type]
        assert all(isinstance(c, type) for c in policy.on), policy.on
    assert Retry(on=ValueError | KeyError).should_retry(KeyError(), 1)  # type: ignore[arg-type]
    assert Retry(on=(network, OSError)).on == (ConnectionError, TimeoutError, OSError)  # type: ignore[arg-type]
