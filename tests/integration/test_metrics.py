"""Prometheus metrics of a real worker, scraped over HTTP and parsed with prometheus-client's
own parser: runs, steps by outcome, step durations, loop iterations by outcome, lease
losses, queue depth — and the endpoint binds 127.0.0.1 unless told otherwise."""

from __future__ import annotations

import asyncio
import os
import threading
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from loopkit import SteppedClock, drive, until
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel
from storekit import dead_owner

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.errors import ConfigError
from flowloop.journal import JournalEvent
from flowloop.loops import Iteration, Loop
from flowloop.metrics import BEGINS, Metrics
from flowloop.worker import Worker

T0 = 1_800_000_000.0
WAIT_S = 10.0

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int, host: str = "127.0.0.1") -> Samples:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


class Job(BaseModel):
    mode: str = "ok"
    seconds: float = 0.25


def metered(clock: FakeClock, hold: threading.Event | None = None) -> Workflow:
    """``work`` takes ``seconds`` of the fake clock and then: ok, flaky (ConnectionError on
    attempt 1, retried), fail (ValueError, no retry), timeout (outlives its 0.05 s), hold
    (waits for the test)."""
    wf = Workflow("metered", context=Job)

    @wf.step(
        initial=True,
        next="done",
        timeout=0.05,
        retry=Retry(attempts=2, backoff="fixed", base=0, cap=0, on=(ConnectionError,)),
    )
    async def work(ctx: Job, step: Step) -> None:
        if ctx.mode == "timeout":
            await asyncio.sleep(5)
        clock.advance(ctx.seconds)
        if ctx.mode == "flaky" and step.attempt == 1:
            raise ConnectionError("flaky")
        if ctx.mode == "fail":
            raise ValueError("bad input")
        if ctx.mode == "hold" and hold is not None:
            await asyncio.to_thread(hold.wait, WAIT_S)

    wf.final("done")
    return wf


async def run_worker(worker: Worker, body: Callable[[Worker], Awaitable[Any]]) -> Any:
    """Run ``worker`` until ``body`` (given the started worker) returns."""
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await until(
            lambda: worker.metrics_bound is not None or task.done(), what="the metrics endpoint"
        )
        if task.done():
            task.result()
        return await body(worker)
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


def test_metrics__runs_and_steps_by_outcome_with_durations(sqlite_url: str) -> None:
    clock = FakeClock(T0)
    with Engine(sqlite_url, clock=clock, poll_seconds=0.05) as engine:
        wf = metered(clock)
        engine.register(wf)
        ids = [engine.start(wf, {"mode": mode}).id for mode in ("ok", "flaky", "fail", "timeout")]
        # A run whose worker died in the middle of its step: recovered as interrupted.
        crashed = engine._new_run(
            wf,
            {"mode": "ok"},
            key=None,
            idempotency_key=None,
            priority=0,
            run_at=None,
            owner=dead_owner(),
        )
        engine.store.create_run(crashed)
        ids.append(crashed.record.id)

        async def body(worker: Worker) -> Samples:
            await until(
                lambda: all(engine.get(i).finished for i in ids),
                timeout=WAIT_S,
                what="every run to finish",
            )
            assert worker.metrics_bound is not None
            return await asyncio.to_thread(scrape, worker.metrics_bound)

        # One step at a time: each attempt's fake-clock time is its own.
        samples = asyncio.run(
            run_worker(Worker(engine, concurrency=1, grace=1.0, metrics_port=0), body)
        )

    steps = {
        outcome: value(
            samples, "flowloop_steps_total", workflow="metered", state="work", outcome=outcome
        )
        for outcome in ("succeeded", "retried", "failed", "timed_out", "interrupted")
    }
    assert steps == {"succeeded": 3, "retried": 1, "failed": 1, "timed_out": 1, "interrupted": 1}
    assert value(samples, "flowloop_runs_started_total", workflow="metered") == 4
    assert (
        value(samples, "flowloop_runs_finished_total", workflow="metered", status="succeeded") == 3
    )
    assert value(samples, "flowloop_runs_finished_total", workflow="metered", status="failed") == 2
    # Every attempt with a duration: 3 ok + 1 retried + 1 failed take 0.25 s each; the
    # timed-out one took no fake time.
    histogram = {"workflow": "metered", "state": "work"}
    assert value(samples, "flowloop_step_duration_seconds_count", **histogram) == 6
    assert value(samples, "flowloop_step_duration_seconds_sum", **histogram) == 5 * 0.25
    assert value(samples, "flowloop_step_duration_seconds_bucket", le="0.1", **histogram) == 1
    assert value(samples, "flowloop_step_duration_seconds_bucket", le="0.25", **histogram) == 6
    assert value(samples, "flowloop_queue_depth") == 0
    assert value(samples, "flowloop_lease_losses_total", kind="run") == 0


