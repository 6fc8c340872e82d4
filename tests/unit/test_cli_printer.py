"""What `flowloop run`/`retry`/`resume` print of a run's end, and which of the engine's log
lines they leave out while they print (flowloop/cli/progress.py)."""

from __future__ import annotations

import dataclasses
import io
import logging
from collections.abc import Iterator

import pytest

from flowloop import journal as j
from flowloop.cli.common import out, real_console
from flowloop.cli.progress import printed_not_logged, progress_printer
from flowloop.journal import JournalEvent, RunRecord
from flowloop.logs import setup_logging


def a_run(**ended: object) -> RunRecord:
    record = j.create(
        JournalEvent(
            run_id="r1",
            seq=1,
            kind=j.RUN_CREATED,
            at=1.0,
            state="check",
            context="{}",
            data={"workflow": "jobs", "version": 1, "fingerprint": "f" * 16, "key": None},
        )
    )
    return dataclasses.replace(record, **ended)  # type: ignore[arg-type]


def last_line(record: RunRecord) -> str:
    shown: set[str] = set()
    show = progress_printer(shown_ends=shown)
    with real_console(out).capture() as captured:
        show(record, [])
    assert shown == {record.id}
    return captured.get().splitlines()[-1]


def test_a_runs_last_line_says_why_it_ended_and_nothing_stale() -> None:
    """A run stopped during its second attempt said "stopped in state check:
    ConnectionError: …" — the first attempt's error, left on the record (review); an
    operator's stop said "…: stopped"."""
    error = "ConnectionError: upstream reset"
    failed = a_run(status="failed", reason="error", error=error)
    assert last_line(failed) == f"run r1 failed in state check: {error}"
    stopped = a_run(status="stopped", reason="stopped during step", error=error)
    assert last_line(stopped) == "run r1 stopped in state check: stopped during step"
    by_operator = a_run(status="stopped", reason="stopped", error=error)
    assert last_line(by_operator) == "run r1 stopped in state check"
    assert last_line(a_run(status="succeeded")) == "run r1 succeeded in state check"


@pytest.fixture
def root_logging() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield root
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def log_failures(logger: logging.Logger) -> None:
    logger.error("step failed", extra={"run": "r1", "event": "step_finished"})
    logger.error("run failed", extra={"run": "r1", "event": "run_failed"})
    logger.warning("lease lost", extra={"run": "r1", "event": "lease_lost"})


def test_the_failures_shown_are_left_out_of_flowloops_text_log_only(
    root_logging: logging.Logger,
) -> None:
    """The filter went on every root handler: a program's own file handler lost the ERROR
    lines of its failed runs (review). Only flowloop's own text log leaves them out."""
    ours, theirs = io.StringIO(), io.StringIO()
    setup_logging("text", "warning", stream=ours)
    root_logging.addHandler(logging.StreamHandler(theirs))
    engine_log = logging.getLogger("flowloop.stepping")
    with printed_not_logged():
        log_failures(engine_log)
    assert "step failed" not in ours.getvalue() and "run failed" not in ours.getvalue()
    assert "lease lost" in ours.getvalue()  # (not a line the printer shows)
    assert theirs.getvalue().split() == ["step", "failed", "run", "failed", "lease", "lost"]
    log_failures(engine_log)  # the filter is gone once the command is done
    assert "step failed" in ours.getvalue()


@pytest.mark.parametrize(("fmt", "level"), [("json", "warning"), ("text", "info")])
def test_a_json_log_or_one_asked_for_keeps_every_line(
    root_logging: logging.Logger, fmt: str, level: str
) -> None:
    ours = io.StringIO()
    setup_logging(fmt, level, stream=ours)  # type: ignore[arg-type]
    with printed_not_logged():
        log_failures(logging.getLogger("flowloop.children"))
    assert "step failed" in ours.getvalue() and "run failed" in ours.getvalue()
