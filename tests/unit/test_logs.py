"""Log formats: JSON is one object per line with every ``extra=`` field; text is readable;
setting up twice replaces the handler instead of doubling every line."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from flowloop.errors import ConfigError
from flowloop.logs import JsonFormatter, level_number, setup_logging


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    """A private logger (the root logger belongs to pytest during tests)."""
    log = logging.getLogger("flowloop.test_logs")
    log.propagate = False
    yield log
    for handler in list(log.handlers):
        log.removeHandler(handler)


def json_lines(stream: io.StringIO) -> list[dict[str, object]]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_json_format__one_object_per_line_with_the_step_fields(logger: logging.Logger) -> None:
    stream = io.StringIO()
    setup_logging("json", "info", stream=stream, logger=logger)
    logger.info(
        "run %s seq %d: %s attempt %d started",
        "r1",
        2,
        "charge",
        1,
        extra={"workflow": "order", "run": "r1", "seq": 2, "state": "charge", "attempt": 1},
    )
    logger.info(
        "run %s finished",
        "r1",
        extra={"run": "r1", "duration": 0.25, "outcome": "failed", "error_type": "ValueError"},
    )

    first, second = json_lines(stream)
    assert first["message"] == "run r1 seq 2: charge attempt 1 started"
    assert first["level"] == "info"
    assert first["logger"] == "flowloop.test_logs"
    assert {k: first[k] for k in ("workflow", "run", "seq", "state", "attempt")} == {
        "workflow": "order",
        "run": "r1",
        "seq": 2,
        "state": "charge",
        "attempt": 1,
    }
    assert str(first["ts"]).endswith("+00:00")
    assert second["duration"] == 0.25
    assert second["outcome"] == "failed"
    assert second["error_type"] == "ValueError"
    # Nothing of LogRecord's own bookkeeping leaks into the object.
    assert not {"args", "msg", "levelno", "pathname", "lineno", "created"} & first.keys()


def test_json_format__traceback_and_odd_values_stay_on_one_line(logger: logging.Logger) -> None:
    stream = io.StringIO()
    setup_logging("json", "debug", stream=stream, logger=logger)
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logger.exception("step failed", extra={"path": object(), "items": {"a", "b"}})

    (entry,) = json_lines(stream)
    assert entry["message"] == "step failed"
    assert "ValueError: bad" in str(entry["exc"])
    assert "Traceback" in str(entry["exc"])
    assert str(entry["path"]).startswith("<object object")


def test_text_format__readable_line(logger: logging.Logger) -> None:
    stream = io.StringIO()
    setup_logging("text", "info", stream=stream, logger=logger)
    logger.info("run %s started", "r1", extra={"run": "r1"})
    line = stream.getvalue().strip()
    assert line.endswith("INFO flowloop.test_logs: run r1 started")
    assert "{" not in line


def test_setup_logging__again_replaces_its_handler_and_level(logger: logging.Logger) -> None:
    first, second = io.StringIO(), io.StringIO()
    setup_logging("text", "info", stream=first, logger=logger)
    setup_logging("json", "warning", stream=second, logger=logger)
    logger.info("hidden")
    logger.warning("shown")
    assert first.getvalue() == ""
    assert [e["message"] for e in json_lines(second)] == ["shown"]
    # Only ours: pytest's own capture handlers may sit on the logger too.
    assert len([h for h in logger.handlers if type(h) is logging.StreamHandler]) == 1


def test_setup_logging__default_stream_follows_sys_stderr(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    setup_logging("json", "info", logger=logger)
    swapped = io.StringIO()
    monkeypatch.setattr("sys.stderr", swapped)
    logger.info("after the swap")
    assert json_lines(swapped)[0]["message"] == "after the swap"


@pytest.mark.parametrize(
    ("fmt", "level", "message"),
    [
        ("xml", "info", "log format 'xml' is not one of text, json"),
        ("json", "loud", "log level 'loud' is not one of debug, info, warning, error, critical"),
    ],
)
def test_setup_logging__invalid_choice_is_one_clear_error(
    logger: logging.Logger, fmt: str, level: str, message: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        setup_logging(fmt, level, logger=logger)  # type: ignore[arg-type]
    assert str(raised.value) == message


def test_level_number__names_any_case() -> None:
    assert level_number("DEBUG") == logging.DEBUG
    assert level_number("warning") == logging.WARNING
    assert level_number(logging.ERROR) == logging.ERROR


def test_json_formatter__is_a_plain_formatter_for_any_handler() -> None:
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "n=%d", (3,), None)
    record.run = "r9"
    entry = json.loads(JsonFormatter().format(record))
    assert entry == {
        "ts": entry["ts"],
        "level": "error",
        "logger": "x",
        "message": "n=3",
        "run": "r9",
    }
