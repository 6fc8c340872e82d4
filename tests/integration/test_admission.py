"""Debounced and throttled starts on SQLite and PostgreSQL (a fake clock, real databases)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Workflow
from flowloop.admission import AdmissionError, StartThrottled


class Change(BaseModel):
    customer: str
    n: int


def sync_workflow(seen: list[int]) -> Workflow:
    wf = Workflow("sync", context=Change, key="customer")

    @wf.step(initial=True, on={"done": "synced"})
    def push(ctx: Change) -> str:
        seen.append(ctx.n)
        return "done"

    wf.final("synced")
    return wf


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[Engine]:
    with Engine(store_url, clock=clock, poll_seconds=0.02) as e:
        yield e


def test_debounce__a_burst_becomes_one_run_with_the_last_context(
    engine: Engine, clock: FakeClock
) -> None:
    seen: list[int] = []
    wf = sync_workflow(seen)
    window = timedelta(seconds=30)
    ids = []
    for n in range(1, 6):
        ids.append(engine.start(wf, Change(customer="c1", n=n), debounce=window).id)
        clock.advance(10)  # each start within the window of the one before
    other = engine.start(wf, Change(customer="c2", n=99), debounce=window)
    assert len(set(ids)) == 1 and other.id != ids[0]
    run = engine.get(ids[0])
    assert (run.status, Change.model_validate(run.context).n) == ("scheduled", 5)
    kinds = [e.kind for e in engine.history(run.id)]
    assert kinds == ["run_created"] + ["run_debounced"] * 4
    assert engine.replay(run.id).matches
    engine.run_until_idle(idle_horizon=1)
    assert seen == []  # due 30 s after the last start, not yet
    clock.advance(30)
    engine.run_until_idle()
    assert sorted(seen) == [5, 99] and engine.get(run.id).status == "succeeded"
    # The burst is over and its run has run: the next start opens a new one.
    again = engine.start(wf, Change(customer="c1", n=6), debounce=window)
    assert again.id != run.id and again.status == "scheduled"
    assert engine.replay(again.id).matches


def test_debounce__a_run_already_started_is_not_changed(engine: Engine, clock: FakeClock) -> None:
    seen: list[int] = []
    wf = sync_workflow(seen)
    first = engine.start(wf, Change(customer="c1", n=1), debounce=5)
    clock.advance(5)
    engine.run_until_idle()
    second = engine.start(wf, Change(customer="c1", n=2), debounce=5)
    assert second.id != first.id and seen == [1]
    assert Change.model_validate(engine.get(first.id).context).n == 1


def test_debounce__a_run_that_began_with_a_call_is_not_changed(
    engine: Engine, clock: FakeClock
) -> None:
    # Its call started the child, which waits: the run is queued (scheduled, no owner) with
    # no step started, but it has begun. A later start opens a new burst; merged into it,
    # it replaced the context of a run whose child runs and made it due meanwhile.
    child = Workflow("approve", context=Change)
    child.wait("hold", on={"go": "done"}, initial=True)
    child.final("done")
    wf = Workflow("calling", context=Change, key="customer")
    wf.call("ask", child=child, context=lambda ctx: ctx, on={"succeeded": "done"}, initial=True)
    wf.final("done")
    first = engine.start(wf, Change(customer="c1", n=1), debounce=5)
    clock.advance(5)
    engine.run_until_idle(idle_horizon=1)
    assert [e.kind for e in engine.history(first.id)] == ["run_created", "children_started"]
    second = engine.start(wf, Change(customer="c1", n=2), debounce=5)
    assert second.id != first.id
    assert [e.kind for e in engine.history(first.id)] == ["run_created", "children_started"]
    assert Change.model_validate(engine.get(first.id).context).n == 1


def test_debounce__a_retry_takes_the_bursts_last_context(engine: Engine, clock: FakeClock) -> None:
    # The run entered its first state with the last start's context (run_debounced), and
    # ran with it; a retry there (--from it, or of its current state) took the first
    # start's, from run_created: the run ran again on a context the burst had replaced.
    seen: list[int] = []
    wf = Workflow("sync_fails", context=Change, key="customer")

    @wf.step(initial=True, next="synced", retry=Retry(attempts=1))
    def push(ctx: Change) -> None:
        seen.append(ctx.n)
        if len(seen) == 1:
            raise ConnectionError("provider down")

    wf.final("synced")
    run_id = ""
    for n in (1, 2, 3):
        run_id = engine.start(wf, Change(customer="c1", n=n), debounce=5).id
    clock.advance(5)
    engine.run_until_idle()
    assert engine.get(run_id).status == "failed" and seen == [3]
    engine.retry(run_id)
    assert Change.model_validate(engine.get(run_id).context).n == 3
    engine.run_until_idle()
    assert engine.get(run_id).status == "succeeded" and seen == [3, 3]
    assert engine.replay(run_id).matches


def test_throttle__over_the_limit_is_refused_until_the_oldest_leaves(
    engine: Engine, clock: FakeClock
) -> None:
    wf = sync_workflow([])
    a = engine.start(wf, Change(customer="c1", n=1), throttle=(2, 60))
    clock.advance(20)
    b = engine.start(wf, Change(customer="c1", n=2), throttle=(2, 60))
    assert a.id != b.id
    engine.start(wf, Change(customer="c2", n=1), throttle=(2, 60))  # another key
    with pytest.raises(
        StartThrottled, match=r"throttle of 2 per 1m reached; try again in 40s"
    ) as refused:
        engine.start(wf, Change(customer="c1", n=3), throttle=(2, 60))
    # (retry_at is a time, as documented: it was the seconds to wait.)
    assert (refused.value.retry_at, refused.value.retry_in) == (clock.now() + 40, 40)
    with pytest.raises(StartThrottled, match=r"1 per 1d reached; try again in 1d or later"):
        engine.start(wf, Change(customer="c1", n=3), throttle=(1, 86_400))
    assert len(engine.runs()) == 3  # nothing written
    clock.advance(41)
    engine.start(wf, Change(customer="c1", n=4), throttle=(2, 60))
    assert len(engine.runs()) == 4


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"debounce": 0}, r"debounce=0 must be a positive duration"),
        # (It was taken, and then refused as a run_at the caller never gave: review.)
        ({"debounce": 11 * 365 * 86400.0}, r"must be a positive duration of at most 10 years"),
        ({"debounce": "30s"}, r"debounce='30s' must be seconds or a timedelta"),
        ({"throttle": (0, 60)}, r"n must be a positive integer"),
        ({"throttle": (5, -1)}, r"throttle period=-1 must be a positive duration"),
        ({"throttle": 5}, r"must be \(n, period\)"),
        ({"debounce": 5, "throttle": (1, 5)}, r"not both"),
        ({"debounce": 5, "run_at": 0.0}, r"drop idempotency_key= and run_at="),
    ],
)
def test_admission__bad_arguments_are_one_line_and_write_nothing(
    engine: Engine, options: dict[str, object], message: str
) -> None:
    wf = sync_workflow([])
    with pytest.raises(AdmissionError, match=message) as caught:
        engine.start(wf, Change(customer="c1", n=1), **options)  # type: ignore[arg-type]
    assert "\n" not in str(caught.value) and engine.runs() == []


def test_admission__needs_a_key(engine: Engine) -> None:
    wf = Workflow("keyless", context=Change)

    @wf.step(initial=True, on={"done": "end"})
    def go(ctx: Change) -> str:
        return "done"

    wf.final("end")
    with pytest.raises(AdmissionError, match="group starts by key: give key="):
        engine.start(wf, Change(customer="c1", n=1), debounce=5)
    assert engine.runs() == []
    assert engine.start(wf, Change(customer="c1", n=1), key="k", debounce=5).status == "scheduled"


def test_throttle__holds_across_engines_starting_at_once(store_url: str) -> None:
    """Four engines (own connections) start 10 runs of one key each at once under a
    throttle of 5: exactly 5 are created, the rest refused."""
    import threading

    clock = FakeClock()
    wf = sync_workflow([])
    engines = [Engine(store_url, clock=clock) for _ in range(4)]
    gate = threading.Barrier(len(engines))
    outcomes: list[str] = []

    def starter(engine: Engine, base: int) -> None:
        gate.wait()
        for n in range(10):
            try:
                engine.start(wf, Change(customer="c1", n=base + n), throttle=(5, 60))
                outcomes.append("created")
            except StartThrottled:
                outcomes.append("refused")

    threads = [
        threading.Thread(target=starter, args=(engine, 100 * i)) for i, engine in enumerate(engines)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(set(outcomes)) == ["created", "refused"]
        assert outcomes.count("created") == 5 and len(outcomes) == 40
        assert len(engines[0].runs()) == 5
    finally:
        for engine in engines:
            engine.close()


def test_debounce__engines_starting_at_once_make_one_run(store_url: str) -> None:
    import threading

    clock = FakeClock()
    wf = sync_workflow([])
    engines = [Engine(store_url, clock=clock) for _ in range(4)]
    gate = threading.Barrier(len(engines))
    ids: list[str] = []

    def starter(engine: Engine, base: int) -> None:
        gate.wait()
        for n in range(5):
            ids.append(engine.start(wf, Change(customer="c1", n=base + n), debounce=30).id)

    threads = [
        threading.Thread(target=starter, args=(engine, 100 * i)) for i, engine in enumerate(engines)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(ids) == 20 and len(set(ids)) == 1
        history = engines[0].history(ids[0])
        assert [e.kind for e in history].count("run_debounced") == 19
        last = Change.model_validate_json(history[-1].context or "{}").n
        assert Change.model_validate(engines[0].get(ids[0]).context).n == last
        assert engines[0].replay(ids[0]).matches
    finally:
        for engine in engines:
            engine.close()
