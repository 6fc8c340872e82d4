"""Alerts: something an operator must look at, sent to pluggable sinks.

Two levels: ``warning`` (look soon: a loop keeps skipping slots, a worker lost a lease) and
``critical`` (act: a run failed, a non-idempotent step was interrupted, a loop paused itself
after ``max_failures``). Each alert says what happened, to which run or loop, the last
error, and the command that shows more.

Sinks are callables ``(Alert) -> None``. Built in: :func:`log_sink`, :func:`command_sink`
(a shell command; the alert as JSON on stdin and ``FLOWLOOP_ALERT_*`` variables),
:func:`webhook_sink` (an HTTP POST with a JSON body); any Python callable works as well.
:class:`Alerts` fans out to them on a background thread, so a slow webhook never holds up
the worker's event loop, and a failing sink is logged, never raised.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import queue
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

from flowloop import journal as j
from flowloop.errors import ConfigError, FlowloopError
from flowloop.journal import JournalEvent, RunRecord

log = logging.getLogger("flowloop.alerts")

Level = Literal["warning", "critical"]
LEVELS: Final[tuple[Level, ...]] = ("warning", "critical")
DEFAULT_COMMAND_TIMEOUT_SECONDS: Final = 10.0
DEFAULT_WEBHOOK_TIMEOUT_SECONDS: Final = 5.0
DEFAULT_FLUSH_SECONDS: Final = 10.0
"""How long closing :class:`Alerts` waits for queued alerts to be delivered."""


@dataclass(frozen=True, kw_only=True)
class Alert:
    """What happened, to which run or loop, the last error, and the command that shows more."""

    level: Level
    what: str
    subject: str
    """The run id or loop name."""
    message: str
    error: str | None = None
    hint: str | None = None
    """A command that shows more, e.g. ``flowloop history RUN_ID``."""
    data: dict[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.time)
    """When it was raised (UTC epoch seconds)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        text = f"[{self.level}] {self.what} {self.subject}: {self.message}"
        if self.error:
            text += f" (last error: {self.error})"
        if self.hint:
            text += f" — see `{self.hint}`"
        return text


@dataclass(frozen=True)
class AlertKind:
    """One kind of alert flowloop raises: its level and its ``what`` (the metrics' labels)."""

    level: Level
    what: str

    def alert(
        self,
        subject: str,
        message: str,
        *,
        error: str | None = None,
        hint: str | None = None,
        data: dict[str, Any] | None = None,
    ) -> Alert:
        return Alert(
            level=self.level,
            what=self.what,
            subject=subject,
            message=message,
            error=error,
            hint=hint,
            data=data or {},
        )


INTERRUPTED_STEP: Final = AlertKind("critical", "interrupted step (not idempotent)")
RUN_FAILED: Final = AlertKind("critical", "run failed")
LOOP_PAUSED: Final = AlertKind("critical", "loop paused")
BREAKER_OPENED: Final = AlertKind("critical", "breaker opened")
BREAKER_CLOSED: Final = AlertKind("warning", "breaker closed")
LEASE_LOST: Final = AlertKind("warning", "lease lost")
LOOP_SKIPPING: Final = AlertKind("warning", "loop iterations skipped")
LOOP_HELD: Final = AlertKind("critical", "loop held")
"""A loop function did not end within its grace after its cut-off (1 s; 4 s after a stop):
its loop is held (running) until it ends, its failure not counted meanwhile (the severity of
a loop paused by max_failures)."""
KINDS: Final = (
    INTERRUPTED_STEP,
    RUN_FAILED,
    LOOP_PAUSED,
    BREAKER_OPENED,
    BREAKER_CLOSED,
    LEASE_LOST,
    LOOP_SKIPPING,
    LOOP_HELD,
)
"""Every alert flowloop raises (the metrics create a series for each before the first)."""
SKIP_ALERT_EVERY: Final = 10
"""Alert when a loop has had this many more skipped slots (it runs longer than its rate)."""

AlertSink = Callable[[Alert], None]


class AlertSinkError(FlowloopError):
    """An alert sink could not deliver an alert (the message says which and why)."""


def log_sink(alert: Alert) -> None:
    """The default sink: a log record at WARNING or CRITICAL."""
    log.log(
        logging.CRITICAL if alert.level == "critical" else logging.WARNING,
        alert.line(),
        extra={
            "alert": alert.what,
            "alert_level": alert.level,
            "subject": alert.subject,
            "event": "alert",
        },
    )