def test_metrics__loop_iterations_ok_failed_skipped(sqlite_url: str) -> None:
    clock = SteppedClock(T0)
    seen: list[int] = []

    async def tick(it: Iteration) -> None:
        seen.append(it.number)
        if it.number == 2:
            raise RuntimeError("feed down")
        if it.number == 3:
            clock.advance(35)  # runs over 3 more slots of a 10 s fixed-rate loop

    async def body(worker: Worker) -> Samples:
        await drive(clock, 30, step=5)
        await until(lambda: len(seen) >= 4, what="four iterations")
        await drive(clock, 5, step=5)
        assert worker.metrics_bound is not None
        return await asyncio.to_thread(scrape, worker.metrics_bound)

    with Engine(sqlite_url, clock=clock) as engine:
        loop = Loop("tick", tick, every=10)
        samples = asyncio.run(run_worker(Worker(engine, [loop], grace=1.0, metrics_port=0), body))

    assert value(samples, "flowloop_loop_iterations_total", loop="tick", outcome="failed") == 1
    assert value(samples, "flowloop_loop_iterations_total", loop="tick", outcome="skipped") == 3
    ok = value(samples, "flowloop_loop_iterations_total", loop="tick", outcome="ok")
    assert ok == len(seen) - 1 >= 3
    durations = value(samples, "flowloop_loop_iteration_duration_seconds_count", loop="tick")
    assert durations == len(seen)


def test_metrics__lease_loss_is_counted(sqlite_url: str) -> None:
    clock = FakeClock(T0)
    hold = threading.Event()
    with Engine(sqlite_url, clock=clock, poll_seconds=0.05, lease_seconds=30) as engine:
        wf = metered(clock, hold)
        run_id = engine.start(wf, {"mode": "hold"}).id
        store = engine.store

        async def body(worker: Worker) -> Samples:
            await until(lambda: engine.get(run_id).status == "running", what="the step")
            # Another worker takes the run over (this one looks paused to the database).
            store.expire_leases([engine.worker_id])
            assert [
                r.id for r in store.claim_interrupted(worker="thief", limit=1, lease_seconds=30)
            ] == [run_id]
            hold.set()
            assert worker.metrics is not None
            await until(
                lambda: worker.executor is not None and worker.executor.stats.lost_leases >= 1,
                what="the lease loss",
            )
            assert worker.metrics_bound is not None
            return await asyncio.to_thread(scrape, worker.metrics_bound)

        samples = asyncio.run(run_worker(Worker(engine, grace=1.0, metrics_port=0), body))
        assert engine.get(run_id).owner == "thief"

    assert value(samples, "flowloop_lease_losses_total", kind="run") == 1
    assert value(samples, "flowloop_alerts_total", level="warning", what="lease lost") == 1


def test_metrics__queue_depth_counts_due_unclaimed_runs(sqlite_url: str) -> None:
    clock = FakeClock(T0)
    with Engine(sqlite_url, clock=clock) as engine:
        wf = metered(clock)
        for _ in range(3):
            engine.start(wf, {})
        engine.start(wf, {}, run_at=T0 + 3600)  # not due yet
        metrics = Metrics()
        metrics.track_queue(lambda: engine.store.count_due(now=clock.now()))
        port = metrics.serve(0)
        try:
            assert value(scrape(port), "flowloop_queue_depth") == 3
            clock.advance(3600)
            assert value(scrape(port), "flowloop_queue_depth") == 4
        finally:
            metrics.close()


