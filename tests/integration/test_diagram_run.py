"""A real run on a real SQLite file, drawn with its overlay (and rendered by the real `dot`)."""

from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow, render
from flowloop.errors import UnknownRun, UnknownWorkflow

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot")


class Job(BaseModel):
    polls: int = 0


def branching_job() -> Workflow:
    """poll (a cycle, 3 visits) → fetch (fails once, retried) → check (fails for good);
    the `skip` branch, `report` and `done` are never reached."""
    job = Workflow("job", context=Job)

    @job.step(initial=True, on={"again": "poll", "ready": "fetch", "skip": "report"}, max_visits=5)
    def poll(ctx: Job) -> str:
        ctx.polls += 1
        return "again" if ctx.polls < 3 else "ready"

    @job.step(next="check", retry=Retry(attempts=3, backoff="fixed", base=1))
    def fetch(ctx: Job, step: Step) -> None:
        if step.attempt == 1:
            raise ConnectionError("feed closed the connection")

    @job.step(on={"ok": "report", "empty": "done"}, retry=Retry(attempts=1))
    def check(ctx: Job) -> str:
        raise ValueError("total does not add up\nsecond line of detail")

    @job.step(next="done")
    def report(ctx: Job) -> None:
        pass

    job.final("done")
    return job


def node_lines(dot: str) -> dict[str, str]:
    """``{state: its DOT node statement}`` (one statement per line in graphviz's output)."""
    found = {}
    for line in dot.splitlines():
        match = re.match(r'\t("?[\w.()-]+"?) \[', line)
        if match and "->" not in line:
            found[match.group(1).strip('"')] = line
    return found


def edge_lines(dot: str) -> dict[tuple[str, str], str]:
    found = {}
    for line in dot.splitlines():
        match = re.match(r'\t"?([\w.()-]+)"? -> "?([\w.()-]+)"? \[', line)
        if match:
            found[(match.group(1), match.group(2))] = line
    return found


@pytest.fixture
def failed_run(tmp_path: Path) -> Iterator[tuple[Engine, str]]:
    engine = Engine(str(tmp_path / "x.db"), clock=FakeClock(), workflows=[branching_job()])
    info = engine.start(engine.workflow("job"), {})
    engine.run_until_idle()
    assert engine.get(info.id).status == "failed"
    yield engine, info.id
    engine.close()


def test_run_overlay__counts_visits_attempts_and_transitions(
    failed_run: tuple[Engine, str],
) -> None:
    engine, run_id = failed_run
    overlay = render.RunOverlay.from_journal(engine.history(run_id))
    assert overlay.status == "failed"
    assert overlay.state == "check"
    assert overlay.failed_state == "check"
    assert overlay.error == "ValueError: total does not add up"
    assert dict(overlay.visits) == {"poll": 3, "fetch": 1, "check": 1}
    assert dict(overlay.attempts) == {"poll": 3, "fetch": 2, "check": 1}
    assert dict(overlay.taken) == {
        ("poll", "again", "poll"): 2,
        ("poll", "ready", "fetch"): 1,
        ("fetch", "next", "check"): 1,
    }


def test_run_overlay__marks_exactly_what_the_run_did(failed_run: tuple[Engine, str]) -> None:
    engine, run_id = failed_run
    model = render.apply_overlay(
        render.workflow_model(engine.workflow("job")),
        render.RunOverlay.from_journal(engine.history(run_id)),
    )
    assert {node.name: node.mark for node in model.nodes} == {
        "poll": "visited",
        "fetch": "visited",
        "check": "failed",
        "report": "faded",
        "done": "faded",
    }
    assert model.node("poll").notes == ("3 visits",)
    assert model.node("fetch").notes == ("1 visit, 2 attempts",)
    assert model.node("check").notes == ("1 visit", "failed: ValueError: total does not add up")
    assert {(e.source, e.event, e.dest): (e.mark, e.count) for e in model.edges} == {
        ("poll", "again", "poll"): ("taken", 2),
        ("poll", "ready", "fetch"): ("taken", 1),
        ("poll", "skip", "report"): ("faded", 0),
        ("fetch", "next", "check"): ("taken", 1),
        ("check", "ok", "report"): ("faded", 0),
        ("check", "empty", "done"): ("faded", 0),
        ("report", "next", "done"): ("faded", 0),
    }
    assert model.caption == f"run {run_id}: failed in check"


