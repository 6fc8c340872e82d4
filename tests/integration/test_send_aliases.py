"""`Engine.send` with a payload given as a model instance whose fields have aliases, on
SQLite and PostgreSQL: the payload is journaled as JSON and validated from it, by alias
as pydantic does; it was dumped by field name, so the aliased fields were missing and the
send failed (`InvalidPayload … approvedBy: Field required`)."""

from __future__ import annotations

from pydantic import AliasChoices, BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from flowloop import Engine, FakeClock, Workflow


class Order(BaseModel):
    approved_by: str = ""
    note: str = ""


class Approval(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel)
    approved_by: str


class Remark(BaseModel):  # validated by a name its serialization does not use
    note: str = Field(validation_alias=AliasChoices("remark", "text"), serialization_alias="x")


def approved(ctx: Order, given: Approval) -> None:
    ctx.approved_by = given.approved_by


def remarked(ctx: Order, given: Remark) -> None:
    ctx.note = given.note


def flow() -> Workflow:
    wf = Workflow("aliased_send", context=Order)
    wf.wait(
        "review",
        on={"approve": "done", "remark": "review"},
        payloads={"approve": Approval, "remark": Remark},
        handlers={"approve": approved, "remark": remarked},
        initial=True,
    )
    wf.final("done")
    return wf


def test_a_payload_model_with_aliases_is_sent_as_it_validates(store_url: str) -> None:
    wf = flow()
    with Engine(store_url, workflows=[wf], clock=FakeClock()) as engine:
        run_id = engine.start(wf, Order()).id
        engine.run_until_idle()
        remark = Remark.model_validate({"text": "rush"})
        assert engine.send(run_id, "remark", remark).status == "applied"
        engine.run_until_idle()
        assert engine.send(run_id, "approve", Approval(approvedBy="bob")).status == "applied"
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.context) == ("succeeded", Order(approved_by="bob", note="rush"))
