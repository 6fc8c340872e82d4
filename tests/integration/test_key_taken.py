"""An idempotency key is unique across workflows: a start of one workflow with a key a run
of another workflow holds is refused (``KeyTaken``, one line) instead of returning that
run as a run of the workflow asked for — which ``engine.run`` then drove and waited for
by the wrong definition's states. On SQLite files and PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.errors import KeyTaken


class Ctx(BaseModel):
    n: int = 0


def _workflow(name: str, **bounds: int) -> Workflow:
    workflow = Workflow(name, context=Ctx, **bounds)

    @workflow.step(initial=True, next="done")
    def count(ctx: Ctx) -> None:
        ctx.n += 1

    workflow.final("done")
    return workflow


def test_a_start_with_a_key_of_another_workflows_run_is_refused(store_url: str) -> None:
    mail, invoice = _workflow("mail"), _workflow("invoice")
    with Engine(store_url, workflows=[mail, invoice]) as engine:
        held = engine.start(mail, Ctx(), idempotency_key="req-7")
        with pytest.raises(KeyTaken) as refused:
            engine.start(invoice, Ctx(), idempotency_key="req-7")
        assert str(refused.value) == (
            f"idempotency key 'req-7' is taken by run {held.id} of workflow 'mail', "
            "not 'invoice': start with another key"
        )
        with pytest.raises(KeyTaken, match="is taken by run"):
            engine.run(invoice, Ctx(), idempotency_key="req-7")
        with pytest.raises(KeyTaken, match="is taken by run"):
            asyncio.run(engine.arun(invoice, Ctx(), idempotency_key="req-7"))
        # Nothing was made, and the holder was neither driven nor changed.
        assert [info.id for info in engine.runs()] == [held.id]
        assert engine.get(held.id).status == "scheduled"
        # Its own workflow still finds it, as before.
        assert engine.start(mail, Ctx(n=5), idempotency_key="req-7").id == held.id
        done = engine.run(mail, Ctx(), idempotency_key="req-7")
        assert done.id == held.id and done.status == "succeeded"


def test_a_bounded_start_with_a_key_of_another_workflows_run_is_refused(
    store_url: str,
) -> None:
    mail, invoice = _workflow("mail"), _workflow("invoice", max_queued=10)
    with Engine(store_url, workflows=[mail, invoice]) as engine:
        held = engine.start(mail, Ctx(), idempotency_key="req-8")
        with pytest.raises(KeyTaken, match=f"taken by run {held.id} of workflow 'mail'"):
            engine.start(invoice, Ctx(), idempotency_key="req-8")
        assert len(engine.runs()) == 1
