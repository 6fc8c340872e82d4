"""Diagrams without I/O: extraction into the model, the overlay fold, and the DOT text
(golden files in diagrams/ for the examples and the lifecycle)."""

from __future__ import annotations

import difflib
from pathlib import Path

import graphviz
import pytest
from pydantic import BaseModel

from flowloop import Retry, Workflow, lifecycle, render
from flowloop import journal as j
from flowloop.errors import FlowloopError, RenderError
from flowloop.journal import JournalEvent
from flowloop.loader import load_paths

ROOT = Path(__file__).resolve().parents[2]
DIAGRAMS = ROOT / "diagrams"


class Ctx(BaseModel):
    n: int = 0


def order_like() -> Workflow:
    wf = Workflow("shop", context=Ctx, version=2)

    @wf.step(initial=True, on={"reserved": "charge", "out_of_stock": "cancelled"})
    def reserve(ctx: Ctx) -> str:
        return "reserved"

    @wf.step(
        on={"charged": "ship", "declined": "cancelled"},
        timeout=10,
        retry=Retry(attempts=5, backoff="exponential", base=0.2, cap=5, on=(ConnectionError,)),
    )
    def charge(ctx: Ctx) -> str:
        return "charged"

    @wf.step(next="delivered", idempotent=False)
    def ship(ctx: Ctx) -> None:
        pass

    wf.final("delivered", "cancelled")
    return wf


def polling(max_visits: int | None) -> Workflow:
    wf = Workflow("poller", context=Ctx)

    @wf.step(initial=True, on={"again": "wait_a_bit", "ready": "done"}, max_visits=max_visits)
    def poll(ctx: Ctx) -> str:
        return "ready"

    @wf.step(next="poll", retry=Retry(attempts=1))
    def wait_a_bit(ctx: Ctx) -> None:
        pass

    wf.final("done")
    return wf


# -- extract -------------------------------------------------------------------------------


def test_workflow_model__states_in_declaration_order_with_kinds() -> None:
    model = render.workflow_model(order_like())
    assert [(n.name, n.kind) for n in model.nodes] == [
        ("reserve", "step"),
        ("charge", "step"),
        ("ship", "step"),
        ("delivered", "final"),
        ("cancelled", "final"),
    ]
    assert model.initial == "reserve"
    assert [n.name for n in model.nodes if n.initial] == ["reserve"]
    assert model.title == "shop v2"


def test_workflow_model__every_declared_transition_with_its_event() -> None:
    model = render.workflow_model(order_like())
    assert [(e.source, e.event, e.dest) for e in model.edges] == [
        ("reserve", "reserved", "charge"),
        ("reserve", "out_of_stock", "cancelled"),
        ("charge", "charged", "ship"),
        ("charge", "declined", "cancelled"),
        ("ship", "next", "delivered"),
    ]


def test_workflow_model__step_settings_compact_and_in_tooltip() -> None:
    wf = order_like()
    model = render.workflow_model(wf)
    charge = model.node("charge")
    assert charge.settings == render.wrap_settings(wf.steps["charge"].describe())
    assert "timeout 10s" in charge.settings and "5 attempts" in charge.settings
    assert "on ConnectionError" in charge.tooltip and "timeout: 10s" in charge.tooltip
    assert "not idempotent" in model.node("ship").settings
    assert "idempotent: no" in model.node("ship").tooltip
    assert model.node("delivered").settings == ""


