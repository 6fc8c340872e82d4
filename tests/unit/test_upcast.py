"""Context versions: the upcaster chain, its definition-time checks, and the fingerprint
policy (what changes it and what does not)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from deploykit import OrderV1, OrderV2, added_field, order, removed_state, renamed_state, v1_to_v2
from pydantic import BaseModel, Field, create_model

from flowloop import Workflow
from flowloop.errors import DefinitionError, InvalidContext
from flowloop.loader import load_paths
from flowloop.upcast import ContextMigrationError, check_chain, schema_of, upcast


def _v2_to_v3(data: dict[str, Any]) -> dict[str, Any]:
    out = dict(data)
    out["amount_cents"] = round(out.pop("amount") * 100)
    return out


def test_upcast__runs_the_chain_in_order_without_touching_the_input() -> None:
    stored = {"id": "A", "amount": 1.5}
    chain = {1: lambda d: {**d, "amount": d["amount"] * 2}, 2: _v2_to_v3}
    result = upcast("w", stored, from_version=1, to_version=3, migrate=chain)
    assert result == {"id": "A", "amount_cents": 300}
    assert stored == {"id": "A", "amount": 1.5}  # pure: the journal keeps what was written
    assert upcast("w", stored, from_version=3, to_version=3, migrate=chain) is stored


def test_upcast__from_the_middle_of_the_chain() -> None:
    result = upcast("w", {"amount": 2}, from_version=2, to_version=3, migrate={2: _v2_to_v3})
    assert result == {"amount_cents": 200}


@pytest.mark.parametrize(
    ("chain", "start", "message"),
    [
        ({2: _v2_to_v3}, 1, "no upcaster from context version 1 to 2"),
        ({1: lambda d: 1 / 0}, 1, "upcaster 1->2 raised ZeroDivisionError"),
        ({1: lambda d: [d]}, 1, "upcaster 1->2 returned list, not a JSON object"),
        ({}, 4, "stored context is version 4, newer than this definition's context_version 2"),
    ],
    ids=["no-step-from-1", "raises", "not-an-object", "newer-than-code"],
)
def test_upcast__refusals_say_why(chain: dict[int, Any], start: int, message: str) -> None:
    to = 2 if start == 4 else (3 if 2 in chain else 2)
    with pytest.raises(ContextMigrationError, match=message):
        upcast("w", {"amount": 1}, from_version=start, to_version=to, migrate=chain)


@pytest.mark.parametrize(
    ("version", "chain", "message"),
    [
        (3, {1: v1_to_v2}, r"misses step\(s\) 2 of the chain 1 -> 3"),
        (4, {1: v1_to_v2, 3: v1_to_v2}, r"misses step\(s\) 2 of the chain 1 -> 4"),
        (2, {2: v1_to_v2}, r"step\(s\) 2 outside 1..1"),
        (2, {0: v1_to_v2}, r"step\(s\) 0 outside 1..1"),
        (2, {1: "not a function"}, r"migrate\[1\] is not a function"),
        (0, {}, "context_version must be an integer of at least 1"),
    ],
    ids=["gap", "gap-in-the-middle", "step-at-version", "step-zero", "not-callable", "zero"],
)
def test_check_chain__a_broken_chain_is_a_definition_error(
    version: int, chain: dict[int, Any], message: str
) -> None:
    with pytest.raises(DefinitionError, match=message):
        check_chain("w", version, chain)
    with pytest.raises(DefinitionError, match=message):
        Workflow("w", context=OrderV1, context_version=version, migrate=chain)


def test_check_chain__may_start_above_one() -> None:
    check_chain("w", 3, {2: _v2_to_v3})  # contexts of version 1 are then parked


def test_load_context__upcasts_an_older_context_then_validates() -> None:
    wf = added_field(migrated=True).validate()
    ctx = wf.load_context('{"order_id": "A"}', 1)
    assert isinstance(ctx, OrderV2) and ctx.currency == "EUR"
    assert wf.load_context('{"order_id": "A", "currency": "USD"}', 2).currency == "USD"  # type: ignore[attr-defined]
    assert wf.context_stamp() == {"cv": 2}
    assert order().validate().context_stamp() == {}  # version 1 journals stay as they were


def test_load_context__without_an_upcaster_names_the_missing_field() -> None:
    wf = added_field(migrated=False).validate()
    with pytest.raises(ContextMigrationError, match="no upcaster from context version 1"):
        wf.load_context('{"order_id": "A"}', 1)
    same_version = order(context=OrderV2).validate()
    with pytest.raises(InvalidContext, match="currency: Field required"):
        same_version.load_context('{"order_id": "A"}', 1)


def test_migrates_from__maps_to_states_that_exist() -> None:
    with pytest.raises(DefinitionError, match=r"maps to unknown state\(s\) 'nowhere'"):
        order(version=2, migrates_from={1: {"charge": "nowhere"}}).validate()
    with pytest.raises(DefinitionError, match="version 2 is not older"):
        order(version=2, migrates_from={2: {"charge": "ship"}}).validate()


# -- the fingerprint ----------------------------------------------------------------------


def test_fingerprint__adding_a_required_field_changes_it() -> None:
    assert order().fingerprint != order(context=OrderV2).fingerprint


def test_fingerprint__context_version_changes_it() -> None:
    base = order(context=OrderV2)
    assert base.fingerprint != added_field(migrated=True).fingerprint


def test_fingerprint__a_changed_type_or_required_field_changes_it() -> None:
    class Typed(BaseModel):
        order_id: int
        trail: list[str] = []
        sleep: bool = False
        fail_reserve: int = 0

    class Required(BaseModel):  # fail_reserve without its default: now required
        order_id: str
        trail: list[str] = []
        sleep: bool = False
        fail_reserve: int

    class Renamed(BaseModel):
        order_id: str
        trail: list[str] = []
        sleep: bool = False
        failing_reserves: int = 0

    models = (OrderV1, Typed, Required, Renamed)
    assert len({order(context=m).fingerprint for m in models}) == len(models)


def test_fingerprint__a_changed_default_does_not_change_it() -> None:
    """A default fills a field only in a context being created (a stored one is written
    whole): changing it strands no run, and one that depends on the environment (a path
    of the checkout) must not give the same definition another fingerprint elsewhere."""

    class Loose(OrderV1):
        fail_reserve: int = 1
        trail: list[str] = ["started"]

    class Elsewhere(OrderV1):
        sleep: bool = Field(default=True, description="another checkout's default")

    base = order().fingerprint
    assert order(context=Loose).fingerprint == base
    assert order(context=Elsewhere).fingerprint == base
    # A nested model's field defaults, and a default object for a field, are left out too.
    here = order(context=with_nested_source("/home/a/checkout/data")).fingerprint
    there = order(context=with_nested_source("/builds/ci/data", whole=True)).fingerprint
    assert here == there != base  # the added field itself counts


def with_nested_source(folder: str, *, whole: bool = False) -> type[BaseModel]:
    """The order context with a ``source`` whose ``path`` defaults to ``folder`` (as a
    checkout-dependent default would); ``whole``: the field's default object says it too."""

    class Source(BaseModel):
        path: str = folder

    class WithSource(OrderV1):
        source: Source = Source(path=folder) if whole else Source()

    return WithSource


