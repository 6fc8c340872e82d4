"""``flowloop_runs_started``: every run counted once, when it begins — whatever its journal
holds before that (a debounce, a rate limit's deferral, a pause, an event its sender
delivered) and whatever it begins with (a step, a call's or a map's children) — scraped
from a real worker over HTTP on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from loopkit import until
from pydantic import BaseModel
from test_metrics import Samples, run_worker, scrape, value

from flowloop import Engine, Retry, Workflow
from flowloop import journal as j
from flowloop.flowcontrol import RateLimit
from flowloop.loops import Loop
from flowloop.worker import Worker

WAIT_S = 10.0


class Ctx(BaseModel):
    n: int = 0
    fail: bool = False


def starts_workflows() -> dict[str, Workflow]:
    leaf = Workflow("leaf", context=Ctx)

    @leaf.step(initial=True, next="done")
    def work(ctx: Ctx) -> None:
        return None

    leaf.final("done")

    fan = Workflow("fan", context=Ctx)  # begins with a map's children
    fan.map(
        "each",
        child=leaf,
        items=lambda ctx: range(2),
        context=lambda ctx, i: Ctx(n=i),
        max_parallel=1,
        on={"done": "done"},
        initial=True,
    )
    fan.final("done")

    caller = Workflow("caller", context=Ctx)  # begins with a call's child
    caller.call(
        "sub", child=leaf, context=lambda ctx: Ctx(), on={"succeeded": "done"}, initial=True
    )
    caller.final("done")

    paced = Workflow("paced", context=Ctx)  # the second run is deferred first

    @paced.step(initial=True, next="done", rate_limit=RateLimit("one", 1, per=timedelta(seconds=1)))
    def call(ctx: Ctx) -> None:
        return None

    paced.final("done")

    gate = Workflow("gate", context=Ctx)  # waits first: its sender's process takes the event
    gate.wait("hold", on={"go": "act"}, initial=True)

    @gate.step(next="done")
    def act(ctx: Ctx) -> None:
        return None

    gate.final("done")

    flaky = Workflow("flaky", context=Ctx)  # fails, then an operator retries it

    @flaky.step(initial=True, next="done", retry=Retry(attempts=1))
    def once(ctx: Ctx) -> None:
        if ctx.fail:
            raise ValueError("bad input")

    flaky.final("done")

    plain = Workflow("plain", context=Ctx)  # paused before it began, then unpaused

    @plain.step(initial=True, next="done")
    def go(ctx: Ctx) -> None:
        return None

    plain.final("done")

    sync = Workflow("sync", context=Ctx)  # debounced: a burst of starts, one run

    @sync.step(initial=True, next="done")
    def push(ctx: Ctx) -> None:
        return None

    sync.final("done")
    return {wf.name: wf for wf in (leaf, fan, caller, paced, gate, flaky, plain, sync)}


def test_runs_started__each_run_once_whatever_it_begins_with(store_url: str) -> None:
    # The real clock: a rate limit's tokens go by the database's (a second here).
    flows = starts_workflows()
    with Engine(store_url, poll_seconds=0.02, workflows=flows.values()) as engine:
        ids = [engine.start(flows[name], {}).id for name in ("fan", "caller", "paced", "paced")]
        gated = engine.start(flows["gate"], {}).id
        engine.send(gated, "go")  # journaled by this process: seq 2 is event_received
        failing = engine.start(flows["flaky"], {"fail": True}).id
        paused = engine.start(flows["plain"], {}).id
        engine.pause(paused)  # seq 2 is run_paused
        burst = {engine.start(flows["sync"], Ctx(n=n), key="s", debounce=0.3).id for n in (1, 2, 3)}
        assert len(burst) == 1  # seq 2 and 3 are run_debounced
        ids += [gated, paused, *burst]

        def done() -> bool:
            return all(engine.get(i).finished for i in ids)

        async def body(worker: Worker) -> Samples:
            await until(lambda: engine.get(failing).status == "failed", what="the failure")
            engine.unpause(paused)
            engine.retry(failing, set_fields={"fail": False})
            await until(lambda: engine.get(failing).status == "succeeded", what="the retry")
            await until(done, timeout=WAIT_S, what="every run to finish")
            assert worker.metrics_bound is not None
            return await asyncio.to_thread(scrape, worker.metrics_bound)

        samples = asyncio.run(
            run_worker(Worker(engine, concurrency=4, grace=1.0, metrics_port=0), body)
        )
        kinds = {
            name: [
                [e.kind for e in engine.store.journal(r.id)][1] for r in engine.runs(workflow=name)
            ]
            for name in ("paced", "sync", "gate", "plain")
        }

    # What the runs' seq 2 was: each of these began later.
    assert j.RUN_DEFERRED in kinds["paced"]
    assert kinds["sync"] == [j.RUN_DEBOUNCED]
    assert kinds["gate"] == [j.EVENT_RECEIVED]
    assert kinds["plain"] == [j.RUN_PAUSED]
    started = {name: value(samples, "flowloop_runs_started_total", workflow=name) for name in flows}
    assert started == {
        "leaf": 3,  # the map's two children and the call's one
        "fan": 1,
        "caller": 1,
        "paced": 2,
        "gate": 1,
        "flaky": 1,  # not again when retried
        "plain": 1,
        "sync": 1,
    }


def test_runs_started__a_loop_run_that_begins_with_children_counts_once(
    store_url: str,
) -> None:
    """A loop's run that starts with a step is created claimed, its step started in the
    creating transaction: counted once. One that starts with a call (it had nothing to go on
    with, created claimed, until its lease ran out) or a rate-limited step (started at
    creation without its token) is claimed like any other: counted once too."""
    flows = starts_workflows()
    with Engine(store_url, poll_seconds=0.02, workflows=flows.values()) as engine:
        loops = [
            Loop("calls", workflow=flows["caller"], context={}, every=3600),
            Loop("steps", workflow=flows["plain"], context={}, every=3600),
            Loop("paced", workflow=flows["paced"], context={}, every=3600),
        ]

        async def body(worker: Worker) -> Samples:
            await until(
                lambda: (
                    len(engine.runs(workflow="caller", status="succeeded")) == 1
                    and len(engine.runs(workflow="plain", status="succeeded")) == 1
                ),
                what="each loop's first run",
            )
            assert worker.metrics_bound is not None
            return await asyncio.to_thread(scrape, worker.metrics_bound)

        samples = asyncio.run(run_worker(Worker(engine, loops, grace=1.0, metrics_port=0), body))
        [paced] = engine.runs(workflow="paced")
        first = engine.store.journal(paced.id)[1]

    assert (first.kind, first.data.get("rate_limits")) == (j.STEP_STARTED, ["one"])

    assert value(samples, "flowloop_runs_started_total", workflow="caller") == 1
    assert value(samples, "flowloop_runs_started_total", workflow="leaf") == 1
    assert value(samples, "flowloop_runs_started_total", workflow="plain") == 1
    assert value(samples, "flowloop_runs_started_total", workflow="paced") == 1
