"""Composition in diagrams: call and map states drawn distinctly (child named, max_parallel
shown), error and compensation edges styled apart, the overlay's children and undo lines."""

from __future__ import annotations

from pydantic import BaseModel

from flowloop import Workflow, render
from flowloop import journal as j


class Ctx(BaseModel):
    files: list[str] = []


def machine() -> Workflow:
    child = Workflow("one_file", context=Ctx)

    @child.step(initial=True, next="ok")
    def work(ctx: Ctx) -> None: ...

    child.final("ok")
    wf = Workflow("drawn", context=Ctx)

    @wf.step(initial=True, next="fan", on_error={"*": "undo"}, compensate=lambda c, s: None)
    def prepare(ctx: Ctx) -> None: ...

    wf.map(
        "fan",
        child=child,
        items=lambda c: c.files,
        context=lambda c, i: Ctx(),
        max_parallel=8,
        on={"done": "sub", "failed": "undo"},
    )
    wf.call("sub", child=child, context=lambda c: Ctx(), on={"succeeded": "ok"})
    wf.final("ok")
    wf.final("undo", compensate=True)
    return wf


def test_render__call_and_map_states_name_their_child_and_parallelism() -> None:
    model = render.workflow_model(machine())
    fan, sub = model.node("fan"), model.node("sub")
    assert (fan.kind, fan.settings) == ("map", "maps one_file, max_parallel 8")
    assert (sub.kind, sub.settings) == ("call", "calls one_file")
    dot = render.to_digraph(model).source
    assert "box3d" in dot and "peripheries=2" in dot


def test_render__error_and_compensation_edges_are_styled_apart() -> None:
    model = render.workflow_model(machine())
    kinds = {(e.source, e.event, e.dest): e.kind for e in model.edges}
    assert kinds[("prepare", "error:*", "undo")] == "compensate"
    assert kinds[("prepare", "next", "fan")] == "normal"
    assert kinds[("fan", "done", "sub")] == "normal"
    plain = Workflow("plain_err", context=Ctx)

    @plain.step(initial=True, next="ok", on_error={ValueError: "bad"})
    def go(ctx: Ctx) -> None: ...

    plain.final("ok", "bad")
    [error_edge] = [e for e in render.workflow_model(plain).edges if e.event.startswith("error:")]
    assert error_edge.kind == "error"
    attrs = render.edge_attrs(error_edge)
    assert (attrs["style"], attrs["color"]) == ("dashed", render.ERROR_COLOR)
    compensating = next(e for e in model.edges if e.kind == "compensate")
    assert render.edge_attrs(compensating)["color"] == render.COMPENSATE_COLOR
    assert model.node("undo").settings == "compensates"


def test_render__overlay_shows_children_counts_and_what_was_undone() -> None:
    def entry(seq: int, kind: str, **fields: object) -> j.JournalEvent:
        return j.JournalEvent(run_id="r", seq=seq, kind=kind, at=float(seq), **fields)  # type: ignore[arg-type]

    data = {"workflow": "drawn", "version": 1, "fingerprint": "f"}
    events = [
        entry(1, j.RUN_CREATED, state="prepare", context="{}", data=data),
        entry(2, j.STEP_STARTED, state="prepare", attempt=1),
        entry(3, j.STEP_SUCCEEDED, state="prepare", event="next", next_state="fan", context="{}"),
        entry(
            4, j.CHILDREN_STARTED, state="fan", data={"children": 3, "child_workflow": "one_file"}
        ),
        entry(
            5,
            j.CHILDREN_JOINED,
            state="fan",
            event="failed",
            next_state="undo",
            context="{}",
            data={"compensate": True, "succeeded": 2, "failed": 1},
        ),
        entry(6, j.COMPENSATION_STARTED, state="prepare", attempt=1),
        entry(7, j.COMPENSATION_SUCCEEDED, state="prepare", context="{}"),
        entry(8, j.RUN_COMPENSATED, state="undo", data={"reason": "compensated: prepare"}),
    ]
    overlay = render.RunOverlay.from_journal(events)
    model = render.apply_overlay(render.workflow_model(machine()), overlay)
    assert "3 child run(s) of one_file" in model.node("fan").notes
    assert "children: 2 succeeded, 1 failed" in model.node("fan").notes
    assert "undone (compensated)" in model.node("prepare").notes
    taken = {(e.source, e.event, e.dest) for e in model.edges if e.mark == "taken"}
    assert ("fan", "failed", "undo") in taken