def test_metrics__served_on_loopback_only_by_default() -> None:
    metrics = Metrics()
    port = metrics.serve(0)
    try:
        assert metrics.address == ("127.0.0.1", port)
        assert "flowloop_queue_depth" in {name for name, _ in scrape(port)}
        # The same port twice is one clear error naming it.
        with pytest.raises(ConfigError) as raised:
            Metrics().serve(port)
        assert str(raised.value).startswith(f"metrics port 127.0.0.1:{port}: ")
    finally:
        metrics.close()
    assert metrics.address is None
    with pytest.raises(OSError):
        scrape(port)


def test_metrics__registries_are_private_to_each_instance() -> None:
    a, b = Metrics(), Metrics()
    a.steps.labels("w", "s", "succeeded").inc()
    assert (
        "flowloop_steps_total",
        {"workflow": "w", "state": "s", "outcome": "succeeded"},
        1.0,
    ) in list(a.samples())
    assert not any(name == "flowloop_steps_total" for name, _, _ in b.samples())
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") is None


def test_metrics__a_run_that_rejects_a_kept_event_first_counts_when_its_step_starts() -> None:
    # Created in a wait state, its first boundary (seq 2) is the rejection of a kept event,
    # then it takes one (seq 3): neither begins it (an event may as well be taken in its
    # sender's process, where no worker sees it). Its first step's start (seq 4) does,
    # once: a later start of that step after a wait (seq 6) is not counted again.
    metrics = Metrics()
    created = JournalEvent(
        run_id="r",
        seq=1,
        kind=j.RUN_CREATED,
        at=T0,
        state="gate",
        context="{}",
        data={"workflow": "gated", "version": 1, "fingerprint": "f", "key": None, "due": None},
    )
    rejected = JournalEvent(
        run_id="r",
        seq=2,
        kind=j.EVENT_REJECTED,
        at=T0,
        state="gate",
        event="open",
        error_type="ValueError",
        error_message="no",
    )
    received = JournalEvent(
        run_id="r",
        seq=3,
        kind=j.EVENT_RECEIVED,
        at=T0,
        state="gate",
        event="open",
        next_state="work",
        context="{}",
    )
    started = JournalEvent(run_id="r", seq=4, kind=j.STEP_STARTED, at=T0, state="work", attempt=1)
    journal = [created, rejected, received, started]
    metrics.track_begins(
        lambda run_id: next(e.seq for e in journal if e.run_id == run_id and e.kind in BEGINS)
    )
    again = JournalEvent(run_id="r", seq=6, kind=j.STEP_STARTED, at=T0, state="work", attempt=1)
    record = j.create(created)
    counted = []
    for entry in (rejected, received, started, again):
        if entry is not again:
            record = j.apply(record, entry)
        metrics.listener(record, [entry])
        counted.append(
            sum(
                v
                for name, labels, v in metrics.samples()
                if name == "flowloop_runs_started_total" and labels == {"workflow": "gated"}
            )
        )
    assert counted == [0.0, 0.0, 1.0, 1.0]


def test_metrics__a_run_that_starts_again_and_again_reads_its_first_start_once() -> None:
    # A run whose step sleeps (step.sleep) starts it again after each sleep: a start the
    # boundary does not tell apart from a first one. The first start read from the journal
    # is remembered: 50 wakes cost one read, not 50 (a review counted 49 reads on the
    # event loop for one run).
    metrics = Metrics()
    reads: list[str] = []

    def first_begin(run_id: str) -> int:
        reads.append(run_id)
        return 2

    metrics.track_begins(first_begin)
    created = JournalEvent(
        run_id="r",
        seq=1,
        kind=j.RUN_CREATED,
        at=T0,
        state="work",
        context="{}",
        data={"workflow": "sleepy", "version": 1, "fingerprint": "f", "key": None, "due": None},
    )
    record = j.create(created)
    for wake in range(50):
        start = JournalEvent(
            run_id="r", seq=4 + 2 * wake, kind=j.STEP_STARTED, at=T0, state="work", attempt=1
        )
        metrics.listener(record, [start])
    assert reads == ["r"]
    started = [
        v
        for name, labels, v in metrics.samples()
        if name == "flowloop_runs_started_total" and labels == {"workflow": "sleepy"}
    ]
    assert sum(started) == 0  # (its first start, seq 2, was counted by another worker)


