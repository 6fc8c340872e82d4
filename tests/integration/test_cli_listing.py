"""`flowloop status --status waiting|scheduled`: a status as shown, not as stored, so the
listing filters page by page and still says when more runs match."""

from __future__ import annotations

from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.cli.support import WaitStates, list_runs


class Ticket(BaseModel):
    n: int
    wait: bool = True


def ticket_workflow() -> Workflow:
    wf = Workflow("ticket", context=Ticket)

    @wf.step(initial=True, on={"wait": "parked", "go": "done"})
    def triage(ctx: Ticket) -> str:
        return "wait" if ctx.wait else "go"

    wf.wait("parked", on={"resume": "done"})
    wf.final("done")
    return wf


def test_list_runs__waiting_and_scheduled_filtered_across_pages(sqlite_url: str) -> None:
    wf = ticket_workflow()
    with Engine(sqlite_url) as engine:
        engine.start_many(wf, [Ticket(n=n) for n in range(260)])
        engine.run_until_idle()  # all 260 wait in `parked`
        engine.start_many(wf, [Ticket(n=n, wait=False) for n in range(260, 300)])
        waits = WaitStates(engine)
        args = {"workflow": None, "key": None}

        first, more = list_runs(engine, waits, statuses=["waiting"], limit=250, after=None, **args)
        assert len(first) == 250 and more
        assert {waits.status(info) for info in first} == {"waiting"}
        rest, more = list_runs(
            engine, waits, statuses=["waiting"], limit=250, after=first[-1].id, **args
        )
        assert len(rest) == 10 and not more
        assert {i.id for i in first} | {i.id for i in rest} == {
            i.id for i in engine.runs(status="scheduled", limit=1000) if i.state == "parked"
        }

        queued, more = list_runs(
            engine, waits, statuses=["scheduled"], limit=50, after=None, **args
        )
        assert len(queued) == 40 and not more
        assert {Ticket.model_validate(info.context).n for info in queued} == set(range(260, 300))
