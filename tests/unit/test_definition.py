"""Workflow definitions: what validation refuses (naming the culprits) and what it builds."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from pydantic import (
    AliasChoices,
    AliasPath,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    RootModel,
    computed_field,
    model_validator,
)

from flowloop import Retry, Step, Workflow
from flowloop.definition import NEXT_EVENT, compatible
from flowloop.errors import DefinitionError, InvalidContext, InvalidEvent


class Ctx(BaseModel):
    order_id: str = "o-1"
    n: int = 0


def noop(ctx: Ctx) -> str:
    return "go"


def linear(name: str = "w", *, version: int = 1) -> Workflow:
    """a -> b -> done, the smallest valid workflow with two steps."""
    wf = Workflow(name, context=Ctx, version=version)
    wf.step(initial=True, next="b")(noop)
    wf.step(name="b", on={"ok": "done", "no": "cancelled"})(noop)
    wf.final("done", "cancelled")
    return wf


def define(build: Callable[[Workflow], None]) -> Workflow:
    wf = Workflow("w", context=Ctx)
    build(wf)
    return wf


def fn(*_: Any) -> None:
    return None


# -- what validation refuses --------------------------------------------------------------


def test_validate__unknown_target_names_state_and_target() -> None:
    def build(wf: Workflow) -> None:
        wf.step(name="a", initial=True, on={"ok": "done", "odd": "nowhere"})(fn)
        wf.final("done")

    with pytest.raises(DefinitionError, match=r"state 'a' goes to unknown state\(s\) 'nowhere'"):
        define(build).validate()


def test_validate__no_initial_state() -> None:
    def build(wf: Workflow) -> None:
        wf.step(name="a", next="done")(fn)
        wf.final("done")

    with pytest.raises(DefinitionError, match=r"exactly one initial state .*found none"):
        define(build).validate()


def test_validate__two_initial_states_named() -> None:
    def build(wf: Workflow) -> None:
        wf.step(name="a", initial=True, next="done")(fn)
        wf.step(name="b", initial=True, next="done")(fn)
        wf.final("done")

    with pytest.raises(DefinitionError, match=r"exactly one initial state .*found 'a', 'b'"):
        define(build).validate()


def test_validate__non_final_state_that_cannot_reach_a_final_state() -> None:
    def build(wf: Workflow) -> None:
        wf.step(name="a", initial=True, on={"ok": "done", "loop": "b"})(fn)
        wf.step(name="b", next="c")(fn)  # b <-> c forever
        wf.step(name="c", next="b")(fn)
        wf.final("done")

    with pytest.raises(DefinitionError, match=r"state\(s\) 'b', 'c' can never reach a final"):
        define(build).validate()


def test_validate__unreachable_state_named() -> None:
    def build(wf: Workflow) -> None:
        wf.step(name="a", initial=True, next="done")(fn)
        wf.step(name="orphan", next="done")(fn)
        wf.final("done", "never")

    with pytest.raises(DefinitionError, match=r"'never', 'orphan' cannot be reached"):
        define(build).validate()


def test_validate__step_on_a_final_state() -> None:
    def build(wf: Workflow) -> None:
        wf.step(name="a", initial=True, next="done")(fn)
        wf.step(name="done", next="a")(fn)
        wf.final("done")

    with pytest.raises(DefinitionError, match=r"final state\(s\) 'done' must not have a step"):
        define(build).validate()


def test_validate__no_final_state() -> None:
    def build(wf: Workflow) -> None:
        wf.step(name="a", initial=True, next="a")(fn)

    with pytest.raises(DefinitionError, match="declares no final state"):
        define(build).validate()


def test_validate__message_names_the_workflow() -> None:
    wf = Workflow("orders", context=Ctx)
    wf.step(name="a", initial=True, next="gone")(fn)
    wf.final("done")
    with pytest.raises(DefinitionError, match=r"^workflow 'orders': ") as info:
        wf.validate()
    assert info.value.workflow == "orders"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "needs exactly one of on="),
        ({"on": {"x": "done"}, "next": "done"}, "needs exactly one of on="),
        ({"on": {}}, "declares no transition"),
        ({"next": "done", "timeout": 0}, "timeout must be positive"),
        ({"next": "done", "timeout": timedelta(seconds=-1)}, "timeout must be positive"),
        ({"next": "done", "max_visits": 0}, "max_visits must be at least 1"),
        ({"next": "done", "name": "bad name"}, "not a valid name"),
        # Taken before, they failed only when the step raised, taking the worker down
        # (new-user audit).
        ({"next": "done", "retry": 3}, r"retry=3 must be a flowloop Retry"),
        (
            {"next": "done", "compensate": fn, "compensate_retry": 2},
            r"compensate_retry=2 must be a flowloop Retry",
        ),
    ],
    ids=[
        "neither",
        "both",
        "empty-on",
        "zero-timeout",
        "negative-timedelta",
        "zero-visits",
        "bad-name",
        "retry-a-number",
        "compensate-retry-a-number",
    ],
)
def test_step__bad_declaration_refused(kwargs: dict[str, Any], message: str) -> None:
    wf = Workflow("w", context=Ctx)
    with pytest.raises(DefinitionError, match=message):
        wf.step(initial=True, **kwargs)(fn)


def test_tune_step__retry_not_a_retry_refused() -> None:
    wf = Workflow("w", context=Ctx)
    wf.step(name="a", initial=True, next="done")(fn)
    with pytest.raises(DefinitionError, match=r"state 'a': retry='3' must be a flowloop Retry"):
        wf.tune_step("a", retry="3")  # type: ignore[arg-type]


def test_step__declared_twice_refused() -> None:
    wf = Workflow("w", context=Ctx)
    wf.step(name="a", initial=True, next="done")(fn)
    with pytest.raises(DefinitionError, match="state 'a' is declared twice"):
        wf.step(name="a", next="done")(fn)


def test_step__named_like_a_wait_or_a_call_state_refused() -> None:
    """One name, one kind of state: a step named like a wait or a call state was taken,
    and the engine then had to guess which the run was in."""
    wf = Workflow("w", context=Ctx)
    wf.wait("approval", on={"approved": "done"})
    child = Workflow("child", context=Ctx)
    wf.call("fetch", child=child, context=lambda c: c, on={"succeeded": "done"})
    for name in ("approval", "fetch"):
        with pytest.raises(DefinitionError, match=f"state '{name}' is declared twice"):
            wf.step(name=name, next="done")(fn)
    wf.step(name="charge", initial=True, next="approval")(fn)
    with pytest.raises(DefinitionError, match="state 'charge' is declared twice"):
        wf.wait("charge", on={"approved": "done"})


def test_step__function_without_ctx_refused() -> None:
    def nothing() -> None: ...

    wf = Workflow("w", context=Ctx)
    with pytest.raises(DefinitionError, match=r"must take \(ctx\) or \(ctx, step\)"):
        wf.step(initial=True, next="done")(nothing)


@pytest.mark.parametrize(
    ("define_fn", "required"),
    [
        (lambda: lambda ctx, step, extra: None, "ctx, step, extra"),
        (lambda: lambda ctx, *, region: None, "ctx, region"),
        (lambda: lambda ctx, step, *args, limit: None, "ctx, step, limit"),
    ],
    ids=["third_positional", "required_keyword_only", "keyword_after_args"],
)
def test_step__function_that_cannot_take_ctx_and_step_refused_naming_the_state(
    define_fn: Callable[[], Callable[..., None]], required: str
) -> None:
    wf = Workflow("w", context=Ctx)
    with pytest.raises(DefinitionError) as caught:
        wf.step(name="pack", initial=True, next="done")(define_fn())
    message = str(caught.value)
    assert "workflow 'w'" in message and "step 'pack'" in message
    assert f"requires ({required})" in message


def test_step__optional_extra_parameters_are_fine() -> None:
    wf = Workflow("w", context=Ctx)

    @wf.step(initial=True, next="b")
    def a(ctx: Ctx, *, verbose: bool = False) -> None: ...

    @wf.step(next="done")
    def b(ctx: Ctx, step: Step | None = None, extra: int = 0, **options: Any) -> None: ...

    wf.final("done")
    wf.validate()
    assert [wf.steps[s].wants_step for s in ("a", "b")] == [False, True]


def test_workflow__bad_arguments_refused() -> None:
    with pytest.raises(DefinitionError, match="name must start with"):
        Workflow("has space", context=Ctx)
    # (The error said "letters" and refused one: it says which.)
    with pytest.raises(DefinitionError, match="only ASCII letters, digits"):
        Workflow("zürich", context=Ctx)
    with pytest.raises(DefinitionError, match="pydantic BaseModel"):
        Workflow("w", context=dict)  # type: ignore[arg-type]
    with pytest.raises(DefinitionError, match="max_concurrency"):
        Workflow("w", context=Ctx, max_concurrency=0)
    with pytest.raises(DefinitionError, match="not a valid name"):
        Workflow("w", context=Ctx).final("no way")


def test_validate__frozen_after_use() -> None:
    wf = linear()
    wf.validate()
    assert wf.validate() is wf  # idempotent
    with pytest.raises(DefinitionError, match="already validated"):
        wf.step(name="late", next="done")(fn)
    with pytest.raises(DefinitionError, match="already validated"):
        wf.final("other")


# -- what it builds -----------------------------------------------------------------------


def test_validate__builds_states_transitions_and_machine() -> None:
    wf = linear().validate()
    assert wf.states == ["noop", "b", "done", "cancelled"]
    assert wf.initial == "noop"
    assert wf.finals == ("done", "cancelled")
    assert [(t.source, t.event, t.dest) for t in wf.transitions()] == [
        ("noop", NEXT_EVENT, "b"),
        ("b", "ok", "done"),
        ("b", "no", "cancelled"),
    ]
    assert set(wf.machine.states) == set(wf.states)
    assert wf.is_final("done") and not wf.is_final("b")


def test_next_state__declared_event_leads_to_its_target() -> None:
    wf = linear().validate()
    assert wf.next_state("b", "ok") == "done"
    assert wf.next_state("noop", NEXT_EVENT) == "b"


@pytest.mark.parametrize("event", ["maybe", None, 3])
def test_next_state__undeclared_event_names_what_is_accepted(event: object) -> None:
    wf = linear().validate()
    with pytest.raises(InvalidEvent, match=r"state 'b' does not accept event .* accepts: no, ok"):
        wf.next_state("b", event)


def test_event_for__next_steps_take_next_when_they_return_none() -> None:
    """A ``next=`` step returns None (or "next"); anything else is refused (before, it
    was ignored: a ``step.sleep(…, "event")`` of one went on to its next state)."""
    wf = linear().validate()
    assert wf.event_for("noop", None) == NEXT_EVENT
    assert wf.event_for("noop", NEXT_EVENT) == NEXT_EVENT
    assert wf.event_for("b", "ok") == "ok"
    with pytest.raises(InvalidEvent, match=r"has next='b' and returned 'anything': return None"):
        wf.event_for("noop", "anything")


def test_fingerprint__depends_on_structure_not_code_or_version() -> None:
    a, b = linear(), linear(version=2)
    assert a.fingerprint == b.fingerprint
    changed = Workflow("w", context=Ctx)
    changed.step(initial=True, next="b")(noop)
    changed.step(name="b", on={"ok": "done"})(noop)
    changed.final("done")
    assert changed.fingerprint != a.fingerprint
    assert len(a.fingerprint) == 16


def test_step_spec__records_settings() -> None:
    wf = Workflow("w", context=Ctx)

    @wf.step(
        initial=True,
        next="done",
        timeout=timedelta(seconds=2),
        idempotent=False,
        max_visits=3,
        retry=Retry(attempts=5, backoff="fixed", base=1, cap=1),
    )
    async def a(ctx: Ctx, step: Step) -> None: ...

    wf.final("done")
    spec = wf.validate().steps["a"]
    assert spec.is_async and spec.wants_step and not spec.returns_event
    assert spec.timeout == 2.0 and spec.max_visits == 3 and not spec.idempotent
    assert spec.describe() == (f"{spec.retry.describe()}, timeout 2s, not idempotent, max 3 visits")
    assert spec.retry.attempts == 5


def test_step__signature_decides_whether_step_is_passed() -> None:
    wf = Workflow("w", context=Ctx)

    @wf.step(initial=True, next="b")
    def a(ctx: Ctx) -> None: ...

    @wf.step(next="c")
    def b(ctx: Ctx, step: Step) -> None: ...

    @wf.step(next="done")
    def c(*args: Any) -> None: ...

    wf.final("done")
    assert [wf.steps[s].wants_step for s in ("a", "b", "c")] == [False, True, True]


def test_on_cycle__finds_loops() -> None:
    wf = Workflow("poll", context=Ctx)
    wf.step(name="ask", initial=True, on={"wait": "sleep", "ready": "done"})(fn)
    wf.step(name="sleep", next="ask")(fn)
    wf.final("done")
    assert wf.validate().on_cycle() == {"ask", "sleep"}
    assert linear().on_cycle() == set()


def test_step__idempotency_key_is_stable_across_attempts() -> None:
    keys = {
        Step(
            run_id="r1", workflow="w", state="charge", attempt=n, visit=1, seq=4 + n, worker=f"w{n}"
        ).idempotency_key
        for n in (1, 2, 3)
    }
    assert keys == {"r1:charge:1"}
    second_visit = Step(
        run_id="r1", workflow="w", state="charge", attempt=1, visit=2, seq=9, worker="w"
    )
    assert second_visit.idempotency_key == "r1:charge:2"


# -- contexts and keys --------------------------------------------------------------------


def test_parse_context__accepts_json_mapping_and_model() -> None:
    wf = linear()
    assert wf.parse_context('{"order_id": "x", "n": 2}') == Ctx(order_id="x", n=2)
    assert wf.parse_context({"order_id": "y"}) == Ctx(order_id="y")
    original = Ctx(n=5)
    parsed = wf.parse_context(original)
    assert parsed == original and parsed is not original  # a copy: steps never share one


def test_parse_context__invalid_names_the_field() -> None:
    with pytest.raises(InvalidContext, match="context for workflow 'w' is invalid: n: "):
        linear().parse_context({"n": "many"})
    with pytest.raises(InvalidContext, match="invalid"):
        linear().parse_context("{not json")
    # A list of pairs would pass dict(); a context is an object of fields, nothing else.
    with pytest.raises(InvalidContext, match="expected an object of fields, got list"):
        linear().parse_context([("order_id", "n")])  # type: ignore[arg-type]


def test_parse_new_context__a_field_the_model_lacks_is_refused() -> None:
    """A misspelt field of a new run's context was dropped without a word and the run
    started with that field's default (new-user audit): refused, naming it and the fields.
    A model that says what becomes of extra fields keeps its say; a stored context (an
    older version's leftover fields) still loads."""
    wf = linear()
    for given in ('{"order_id": "x", "m": 2}', {"order_id": "x", "m": 2}):
        with pytest.raises(
            InvalidContext, match=r"no field\(s\) 'm' in Ctx \(fields: order_id, n\)"
        ):
            wf.parse_new_context(given)
    assert wf.parse_new_context({"order_id": "x", "n": 2}) == Ctx(order_id="x", n=2)
    with pytest.raises(InvalidContext, match="invalid"):
        wf.parse_new_context("{not json")

    class Loose(BaseModel):
        model_config = ConfigDict(extra="ignore")
        n: int = 0

    loose = Workflow("loose", context=Loose)
    assert loose.parse_new_context({"n": 1, "other": 2}) == Loose(n=1)
    assert wf.load_context('{"order_id": "x", "n": 1, "gone": true}') == Ctx(order_id="x", n=1)


def test_parse_new_context__takes_every_key_the_model_takes() -> None:
    """A first version refused keys pydantic takes (review): validation aliases (a choice, a
    path's first key), a computed field (a dumped context holds it), a model that reads
    its raw input itself (a root model, a "before" validator); a non-text key was a
    traceback."""

    class Aliased(BaseModel):
        order_id: str = Field("", validation_alias=AliasChoices("orderId", AliasPath("o", 0)))
        note: str = Field("", alias="Note")

        @computed_field  # type: ignore[prop-decorator]
        @property
        def size(self) -> int:
            return len(self.order_id)

    wf = Workflow("aliased", context=Aliased)
    assert wf.parse_new_context({"orderId": "x", "Note": "n"}).order_id == "x"  # type: ignore[attr-defined]
    assert wf.parse_new_context('{"o": ["y"], "size": 1}').order_id == "y"  # type: ignore[attr-defined]
    # A field's own name is taken too (contexts are validated by name as well: they are
    # stored by name).
    assert wf.parse_new_context({"orderId": "x", "note": "kept"}).note == "kept"  # type: ignore[attr-defined]
    with pytest.raises(InvalidContext, match=r"no field\(s\) '1'"):
        wf.parse_new_context({1: "a", "orderId": "x"})  # type: ignore[dict-item]

    # An edit (`retry --set`) of a computed field would be dropped: not a key to set.
    with pytest.raises(InvalidContext, match=r"no field\(s\) 'size'"):
        wf.check_fields({"size"})
    wf.check_fields({"size"}, dumped=True)

    class Legacy(BaseModel):
        order_id: str

        @model_validator(mode="before")
        @classmethod
        def renamed(cls, data: Any) -> Any:
            if isinstance(data, dict) and "orderId" in data:
                data = {"order_id": data.pop("orderId"), **data}
            return data

    assert Workflow("legacy", context=Legacy).parse_new_context({"orderId": "z"}).order_id == "z"  # type: ignore[attr-defined]

    class Counts(RootModel[dict[str, int]]):
        pass

    assert Workflow("counts", context=Counts).parse_new_context({"a": 1}).root == {"a": 1}  # type: ignore[attr-defined]


def test_parse_new_context__another_models_instance_is_judged_by_its_fields() -> None:
    """An instance of another model was taken and its fields the workflow's model has not
    dropped without a word, where the mapping of the same fields was refused (audit):
    judged like that mapping now. The model's own instances are taken as before, and so
    is any instance whose fields the model all has."""

    class Refund(BaseModel):
        order_id: str
        refund_amount: float

    class Rush(Ctx):
        rush: bool = True

    class Same(BaseModel):
        order_id: str

        @computed_field  # type: ignore[prop-decorator]
        @property
        def shown(self) -> str:  # derived, no data of its own: nothing is lost
            return self.order_id.upper()

    class Plain(Ctx):
        pass

    wf = linear()
    refused = [Refund(order_id="A1", refund_amount=5.0), Rush(order_id="R")]
    for given, field, kind in zip(
        refused, ("refund_amount", "rush"), ("Refund", "Rush"), strict=True
    ):
        with pytest.raises(
            InvalidContext,
            match=rf"no field\(s\) '{field}' in Ctx \(fields: order_id, n\); "
            rf"the context given is a {kind}$",
        ):
            wf.parse_new_context(given)
    assert wf.parse_new_context(Same(order_id="S")) == Ctx(order_id="S")
    assert wf.parse_new_context(Plain(order_id="P", n=2)) == Ctx(order_id="P", n=2)
    own = Ctx(order_id="O", n=3)
    taken = wf.parse_new_context(own)
    assert taken == own and taken is not own and type(taken) is Ctx

    class Loose(BaseModel):  # it says what becomes of extra fields: its say is kept
        model_config = ConfigDict(extra="ignore")
        order_id: str = ""

    loose = Workflow("loose", context=Loose)
    assert loose.parse_new_context(Refund(order_id="L", refund_amount=1)) == Loose(order_id="L")


def test_business_key__field_function_or_none() -> None:
    by_field = Workflow("w", context=Ctx, key="order_id")
    by_function = Workflow("w", context=Ctx, key=lambda c: f"{c.order_id}/{c.n}")
    assert by_field.business_key(Ctx(order_id="A1")) == "A1"
    assert by_function.business_key(Ctx(order_id="A1", n=2)) == "A1/2"
    assert linear().business_key(Ctx()) is None


# -- compatibility of a stored run with a changed definition ------------------------------


def test_compatible__same_structure_continues() -> None:
    wf = linear().validate()
    assert compatible(wf.structure(), wf, "b") is None


def test_compatible__added_states_and_transitions_continue() -> None:
    old = linear().structure()
    new = Workflow("w", context=Ctx, version=2)
    new.step(initial=True, next="b")(noop)
    new.step(name="b", on={"ok": "done", "no": "cancelled", "later": "wait"})(noop)
    new.step(name="wait", next="b")(noop)
    new.final("done", "cancelled")
    assert compatible(old, new.validate(), "b") is None


def test_compatible__removed_state_refused() -> None:
    old = linear().structure()
    new = Workflow("w", context=Ctx, version=2)
    new.step(name="other", initial=True, next="done")(noop)
    new.final("done")
    assert compatible(old, new.validate(), "b") == "state 'b' no longer exists in w v2"


def test_compatible__changed_transition_refused() -> None:
    old = linear().structure()
    new = Workflow("w", context=Ctx, version=2)
    new.step(initial=True, next="b")(noop)
    new.step(name="b", on={"ok": "cancelled", "no": "cancelled", "fine": "done"})(noop)
    new.final("done", "cancelled")
    why = compatible(old, new.validate(), "b")
    assert why == "transitions of state 'b' changed (ok->done no longer exist)"


def test_compatible__unknown_old_structure_judged_on_state_alone() -> None:
    assert compatible({}, linear().validate(), "b") is None
    assert compatible({}, linear().validate(), "gone") is not None


def test_validate__every_problem_at_once() -> None:
    """A definition with three mistakes took three tries to learn them (new-user audit):
    one error lists them all, numbered — and not the states a misspelt target leaves
    unreached, which are no mistakes of their own."""

    def build(wf: Workflow) -> None:
        wf.step(name="a", initial=True, on={"ok": "shiped", "no": "b"})(fn)
        wf.step(name="b", on={"again": "a", "give_up": "nowhere"})(fn)
        wf.step(name="done", next="a")(fn)
        wf.final("done", "shipped")

    with pytest.raises(DefinitionError) as caught:
        define(build).validate()
    message = str(caught.value)
    assert message.startswith("workflow 'w': 3 problems: (1) final state(s) 'done' must not")
    assert "(2) state 'a' goes to unknown state(s) 'shiped'" in message
    assert "(3) state 'b' goes to unknown state(s) 'nowhere'" in message
    assert "cannot be reached" not in message  # ('shipped': the typo's doing)

    def unreachable_and_stuck(wf: Workflow) -> None:
        wf.step(name="a", initial=True, on={"ok": "done", "loop": "b"})(fn)
        wf.step(name="b", next="c")(fn)
        wf.step(name="c", next="b")(fn)
        wf.step(name="orphan", next="done")(fn)
        wf.final("done")

    with pytest.raises(DefinitionError) as caught:
        define(unreachable_and_stuck).validate()
    assert str(caught.value).endswith(
        "2 problems: (1) state(s) 'orphan' cannot be reached; "
        "(2) state(s) 'b', 'c' can never reach a final state"
    ), caught.value


def test_workflow__key_naming_no_field_refused() -> None:
    """A misspelt ``key=`` was taken, and every start failed with an AttributeError's
    traceback (new-user audit)."""

    class Order(BaseModel):
        id: str

        @property
        def upper(self) -> str:
            return self.id.upper()

        @functools.cached_property
        def lower(self) -> str:  # (refused by the first version of this check: review)
            return self.id.lower()

    with pytest.raises(
        DefinitionError, match=r"key='order_id' is not a field of Order \(fields: id\)"
    ):
        Workflow("keyed", context=Order, key="order_id")
    with pytest.raises(DefinitionError, match=r"key=3 must be a field name or a function"):
        Workflow("keyed", context=Order, key=3)  # type: ignore[arg-type]
    for key in ("id", "upper", "lower", lambda ctx: ctx.id):
        assert Workflow("keyed", context=Order, key=key).key == key  # type: ignore[arg-type]

    # Models that answer attributes their own way are trusted, as before (review).
    class Private(BaseModel):
        id: str
        _shard: str = PrivateAttr("s1")

    class Loose(RootModel[dict[str, str]]):
        def __getattr__(self, name: str) -> str:
            return self.root[name]

    assert Workflow("keyed", context=Private, key="_shard").key == "_shard"
    assert Workflow("keyed", context=Loose, key="anything").key == "anything"
