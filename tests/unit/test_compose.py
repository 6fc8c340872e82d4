"""The pure half of composition: define-time checks of on_error, call, map, compensation
and deadlines; error routing; child ids; tolerate and join maths; which compensations
are owed."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import BaseModel

from flowloop import Step, Workflow, compose
from flowloop import journal as j
from flowloop.errors import DefinitionError, Interrupted, StepTimeout


class Ctx(BaseModel):
    n: int = 0
    files: list[str] = []


class Declined(Exception):
    pass


class HardDeclined(Declined):
    pass


def child() -> Workflow:
    wf = Workflow("child", context=Ctx)

    @wf.step(initial=True, next="done")
    def work(ctx: Ctx) -> None: ...

    wf.final("done")
    return wf


# -- on_error ---------------------------------------------------------------------------------


def test_on_error__key_must_be_an_exception_class_or_star() -> None:
    wf = Workflow("w", context=Ctx)
    with pytest.raises(DefinitionError, match="on_error keys must be exception classes"):

        @wf.step(initial=True, next="done", on_error={"Declined": "done"})
        def charge(ctx: Ctx) -> None: ...


def test_on_error__unknown_target_names_the_state() -> None:
    wf = Workflow("w", context=Ctx)

    @wf.step(initial=True, next="done", on_error={Declined: "nowhere"})
    def charge(ctx: Ctx) -> None: ...

    wf.final("done")
    with pytest.raises(DefinitionError, match=r"'charge' goes to unknown state.*'nowhere'"):
        wf.validate()


def test_on_error__a_target_reached_only_by_an_error_is_reachable() -> None:
    wf = Workflow("w", context=Ctx)

    @wf.step(initial=True, next="done", on_error={"*": "refund"})
    def charge(ctx: Ctx) -> None: ...

    @wf.step(next="refunded")
    def refund(ctx: Ctx) -> None: ...

    wf.final("done", "refunded")
    wf.validate()
    assert ("charge", "error:*", "refund") in {
        (t.source, t.event, t.dest) for t in wf.transitions()
    }


def test_on_error__an_error_edge_counts_for_reaching_a_final_state() -> None:
    wf = Workflow("w", context=Ctx)

    @wf.step(initial=True, on={"again": "charge"}, on_error={Declined: "cancelled"})
    def charge(ctx: Ctx) -> str: ...

    wf.final("cancelled")
    wf.validate()  # without the error edge, 'charge' could never reach a final state


def test_route_error__most_specific_class_then_star_never_interrupted() -> None:
    routes = ((Declined, "declined"), (HardDeclined, "hard"), ("*", "refund"))
    assert compose.route_error(routes, HardDeclined()) == ("error:HardDeclined", "hard")
    assert compose.route_error(routes, Declined()) == ("error:Declined", "declined")
    assert compose.route_error(routes, ValueError()) == ("error:*", "refund")
    assert compose.route_error(routes, StepTimeout()) == ("error:*", "refund")
    assert compose.route_error(routes, Interrupted("cut")) is None
    assert compose.route_error(((Interrupted, "check"),), Interrupted("cut")) == (
        "error:Interrupted",
        "check",
    )
    assert compose.route_error((), ValueError()) is None


def test_step_error__parsed_from_the_record() -> None:
    record = j.create(
        j.JournalEvent(
            run_id="r",
            seq=1,
            kind=j.RUN_CREATED,
            at=0.0,
            state="a",
            context="{}",
            data={"workflow": "w", "version": 1, "fingerprint": "f"},
        )
    )
    assert compose.step_error(record) is None
    failed = object.__new__(j.RunRecord)
    failed.__dict__.update({**record.__dict__, "error": "Declined: card: declined"})
    assert compose.step_error(failed) == compose.StepError("Declined", "card: declined")


# -- call and map -----------------------------------------------------------------------------


def parent_with(**kwargs: object) -> Workflow:
    wf = Workflow("parent", context=Ctx)
    kind = kwargs.pop("kind", "call")
    if kind == "call":
        wf.call(
            "pack",
            child=kwargs.pop("child", child()),
            context=lambda c: Ctx(),
            initial=True,
            **kwargs,
        )  # type: ignore[arg-type]
    else:
        wf.map(
            "load",
            child=kwargs.pop("child", child()),  # type: ignore[arg-type]
            items=lambda c: c.files,
            context=lambda c, item: Ctx(),
            initial=True,
            **kwargs,  # type: ignore[arg-type]
        )
    wf.final("done", "bad")
    return wf


def test_call__outcomes_are_checked() -> None:
    with pytest.raises(DefinitionError, match="call state 'pack': on= accepts succeeded"):
        parent_with(on={"succeeded": "done", "exploded": "bad"})
    with pytest.raises(DefinitionError, match="call state 'pack': on= needs 'succeeded'"):
        parent_with(on={"failed": "bad"})
    with pytest.raises(DefinitionError, match="child must be a Workflow"):
        parent_with(on={"succeeded": "done"}, child="packing")


def test_map__settings_are_checked() -> None:
    with pytest.raises(DefinitionError, match="max_parallel=0 must be an integer of at least 1"):
        parent_with(kind="map", on={"done": "done"}, max_parallel=0)
    with pytest.raises(DefinitionError, match=r"tolerate_failures=1\.5 is a count"):
        parent_with(kind="map", on={"done": "done"}, tolerate_failures=1.5)
    with pytest.raises(DefinitionError, match=r"tolerate_failures=-1 is a count"):
        parent_with(kind="map", on={"done": "done"}, tolerate_failures=-1)
    # Taken before: NaN failed every run at its join ("cannot convert float NaN to
    # integer"), a fraction of a slot ran as many (API audit).
    for bad in ({"tolerate_failures": float("nan")}, {"tolerate_failures": float("inf")}):
        with pytest.raises(DefinitionError, match="is a count"):
            parent_with(kind="map", on={"done": "done"}, **bad)
    for option in ("max_parallel", "max_items"):
        with pytest.raises(DefinitionError, match=rf"{option}=2\.5 must be an integer"):
            parent_with(kind="map", on={"done": "done"}, **{option: 2.5})
        with pytest.raises(DefinitionError, match=f"{option}=True must be an integer"):
            parent_with(kind="map", on={"done": "done"}, **{option: True})
    with pytest.raises(DefinitionError, match="map state 'load': on= accepts done, failed"):
        parent_with(kind="map", on={"done": "done", "succeeded": "bad"})


def test_call__targets_exist_and_count_as_edges() -> None:
    wf = parent_with(on={"succeeded": "done", "failed": "bad"})
    wf.validate()
    assert wf.structure()["states"]["pack"] == {
        "kind": "call",
        "on": {"failed": "bad", "succeeded": "done"},
        "child": "child",
    }
    broken = parent_with(on={"succeeded": "done", "failed": "nowhere"})
    with pytest.raises(DefinitionError, match="'pack' goes to unknown state"):
        broken.validate()


def test_call__a_workflow_that_calls_itself_is_refused() -> None:
    wf = Workflow("loop", context=Ctx)
    wf.call("again", child=wf, context=lambda c: c, on={"succeeded": "done"}, initial=True)
    wf.final("done")
    with pytest.raises(DefinitionError, match="'again' starts a cycle of calls: loop -> loop"):
        wf.validate()


def test_child_id__derived_and_distinct() -> None:
    a = compose.child_id("run1", "pack", 1)
    assert a == compose.child_id("run1", "pack", 1)
    assert len(a) == compose.CHILD_ID_LENGTH
    others = {
        compose.child_id("run1", "pack", 2),
        compose.child_id("run2", "pack", 1),
        compose.child_id("run1", "ship", 1),
        compose.child_id("run1", "pack", 1, 1),
        compose.join_id("run1", "pack", 1),
    }
    assert a not in others and len(others) == 5


@pytest.mark.parametrize(
    ("tolerate", "total", "allowed"),
    [(0, 10, 0), (3, 10, 3), (0.1, 10, 1), (0.1, 25, 2), (0.1, 9, 0), (0.5, 3, 1), (0.3, 10, 3)],
)
def test_tolerated__count_or_fraction(tolerate: float, total: int, allowed: int) -> None:
    assert compose.tolerated(tolerate, total) == allowed


def test_map_outcome__done_up_to_the_tolerance() -> None:
    assert compose.map_outcome(0, 5, 0) == "done"
    assert compose.map_outcome(0, 5, 1) == "failed"
    assert compose.map_outcome(0.2, 10, 2) == "done"
    assert compose.map_outcome(0.2, 10, 3) == "failed"
    assert compose.map_outcome(0, 0, 0) == "done"
    assert compose.call_outcome("stopped") == "stopped"
    assert compose.call_outcome("paused") == "failed"


# -- compensation and deadlines ---------------------------------------------------------------


def saga() -> Workflow:
    wf = Workflow("saga", context=Ctx)

    @wf.step(initial=True, next="charge", compensate=lambda c, s: None)
    def reserve(ctx: Ctx) -> None: ...

    @wf.step(next="ship", compensate=lambda c, s: None)
    def charge(ctx: Ctx) -> None: ...

    @wf.step(next="done", on_error={"*": "cancelled"})
    def ship(ctx: Ctx) -> None: ...

    wf.final("done")
    wf.final("cancelled", compensate=True)
    return wf


def entry(seq: int, kind: str, **fields: object) -> j.JournalEvent:
    return j.JournalEvent(run_id="r", seq=seq, kind=kind, at=float(seq), **fields)  # type: ignore[arg-type]


CREATED = {"workflow": "saga", "version": 1, "fingerprint": "f"}
"""A ``run_created`` entry's data (compensations_due folds the journal as apply does)."""


