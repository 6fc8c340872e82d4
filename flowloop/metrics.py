"""Prometheus metrics of a worker: counters and histograms fed by the executor's committed
boundaries and the scheduler's iteration outcomes, plus gauges read at scrape time.

Every instance has its own registry (two workers in one process, or tests, never clash).
:meth:`Metrics.serve` exposes it over HTTP on ``127.0.0.1`` unless told otherwise:
metrics name workflows and states, which is not for the whole network by default.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)

from flowloop import journal as j
from flowloop.alerts import KINDS as ALERT_KINDS
from flowloop.errors import ConfigError
from flowloop.journal import JournalEvent, RunRecord

log = logging.getLogger("flowloop.metrics")

DEFAULT_METRICS_HOST: Final = "127.0.0.1"
STEP_BUCKETS: Final = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    float("inf"),
)
"""Step duration buckets in seconds: from a 1 ms database step to a 5 min batch job."""
STEP_OUTCOMES: Final = ("succeeded", "failed", "retried", "timed_out", "interrupted")
FINISHED_STATUSES: Final = ("succeeded", "failed", "stopped")
ITERATION_OUTCOMES: Final = ("ok", "failed", "skipped", "skipped_idle", "stopped", "cancelled")
LEASE_KINDS: Final = ("run", "loop")
TIMEOUT_ERROR: Final = "StepTimeout"
BEGUN_KEPT: Final = 50_000
"""Run ids :class:`Metrics` remembers as begun (~6 MB at most)."""
BEGINS: Final = j.BEGINS
GONE_ON: Final = frozenset({*BEGINS, j.STEP_SUCCEEDED, j.STEP_FAILED, j.CHILDREN_JOINED})
"""Kinds of an entry that follows a beginning: a start after one in the same boundary is
not the run's first."""


def step_outcome(event: JournalEvent) -> str | None:
    """The outcome of a step attempt that ``event`` ends (``None``: it ends none).

    Each attempt has exactly one: ``timed_out`` (whether retried or not), else ``retried``
    (failed, another attempt is scheduled), ``failed`` (no attempt left), ``interrupted``
    (the worker died or shut down during it) or ``succeeded``."""
    if event.kind == j.STEP_SUCCEEDED:
        return "succeeded"
    if event.kind == j.STEP_INTERRUPTED:
        return "interrupted"
    if event.kind == j.STEP_FAILED:
        if event.error_type == TIMEOUT_ERROR:
            return "timed_out"
        return "retried" if event.retryable else "failed"
    return None