def command_sink(
    command: str | Sequence[str], *, timeout: float = DEFAULT_COMMAND_TIMEOUT_SECONDS
) -> AlertSink:
    """A sink that runs ``command`` for each alert: a string goes through ``/bin/sh -c``, a
    sequence is run as is. The alert is on stdin as JSON and in the environment as
    ``FLOWLOOP_ALERT_LEVEL``, ``_WHAT``, ``_SUBJECT``, ``_MESSAGE``, ``_ERROR``, ``_HINT``
    and ``_JSON``. A non-zero exit or a timeout raises AlertSinkError."""
    shell = isinstance(command, str)
    argv: str | list[str] = command if isinstance(command, str) else list(command)

    def sink(alert: Alert) -> None:
        body = json.dumps(alert.as_dict(), sort_keys=True)
        env = {
            **os.environ,
            "FLOWLOOP_ALERT_LEVEL": alert.level,
            "FLOWLOOP_ALERT_WHAT": alert.what,
            "FLOWLOOP_ALERT_SUBJECT": alert.subject,
            "FLOWLOOP_ALERT_MESSAGE": alert.message,
            "FLOWLOOP_ALERT_ERROR": alert.error or "",
            "FLOWLOOP_ALERT_HINT": alert.hint or "",
            "FLOWLOOP_ALERT_JSON": body,
        }
        try:
            done = subprocess.run(
                argv,
                shell=shell,
                input=body.encode(),
                env=env,
                capture_output=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise AlertSinkError(
                f"alert command {command!r} took longer than {timeout:g}s"
            ) from None
        except OSError as error:
            raise AlertSinkError(f"alert command {command!r} could not run: {error}") from error
        if done.returncode != 0:
            detail = done.stderr.decode(errors="replace").strip().splitlines()
            raise AlertSinkError(
                f"alert command {command!r} exited {done.returncode}"
                + (f": {detail[-1]}" if detail else "")
            )

    sink.__qualname__ = f"command_sink({command!r})"
    return sink


def webhook_sink(
    url: str,
    *,
    timeout: float = DEFAULT_WEBHOOK_TIMEOUT_SECONDS,
    headers: Mapping[str, str] | None = None,
) -> AlertSink:
    """A sink that POSTs each alert to ``url`` as a JSON object (the fields of
    :class:`Alert`). A status of 400 or more, or no answer within ``timeout``, raises
    AlertSinkError."""
    if not url.startswith(("http://", "https://")):
        raise ConfigError(f"webhook url {url!r} must start with http:// or https://")
    extra_headers = dict(headers or {})

    def sink(alert: Alert) -> None:
        request = urllib.request.Request(
            url,
            data=json.dumps(alert.as_dict(), sort_keys=True).encode(),
            headers={
                "Content-Type": "application/json",
                "User-Agent": "flowloop-alerts",
                **extra_headers,
            },
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                response.read()
        except OSError as error:  # URLError, HTTPError and timeouts are all OSErrors
            raise AlertSinkError(f"webhook {url}: {error}") from error

    sink.__qualname__ = f"webhook_sink({url!r})"
    return sink


def import_sink(target: str) -> AlertSink:
    """The callable named ``package.module:function`` (for configuration files)."""
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"alert callable {target!r} must look like package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(
            f"alert callable {target!r}: cannot import {module_name}: {error}"
        ) from None
    found = getattr(module, attribute, None)
    if not callable(found):
        raise ConfigError(f"alert callable {target!r}: {module_name} has no function {attribute}")
    sink: AlertSink = found
    return sink


def at_least(level: Level, sink: AlertSink) -> AlertSink:
    """``sink``, called only for alerts of ``level`` or more severe."""
    rank = LEVELS.index(level)

    def filtered(alert: Alert) -> None:
        if LEVELS.index(alert.level) >= rank:
            sink(alert)

    filtered.__qualname__ = getattr(sink, "__qualname__", repr(sink))
    return filtered


class Alerts:
    """Fans an alert out to every sink; a failing sink never breaks the caller.

    With ``background=True`` (what the worker uses) sinks run on one daemon thread, in the
    order alerts were raised: raising an alert costs a queue put. :meth:`flush` waits for
    the queue to drain; :meth:`close` flushes and stops the thread.
    """

    def __init__(
        self, sinks: Sequence[AlertSink] = (log_sink,), *, background: bool = False
    ) -> None:
        self.sinks = list(sinks)
        self.background = background
        self.sent = 0
        self.failed = 0
        self._queue: queue.Queue[Alert | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __call__(self, alert: Alert) -> None:
        if not self.background:
            self._deliver(alert)
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._drain, name="flowloop-alerts", daemon=True
                )
                self._thread.start()
        self._queue.put(alert)

    def _deliver(self, alert: Alert) -> None:
        for sink in self.sinks:
            try:
                sink(alert)
                self.sent += 1
            except Exception as error:
                self.failed += 1
                log.error(
                    "alert sink %s failed: %s (alert: %s)",
                    getattr(sink, "__qualname__", repr(sink)),
                    error,
                    alert.line(),
                )

    def _drain(self) -> None:
        while True:
            alert = self._queue.get()
            try:
                if alert is None:
                    return
                self._deliver(alert)
            finally:
                self._queue.task_done()

    def flush(self, timeout: float = DEFAULT_FLUSH_SECONDS) -> bool:
        """Wait until every queued alert went to every sink; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = DEFAULT_FLUSH_SECONDS) -> None:
        """Deliver what is queued (up to ``timeout`` seconds), then stop the thread."""
        thread = self._thread
        if thread is None:
            return
        self.flush(timeout)
        self._queue.put(None)
        thread.join(timeout=1.0)
        self._thread = None


# -- what raises alerts ------------------------------------------------------------------------


def run_alerts(
    record: RunRecord,
    events: Sequence[JournalEvent],
    *,
    idempotent: Callable[[str, str], bool] = lambda workflow, state: True,
) -> list[Alert]:
    """Alerts for one committed boundary of a run: ``critical`` when the run failed; when
    the cause is an interrupted step that is not idempotent, the alert says so (an operator
    must check its effect before `flowloop retry`). ``idempotent(workflow, state)``."""
    if record.status != "failed" or not events:
        return []
    last = events[-1]
    data = {
        "run_id": record.id,
        "workflow": record.workflow,
        "state": record.state,
        "reason": record.reason,
        "seq": last.seq,
    }
    if last.kind == j.STEP_INTERRUPTED and not idempotent(record.workflow, record.state):
        return [
            INTERRUPTED_STEP.alert(
                record.id,
                f"{record.workflow} step {record.state} was cut off and is not re-run "
                "on its own; check its effect, then retry the run",
                error=record.error,
                hint=f"flowloop history {record.id}",
                data=data,
            )
        ]
    return [
        RUN_FAILED.alert(
            record.id,
            f"{record.workflow} failed in state {record.state} ({record.reason or 'error'})",
            error=record.error,
            hint=f"flowloop history {record.id}",
            data=data,
        )
    ]


def breaker_alert(name: str, kind: str, worker: str, error: str | None) -> Alert | None:
    """A circuit breaker opened (``critical``: its steps are not called) or closed again
    (``warning``); ``None`` for other transitions (its half-open trial)."""
    data = {"breaker": name, "worker": worker}
    if kind == "opened":
        return BREAKER_OPENED.alert(
            name,
            f"steps behind breaker {name} are not called until its cool-down ends",
            error=error,
            hint="flowloop status",
            data=data,
        )
    if kind == "closed":
        return BREAKER_CLOSED.alert(
            name,
            f"breaker {name} closed: a trial call succeeded; its steps run again",
            hint="flowloop status",
            data=data,
        )
    return None


def lease_lost_alert(kind: Literal["run", "loop"], subject: str, why: str, worker: str) -> Alert:
    """A worker stopped driving a run or loop because its lease was lost (paused process,
    network partition, a database too slow to renew in time)."""
    hint = f"flowloop status {subject}" if kind == "run" else f"flowloop loops {subject}"
    return LEASE_LOST.alert(
        subject,
        f"worker {worker} {why}; another worker takes the {kind} over",
        hint=hint,
        data={"kind": kind, "worker": worker},
    )


def loop_alerts(
    loop: str,
    *,
    paused: str | None,
    error: str | None,
    skipped_before: int,
    skipped_now: int,
) -> list[Alert]:
    """Alerts for one recorded loop iteration: ``critical`` when the loop paused itself
    (``paused``: the reason, after ``max_failures``); ``warning`` each time its skipped
    slots pass another :data:`SKIP_ALERT_EVERY` (iterations outlast the rate)."""
    hint = f"flowloop loops {loop}"
    found = []
    if paused is not None:
        found.append(LOOP_PAUSED.alert(loop, paused, error=error, hint=hint))
    total = skipped_before + skipped_now
    if skipped_now and total // SKIP_ALERT_EVERY > skipped_before // SKIP_ALERT_EVERY:
        found.append(
            LOOP_SKIPPING.alert(
                loop, f"{total} slots skipped: iterations take longer than the rate", hint=hint
            )
        )
    return found


def loop_held_alert(loop: str, note: str) -> Alert:
    """A loop held by its abandoned function (``note``: what the loop's row says)."""
    return LOOP_HELD.alert(loop, note, hint=f"flowloop loops {loop}")
