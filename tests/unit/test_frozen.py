"""flowloop.frozen.build: a frozen dataclass built without its generated __init__ equals
the one its constructor builds, and refuses what the constructor refuses."""

from __future__ import annotations

import dataclasses

import pytest

from flowloop import frozen
from flowloop.definition import Step
from flowloop.journal import JournalEvent, new_event


def test_frozen__build_equals_the_constructor_defaults_and_factories_included() -> None:
    fields = {"run_id": "r", "seq": 3, "kind": "step_started", "at": 1.5, "attempt": 1}
    built, made = new_event(fields), JournalEvent(**fields)  # type: ignore[arg-type]
    assert built == made and repr(built) == repr(made)
    assert built.data == {} and built.data is not new_event(fields).data  # a fresh dict each
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.seq = 4  # type: ignore[misc]
    step = frozen.build(
        Step,
        {
            "run_id": "r",
            "workflow": "w",
            "state": "s",
            "attempt": 1,
            "visit": 2,
            "seq": 3,
            "worker": "w",
        },
    )
    step.note("one")
    assert step.notes == ["one"] and step.idempotency_key == "r:s:2"
    assert frozen.build(Step, dataclasses.asdict(step) | {"notes": []}).notes == []


def test_frozen__unknown_and_missing_fields_raise_as_the_constructor_does() -> None:
    with pytest.raises(TypeError, match=r"no field.* stat"):
        new_event({"run_id": "r", "seq": 1, "kind": "run_created", "at": 0.0, "stat": "x"})
    with pytest.raises(TypeError, match="needs at, kind"):
        new_event({"run_id": "r", "seq": 1})


def test_frozen__a_build_starts_from_the_fields_defaults_whatever_the_last_one_gave() -> None:
    # Every instance's dict starts as a copy of its class's template: what one build gives
    # reaches neither the template nor the next build, and a field left out is its default
    # (or the factory's fresh value), never another instance's.
    first = new_event({"run_id": "r", "seq": 1, "kind": "k", "at": 0.0, "state": "s"})
    second = new_event({"run_id": "q", "seq": 2, "kind": "k", "at": 0.0})
    assert first.state == "s" and second.state is None and second.data == {}
    assert second == JournalEvent(run_id="q", seq=2, kind="k", at=0.0)
    # Unknown and missing at once: the unknown one is named, as the constructor names an
    # unexpected keyword before any missing argument.
    with pytest.raises(TypeError, match=r"no field.* stat"):
        new_event({"run_id": "r", "stat": "x"})
    with pytest.raises(TypeError, match="needs at, kind, seq"):
        new_event({"run_id": "r", "data": {"x": 1}})


def test_frozen__classes_it_cannot_fill_are_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Checked:
        n: int

        def __post_init__(self) -> None:
            assert self.n >= 0

    @dataclasses.dataclass(frozen=True, slots=True)
    class Slotted:
        n: int

    for cls in (Checked, Slotted):
        with pytest.raises(TypeError, match=cls.__name__):
            frozen.build(cls, {"n": 1})


def test_frozen__replaced_equals_dataclasses_replace_and_checks_names() -> None:
    event = new_event({"run_id": "r", "seq": 3, "kind": "step_started", "at": 1.5})
    moved = frozen.replaced(event, seq=4, data={"x": 1})
    assert moved == dataclasses.replace(event, seq=4, data={"x": 1}) and event.seq == 3
    with pytest.raises(TypeError, match="no field"):
        frozen.replaced(event, sek=4)
