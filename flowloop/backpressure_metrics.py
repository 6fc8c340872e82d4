"""Backpressure in Prometheus: what is queued, kept and dropped, read at scrape time from
the database (so every worker shows the whole picture, whoever sent or started)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger("flowloop.metrics")


class BackpressureCollector(Collector):
    def __init__(self, usage: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.usage = usage

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
            usage = self.usage()
        except Exception as error:  # a scrape must not fail with the database
            log.warning("backpressure metrics: %s", error)
            usage = {}
        for workflow, entry in sorted(usage.items()):
            queued.add_metric([workflow], entry["queued"])
            kept.add_metric([workflow], entry["kept"])
            kept_max.add_metric([workflow], entry["kept_max"])
            dropped.add_metric([workflow, "event"], entry["dropped_events"])
            dropped.add_metric([workflow, "run"], entry["dropped_runs"])
        yield from (queued, kept, kept_max, dropped)


def track(registry: CollectorRegistry, usage: Callable[[], dict[str, dict[str, int]]]) -> None:
    """Add the backpressure series to ``registry``."""
    registry.register(BackpressureCollector(usage))