@pytest.mark.parametrize(
    ("retry", "said"),
    [
        (Retry(backoff="fixed", base=60), "3 attempts, fixed backoff 60s on Exception"),
        (Retry(backoff="fixed", base=5, cap=0), "3 attempts, fixed backoff 0s on Exception"),
        (Retry(attempts=4, base=1, cap=30), "4 attempts, exponential backoff 1s..30s on"),
        (Retry(attempts=4, backoff="linear", base=2, cap=2), "4 attempts, linear backoff 2s on"),
        (Retry(attempts=2, base=1), "2 attempts, exponential backoff 1s on"),
    ],
)
def test_workflow_model__retry_tooltip_says_the_waits_it_makes(retry: Retry, said: str) -> None:
    """A fixed backoff of 60 s read "fixed backoff 60s..300s" (ops audit): it always waits
    60 s. One wait (a fixed backoff, a single retry, a cap at the base) is one time."""
    wf = Workflow("waits", context=Ctx)
    wf.step(name="a", initial=True, next="end", retry=retry)(lambda ctx: None)
    wf.final("end")
    assert f"retry: {said}" in render.workflow_model(wf).node("a").tooltip


def test_workflow_model__cyclic_states_show_max_visits() -> None:
    model = render.workflow_model(polling(max_visits=4))
    assert {n.name for n in model.nodes if n.cyclic} == {"poll", "wait_a_bit"}
    assert "max 4 visits" in model.node("poll").settings
    assert model.node("poll").title == f"poll {render.CYCLE_MARK}"
    # A cycle without a limit is called out, so a review sees it can spin forever.
    assert model.node("wait_a_bit").settings.endswith("no max_visits")
    assert not render.workflow_model(order_like()).node("charge").cyclic


def test_workflow_model__unbounded_cycle_named_on_every_state_without_a_limit() -> None:
    model = render.workflow_model(polling(max_visits=None))
    assert model.node("poll").settings.endswith("no max_visits")


def test_lifecycle_model__is_the_lifecycle_machine() -> None:
    model = render.lifecycle_model()
    assert [n.name for n in model.nodes] == [*lifecycle.STATUSES, lifecycle.ANY_LIVE]
    assert model.initial == "idle"
    assert [n.name for n in model.nodes if n.kind == "final"] == ["succeeded"]
    # One edge from the "(any live status)" group stands for the rule's every source, as
    # in the README's text: spelt out, the drawing allows exactly what the machine does.
    group = {rule.trigger: rule for rule in lifecycle.RULES}
    drawn = set()
    for edge in model.edges:
        if edge.source == lifecycle.ANY_LIVE:
            assert edge.secondary
            drawn |= {(s, edge.dest) for s in group[edge.event].expanded()}
        else:
            drawn.add((edge.source, edge.dest))
    assert drawn == set(lifecycle.ALLOWED)
    assert [e.event for e in model.edges if e.source == lifecycle.ANY_LIVE] == ["pause", "stop"]
    assert {e.event for e in model.edges} == {str(t["trigger"]) for t in lifecycle.TRANSITIONS}


def test_machine_model__any_transitions_machine() -> None:
    from transitions import Machine

    machine = Machine(
        model=None,
        states=["a", {"name": "b", "final": True}],
        transitions=[{"trigger": "go", "source": "a", "dest": "b"}],
        initial="a",
        auto_transitions=False,
    )
    model = render.machine_model(machine, name="m", title="m")
    assert [(n.name, n.kind, n.initial) for n in model.nodes] == [
        ("a", "state", True),
        ("b", "final", False),
    ]
    assert [(e.source, e.event, e.dest) for e in model.edges] == [("a", "go", "b")]


# -- DOT -----------------------------------------------------------------------------------


def dot_of(model: render.DiagramModel) -> str:
    source: str = render.to_digraph(model).source
    return source


def test_dot__initial_marked_and_finals_have_a_double_border() -> None:
    dot = order_like().diagram().source
    assert f'"{render.START_NODE}" -> reserve' in dot
    assert f'"{render.START_NODE}" [label="" ' in dot and "shape=point" in dot
    for final in ("delivered", "cancelled"):
        line = next(line for line in dot.splitlines() if line.startswith(f"\t{final} ["))
        # A double border on the usual box: a double circle grows with the name.
        assert "peripheries=2" in line and "circle" not in line
    for step in ("reserve", "charge", "ship"):
        line = next(line for line in dot.splitlines() if line.startswith(f"\t{step} ["))
        assert "peripheries" not in line


