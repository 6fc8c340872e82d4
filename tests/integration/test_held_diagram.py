"""`flowloop diagram --run CHILD` of a map's child held back by its parent's
``max_parallel``, on SQLite and PostgreSQL: it said "now scheduled" (the row's stored
status) while `flowloop status` and the dashboard said held; it says held, and what
releases it, until its turn comes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner

from flowloop import FakeClock
from flowloop.cli import cli
from flowloop.loader import load_target
from flowloop.testing import TestEngine

FLOWS = """
from heldkit import held_fan

fan, item = held_fan("diagram")
"""
TOLD = "held back by its parent's max_parallel: starts when a sibling ends"


def diagram(url: str, flows: Path, run_id: str) -> str:
    result = CliRunner().invoke(cli, ["diagram", "--run", run_id, "-w", str(flows), "--db", url])
    assert result.exit_code == 0, result.output
    return result.output


def test_diagram_of_a_held_child_says_held_and_what_releases_it(
    store_url: str, tmp_path: Path
) -> None:
    flows = tmp_path / "fan_flows.py"
    flows.write_text(FLOWS)
    fan, _ = load_target(f"{flows}:fan")
    item, _ = load_target(f"{flows}:item")
    clock = FakeClock(auto_advance=False)
    with TestEngine(store_url, clock=clock, workflows=[fan, item]) as engine:
        parent = engine.start(fan, {"items": [1, 2]}).id
        engine.run_until_idle(idle_horizon=0)
        store: Any = engine.store
        first, second = (c.id for c in store.children_of(parent))
        assert engine.is_held(second) and not engine.is_held(first)
    held = diagram(store_url, flows, second)
    assert f"run {second}: held at hold ({TOLD})" in held, held
    assert "now held: starts when a sibling ends" in held and "now scheduled" not in held
    free = diagram(store_url, flows, first)
    assert f"run {first}: scheduled at hold" in free and "held" not in free, free
    # Its turn come (its sibling's end), it is drawn as it is again.
    with TestEngine(store_url, clock=clock, workflows=[fan, item]) as engine:
        engine.send(first, "go")
        engine.run_until_idle(idle_horizon=0)
        assert not engine.is_held(second)
    released = diagram(store_url, flows, second)
    assert f"run {second}: scheduled at hold" in released and "held" not in released