def test_compensations_due__reverse_journal_order_minus_those_done() -> None:
    wf = saga()
    wf.validate()
    events = [
        entry(1, j.RUN_CREATED, state="reserve", context="{}", data=CREATED),
        entry(2, j.STEP_STARTED, state="reserve"),
        entry(3, j.STEP_SUCCEEDED, state="reserve", next_state="charge", context="{}"),
        entry(4, j.STEP_STARTED, state="charge"),
        entry(5, j.STEP_SUCCEEDED, state="charge", next_state="ship", context="{}"),
        entry(6, j.STEP_STARTED, state="ship"),
        entry(7, j.STEP_FAILED, state="ship", next_state="cancelled", event="error:*"),
    ]
    owed = compose.compensations_due(wf, events)
    assert [(u.state, u.seq) for u in owed] == [("charge", 5), ("reserve", 3)]
    events += [
        entry(8, j.COMPENSATION_STARTED, state="charge", data={"for_seq": 5}),
        entry(9, j.COMPENSATION_SUCCEEDED, state="charge", context="{}", data={"for_seq": 5}),
    ]
    assert [u.state for u in compose.compensations_due(wf, events)] == ["reserve"]
    assert compose.undone(events) == ["charge"]


def test_compensating_final__needs_a_step_with_compensate() -> None:
    wf = Workflow("w", context=Ctx)

    @wf.step(initial=True, next="done", on_error={"*": "cancelled"})
    def charge(ctx: Ctx) -> None: ...

    wf.final("done")
    wf.final("cancelled", compensate=True)
    with pytest.raises(DefinitionError, match="'cancelled' compensate, but no step declares"):
        wf.validate()


