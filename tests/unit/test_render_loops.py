"""Loop diagrams without I/O: a loop's machine with its settings, the overlay fold of a loop
journal, and golden DOT for both (diagrams/poll_feed.loop.dot is the loop's golden file,
checked by tests/test_diagrams_up_to_date.py; the overlay's is tests/unit/golden/)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from loopkit import loop_row
from pydantic import BaseModel

from flowloop import Retry, Workflow, render, render_loops
from flowloop.errors import FlowloopError
from flowloop.loader import load_machine, load_paths
from flowloop.loops import Iteration, Loop
from flowloop.store.loops import LoopEvent, LoopRow

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden")
REGENERATE = os.environ.get("FLOWLOOP_REGENERATE_GOLDEN") == "1"
T0 = 1_800_000_000.0  # 2027-01-15 08:00:00Z


def poll(it: Iteration) -> None:
    pass


def feed_loop(**options: object) -> Loop:
    settings: dict[str, object] = dict(
        every=30,
        mode="fixed_delay",
        timeout=10,
        retry=Retry(attempts=3, backoff="fixed", base=1),
        max_failures=5,
    )
    settings.update(options)
    return Loop("feed", poll, **settings)  # type: ignore[arg-type]


def assert_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if REGENERATE:
        path.write_text(text)
    checked_in = path.read_text() if path.exists() else ""
    if text != checked_in:
        diff = "\n".join(
            difflib.unified_diff(
                checked_in.splitlines(), text.splitlines(), str(path), "now", lineterm="", n=1
            )
        )
        pytest.fail(
            f"{path.name} differs from what the code renders (FLOWLOOP_REGENERATE_GOLDEN=1 "
            f"rewrites it; review the diff):\n{diff}"
        )


# -- the machine ---------------------------------------------------------------------------


def test_loop_model__settings_in_the_labels() -> None:
    model = render_loops.loop_model(feed_loop())
    assert [n.name for n in model.nodes] == ["scheduled", "running", "paused", "stopped"]
    assert model.initial == "scheduled" and model.name == "feed.loop"
    scheduled, running, paused = (model.node(n) for n in ("scheduled", "running", "paused"))
    assert scheduled.settings.splitlines() == [
        "every 30s after each end (fixed_delay)",
        "late slots: coalesced, missed past 1h",
    ]
    assert running.settings.splitlines() == ["calls poll()", "timeout 10s, 3 attempts, 1s apart"]
    assert paused.settings == "after 5 failures in a row"
    edges = {(e.source, e.event, e.dest) for e in model.edges}
    assert ("running", "attempt failed: retry", "running") in edges
    assert ("running", "max_failures", "paused") in edges
    # fixed_delay waits for the end: a slot can never come due while one runs.
    assert not any(e.event == render_loops.SKIPPED for e in model.edges)
    operator = [e for e in model.edges if e.event in ("pause", "unpause", "stop")]
    assert operator and all(e.secondary for e in operator)


def test_loop_model__what_the_settings_leave_out_is_not_drawn() -> None:
    model = render_loops.loop_model(
        Loop("tick", poll, cron="*/5 * * * *", misfire_grace=None, coalesce=False)
    )
    events = {e.event for e in model.edges}
    assert render_loops.SKIPPED in events  # cron is fixed_rate
    assert not events & {render_loops.RETRIED, render_loops.MAX_FAILURES, render_loops.LATE}
    assert model.node("scheduled").settings.splitlines() == [
        "cron */5 * * * *",
        "late slots: caught up one by one",
    ]
    assert model.node("running").settings.splitlines() == ["calls poll()", "no retry"]
    assert model.node("paused").settings == ""


def test_loop_model__workflow_loop_links_to_its_workflow_diagram() -> None:
    class Ctx(BaseModel):
        n: int = 0

    wf = Workflow("report", context=Ctx)

    @wf.step(initial=True, next="done")
    def build(ctx: Ctx) -> None:
        pass

    wf.final("done")
    model = render_loops.loop_model(Loop("nightly", workflow=wf, context={}, cron="0 2 * * *"))
    running = model.node("running")
    assert running.settings.splitlines()[0] == "runs workflow report"
    assert running.url == "report.svg" and "report.svg" in running.tooltip
    dot = render.to_digraph(model).source
    assert 'URL="report.svg"' in next(line for line in dot.splitlines() if "\trunning [" in line)


def test_load_machine__a_file_with_only_a_loop_draws_the_loop() -> None:
    loop, _ = load_machine(str(ROOT / "workflows" / "poll.py"))
    assert isinstance(loop, Loop) and loop.name == "poll_feed"
    etl, _ = load_machine(str(ROOT / "workflows" / "etl.py"))
    assert isinstance(etl, Workflow)  # a workflow and its loop: the workflow, as before
    inbox, _ = load_machine(f"{ROOT / 'workflows' / 'etl.py'}:etl_inbox")
    assert isinstance(inbox, Loop)
    with pytest.raises(FlowloopError, match=r"no workflow or loop 'nope'.*etl, etl_inbox"):
        load_machine(f"{ROOT / 'workflows' / 'etl.py'}:nope")


def test_all_models__include_every_loop_after_the_workflows() -> None:
    loaded = load_paths([ROOT / "workflows"])
    names = list(render.all_models(loaded.workflows.values(), loaded.loops.values()))
    assert names[0] == render.LIFECYCLE
    assert names[-2:] == ["etl_inbox.loop", "poll_feed.loop"]
    inbox = render.all_models([], [loaded.loops["etl_inbox"]])["etl_inbox.loop"]
    assert inbox.node("running").url == "etl.svg"


# -- the overlay ---------------------------------------------------------------------------


def stored(**fields: object) -> LoopRow:
    return loop_row(**{"updated_at": T0, **fields})


def entry(kind: str, **fields: object) -> LoopEvent:
    return LoopEvent(loop="feed", kind=kind, at=T0, **fields)  # type: ignore[arg-type]


def eventful_journal() -> list[LoopEvent]:
    """Two iterations succeed (one after a retry), downtime is coalesced and partly missed,
    a worker dies in one, then five fail in a row and the loop pauses itself."""
    events = [entry("loop_created"), entry("iteration_started")]
    events += [entry("iteration_succeeded", attempt=1), entry("missed", count=3)]
    events += [entry("coalesced", count=2), entry("iteration_started")]
    events += [entry("iteration_succeeded", attempt=2), entry("iteration_started")]
    events += [entry("iteration_interrupted", error_message="the worker died")]
    for n in range(5):
        events += [entry("iteration_started"), entry("iteration_failed", attempt=3)]
        if n == 4:
            reason = "5 consecutive failures (max_failures=5)"
            events.append(entry("loop_paused", data={"reason": reason}))
    return events


def test_loop_overlay__counts_per_transition_and_where_a_pause_came_from() -> None:
    row = stored(
        status="paused",
        reason="5 consecutive failures (max_failures=5)",
        last_error="ConnectionError: feed unreachable\nTraceback ...",
    )
    overlay = render_loops.LoopOverlay.from_store(row, eventful_journal())
    assert dict(overlay.counts) == {
        "succeeded": 2,
        "failed": 5,
        "interrupted": 1,
        "retried": 1 + 5 * 2,
        "missed": 3,
        "coalesced": 2,
    }
    assert dict(overlay.taken) == {
        ("scheduled", "slot due", "running"): 8,
        ("running", "succeeded", "scheduled"): 2,
        ("scheduled", "late slot", "scheduled"): 2,
        ("running", "attempt failed: retry", "running"): 11,
        ("running", "interrupted", "scheduled"): 1,
        ("running", "failed", "scheduled"): 4,
        # The fifth failure paused the loop: that iteration went to paused, not back.
        ("running", "max_failures", "paused"): 1,
    }
    assert overlay.last_error == "ConnectionError: feed unreachable"

    model = render_loops.apply_loop_overlay(render_loops.loop_model(feed_loop()), overlay)
    marks = {n.name: n.mark for n in model.nodes}
    assert marks == {
        "scheduled": "visited",
        "running": "failed",
        "paused": "current",
        "stopped": "faded",
    }
    assert model.node("running").notes == (
        "8 iterations: 2 succeeded, 5 failed, 1 interrupted",
        "11 retried",
        "last error: ConnectionError: feed unreachable",
    )
    assert model.node("paused").notes == ("now paused: 5 consecutive failures (max_failures=5)",)
    assert model.node("scheduled").notes == ("2 slots coalesced, 3 slots missed",)
    unpause = next(e for e in model.edges if (e.source, e.event) == ("paused", "unpause"))
    assert (unpause.mark, unpause.count) == ("faded", 0)


def test_loop_overlay__operator_pause_and_skips_of_a_fixed_rate_loop() -> None:
    loop = feed_loop(mode="fixed_rate", max_failures=None)
    events = [
        entry("loop_created"),
        entry("iteration_started"),
        entry("iteration_succeeded", attempt=1),
        entry("skipped_overlap", count=4),
        entry("loop_paused", data={"reason": "paused by ann"}),
        entry("loop_unpaused"),
        entry("loop_paused", data={"reason": "paused by ann"}),
        entry("loop_stopped", data={"reason": "stopped by ann"}),
    ]
    row = stored(status="stopped", reason="stopped by ann")
    overlay = render_loops.LoopOverlay.from_store(row, events)
    assert dict(overlay.counts) == {"succeeded": 1, "skipped": 4}
    assert dict(overlay.taken) == {
        ("scheduled", "slot due", "running"): 1,
        ("running", "skipped for overlap", "running"): 1,
        ("running", "pause", "paused"): 1,  # requested while the iteration ran
        ("paused", "unpause", "scheduled"): 1,
        ("scheduled", "pause", "paused"): 1,
        ("paused", "stop", "stopped"): 1,
    }
    model = render_loops.apply_loop_overlay(render_loops.loop_model(loop), overlay)
    assert model.node("running").notes == (
        "1 iteration: 1 succeeded, 0 failed",
        "4 skipped for overlap",
    )
    assert model.node("stopped").mark == "current"


def test_loop_overlay__a_pause_written_after_the_last_iteration_leaves_it_ended() -> None:
    """An operator's pause of an idle loop, after its last iteration failed, was drawn as
    taken from ``running`` and swallowed that failure's edge back to ``scheduled``."""
    events = [entry("loop_created"), entry("iteration_started")]
    events += [entry("iteration_failed", attempt=1)]
    later = LoopEvent(loop="feed", kind="loop_paused", at=T0 + 60, data={"reason": "by ann"})
    row = stored(status="paused", reason="by ann")
    overlay = render_loops.LoopOverlay.from_store(row, [*events, later])
    assert dict(overlay.taken) == {
        ("scheduled", "slot due", "running"): 1,
        ("running", "failed", "scheduled"): 1,
        ("scheduled", "pause", "paused"): 1,
    }
    assert overlay.counts["failed"] == 1


