"""Logging setup: human text or one JSON object per line, through stdlib ``logging``.

flowloop logs with ``extra=`` fields (``workflow``, ``run``, ``seq``, ``state``, ``attempt``,
``duration``, ``outcome``, ``error_type`` …). The text format shows the message only (the
fields are already in it); the JSON format emits every field as a key, so a log pipeline
can filter on ``run`` or ``outcome`` without parsing sentences.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import IO, Any, Final, Literal

from flowloop.errors import ConfigError

LogFormat = Literal["text", "json"]
FORMATS: Final[tuple[LogFormat, ...]] = ("text", "json")
LEVELS: Final = ("debug", "info", "warning", "error", "critical")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD: Final = frozenset(
    vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None))
) | {"message", "asctime", "taskName"}
_MARK: Final = "_flowloop_handler"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line: ``ts`` (ISO-8601 UTC), ``level``,
    ``logger``, ``message``, every ``extra=`` field, and ``exc`` with the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # default=str: an extra that is not JSON (a Path, an exception) must not lose the line.
        return json.dumps(entry, default=str, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of the record (a test runner or a
    daemon may swap it after logging was set up)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, _value: IO[str]) -> None:
        pass


def formatter(fmt: LogFormat) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    return logging.Formatter(TEXT_FORMAT)


def text_handlers(logger: logging.Logger | None = None) -> list[logging.Handler]:
    """The handlers :func:`setup_logging` installed on ``logger`` (default: the root) that
    write text lines — not a program's own handlers, not JSON logs (a log pipeline's)."""
    target = logger if logger is not None else logging.getLogger()
    return [
        handler
        for handler in target.handlers
        if getattr(handler, _MARK, False) and not isinstance(handler.formatter, JsonFormatter)
    ]


def level_number(level: str | int) -> int:
    """``"info"`` → ``logging.INFO``; raises ConfigError naming the choices."""
    if isinstance(level, int):
        return level
    name = level.strip().lower()
    if name not in LEVELS:
        raise ConfigError(f"log level {level!r} is not one of {', '.join(LEVELS)}")
    return int(logging.getLevelName(name.upper()))


def setup_logging(
    fmt: LogFormat = "text",
    level: str | int = "info",
    *,
    stream: IO[str] | None = None,
    logger: logging.Logger | None = None,
) -> logging.Handler:
    """Send log records of ``logger`` (default: the root logger, so step functions' own
    logs come out the same way) to ``stream`` (default stderr) in ``fmt``.

    Calling it again replaces the handler it installed before (never stacks handlers).
    Returns the handler."""
    if fmt not in FORMATS:
        raise ConfigError(f"log format {fmt!r} is not one of {', '.join(FORMATS)}")
    target = logger if logger is not None else logging.getLogger()
    for old in list(target.handlers):
        if getattr(old, _MARK, False):
            target.removeHandler(old)
    handler: logging.Handler = (
        logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    )
    handler.setFormatter(formatter(fmt))
    setattr(handler, _MARK, True)
    target.addHandler(handler)
    number = level_number(level)
    target.setLevel(number)
    if logger is None:
        # Alembic says "Context impl SQLiteImpl." at INFO on every start: noise for operators.
        logging.getLogger("alembic").setLevel(max(number, logging.WARNING))
    return handler
