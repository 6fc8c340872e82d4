"""Alerts: something an operator must look at, sent to pluggable sinks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

log = logging.getLogger("flowloop.alerts")

Level = Literal["warning", "critical"]


@dataclass(frozen=True, kw_only=True)
class Alert:
    """What happened, to which run or loop, the last error, and the command that shows more."""

    level: Level
    what: str
    subject: str
    message: str
    error: str | None = None
    hint: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        text = f"[{self.level}] {self.what} {self.subject}: {self.message}"
        if self.error:
            text += f" (last error: {self.error})"
        if self.hint:
            text += f" — see `{self.hint}`"
        return text


AlertSink = Callable[[Alert], None]


def log_sink(alert: Alert) -> None:
    """The default sink: a log record at WARNING or CRITICAL."""
    log.log(logging.CRITICAL if alert.level == "critical" else logging.WARNING, alert.line())


class Alerts:
    """Fans an alert out to every sink; a failing sink never breaks the caller."""

    def __init__(self, sinks: Sequence[AlertSink] = (log_sink,)) -> None:
        self.sinks = list(sinks)

    def __call__(self, alert: Alert) -> None:
        for sink in self.sinks:
            try:
                sink(alert)
            except Exception:
                log.exception("alert sink %r failed", sink)
