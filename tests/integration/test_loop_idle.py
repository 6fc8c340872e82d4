"""A loop with nothing to do creates no run: a workflow loop's context function returning
None (or a loop function returning IDLE) is journaled ``iteration_skipped_idle``.
And the ETL inbox loop of `flowloop worker workflows/` stays idle unless ETL_INPUT asks."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import etlkit
import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.loops import IDLE, Iteration, Loop
from flowloop.worker import Worker

WAIT_S = 30.0


class Job(BaseModel):
    item: str


def test_loop__context_none_creates_no_run_and_journals_skipped_idle(sqlite_url: str) -> None:
    wf = Workflow("job", context=Job)

    @wf.step(initial=True, next="done")
    def work(ctx: Job) -> None: ...

    wf.final("done")
    queue = ["a"]  # one item, then nothing to do

    def next_job(_: Iteration) -> Job | None:
        return Job(item=queue.pop()) if queue else None

    loops = [
        Loop(name="jobs", workflow=wf, context=next_job, every=0.05, mode="fixed_delay"),
        Loop(name="idle_fn", fn=lambda _: IDLE, every=0.05),
    ]

    async def scenario(engine: Engine) -> None:
        stop = asyncio.Event()
        worker = asyncio.create_task(Worker(engine, loops, grace=5).run(stop))

        def idle(name: str) -> int:
            history = engine.loop_history(name) if engine.loops() else []
            return sum(event.kind == "iteration_skipped_idle" for event in history)

        try:
            deadline = time.monotonic() + WAIT_S
            while idle("jobs") < 3 or idle("idle_fn") < 2:
                assert time.monotonic() < deadline, "no idle iterations journaled"
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await asyncio.wait_for(worker, WAIT_S)

    with Engine(sqlite_url, poll_seconds=0.02) as engine:
        asyncio.run(scenario(engine))
        runs = engine.runs(limit=1000)
        rows = {row.name: row for row in engine.loops()}
        kinds = [event.kind for event in engine.loop_history("jobs")]
    assert [(run.status, run.context.item) for run in runs] == [("succeeded", "a")]
    assert kinds.count("iteration_succeeded") == 1  # the run for "a"
    assert "iteration_failed" not in kinds
    assert rows["jobs"].consecutive_failures == 0
    assert rows["jobs"].last_result == "skipped_idle"


def test_etl_inbox__idle_without_etl_input_and_without_new_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`flowloop worker workflows/` registers the ETL inbox loop, but without ETL_INPUT it
    creates no run (nor a target next to the sample data); with it, a run only when a file
    is new."""
    etl = etlkit.load_etl()
    for name in ("ETL_INPUT", "ETL_TARGET"):
        monkeypatch.delenv(name, raising=False)
    it = Iteration(loop="etl_inbox", slot=0.0, number=1, attempt=1)
    assert etl.inbox_loop().context_for(it) is None
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    monkeypatch.setenv("ETL_INPUT", str(inbox))
    loop = etl.inbox_loop()
    assert loop.context_for(it) is None  # an empty inbox
    etlkit.write_csv(inbox / "a.csv", [])
    ctx = loop.context_for(it)
    assert ctx is not None and ctx.input_dir == str(inbox)
