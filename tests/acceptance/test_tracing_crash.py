"""Tracing across a crash: a run SIGKILLed in the middle of a step (a real process) and
resumed by another process is one trace — every attempt a span under the run span, the
killed attempt marked interrupted, the run span a child of the request that started it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from polling import poll
from tracekit import read_spans

from flowloop import Engine
from flowloop import journal as j
from flowloop.tracecontext import run_trace

TRACEKIT = Path(__file__).resolve().parents[1] / "tracekit.py"


def process(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(TRACEKIT.parent)}
    return subprocess.Popen(
        [sys.executable, str(TRACEKIT), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_tracing__killed_run_resumed_elsewhere_is_one_trace(tmp_path: Path) -> None:
    db, marker = str(tmp_path / "runs.db"), tmp_path / "load.started"
    first_spans, second_spans = tmp_path / "first.jsonl", tmp_path / "second.jsonl"

    first = process("run", db, str(first_spans), str(marker), cwd=tmp_path)
    assert first.stdout is not None
    request = json.loads(first.stdout.readline() or "{}")
    poll(
        lambda: marker.exists() or first.poll() is not None,
        timeout=60,
        what="the first process to reach `load`",
        every=0.02,
    )
    assert first.poll() is None, first.stderr.read() if first.stderr else ""
    first.send_signal(signal.SIGKILL)  # in the middle of `load`, attempt 1
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    killed_pid = int(marker.read_text())

    second = process("resume", db, str(second_spans), cwd=tmp_path)
    _, stderr = second.communicate(timeout=120)
    assert second.returncode == 0, stderr

    with Engine(db) as engine:
        [run] = engine.runs()
        assert run.status == "succeeded"
        journal = engine.history(run.id)
    stored = run_trace(run.id, journal[0].data)
    assert stored.trace_id == request["trace_id"] and stored.parent_id == request["span_id"]

    spans = read_spans(first_spans, second_spans)
    assert {span["trace_id"] for span in spans} == {request["trace_id"]}, "one trace"
    [run_span] = [span for span in spans if span["name"] == "flowloop.run traced"]
    assert run_span["span_id"] == stored.span_id
    assert run_span["parent_id"] == request["span_id"]
    assert run_span["status"] == "UNSET" and run_span["pid"] != killed_pid
    assert "flowloop.interrupted" in run_span["events"]

    attempts = sorted(
        (span for span in spans if span["name"].startswith("flowloop.step ")),
        key=lambda span: span["start"],
    )
    shape = [
        (
            span["attributes"]["flowloop.state"],
            span["attributes"]["flowloop.attempt"],
            span["attributes"]["flowloop.outcome"],
            "first" if span["pid"] == killed_pid else "second",
        )
        for span in attempts
    ]
    assert shape == [
        ("fetch", 1, "succeeded", "first"),
        ("load", 1, "interrupted", "second"),  # the killed attempt, found by the resume
        ("load", 2, "succeeded", "second"),
        ("publish", 1, "succeeded", "second"),
    ]
    assert all(span["parent_id"] == stored.span_id for span in attempts)
    assert len({span["span_id"] for span in spans}) == len(spans)
    killed = attempts[1]
    assert killed["status"] == "ERROR" and killed["attributes"]["flowloop.interrupted"] is True
    assert killed["attributes"]["flowloop.run_id"] == run.id
    # The killed attempt's span starts at its journaled step_started, written by the
    # process that died, and ends when the resume journaled it interrupted.
    started = next(e for e in journal if e.kind == j.STEP_STARTED and e.state == "load")
    interrupted = next(e for e in journal if e.kind == j.STEP_INTERRUPTED)
    assert killed["start"] == int(started.at * 1e9)
    assert killed["end"] == int(interrupted.at * 1e9)
    assert run_span["start"] == int(journal[0].at * 1e9)
    assert run_span["end"] == int(journal[-1].at * 1e9)


def test_cli__trace_flag_exports_the_run_with_the_console_exporter(tmp_path: Path) -> None:
    order = Path(__file__).resolve().parents[2] / "workflows" / "order.py"
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "shop"}
    context = '{"order_id": "A1", "items": [{"sku": "book", "qty": 1}]}'
    result = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", "--trace", "run", str(order), "--context", context],
        cwd=tmp_path,
        env={**env, "FLOWLOOP_DB": str(tmp_path / "cli.db")},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    spans = _console_spans(result.stderr)
    names = [span["name"] for span in spans]
    assert names.count("flowloop.run order") == 1
    assert names.count("flowloop.step order.charge") == 2  # the flaky provider: one retry
    [run] = [span for span in spans if span["name"] == "flowloop.run order"]
    assert run["resource"]["attributes"]["service.name"] == "shop"
    assert {span["context"]["trace_id"] for span in spans} == {run["context"]["trace_id"]}

    result = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", "--trace", "status"],
        cwd=tmp_path,
        env={**env, "OTEL_TRACES_EXPORTER": "zipkin", "FLOWLOOP_DB": str(tmp_path / "cli.db")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "OTEL_TRACES_EXPORTER='zipkin'" in result.stderr


def _console_spans(text: str) -> list[dict[str, Any]]:
    """The spans the console exporter wrote (JSON objects, one after another) in ``text``."""
    decoder, spans = json.JSONDecoder(), []
    at = text.find("{")
    while at != -1:
        span, end = decoder.raw_decode(text, at)
        spans.append(span)
        at = text.find("{", end)
    return spans


def test_cli__trace_flag_exports_a_resumed_run(tmp_path: Path) -> None:
    """``flowloop --trace resume`` exported nothing: the README names it for a resumed run
    joining its trace."""
    order = Path(__file__).resolve().parents[2] / "workflows" / "order.py"
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "console", "FLOWLOOP_DB": str(tmp_path / "r.db")}
    context = '{"order_id": "A2", "items": [{"sku": "book", "qty": 1}]}'
    for args in (
        ("start", str(order), "--context", context),
        ("--trace", "resume", "-w", str(order)),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "flowloop.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
    names = [span["name"] for span in _console_spans(result.stderr)]
    assert names.count("flowloop.run order") == 1, names
    assert "flowloop.step order.reserve" in names