def test_loop_overlay__a_stop_that_cuts_an_iteration_off_is_taken_from_running() -> None:
    """``iteration_stopped`` was folded as back to ``scheduled``, so the ``loop_stopped``
    written with it was drawn as a stop of the idle loop."""
    events = [entry("loop_created"), entry("iteration_started")]
    events += [entry("iteration_stopped"), entry("loop_stopped", data={"reason": "by ann"})]
    events += [entry("loop_unpaused"), entry("iteration_started"), entry("iteration_cancelled")]
    row = stored(status="scheduled")
    overlay = render_loops.LoopOverlay.from_store(row, events)
    assert dict(overlay.taken) == {
        ("scheduled", "slot due", "running"): 2,
        ("running", "stop", "stopped"): 1,
        ("stopped", "unpause", "scheduled"): 1,
    }


# -- golden DOT ----------------------------------------------------------------------------


def test_golden__loop_machine_dot() -> None:
    assert_golden("feed.loop.dot", render_loops.loop_digraph(feed_loop()).source)


def test_golden__loop_overlay_dot() -> None:
    row = stored(
        status="scheduled",
        next_fire_at=T0 + 30,
        last_error="ValueError: bad feed",
        iterations=8,
    )
    events = [*eventful_journal(), entry("loop_unpaused")]
    graph = render_loops.stored_loop_digraph(feed_loop(), row, events)
    dot = graph.source
    assert "next fire 2027-01-15 08:00:30Z" in dot
    assert_golden("feed.loop-overlay.dot", dot)