def test_workflow_model__long_chains_top_to_bottom_short_ones_left_to_right() -> None:
    # reserve → charge → ship → delivered: 3 transitions; polling: 1 (its cycle is cut).
    assert render.workflow_model(order_like()).rankdir == "LR"
    assert render.workflow_model(polling(4)).rankdir == "LR"
    wf = Workflow("long", context=Ctx)
    names = ["a", "b", "c", "d"]
    for name, nxt in zip(names, [*names[1:], "end"], strict=True):
        wf.step(name=name, initial=name == "a", next=nxt)(lambda ctx: None)
    wf.final("end")
    model = render.workflow_model(wf)
    assert model.rankdir == "TB"
    assert "rankdir=TB" in render.to_digraph(model).source


def test_wrap_settings__break_after_a_comma_near_the_width() -> None:
    text = "3 attempts, exponential 1s..5m, timeout 10s, not idempotent"
    assert render.wrap_settings(text, 34) == (
        "3 attempts, exponential 1s..5m,\ntimeout 10s, not idempotent"
    )
    assert render.wrap_settings("no retry") == "no retry"


def test_dot__every_transition_labelled_with_its_event() -> None:
    dot = order_like().diagram().source
    for edge in (
        "reserve -> charge [label=reserved",
        "reserve -> cancelled [label=out_of_stock",
        "charge -> ship [label=charged",
        "charge -> cancelled [label=declined",
        "ship -> delivered [label=next",
    ):
        assert edge in dot


def test_dot__settings_in_a_second_smaller_line() -> None:
    dot = order_like().diagram().source
    assert (
        'charge [label=<charge<BR/><FONT POINT-SIZE="10" COLOR="#555555">'
        '5 attempts, exponential 0.2s..5s,</FONT><BR/><FONT POINT-SIZE="10" COLOR="#555555">'
        "timeout 10s</FONT>>"
    ) in dot


def test_dot__deterministic_and_free_of_timestamps_and_ids() -> None:
    first, second = order_like().diagram().source, order_like().diagram().source
    assert first == second
    assert "0x" not in first  # no object ids
    lifecycle_dot = render.lifecycle_digraph().source
    assert lifecycle_dot == render.lifecycle_digraph().source


def test_dot__labels_and_tooltips_are_escaped() -> None:
    model = render.DiagramModel(
        name="m",
        title="a <b> & c",
        nodes=(
            render.DiagramNode(
                name="a", kind="step", initial=True, settings="x < y", tooltip='say "hi" \\ <there>'
            ),
            render.DiagramNode(name="b", kind="final"),
        ),
        edges=(render.DiagramEdge(source="a", dest="b", event="<go>"),),
    )
    dot = dot_of(model)
    assert "a &lt;b&gt; &amp; c" in dot
    assert "x &lt; y" in dot
    assert 'label="<go>"' in dot  # quoted text, not an HTML label
    assert 'tooltip="say \\"hi\\" \\\\ <there>"' in dot


def test_dot__events_shared_by_many_states_are_grey() -> None:
    dot = render.lifecycle_digraph().source
    fail_lines = [line for line in dot.splitlines() if "label=fail" in line]
    assert len(fail_lines) == 3 and all(render.SECONDARY in line for line in fail_lines)
    # A rule from any live status is one grey edge from the group, not one per status.
    stop_lines = [line for line in dot.splitlines() if "label=stop" in line]
    assert len(stop_lines) == 1 and render.SECONDARY in stop_lines[0]
    start_line = next(line for line in dot.splitlines() if "scheduled -> running" in line)
    assert render.SECONDARY not in start_line


def approval_flow() -> Workflow:
    wf = Workflow("approval", context=Ctx)

    @wf.step(initial=True, next="awaiting")
    def ask(ctx: Ctx) -> None:
        pass

    wf.wait(
        "awaiting",
        on={"approve": "done", "reject": "ask"},
        timeout=60,
        on_timeout="expired",
        max_visits=3,
    )
    wf.final("done", "expired")
    return wf