def test_engine_diagram__dot_highlights_visited_fades_the_rest(
    failed_run: tuple[Engine, str],
) -> None:
    engine, run_id = failed_run
    dot = engine.diagram(run_id).source
    nodes, edges = node_lines(dot), edge_lines(dot)

    check = nodes["check"]
    assert f'color="{render.FAILED}"' in check
    assert "failed: ValueError: total does not add up" in check
    assert "second line of detail" not in dot
    for state in ("poll", "fetch"):
        assert f'fillcolor="{render.ACCENT_FILL}"' in nodes[state], state
    for state in ("report", "done"):
        assert f'color="{render.FADED}"' in nodes[state], state
    for state in ("poll", "fetch", "check"):
        assert f'color="{render.FADED}"' not in nodes[state], state

    times = render.TIMES
    taken = {
        ("poll", "poll"): f"again {times}2",
        ("poll", "fetch"): f"ready {times}1",
        ("fetch", "check"): f"next {times}1",
    }
    for pair, line in edges.items():
        if pair in taken:
            assert f'label="{taken[pair]}" color="{render.ACCENT}"' in line, line
        elif pair != (render.START_NODE, "poll"):
            assert f'color="{render.FADED}"' in line and times not in line, line
    assert dot.count(times) == 3
    assert f"run {run_id}: failed in check" in dot


def test_engine_diagram__succeeded_run_emphasises_its_final_state(tmp_path: Path) -> None:
    job = Workflow("short", context=Job)

    @job.step(initial=True, on={"go": "done", "stop": "halted"})
    def begin(ctx: Job) -> str:
        return "go"

    job.final("done", "halted")
    with Engine(str(tmp_path / "x.db"), clock=FakeClock(), workflows=[job]) as engine:
        info = engine.run(job, {})
        model = render.apply_overlay(
            render.workflow_model(job), render.RunOverlay.from_journal(engine.history(info.id))
        )
    assert model.node("done").mark == "current"
    assert model.node("done").notes == ("1 visit", "now succeeded")
    assert model.node("halted").mark == "faded"
    assert model.caption == f"run {info.id}: succeeded at done"


def test_engine_diagram__wait_state_event_counts_as_taken(tmp_path: Path) -> None:
    flow = Workflow("approval", context=Job)

    @flow.step(initial=True, next="awaiting")
    def ask(ctx: Job) -> None:
        pass

    # The timeout is beyond run_until_idle's horizon: the fake clock never reaches it.
    flow.wait(
        "awaiting", on={"approve": "done", "reject": "ask"}, timeout=86_400, on_timeout="expired"
    )
    flow.final("done", "expired")
    with Engine(str(tmp_path / "x.db"), clock=FakeClock(), workflows=[flow]) as engine:
        run_id = engine.start(flow, {}).id
        engine.run_until_idle()
        engine.send(run_id, "reject")
        engine.run_until_idle()
        engine.send(run_id, "approve")
        engine.run_until_idle()
        assert engine.get(run_id).status == "succeeded"
        dot = engine.diagram(run_id).source
    edges = edge_lines(dot)
    times = render.TIMES
    assert f'label="next {times}2"' in edges[("ask", "awaiting")]
    assert f'label="reject {times}1"' in edges[("awaiting", "ask")]
    assert f'label="approve {times}1"' in edges[("awaiting", "done")]
    assert f'color="{render.FADED}"' in edges[("awaiting", "expired")]
    assert f'fillcolor="{render.CURRENT_FILL}"' in node_lines(dot)["done"]


def test_engine_diagram__without_run_is_the_lifecycle(failed_run: tuple[Engine, str]) -> None:
    engine, _ = failed_run
    assert engine.diagram().source == render.lifecycle_digraph().source


def test_engine_diagram__unknown_run_or_unregistered_workflow(tmp_path: Path) -> None:
    db = str(tmp_path / "x.db")
    with Engine(db, clock=FakeClock(), workflows=[branching_job()]) as engine:
        run_id = engine.start(engine.workflow("job"), {}).id
        with pytest.raises(UnknownRun):
            engine.diagram("nope")
    with Engine(db, clock=FakeClock()) as bare, pytest.raises(UnknownWorkflow):
        bare.diagram(run_id)


@needs_dot
def test_svg__real_dot_output_parses_and_names_every_state(
    failed_run: tuple[Engine, str], tmp_path: Path
) -> None:
    engine, run_id = failed_run
    path = render.save(engine.diagram(run_id), tmp_path / "run.svg")
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = " ".join(t.text or "" for t in root.iter("{http://www.w3.org/2000/svg}text"))
    for state in engine.workflow("job").states:
        assert state in texts
    assert "failed: ValueError: total does not add up" in texts