def test_fingerprint__docstrings_titles_descriptions_and_bodies_do_not_change_it() -> None:
    class Documented(BaseModel):
        """Another docstring, another class name."""

        order_id: str = Field(description="the shop's id", title="Order id")
        trail: list[str] = Field(default=[], description="what happened")
        sleep: bool = False
        fail_reserve: int = 0

    assert order(context=Documented).fingerprint == order().fingerprint
    other_body = order()
    assert other_body.fingerprint == order().fingerprint  # fresh functions, same structure


@pytest.mark.parametrize("name", ["title", "description", "default"])
def test_fingerprint__a_field_named_like_a_left_out_key_is_kept(name: str) -> None:
    named = create_model("Named", **{name: (str, ...)})  # type: ignore[call-overload]
    other = create_model("Named", other=(str, ...))
    assert name in schema_of(named)["properties"] and name in schema_of(named)["required"]
    assert schema_of(named) != schema_of(other)


def test_fingerprint__structure_changes_change_it() -> None:
    prints = {
        order().fingerprint,
        renamed_state().fingerprint,
        removed_state().fingerprint,
    }
    assert len(prints) == 3
    assert order(version=2).fingerprint == order().fingerprint  # a version number alone


def test_definition_record__carries_the_context_schema() -> None:
    record = added_field(migrated=True).validate().definition_record()
    assert record["context"]["version"] == 2
    assert "currency" in record["context"]["schema"]["required"]


COPIED_WORKFLOW = """
from pathlib import Path

from pydantic import BaseModel

from flowloop import Workflow


class Job(BaseModel):
    folder: str = str(Path(__file__).parent)  # where this checkout keeps its files


copied = Workflow("copied", context=Job)


@copied.step(initial=True, next="done")
def only(ctx: Job) -> None: ...


copied.final("done")
"""


def test_fingerprint__the_same_file_in_another_checkout_folder_keeps_it(tmp_path: Path) -> None:
    prints = set()
    for checkout in ("here", "elsewhere/ci"):
        folder = tmp_path / checkout / "workflows"
        folder.mkdir(parents=True)
        (folder / "copied.py").write_text(COPIED_WORKFLOW)
        workflow = load_paths([folder]).workflows["copied"]
        assert workflow.parse_context({}).folder == str(folder)  # type: ignore[attr-defined]
        prints.add(workflow.fingerprint)
    assert len(prints) == 1
