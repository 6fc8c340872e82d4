"""Each verdict of flowloop.verdicts.judge: what a worker (and ``flowloop check``) does with
one stored run under a new definition."""

from __future__ import annotations

import json

from deploykit import OrderV1, added_field, order, removed_state, renamed_state

from flowloop.verdicts import judge

V1 = order().validate()
STORED = json.dumps({"order_id": "A"})


def _judge(new: object, state: str, *, context: str = STORED, version: int = 1) -> object:
    assert hasattr(new, "fingerprint")
    return judge(
        new,  # type: ignore[arg-type]
        state=state,
        fingerprint=V1.fingerprint,
        context=context,
        context_version=version,
        old=V1.definition_record(),
    )


def test_verdict__same_definition_continues() -> None:
    verdict = _judge(V1, "charge")
    assert (verdict.kind, verdict.reason, verdict.outcome) == ("continues", None, "runs")


def test_verdict__added_field_with_upcaster_migrates() -> None:
    verdict = _judge(added_field(migrated=True).validate(), "confirm")
    assert (verdict.kind, verdict.outcome) == ("migrates", "runs")


def test_verdict__added_field_without_upcaster_fails_with_the_reason() -> None:
    verdict = _judge(added_field(migrated=False).validate(), "confirm")
    assert (verdict.kind, verdict.outcome) == ("fails", "paused")
    assert verdict.reason == (
        "context_mismatch: no upcaster from context version 1 to 2 (add migrate={1: ...}) "
        "(context v1 -> v2)"
    )


def test_verdict__required_field_same_context_version_names_the_field() -> None:
    from deploykit import OrderV2

    verdict = _judge(order(context=OrderV2).validate(), "ship")
    assert verdict.kind == "fails" and verdict.outcome == "paused"
    assert verdict.reason == "context_mismatch: currency: Field required (context v1)"


def test_verdict__removed_state_parks() -> None:
    verdict = _judge(removed_state().validate(), "confirm")
    assert (verdict.kind, verdict.outcome) == ("parks", "paused")
    assert verdict.reason == "definition_mismatch: state 'confirm' no longer exists in order v2"


def test_verdict__removed_transition_parks_renamed_state_too() -> None:
    renamed = renamed_state().validate()
    # reserve's transition next->charge is gone; a run in charge finds no state.
    assert _judge(renamed, "reserve").reason == (
        "definition_mismatch: transitions of state 'reserve' changed (next->charge no longer exist)"
    )
    assert _judge(renamed, "charge").kind == "parks"
    assert _judge(renamed, "ship").kind == "continues"  # untouched states go on


def test_verdict__removed_state_untouched_positions_continue() -> None:
    assert _judge(removed_state().validate(), "ship").kind == "continues"


def test_verdict__corrupt_row_of_the_same_definition_fails_at_once() -> None:
    assert _judge(V1, "nowhere").outcome == "failed"
    assert _judge(V1, "nowhere").reason == "unknown_state: nowhere"
    corrupt = _judge(V1, "charge", context='["not", "an", "object"]')
    assert (corrupt.kind, corrupt.reason, corrupt.outcome) == ("fails", "invalid_context", "failed")


def test_verdict__a_context_its_unchanged_definition_refuses_is_parked() -> None:
    """A validator added without a change the fingerprint sees: the worker failed every
    run whose context it refused ("invalid_context"); it parks them, as a deploy should."""
    bad = _judge(V1, "charge", context='{"order_id": 5}')
    assert (bad.kind, bad.outcome) == ("fails", "paused")
    assert bad.reason is not None and bad.reason.startswith("context_mismatch: order_id")
    assert bad.reason.endswith("(context v1, definition unchanged: a validator may have changed)")


def test_verdict__validate_false_trusts_an_unchanged_context_model() -> None:
    new = order(version=2).validate()  # same context model, same fingerprint here
    assert new.fingerprint == V1.fingerprint
    changed = renamed_state().validate()
    verdict = judge(
        changed,
        state="ship",
        fingerprint=V1.fingerprint,
        context='{"order_id": 5}',  # would not validate: not looked at
        context_version=1,
        old=V1.definition_record(),
        validate=False,
    )
    assert verdict.kind == "continues"
    assert OrderV1.model_fields.keys() == changed.context.model_fields.keys()


def test_describe_changes__a_state_of_another_kind_is_a_change_that_matters() -> None:
    """A wait turned into a step parks the runs resting there, yet ``check``'s summary of
    the changes said "no change that matters"."""
    from flowloop import Workflow
    from flowloop.checking import describe_changes

    def shaped(kind: str) -> Workflow:
        wf = Workflow("shaped", context=OrderV1)
        if kind == "wait":
            wf.wait("confirm", on={"confirmed": "done"}, initial=True)
        else:
            wf.step(name="confirm", next="done", initial=True)(lambda ctx: None)
        wf.final("done")
        return wf.validate()

    old = shaped("wait").definition_record()
    assert describe_changes(old, shaped("step")) == [
        "state 'confirm' changed from a wait to a step",
        "transition confirm.confirmed: done -> nothing",
        "transition confirm.next: nothing -> done",
    ]
