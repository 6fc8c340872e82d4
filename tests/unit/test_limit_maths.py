"""The pure maths of rate limits and breakers (flowloop/limits.py), with times given
explicitly (a fake clock's readings), and how limits show in diagrams, metrics and alerts."""

from __future__ import annotations

import itertools
from datetime import timedelta

from pydantic import BaseModel

from flowloop import FakeClock, Workflow
from flowloop.alerts import breaker_alert
from flowloop.flowcontrol import (
    Breaker,
    BreakerState,
    Bucket,
    RateLimit,
    admit,
    failed,
    parse_call,
    take,
)
from flowloop.flowcontrol import succeeded as breaker_succeeded
from flowloop.metrics import Metrics

PAY = RateLimit("payments", 10, per=timedelta(seconds=1))


def test_rate_limit__calls_are_spread_evenly_and_never_more_than_limit_per_window() -> None:
    clock = FakeClock(start=1000.0)
    bucket = Bucket(None, 0.0)
    granted: list[float] = []
    for _ in range(400):  # a caller every 10 ms, 4 s: 10/s are let through
        decision = take(PAY, bucket, clock.now(), queued=False)
        bucket = decision.bucket if decision.granted else Bucket(bucket.last_grant, 0.0)
        if decision.granted:
            granted.append(decision.due)
        clock.advance(0.01)
    # 10/s at most (41: both ends of the 4 s); a caller every 10 ms loses < 10 ms a grant.
    assert 36 <= len(granted) <= 41
    gaps = [b - a for a, b in itertools.pairwise(granted)]
    assert min(gaps) >= PAY.interval - 1e-9


def test_rate_limit__a_burst_is_queued_in_order_each_to_its_own_slot() -> None:
    now = 50.0
    bucket = Bucket(None, 0.0)
    first = take(PAY, bucket, now, queued=False)
    assert first.granted and first.due == now
    bucket = first.bucket
    slots = []
    for _ in range(5):  # five more callers at the same instant
        decision = take(PAY, bucket, now, queued=False)
        assert not decision.granted
        slots.append(decision.due)
        bucket = decision.bucket
    expected = [now + 0.1 * i for i in range(1, 6)]
    assert all(abs(a - b) < 1e-9 for a, b in zip(slots, expected, strict=True))
    # A newcomer waits behind the queue; the first queued caller, back at its slot, goes.
    assert take(PAY, bucket, now + 0.1, queued=False).granted is False
    back = take(PAY, bucket, slots[0], queued=True)
    assert back.granted and abs(back.due - slots[0]) < 1e-9
    # Back too early: told when it may go, the queue unchanged.
    early = take(PAY, back.bucket, slots[0] + 0.05, queued=True)
    assert not early.granted and early.bucket == back.bucket


def test_rate_limit__a_grant_due_within_the_lead_is_given_for_that_instant() -> None:
    bucket = Bucket(10.0, 0.0)
    decision = take(PAY, bucket, 10.05, queued=False, lead=0.2)
    assert decision.granted and abs(decision.due - 10.1) < 1e-9
    assert decision.bucket.last_grant == decision.due


def test_breaker__opens_after_failures_within_the_window_and_closes_after_a_trial() -> None:
    breaker = Breaker("pay", failures=3, within=timedelta(seconds=60), cool_down=30)
    clock = FakeClock(start=0.0)
    state = BreakerState()
    for _ in range(2):
        state, change = failed(breaker, state, clock.now(), None)
        assert change is None
        clock.advance(40)  # the first failure falls out of the 60 s window
    state, change = failed(breaker, state, clock.now(), "r0:2")
    assert change is None and state.status == "closed"
    state, change = failed(breaker, state, clock.now(), None)
    assert change == "opened" and state.until == clock.now() + 30
    refused = admit(breaker, state, clock.now() + 29, "r1:2")
    assert not refused.allowed and refused.due == state.until
    clock.advance(30)
    trial = admit(breaker, state, clock.now(), "r1:2")
    assert trial.allowed and trial.trial and trial.change == "half_opened"
    assert trial.state.trial == "r1:2"
    # Another call is refused while the trial runs (asked again within a second).
    other = admit(breaker, trial.state, clock.now() + 0.1, "r2:4")
    assert not other.allowed and other.due is not None and other.due <= clock.now() + 1.1
    # Another call's success does not close it; the trial's does.
    assert breaker_succeeded(trial.state, "r2:4") == (trial.state, None)
    closed, change = breaker_succeeded(trial.state, "r1:2")
    assert change == "closed" and closed.status == "closed"
    # A failed trial opens it for another cool-down.
    reopened, change = failed(breaker, trial.state, clock.now() + 1, "r1:2")
    assert change == "opened" and reopened.until == clock.now() + 31