class Metrics:
    """The metrics of one worker (see the module docstring for what is exported).

    Feed it with :meth:`listener` (an executor listener), :meth:`iteration` (a scheduler
    iteration listener) and :meth:`lease_lost`; give it gauges read at scrape time with
    :meth:`track_queue` and :meth:`track_in_flight`, and the journal's first start of a run
    with :meth:`track_begins` (``flowloop_runs_started`` counts each run once, there).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # The `_created` series double every counter and histogram and are not used by
        # rate()/increase(); prometheus-client's switch for them is process-wide.
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.runs_started = Counter(
            "flowloop_runs_started",
            "Runs that began on this worker: their first step started, or their first call's "
            "or map's children (each run once, whatever came before: a debounce, a deferral, "
            "a pause, an event).",
            ["workflow"],
            registry=r,
        )
        self.runs_finished = Counter(
            "flowloop_runs_finished",
            "Runs this worker took to a final status (succeeded, failed, stopped).",
            ["workflow", "status"],
            registry=r,
        )
        self.steps = Counter(
            "flowloop_steps",
            "Step attempts by outcome: succeeded, failed, retried, timed_out, interrupted.",
            ["workflow", "state", "outcome"],
            registry=r,
        )
        self.step_duration = Histogram(
            "flowloop_step_duration_seconds",
            "Duration of step attempts (succeeded or failed).",
            ["workflow", "state"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.iterations = Counter(
            "flowloop_loop_iterations",
            "Loop iterations by outcome: ok, failed, skipped (slots skipped while the previous "
            "iteration still ran), skipped_idle (nothing to do), stopped, cancelled.",
            ["loop", "outcome"],
            registry=r,
        )
        self.iteration_duration = Histogram(
            "flowloop_loop_iteration_duration_seconds",
            "Duration of loop iterations.",
            ["loop"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.leases_lost = Counter(
            "flowloop_lease_losses",
            "Runs and loops this worker stopped driving: lease lost.",
            ["kind"],
            registry=r,
        )
        self.alerts = Counter(
            "flowloop_alerts",
            "Alerts raised by this worker.",
            ["level", "what"],
            registry=r,
        )
        self.loop_stalls = Counter(
            "flowloop_event_loop_stalls",
            "Times the worker's event loop did not run for the stall threshold or longer "
            "(a blocking call in an async step; the log names the step).",
            registry=r,
        )
        self.loop_stall_seconds = Histogram(
            "flowloop_event_loop_stall_seconds",
            "Length of event-loop stalls.",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "flowloop_queue_depth",
            "Runs due but not yet claimed (scheduled or retrying).",
            registry=r,
        )
        self.in_flight = Gauge(
            "flowloop_runs_in_flight",
            "Runs this worker is driving right now.",
            registry=r,
        )
        self.breaker_transitions = Counter(
            "flowloop_breaker_transitions",
            "Circuit breaker transitions this worker made: opened, half_opened, closed.",
            ["breaker", "kind"],
            registry=r,
        )
        self.breaker_open = Gauge(
            "flowloop_breaker_open",
            "1 while a breaker is open or half open (as last changed by this worker), else 0.",
            ["breaker"],
            registry=r,
        )
        self.deferred = Counter(
            "flowloop_runs_deferred",
            "Runs whose step was not called yet and that were rescheduled: by rate limit "
            "or open breaker (reason: rate_limit, breaker_open).",
            ["workflow", "reason"],
            registry=r,
        )
        self.abandoned_threads = Gauge(
            "flowloop_abandoned_step_threads",
            "Threads still running a sync step given up on (timed out or cut off).",
            registry=r,
        )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None
        self._first_begin: Callable[[str], int | None] | None = None
        self._begun: OrderedDict[str, None] = OrderedDict()
        """Runs known to have begun (counted here, or read once): no read for their later
        starts (a run sleeping 50 times read its journal 50 times). The oldest are
        forgotten past :data:`BEGUN_KEPT` (read again if they start once more)."""

    def known(self, workflows: Mapping[str, Iterable[str]], loops: Iterable[str]) -> None:
        """Create every labelled series this worker can produce at 0: per workflow (name →
        its step states) each step outcome, run status and duration histogram, per loop
        each iteration outcome, and every lease kind and alert. Prometheus's ``increase()``
        needs a series to exist before its first event, or the first failures after a
        worker starts are never counted by an alert rule."""
        for kind in LEASE_KINDS:
            self.leases_lost.labels(kind)
        for alert in ALERT_KINDS:
            self.alerts.labels(alert.level, alert.what)
        for workflow, states in workflows.items():
            self.runs_started.labels(workflow)
            for status in FINISHED_STATUSES:
                self.runs_finished.labels(workflow, status)
            for state in states:
                self.step_duration.labels(workflow, state)
                for outcome in STEP_OUTCOMES:
                    self.steps.labels(workflow, state, outcome)
        for loop in loops:
            self.iteration_duration.labels(loop)
            for outcome in ITERATION_OUTCOMES:
                self.iterations.labels(loop, outcome)

    # -- feeding ---------------------------------------------------------------------------

    def listener(self, record: RunRecord, events: Sequence[JournalEvent]) -> None:
        """An executor listener: counts what one committed boundary did."""
        workflow = record.workflow
        for index, event in enumerate(events):
            if event.kind in BEGINS and self._begins(events, index):
                self.runs_started.labels(workflow).inc()
            outcome = step_outcome(event)
            if outcome is None:
                continue
            state = event.state or ""
            self.steps.labels(workflow, state, outcome).inc()
            if event.duration is not None:
                self.step_duration.labels(workflow, state).observe(event.duration)
        if record.status in FINISHED_STATUSES:
            # A finished run is written again only by an operator (not through a worker's
            # listener), so each run is counted once.
            self.runs_finished.labels(workflow, record.status).inc()

    def track_begins(self, first_begin: Callable[[str], int | None]) -> None:
        """Read a run's first :data:`BEGINS` entry with ``first_begin(run_id)`` (its seq):
        asked only of a start the boundary itself does not tell (not seq 2, not after a
        step's end) — a run's first after a deferral, a debounce or a pause, and each start
        after a wait, a sleep or a join. Without it only a start at seq 2 is counted."""
        self._first_begin = first_begin

    def _begins(self, events: Sequence[JournalEvent], index: int) -> bool:
        """Whether ``events[index]`` (one of :data:`BEGINS`) is its run's first."""
        event = events[index]
        if event.kind == j.STEP_STARTED and event.attempt != 1:
            return False  # a retry: attempt 1 started before
        if event.seq == 2:
            self._remember(event.run_id)
            return True  # right after run_created
        if any(earlier.kind in GONE_ON for earlier in events[:index]):
            return False  # after a step's end or a join: the usual boundary of a step
        if self._first_begin is None or event.run_id in self._begun:
            return False
        try:
            first = self._first_begin(event.run_id) == event.seq
        except Exception as error:  # the database: this start is not counted
            log.warning("runs started: run %s not counted: %s", event.run_id, error)
            return False
        self._remember(event.run_id)
        return first

    def _remember(self, run_id: str) -> None:
        self._begun[run_id] = None
        if len(self._begun) > BEGUN_KEPT:
            self._begun.popitem(last=False)

    def iteration(self, loop: str, outcome: str, duration: float, skipped: int) -> None:
        """A scheduler iteration listener."""
        self.iterations.labels(loop, outcome).inc()
        self.iteration_duration.labels(loop).observe(duration)
        if skipped:
            self.iterations.labels(loop, "skipped").inc(skipped)

    def lease_lost(self, kind: str) -> Callable[[str, str], None]:
        """A lease-lost hook for runs (``kind="run"``) or loops (``"loop"``)."""
        counter = self.leases_lost.labels(kind)

        def hook(_subject: str, _why: str) -> None:
            counter.inc()

        return hook

    def breaker(self, name: str, kind: str) -> None:
        """A breaker transition made by this worker (flowloop/gates.py)."""
        self.breaker_transitions.labels(name, kind).inc()
        self.breaker_open.labels(name).set(0 if kind == "closed" else 1)

    def deferrals(self, record: RunRecord, events: Sequence[JournalEvent]) -> None:
        """An executor listener counting ``run_deferred`` entries."""
        for event in events:
            if event.kind == j.RUN_DEFERRED:
                reason = str(event.data.get("reason", "")).split(":", 1)[0]
                self.deferred.labels(record.workflow, reason).inc()

    def stall(self, lag: float, _steps: list[str]) -> None:
        """A loop-watchdog stall listener."""
        self.loop_stalls.inc()
        self.loop_stall_seconds.observe(lag)

    def alert(self, level: str, what: str) -> None:
        self.alerts.labels(level, what).inc()

    def track_queue(self, count_due: Callable[[], int]) -> None:
        """Read the queue depth at scrape time (one indexed count query per scrape)."""

        def read() -> float:
            try:
                return float(count_due())
            except Exception as error:  # a scrape must not fail with the database
                log.warning("queue depth unavailable: %s", error)
                return float("nan")

        self.queue_depth.set_function(read)

    def track_in_flight(self, busy: Callable[[], int]) -> None:
        self.in_flight.set_function(lambda: float(busy()))

    def track_abandoned_threads(self, abandoned: Callable[[], int]) -> None:
        self.abandoned_threads.set_function(lambda: float(abandoned()))

    # -- exposition ------------------------------------------------------------------------

    def serve(self, port: int, host: str = DEFAULT_METRICS_HOST) -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0: any free port) from a daemon thread.
        Returns the port. A port in use raises ConfigError naming it."""
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as error:
            raise ConfigError(f"metrics port {host}:{port}: {error.strerror or error}") from None
        self._server, self._thread = server, thread
        bound = int(server.server_port)
        log.info(
            "metrics on http://%s:%d/metrics",
            host,
            bound,
            extra={"event": "metrics_serving", "host": host, "port": bound},
        )
        return bound

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) being served, ``None`` when not serving."""
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Stop serving (if serving)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def samples(self) -> Iterable[tuple[str, dict[str, str], float]]:
        """Every sample as (name, labels, value): for tests and `--json` dumps."""
        for family in self.registry.collect():
            for sample in family.samples:
                yield sample.name, dict(sample.labels), float(sample.value)
