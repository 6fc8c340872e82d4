"""A step's error whose message holds a NUL character: PostgreSQL's text holds none, and the
write of the failure took the worker down (``DataError``) on the concurrent and the single
path alike. The journal keeps the message with the NUL written ``\\x00``, on both
databases."""

from __future__ import annotations

import pytest
from pydantic import BaseModel
from storekit import batch_sizes

from flowloop import Engine, Retry, Workflow
from flowloop import journal as j

MESSAGE = "bad\x00char"


class Ctx(BaseModel):
    n: int = 0


def _failing() -> Workflow:
    workflow = Workflow("nul_error", context=Ctx)

    @workflow.step(initial=True, next="done", retry=Retry(attempts=1))
    async def fail(ctx: Ctx) -> None:
        raise ValueError(MESSAGE)

    workflow.final("done")
    return workflow


def test_a_step_error_holding_nul_is_journaled_and_the_run_fails(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    workflow = _failing()
    with Engine(store_url, workflows=[workflow], max_concurrency=4) as engine:
        alone = engine.run(workflow, Ctx())  # one boundary at a time
        started = [engine.start(workflow, Ctx()).id for _ in range(4)]
        by_executemany, as_json = batch_sizes(monkeypatch)
        engine.run_until_idle()  # the failures of four runs in one batch
        assert max(by_executemany + as_json) == 4, (by_executemany, as_json)
        for run_id in [alone.id, *started]:
            info = engine.get(run_id)
            assert (info.status, info.error) == ("failed", "ValueError: bad\\x00char"), info
            [failed] = [e for e in engine.history(run_id) if e.kind == j.STEP_FAILED]
            assert failed.error_message == "bad\\x00char"
            assert failed.traceback is not None and "bad\\x00char" in failed.traceback
            assert "\x00" not in failed.traceback
            assert engine.replay(run_id).matches
