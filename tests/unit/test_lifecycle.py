"""The lifecycle machine every run shares: which status changes are allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowloop import lifecycle
from flowloop.graph import reachable

ALLOWED_BY_DESIGN = [
    ("idle", "scheduled"),
    ("scheduled", "running"),
    ("retrying", "running"),
    ("running", "succeeded"),
    ("scheduled", "succeeded"),  # a waiting run led to a final state by an event
    ("running", "retrying"),
    ("running", "failed"),
    ("running", "scheduled"),  # released at shutdown / next step queued
    ("retrying", "succeeded"),  # its deadline passed in a backoff: on_deadline is final
    ("retrying", "scheduled"),  # … or on_deadline is a step or a wait
    ("paused", "scheduled"),
    ("failed", "scheduled"),  # an operator's retry
    ("stopped", "scheduled"),
    *[(s, "paused") for s in ("idle", "scheduled", "running", "retrying")],
    *[(s, "stopped") for s in ("idle", "scheduled", "running", "retrying", "paused")],
]

FORBIDDEN = [
    ("succeeded", "running"),
    ("succeeded", "scheduled"),
    ("failed", "running"),
    ("stopped", "running"),
    ("stopped", "paused"),
    ("failed", "paused"),
    ("idle", "running"),
    ("paused", "running"),
]


@pytest.mark.parametrize(("source", "dest"), ALLOWED_BY_DESIGN)
def test_allowed__design_transitions(source: str, dest: str) -> None:
    assert lifecycle.allowed(source, dest)


@pytest.mark.parametrize(("source", "dest"), FORBIDDEN)
def test_allowed__forbidden_transitions(source: str, dest: str) -> None:
    assert not lifecycle.allowed(source, dest)


@pytest.mark.parametrize("status", lifecycle.STATUSES)
def test_allowed__staying_put(status: str) -> None:
    assert lifecycle.allowed(status, status)


def test_statuses__finished_and_live_partition_all() -> None:
    assert set(lifecycle.STATUSES) == lifecycle.FINISHED | lifecycle.LIVE
    assert not lifecycle.FINISHED & lifecycle.LIVE
    assert lifecycle.CLAIMABLE <= lifecycle.LIVE


def test_machine__every_status_reachable_from_idle() -> None:
    edges: dict[str, set[str]] = {}
    for source, dest in lifecycle.ALLOWED:
        edges.setdefault(source, set()).add(dest)
    assert reachable(edges, ["idle"]) == set(lifecycle.STATUSES)
    assert "succeeded" not in edges  # nothing leaves success


def test_machine__drawn_with_transitions() -> None:
    machine = lifecycle.build_machine()
    assert set(machine.states) == set(lifecycle.STATUSES)
    assert set(machine.events) == {t["trigger"] for t in lifecycle.TRANSITIONS}


def test_text__is_the_readme_block_and_says_what_the_machine_allows() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert f"```\n{lifecycle.text()}```\n" in readme, (
        "README.md's lifecycle block differs from flowloop.lifecycle.text(); paste it in"
    )
    # Every (source, dest) pair the text states is one the machine allows, and back.
    said = set()
    for rule in lifecycle.RULES:
        assert f"{rule.trigger}: {rule.meaning}" in lifecycle.text()
        said |= {(source, rule.dest) for source in rule.expanded()}
    assert said == set(lifecycle.ALLOWED)
