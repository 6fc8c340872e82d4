"""What a step returns decides its event, and a return value that is no event it takes
fails the step at once (``InvalidEvent``, not retried) with one line that names the mistake
(flowloop/returns.py): a ``next=`` step returning a value or sleeping into an event (before,
both were ignored: the run went on to the ``next`` state, one waiting there for an event
that never came), a sync step returning a coroutine (an async helper called without
``await``), a bool for an event. A context left holding a float NaN or infinity fails
naming the field (before: "Input should be a valid number"). Real engines on SQLite."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Step, Workflow
from flowloop import journal as j
from flowloop.errors import InvalidEvent


class Ctx(BaseModel):
    total: float = 0.0
    values: list[float] = []
    paid: bool = False


def _one_step(fn: Callable[..., Any], **transitions: Any) -> Workflow:
    """Step ``a`` (``fn``) into ``nap`` (a wait for "woke") or ``done``."""
    wf = Workflow("returns", context=Ctx)
    wf.step(name="a", initial=True, **transitions)(fn)
    if "nap" in str(transitions):
        wf.wait("nap", on={"woke": "done"})
    wf.final("done")
    return wf


def _failed_at_once(url: str, wf: Workflow) -> str:
    """Run ``wf``: it fails on its first attempt, not retried; its error."""
    with Engine(url, workflows=[wf], clock=FakeClock()) as engine:
        info = engine.run(wf, Ctx())
        (failed,) = [e for e in engine.history(info.id) if e.kind == j.STEP_FAILED]
    assert (info.status, info.state) == ("failed", "a"), info
    assert (failed.attempt, failed.retryable, failed.error_type) == (1, False, "InvalidEvent")
    assert info.error is not None
    return info.error


def test_a_next_step_returning_a_value_fails(sqlite_url: str) -> None:
    wf = _one_step(lambda ctx: "whatever", next="done")
    assert _failed_at_once(sqlite_url, wf) == (
        "InvalidEvent: step 'a' has next='done' and returned 'whatever': "
        "return None, or declare on={...}"
    )


def test_a_next_step_sleeping_into_an_event_fails_instead_of_waiting_for_ever(
    sqlite_url: str,
) -> None:
    """The audit's nap: ``next="nap"`` and ``step.sleep(…, "woke")`` went to ``nap`` and
    waited there for "woke"."""

    def pay(ctx: Ctx, step: Step) -> Any:
        return step.sleep(timedelta(seconds=3), "woke")

    assert _failed_at_once(sqlite_url, _one_step(pay, next="nap")) == (
        "InvalidEvent: step 'a' has next='nap' and slept into event 'woke': sleep with no "
        "event (step.sleep(delay)), or declare on={'woke': ...}"
    )


@pytest.mark.parametrize("returned", ["none", "next", "sleep", "sleep next", "sleep done"])
def test_a_next_step_returning_none_or_next_or_sleeping_without_an_event_goes_on(
    sqlite_url: str, returned: str
) -> None:
    def step(ctx: Ctx, step: Step) -> Any:
        ctx.paid = True
        if returned.startswith("sleep"):
            # (a sleep may name the state next= leads to: the full suite's sleepy.py did)
            event = returned.removeprefix("sleep").strip() or None
            return step.sleep(timedelta(minutes=5), event)
        return "next" if returned == "next" else None

    wf = _one_step(step, next="done")
    with Engine(sqlite_url, workflows=[wf], clock=FakeClock()) as engine:
        info = engine.run(wf, Ctx())
    assert (info.status, info.state, info.context) == ("succeeded", "done", Ctx(paid=True))


def test_a_sync_step_returning_a_coroutine_says_to_await_it(sqlite_url: str) -> None:
    async def helper() -> str:
        return "ok"

    wf = _one_step(lambda ctx: helper(), on={"ok": "done"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error = _failed_at_once(sqlite_url, wf)
        gc.collect()
    assert error == (
        "InvalidEvent: step 'a' returned a coroutine (test_a_sync_step_returning_a_coroutine"
        "_says_to_await_it.<locals>.helper() called without await): make the step "
        "`async def` and await it"
    )
    assert not [w for w in caught if "never awaited" in str(w.message)]  # it was closed


@pytest.mark.parametrize(
    ("returned", "said"),
    [(True, "returned True"), (3, "returned 3"), (None, "returned None")],
)
def test_a_step_returning_no_str_says_an_event_is_a_name(
    sqlite_url: str, returned: object, said: str
) -> None:
    wf = _one_step(lambda ctx: returned, on={"ok": "done", "no": "done"})
    assert _failed_at_once(sqlite_url, wf) == (
        f"InvalidEvent: step 'a' {said}: return an event, the name of one of its on= keys "
        "('no', 'ok')"
    )


def test_an_on_step_sleeping_without_an_event_says_so(sqlite_url: str) -> None:
    wf = _one_step(lambda ctx, step: step.sleep(1), on={"ok": "done"})
    assert _failed_at_once(sqlite_url, wf) == (
        "InvalidEvent: step 'a' slept with no event: return an event, the name of one of its "
        "on= keys ('ok')"
    )


def test_an_undeclared_event_is_refused_as_before(sqlite_url: str) -> None:
    wf = _one_step(lambda ctx: "bad", on={"ok": "done"})
    assert _failed_at_once(sqlite_url, wf) == (
        "InvalidEvent: state 'a' does not accept event 'bad' (it accepts: ok)"
    )


def test_the_plain_loop_refuses_what_the_engine_refuses() -> None:
    from flowloop.etl.plain import run_plain

    with pytest.raises(InvalidEvent, match="has next='done' and returned 'whatever'"):
        run_plain(_one_step(lambda ctx, step: "whatever", next="done"), Ctx())


@pytest.mark.parametrize(
    ("field", "value", "where", "shown"),
    [
        ("total", float("nan"), "total", "nan"),
        ("total", float("-inf"), "total", "-inf"),
        ("values", [1.0, float("inf")], "values.1", "inf"),
    ],
)
def test_a_context_left_holding_nan_or_infinity_names_the_field(
    sqlite_url: str, field: str, value: Any, where: str, shown: str
) -> None:
    def step(ctx: Ctx) -> None:
        setattr(ctx, field, value)

    wf = _one_step(step, next="done")
    with Engine(sqlite_url, workflows=[wf], clock=FakeClock()) as engine:
        info = engine.run(wf, Ctx())
        (failed,) = [e for e in engine.history(info.id) if e.kind == j.STEP_FAILED]
    assert (info.status, failed.attempt, failed.retryable) == ("failed", 1, False)
    assert info.error == (
        f"ContextNotSerializable: workflow 'returns' step 'a' left context field {where!r} "
        f"holding a value the journal cannot store ({shown}: JSON has no NaN or infinity); "
        "store a finite number or None instead"
    )


def test_a_validation_error_the_step_raises_is_its_own(sqlite_url: str) -> None:
    """A step's own ValidationError (of another model) is not taken for the context's,
    whatever the context holds."""

    class Other(BaseModel):
        n: int

    def step(ctx: Ctx) -> None:
        ctx.total = float("nan")
        Other.model_validate({"n": "x"})

    wf = _one_step(step, next="done")
    with Engine(sqlite_url, workflows=[wf], clock=FakeClock()) as engine:
        info = engine.run(wf, Ctx())
    assert info.status == "failed"
    assert info.error is not None and info.error.startswith("ValidationError: n: ")
