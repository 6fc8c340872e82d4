"""The README's "Testing your workflows" example, as the test file a user would write (the
README shows this file; a test checks the two stay the same)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import BaseModel

from flowloop import Retry, Step, Workflow
from flowloop.testing import (
    SimulatedCrash,
    TestEngine,
    assert_crash_safe,
    assert_path,
    attempts,
)


class Signup(BaseModel):
    email: str
    welcome_id: str | None = None
    active: bool = False


signup = Workflow("signup", context=Signup, key="email")
mail_retry = Retry(attempts=5, backoff="exponential", base=60, cap=600, on=(ConnectionError,))


@signup.step(initial=True, next="awaiting_confirmation", retry=mail_retry)
def send_welcome(ctx: Signup, step: Step) -> None:
    if step.attempt == 1:
        raise ConnectionError("mail server busy")  # the retry waits a minute
    ctx.welcome_id = "mail-" + step.idempotency_key[:8]


signup.wait(
    "awaiting_confirmation",
    on={"confirm": "activate"},
    timeout=timedelta(days=2),
    on_timeout="expired",
)


@signup.step(next="active", idempotent=False)
def activate(ctx: Signup) -> None:
    ctx.active = True


signup.final("active", "expired")


def test_unconfirmed_signup_expires_after_two_days(flowloop_engine: TestEngine) -> None:
    run = flowloop_engine.start(signup, {"email": "ann@example.com"})
    flowloop_engine.run_until_idle()  # jumps the minute of backoff, then the two days
    assert_path(flowloop_engine, run, ["send_welcome", "awaiting_confirmation", "expired"])
    first, second = attempts(flowloop_engine, run, "send_welcome")
    assert second.started_at - first.started_at == 60


def test_confirmed_signup_is_activated(flowloop_engine: TestEngine) -> None:
    run = flowloop_engine.start(signup, {"email": "bob@example.com"})
    flowloop_engine.advance(timedelta(days=1))
    flowloop_engine.send(run.id, "confirm")
    flowloop_engine.run_until_idle()
    assert flowloop_engine.get(run.id).status == "succeeded"
    assert flowloop_engine.path(run)[-2:] == ["activate", "active"]


def test_a_crash_inside_activate_is_left_to_an_operator(flowloop_engine: TestEngine) -> None:
    run = flowloop_engine.start(signup, {"email": "cy@example.com"})
    flowloop_engine.advance(timedelta(hours=1))  # the welcome mail is out: it waits
    flowloop_engine.send(run.id, "confirm")
    flowloop_engine.crash_at("activate", "inside")  # dies after the step ran, before commit
    with pytest.raises(SimulatedCrash):
        flowloop_engine.run_until_idle()
    flowloop_engine.resume()  # a fresh engine takes over the database
    info = flowloop_engine.get(run.id)
    assert (info.status, info.reason) == ("failed", "interrupted")  # not re-run silently


def test_every_crash_point_ends_like_the_uninterrupted_run() -> None:
    def confirm(engine: TestEngine, run_id: str) -> None:  # done again after a crash:
        engine.advance(timedelta(hours=1))
        engine.send(run_id, "confirm", dedupe_key="confirm-1")  # so sent with a dedupe key

    sweep = assert_crash_safe(signup, {"email": "dee@example.com"}, actions=[confirm])
    assert len(sweep.outcomes) == 2 * len(sweep.commits)  # before and after each commit


def test_a_step_replaced_for_one_test(flowloop_engine: TestEngine) -> None:
    def no_mail(ctx: Signup) -> None:
        ctx.welcome_id = "mail-test"

    with flowloop_engine.override(signup, "send_welcome", no_mail):
        run = flowloop_engine.run(signup, {"email": "eve@example.com"})
    assert run.state == "awaiting_confirmation"
    assert run.context == Signup(email="eve@example.com", welcome_id="mail-test")