def test_compensating_final__is_entered_due_not_finished() -> None:
    from flowloop.events import entering

    wf = saga()
    wf.validate()
    assert entering(wf, "cancelled", 5.0) == {"compensate": True}
    assert entering(wf, "done", 5.0) == {"final": True}
    assert wf.structure()["compensate"] == ["cancelled"]


def test_compensation_key__differs_from_the_step_key() -> None:
    step = Step(run_id="r", workflow="w", state="charge", attempt=1, visit=1, seq=3, worker="x")
    undo = Step(
        run_id="r",
        workflow="w",
        state="charge",
        attempt=1,
        visit=1,
        seq=9,
        worker="x",
        compensating=True,
    )
    assert step.idempotency_key == "r:charge:1"
    assert undo.idempotency_key == "r:charge:1:undo"


def test_deadline__needs_on_deadline_and_a_known_target() -> None:
    with pytest.raises(DefinitionError, match="give deadline= and on_deadline= together"):
        Workflow("w", context=Ctx, deadline=timedelta(hours=1))
    with pytest.raises(DefinitionError, match="deadline must be positive"):
        Workflow("w", context=Ctx, deadline=0, on_deadline="x")
    wf = Workflow("w", context=Ctx, deadline=60, on_deadline="nowhere")

    @wf.step(initial=True, next="done")
    def work(ctx: Ctx) -> None: ...

    wf.final("done")
    with pytest.raises(DefinitionError, match="on_deadline goes to unknown state 'nowhere'"):
        wf.validate()