def test_workflow_model__wait_states_with_events_and_timeout() -> None:
    wf = approval_flow()
    model = render.workflow_model(wf)
    assert [(n.name, n.kind) for n in model.nodes] == [
        ("ask", "step"),
        ("awaiting", "wait"),
        ("done", "final"),
        ("expired", "final"),
    ]
    awaiting = model.node("awaiting")
    assert awaiting.cyclic
    assert awaiting.settings == render.wrap_settings(
        wf.waits["awaiting"].describe() + ", max 3 visits"
    )
    assert "timeout: 60s, then expired" in awaiting.tooltip
    assert [(e.source, e.event, e.dest, e.timer) for e in model.edges] == [
        ("ask", "next", "awaiting", False),
        ("awaiting", "approve", "done", False),
        ("awaiting", "reject", "ask", False),
        ("awaiting", "timeout", "expired", True),
    ]
    dot = wf.diagram().source
    assert "awaiting [label=<awaiting " in dot and 'style="rounded,dashed,filled"' in dot
    assert "awaiting -> expired [label=timeout style=dashed" in dot


def test_workflow_diagram__is_a_graphviz_digraph() -> None:
    wf = order_like()
    graph = wf.diagram()
    assert isinstance(graph, graphviz.Digraph)
    assert graph.source == render.workflow_digraph(wf).source


# -- overlay (a journal written by hand) ---------------------------------------------------


def journal(*rows: tuple[str, dict[str, object]]) -> list[JournalEvent]:
    events = []
    for seq, (kind, fields) in enumerate(rows, 1):
        event = JournalEvent(run_id="r1", seq=seq, kind=kind, at=float(seq), **fields)  # type: ignore[arg-type]
        events.append(event)
    return events


def created(fingerprint: str | None = None) -> tuple[str, dict[str, object]]:
    """``run_created`` of a ``shop`` run (under today's definition unless told otherwise)."""
    fingerprint = fingerprint or order_like().fingerprint
    return (
        j.RUN_CREATED,
        {
            "state": "reserve",
            "context": "{}",
            "data": {"workflow": "shop", "version": 2, "fingerprint": fingerprint, "due": 0.0},
        },
    )


def started(state: str, attempt: int = 1) -> tuple[str, dict[str, object]]:
    return (j.STEP_STARTED, {"state": state, "attempt": attempt})


def succeeded(
    state: str, event: str, dest: str, final: bool = False
) -> tuple[str, dict[str, object]]:
    return (
        j.STEP_SUCCEEDED,
        {
            "state": state,
            "event": event,
            "next_state": dest,
            "context": "{}",
            "data": {"final": True} if final else {},
        },
    )


def test_overlay__retry_then_failure() -> None:
    events = journal(
        created(),
        started("reserve"),
        succeeded("reserve", "reserved", "charge"),
        started("charge"),
        (
            j.STEP_FAILED,
            {
                "state": "charge",
                "attempt": 1,
                "error_type": "ConnectionError",
                "error_message": "closed",
                "data": {"retry_at": 5.0},
            },
        ),
        started("charge", 2),
        (
            j.STEP_FAILED,
            {
                "state": "charge",
                "attempt": 2,
                "error_type": "ValueError",
                "error_message": "bad amount\ntraceback follows",
                "data": {},
            },
        ),
    )
    overlay = render.RunOverlay.from_journal(events)
    assert (overlay.status, overlay.state, overlay.failed_state) == ("failed", "charge", "charge")
    assert overlay.error == "ValueError: bad amount"
    assert dict(overlay.visits) == {"reserve": 1, "charge": 1}
    assert dict(overlay.attempts) == {"reserve": 1, "charge": 2}
    assert dict(overlay.taken) == {("reserve", "reserved", "charge"): 1}

    model = render.apply_overlay(render.workflow_model(order_like()), overlay)
    assert [(n.name, n.mark) for n in model.nodes] == [
        ("reserve", "visited"),
        ("charge", "failed"),
        ("ship", "faded"),
        ("delivered", "faded"),
        ("cancelled", "faded"),
    ]
    assert model.node("charge").notes == ("1 visit, 2 attempts", "failed: ValueError: bad amount")
    assert [(e.event, e.mark, e.count) for e in model.edges] == [
        ("reserved", "taken", 1),
        ("out_of_stock", "faded", 0),
        ("charged", "faded", 0),
        ("declined", "faded", 0),
        ("next", "faded", 0),
    ]
    dot = dot_of(model)
    assert f"reserved {render.TIMES}1" in dot and dot.count(render.TIMES) == 1
    assert "traceback follows" not in dot


