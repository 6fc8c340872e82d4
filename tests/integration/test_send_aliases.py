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


class Api(BaseModel):  # an API's model, passed on to a workflow that declares its own
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
    approved_by: str
    note: str = ""


class Declared(BaseModel):
    model_config = ConfigDict(extra="forbid")
    approved_by: str
    note: str = ""


def declared(ctx: Order, given: Declared) -> None:
    ctx.note = f"declared {given.approved_by} {given.note}"


def raw(ctx: Order, given: dict[str, str]) -> None:  # no payload model: the dict itself
    ctx.note = f"raw {sorted(given)}"


def approved(ctx: Order, given: Approval) -> None:
    ctx.approved_by = given.approved_by


def remarked(ctx: Order, given: Remark) -> None:
    ctx.note = given.note


def flow() -> Workflow:
    wf = Workflow("aliased_send", context=Order)
    wf.wait(
        "review",
        on={"approve": "done", "remark": "review", "declared": "review", "raw": "review"},
        payloads={"approve": Approval, "remark": Remark, "declared": Declared},
        handlers={"approve": approved, "remark": remarked, "declared": declared, "raw": raw},
        initial=True,
    )
    wf.final("done")
    return wf


def test_a_payload_model_with_aliases_is_sent_as_it_validates(store_url: str) -> None:
    wf = flow()
    with Engine(store_url, workflows=[wf], clock=FakeClock()) as engine:
        run_id = engine.start(wf, Order()).id
        engine.run_until_idle()
        # A model the event does not declare, or an event without one: by field name, as
        # always (by alias, a declared model forbidding extras refused it, and a handler
        # of the dict found other keys).
        given = Api(approved_by="ann", note="n")
        for event, note in (("declared", "declared ann n"), ("raw", "raw ['approved_by', 'note']")):
            assert engine.send(run_id, event, given).status == "applied"
            engine.run_until_idle()
            assert engine.get(run_id).context.note == note
        remark = Remark.model_validate({"text": "rush"})
        assert engine.send(run_id, "remark", remark).status == "applied"
        engine.run_until_idle()
        assert engine.send(run_id, "approve", Approval(approvedBy="bob")).status == "applied"
        engine.run_until_idle()
        info = engine.get(run_id)
    assert (info.status, info.context) == ("succeeded", Order(approved_by="bob", note="rush"))