def test_deadline__the_on_deadline_state_is_reachable_by_it() -> None:
    wf = Workflow("w", context=Ctx, deadline=60, on_deadline="expired")

    @wf.step(initial=True, next="done")
    def work(ctx: Ctx) -> None: ...

    wf.final("done", "expired")
    wf.validate()


def test_fold__deadline_makes_a_waiting_run_due_by_it_and_passing_spends_it() -> None:
    created = entry(
        1,
        j.RUN_CREATED,
        state="a",
        context="{}",
        data={"workflow": "w", "version": 1, "fingerprint": "f", "deadline": 100.0, "due": 5.0},
    )
    record = j.create(created)
    assert record.deadline == 100.0
    waiting = j.apply(record, entry(2, j.CHILDREN_STARTED, state="a"))
    assert waiting.next_run_at == 100.0  # no due time of its own: due at the deadline
    passed = j.apply(
        waiting,
        entry(
            3,
            j.DEADLINE_PASSED,
            state="a",
            next_state="b",
            error_type="DeadlineExceeded",
            error_message="late",
        ),
    )
    assert (passed.state, passed.deadline, passed.status) == ("b", None, "scheduled")
    assert passed.error == "DeadlineExceeded: late"


def test_parallel__branches_are_checked_and_their_workflows_registered() -> None:
    with pytest.raises(DefinitionError, match="parallel state 'p': needs at least one branch"):
        Workflow("w", context=Ctx).parallel("p", branches={}, on={"done": "x"})
    with pytest.raises(DefinitionError, match="branch 'a' must be \\(workflow, context"):
        Workflow("w", context=Ctx).parallel("p", branches={"a": child()}, on={"done": "x"})  # type: ignore[dict-item]
    wf = Workflow("w", context=Ctx)
    a, b = child(), Workflow("other", context=Ctx)

    @b.step(initial=True, next="ok")
    def go(ctx: Ctx) -> None: ...

    b.final("ok")
    wf.parallel(
        "p",
        branches={"a": (a, lambda c: c), "b": (b, lambda c: c)},
        on={"done": "x"},
        initial=True,
    )
    wf.final("x")
    wf.validate()
    assert [w.name for w in wf.children] == ["child", "other"]
    assert wf.structure()["states"]["p"]["child"] == "child,other"


def test_interrupted_compensation__counts_against_its_compensate_retry_then_parks() -> None:
    """A crash in a compensation is an attempt of its ``compensate_retry`` (``charge``'s
    default ``Retry()``: 3), as a crash in a step is one of its ``retry``."""
    from flowloop import children

    wf = saga()
    wf.validate()
    record = j.create(entry(1, j.RUN_CREATED, state="cancelled", context="{}", data=CREATED))

    def cut_in(attempt: int) -> tuple[dict[str, object], str]:
        worn = object.__new__(j.RunRecord)
        worn.__dict__.update({**record.__dict__, "attempt": attempt})
        data, message, route = children.interrupted(wf, worn, {}, "cut", 9.0, "charge")
        assert route == {}
        return data, message

    assert cut_in(1)[0] == cut_in(2)[0] == {"retry_at": 9.0}
    parked, message = cut_in(3)
    assert parked == {"reason": "compensation_failed: charge: interrupted 3 time(s)"}
    assert "no attempts left" in message and "flowloop retry" in message
