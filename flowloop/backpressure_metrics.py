"""Backpressure in Prometheus: what is queued, kept and dropped, read at scrape time from
the database (so every worker shows the whole picture, whoever sent or started). Every
workflow the worker knows has its series, at 0 when nothing is queued, kept or dropped (the
database counts only workflows with something to count: the series came and went)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger("flowloop.metrics")


ZERO: dict[str, int] = {
    "queued": 0,
    "kept": 0,
    "kept_max": 0,
    "dropped_events": 0,
    "dropped_runs": 0,
}


class BackpressureCollector(Collector):
    def __init__(
        self, usage: Callable[[], dict[str, dict[str, int]]], workflows: Iterable[str] = ()
    ) -> None:
        self.usage = usage
        self.workflows = tuple(workflows)

    def collect(self) -> Iterator[Any]:
        queued = GaugeMetricFamily(
            "flowloop_runs_queued", "Runs created but not yet started.", labels=["workflow"]
        )
        kept = GaugeMetricFamily(
            "flowloop_inbox_kept", "Events kept for runs, not yet taken.", labels=["workflow"]
        )
        kept_max = GaugeMetricFamily(
            "flowloop_inbox_kept_max",
            "The most events kept for one run (compare with max_inbox).",
            labels=["workflow"],
        )
        dropped = CounterMetricFamily(
            "flowloop_backpressure_dropped",
            "Kept events (what=event) and queued runs (what=run) dropped by drop_oldest.",
            labels=["workflow", "what"],
        )
        try:
            usage = {name: ZERO for name in self.workflows} | self.usage()
        except Exception as error:  # a scrape must not fail with the database
            log.warning("backpressure metrics: %s", error)
            usage = {}  # (unknown, not 0: no samples)
        for workflow, entry in sorted(usage.items()):
            queued.add_metric([workflow], entry["queued"])
            kept.add_metric([workflow], entry["kept"])
            kept_max.add_metric([workflow], entry["kept_max"])
            dropped.add_metric([workflow, "event"], entry["dropped_events"])
            dropped.add_metric([workflow, "run"], entry["dropped_runs"])
        yield from (queued, kept, kept_max, dropped)


def track(
    registry: CollectorRegistry,
    usage: Callable[[], dict[str, dict[str, int]]],
    workflows: Iterable[str] = (),
) -> None:
    """Add the backpressure series to ``registry``; those of ``workflows`` always (at 0)."""
    registry.register(BackpressureCollector(usage, workflows))