def test_overlay__succeeded_run_current_state_is_the_final_one() -> None:
    events = journal(
        created(),
        started("reserve"),
        succeeded("reserve", "out_of_stock", "cancelled", final=True),
    )
    model = render.apply_overlay(
        render.workflow_model(order_like()), render.RunOverlay.from_journal(events)
    )
    assert model.node("cancelled").mark == "current"
    assert model.node("cancelled").notes == ("1 visit", "now succeeded")
    assert model.caption == "run r1: succeeded at cancelled"


def test_overlay__events_received_by_a_wait_state_count_as_taken() -> None:
    wf = approval_flow()
    fp = wf.fingerprint

    def row(kind: str, **fields: object) -> tuple[str, dict[str, object]]:
        return (kind, fields)

    events = journal(
        row(
            j.RUN_CREATED,
            state="ask",
            context="{}",
            data={"workflow": "approval", "version": 1, "fingerprint": fp, "due": 0.0},
        ),
        started("ask"),
        succeeded("ask", "next", "awaiting"),
        row(j.EVENT_RECEIVED, state="awaiting", event="reject", next_state="ask", context="{}"),
        started("ask"),
        succeeded("ask", "next", "awaiting"),
    )
    model = render.apply_overlay(render.workflow_model(wf), render.RunOverlay.from_journal(events))
    assert [(e.event, e.count) for e in model.edges] == [
        ("next", 2),
        ("approve", 0),
        ("reject", 1),
        ("timeout", 0),
    ]
    assert model.node("awaiting").mark == "current"
    assert model.node("awaiting").notes == ("2 visits", "now scheduled")


def test_overlay__a_held_child_is_drawn_held_with_what_releases_it() -> None:
    """A map's child held back by max_parallel said "now scheduled" (its stored status)
    while `flowloop status` and the dashboard's badge said held (audit)."""
    model = render.workflow_model(order_like())
    overlay = render.RunOverlay.from_journal(journal(created()), held=True)
    drawn = render.apply_overlay(model, overlay)
    told = "held back by its parent's max_parallel: starts when a sibling ends"
    assert drawn.node("reserve").notes == ("1 visit", "now held: starts when a sibling ends")
    assert drawn.caption == f"run r1: held at reserve ({told})"
    # Not held (released, or never held): its status as before.
    free = render.apply_overlay(model, render.RunOverlay.from_journal(journal(created())))
    assert free.node("reserve").notes[-1] == "now scheduled"
    assert free.caption == "run r1: scheduled at reserve"


def test_overlay__attempts_cut_off_by_a_crash_are_marked_interrupted() -> None:
    events = journal(
        created(),
        started("reserve"),
        succeeded("reserve", "reserved", "charge"),
        started("charge"),
        (
            j.STEP_INTERRUPTED,
            {
                "state": "charge",
                "attempt": 1,
                "error_type": "Interrupted",
                "error_message": "the worker died during this step; it runs again",
                "data": {"retry_at": 5.0},
            },
        ),
        started("charge", 2),
        succeeded("charge", "charged", "ship"),
    )
    overlay = render.RunOverlay.from_journal(events)
    assert dict(overlay.interrupted) == {"charge": 1}
    model = render.apply_overlay(render.workflow_model(order_like()), overlay)
    assert model.node("charge").notes == ("1 visit, 2 attempts (1 interrupted)",)
    assert model.node("reserve").notes == ("1 visit",)
    assert "2 attempts (1 interrupted)" in dot_of(model)