def test_metrics__every_known_series_exists_at_zero_before_any_run(sqlite_url: str) -> None:
    """An alert on increase(flowloop_steps_total{outcome="failed"}[5m]) must see the first
    failure after a worker starts: the series exists (at 0) from the first scrape."""
    clock = FakeClock(T0)
    with Engine(sqlite_url, clock=clock, poll_seconds=0.05) as engine:
        engine.register(metered(clock))

        async def tick(_: Iteration) -> None:
            return None

        beat = Loop(name="beat", fn=tick, every=3600)

        async def body(worker: Worker) -> Samples:
            assert worker.metrics_bound is not None
            return await asyncio.to_thread(scrape, worker.metrics_bound)

        samples = asyncio.run(run_worker(Worker(engine, [beat], grace=1.0, metrics_port=0), body))

    for outcome in ("succeeded", "retried", "failed", "timed_out", "interrupted"):
        key = (
            "flowloop_steps_total",
            frozenset({"workflow": "metered", "state": "work", "outcome": outcome}.items()),
        )
        assert samples.get(key) == 0.0, (outcome, sorted(n for n, _ in samples))
    for status in ("succeeded", "failed", "stopped"):
        labels = frozenset({"workflow": "metered", "status": status}.items())
        assert samples.get(("flowloop_runs_finished_total", labels)) == 0.0
    assert (
        samples.get(("flowloop_runs_started_total", frozenset({"workflow": "metered"}.items())))
        == 0.0
    )
    histogram = frozenset({"workflow": "metered", "state": "work"}.items())
    assert samples.get(("flowloop_step_duration_seconds_count", histogram)) == 0.0
    # The loop's first slot fires at once (maybe before the scrape): ok may be 1 already.
    for outcome in ("failed", "skipped", "stopped", "cancelled"):
        labels = frozenset({"loop": "beat", "outcome": outcome}.items())
        assert samples.get(("flowloop_loop_iterations_total", labels)) == 0.0
    for kind in ("run", "loop"):
        assert (
            samples.get(("flowloop_lease_losses_total", frozenset({"kind": kind}.items()))) == 0.0
        )
    assert (
        samples.get(
            (
                "flowloop_alerts_total",
                frozenset({"level": "critical", "what": "run failed"}.items()),
            )
        )
        == 0.0
    )
    # No `_created` series: they double the output and no rule uses them.
    assert not [name for name, _ in samples if name.endswith("_created")]


def test_metrics__backpressure_series_exist_at_zero_for_every_known_workflow(
    store_url: str,
) -> None:
    """flowloop_runs_queued and flowloop_inbox_kept* were absent from a scrape while zero
    (the database counts only workflows with something queued or kept), unlike every other
    per-workflow series (ops audit): present at 0 from the first scrape."""
    clock = FakeClock(T0)
    with Engine(store_url, clock=clock, poll_seconds=0.05) as engine:
        engine.register(metered(clock))

        async def body(worker: Worker) -> Samples:
            assert worker.metrics_bound is not None
            return await asyncio.to_thread(scrape, worker.metrics_bound)

        samples = asyncio.run(run_worker(Worker(engine, grace=1.0, metrics_port=0), body))

    mine = frozenset({"workflow": "metered"}.items())
    for name in ("flowloop_runs_queued", "flowloop_inbox_kept", "flowloop_inbox_kept_max"):
        assert samples.get((name, mine)) == 0.0, (name, sorted(n for n, _ in samples))
    for what in ("event", "run"):
        labels = frozenset({"workflow": "metered", "what": what}.items())
        assert samples.get(("flowloop_backpressure_dropped_total", labels)) == 0.0