def test_breaker__only_the_trial_call_changes_a_half_open_breaker() -> None:
    """A call let through before the breaker opened (``stale``), ending while the trial
    runs, neither closes nor reopens it; the trial's own outcome still does."""
    breaker = Breaker("pay", failures=1, within=60, cool_down=30)
    opened, _ = failed(breaker, BreakerState(), 0.0, "a:2")
    trial = admit(breaker, opened, 30.0, "t:2").state
    assert (trial.status, trial.trial) == ("half_open", "t:2")
    for call in ("stale:2", None, "t:1", "t:3"):
        assert failed(breaker, trial, 31.0, call) == (trial, None)
        assert breaker_succeeded(trial, call) == (trial, None)
    # While open, nothing but the cool-down changes it (the old trial's late success too).
    assert breaker_succeeded(opened, "a:2") == (opened, None)
    assert failed(breaker, opened, 1.0, "a:2") == (opened, None)
    assert failed(breaker, trial, 31.0, "t:2")[1] == "opened"


def test_breaker__a_trial_that_still_runs_past_the_cool_down_lets_nobody_through() -> None:
    breaker = Breaker("pay", failures=1, within=60, cool_down=30)
    opened, _ = failed(breaker, BreakerState(), 0.0, None)
    trial = admit(breaker, opened, 30.0, "t:2").state
    assert trial.until == 60.0
    # Past its own cool-down the trial still runs: refused, looked at again a second later.
    slow = admit(breaker, trial, 61.0, "o:2", trial_runs=True)
    assert not slow.allowed and slow.change is None and slow.due == 62.0
    assert slow.state == BreakerState("half_open", (), 62.0, "t:2")
    assert not admit(breaker, slow.state, 61.5, "o:2").allowed  # (no look before)
    # Its run's lease ended (the worker died) or the call ended unseen: the next call is
    # the trial.
    again = admit(breaker, slow.state, 62.5, "o:2", trial_runs=False)
    assert again.allowed and again.trial and again.change == "half_opened"
    assert again.state == BreakerState("half_open", (), 92.5, "o:2")
    # The first trial's late outcome changes nothing any more.
    assert breaker_succeeded(again.state, "t:2") == (again.state, None)
    # The trial's own call asking again (its step_started was never written) is let through.
    assert admit(breaker, again.state, 76.0, "o:2").allowed
    assert parse_call("o:2") == ("o", 2) and parse_call("worker-7") is None


class Ctx(BaseModel):
    n: int = 0


def test_limits__shown_in_the_diagram_metrics_and_alerts() -> None:
    flow = Workflow("pay", context=Ctx)
    flow.step(
        name="charge", initial=True, next="done", rate_limit=PAY, breaker=Breaker("provider")
    )(lambda ctx: None)
    flow.final("done")
    source = flow.diagram().source
    assert "rate payments 10/1s" in source
    assert "breaker provider" in source

    metrics = Metrics()
    metrics.breaker("provider", "opened")
    samples = {(name, tuple(sorted(labels.items()))): v for name, labels, v in metrics.samples()}
    assert samples[("flowloop_breaker_open", (("breaker", "provider"),))] == 1
    metrics.breaker("provider", "closed")
    samples = {(name, tuple(sorted(labels.items()))): v for name, labels, v in metrics.samples()}
    assert samples[("flowloop_breaker_open", (("breaker", "provider"),))] == 0

    opened = breaker_alert("provider", "opened", "w1", "RuntimeError: down")
    assert opened is not None and opened.level == "critical"
    assert breaker_alert("provider", "half_opened", "w1", None) is None