def test_overlay__long_error_cut_to_one_line() -> None:
    assert render.first_line("\n  " + "x" * 200 + "\nmore") == "x" * 79 + "\u2026"
    assert render.first_line("short\nmore") == "short"


def test_overlay__transitions_the_definition_lost_are_drawn_dotted() -> None:
    events = journal(
        created(fingerprint="0ld"),
        started("reserve"),
        succeeded("reserve", "legacy", "audit"),
    )
    model = render.apply_overlay(
        render.workflow_model(order_like()), render.RunOverlay.from_journal(events)
    )
    audit = model.node("audit")
    assert (audit.declared, audit.mark) == (False, "current")
    extra = model.edges[-1]
    assert (extra.source, extra.event, extra.dest, extra.declared, extra.count) == (
        "reserve",
        "legacy",
        "audit",
        False,
        1,
    )
    assert "another definition" in model.caption and "fingerprint 0ld" in model.caption
    dot = dot_of(model)
    assert 'style="rounded,dotted,filled"' in dot
    assert next(line for line in dot.splitlines() if "reserve -> audit" in line).count("dotted")


def test_overlay__unfoldable_journal_is_a_render_error() -> None:
    with pytest.raises(RenderError, match="cannot draw this run"):
        render.RunOverlay.from_journal([])


# -- output formats ------------------------------------------------------------------------


def test_format_for__suffixes() -> None:
    assert [render.format_for(Path(p)) for p in ("a.dot", "a.gv", "a.SVG", "a.png")] == [
        "dot",
        "dot",
        "svg",
        "png",
    ]
    with pytest.raises(FlowloopError, match="suffix"):
        render.format_for(Path("a.pdf"))


def test_render_bytes__dot_needs_no_program_and_unknown_format_is_refused() -> None:
    graph = render.lifecycle_digraph()
    assert render.render_bytes(graph, "dot") == graph.source.encode()
    with pytest.raises(FlowloopError, match="unknown format"):
        render.render_bytes(graph, "pdf")


def test_all_diagrams__lifecycle_first_then_workflows_by_name() -> None:
    diagrams = render.all_diagrams([polling(4), order_like()])
    assert list(diagrams) == ["lifecycle", "poller", "shop"]
    clash = Workflow("lifecycle", context=Ctx)

    @clash.step(initial=True, next="end")
    def go(ctx: Ctx) -> None:
        pass

    clash.final("end")
    with pytest.raises(RenderError, match="lifecycle"):
        render.all_diagrams([clash])


# -- golden files --------------------------------------------------------------------------


def example_diagrams() -> dict[str, graphviz.Digraph]:
    loaded = load_paths([ROOT / "workflows"])
    return render.all_diagrams(loaded.workflows.values(), loaded.loops.values())


@pytest.mark.parametrize("name", list(example_diagrams()))
def test_golden__dot_matches_checked_in_diagram(name: str) -> None:
    rendered = example_diagrams()[name].source
    path = DIAGRAMS / f"{name}.dot"
    checked_in = path.read_text() if path.exists() else ""
    if rendered != checked_in:
        diff = "\n".join(
            difflib.unified_diff(
                checked_in.splitlines(),
                rendered.splitlines(),
                f"diagrams/{name}.dot (checked in)",
                "rendered now",
                lineterm="",
                n=1,
            )
        )
        pytest.fail(
            f"diagrams/{name}.dot differs from what the code renders; run "
            f"`{render.REFRESH_COMMAND}` and review the diff:\n{diff}"
        )
