"""``flowloop diagram FILE --runs --since 24h``: all runs of a window drawn on the machine,
computed in SQL from the journal (SQLite and PostgreSQL), without writing to the store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel
from uikit import parcel, parcels

from flowloop import Engine, Retry, Workflow
from flowloop.heat import apply_heat, heat
from flowloop.render import workflow_model
from flowloop.store.sql import SQLStore

UIKIT = str(Path(__file__).resolve().parents[1] / "uikit.py")


def flowloop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowloop.cli", "diagram", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_heat__counts_runs_per_edge_failures_and_live_runs(store_url: str) -> None:
    parcels(store_url, 5, failing=2)
    from flowloop.store.sql import SQLStore

    store = SQLStore(store_url, create=False)
    try:
        found = heat(store.engine, "parcel", since=None)
    finally:
        store.close()
    assert found.edges[("weigh", "next", "pack")] == (5, 5)
    assert found.edges[("pack", "next", "send")] == (3, 3)
    assert found.states["pack"].attempts == 5 and found.states["pack"].failed == 2
    assert found.states["pack"].p95 is not None
    assert all(not s.live for s in found.states.values())  # every run has finished


class Box(BaseModel):
    items: list[int] = [1, 2]


def _composed() -> tuple[Workflow, Workflow]:
    item = Workflow("box_item", context=Box)

    @item.step(initial=True, next="done")
    def touch(ctx: Box) -> None:
        pass

    item.final("done")
    box = Workflow("box", context=Box)
    box.map(
        "fan",
        child=item,
        items=lambda ctx: ctx.items,
        context=lambda ctx, n: Box(),
        on={"done": "check"},
        initial=True,
    )

    @box.step(next="done", retry=Retry(attempts=1), on_error={"*": "repair"})
    def check(ctx: Box) -> None:
        raise ValueError("dented")

    @box.step(next="done")
    def repair(ctx: Box) -> None:
        pass

    box.final("done")
    return box, item


def test_heat__counts_the_joins_of_maps_and_the_error_routes(store_url: str) -> None:
    """A map's join and an ``on_error`` route move runs on as a step's success does: the
    heat map drew those edges untaken (a map state faded as if no run had reached it)."""
    box, item = _composed()
    with Engine(store_url, workflows=[box, item]) as engine:
        for _ in range(2):
            assert engine.run(box, Box()).status == "succeeded"
    store = SQLStore(store_url, create=False)
    try:
        found = heat(store.engine, "box", since=None)
    finally:
        store.close()
    assert found.edges[("fan", "done", "check")] == (2, 2)
    routes = {edge: n for edge, n in found.edges.items() if edge[0] == "check"}
    assert list(routes.values()) == [(2, 2)] and next(iter(routes))[2] == "repair"
    assert found.edges[("repair", "next", "done")] == (2, 2)
    marks = {node.name: node.mark for node in apply_heat(workflow_model(box), found).nodes}
    assert marks["fan"] == "visited"  # a map state, the initial one: only ever left


def test_diagram_runs__cli_draws_the_heat_map(sqlite_url: str) -> None:
    parcels(sqlite_url, 4, failing=1)
    result = flowloop(f"{UIKIT}:parcel", "--runs", "--since", "1h", "--db", sqlite_url)
    assert result.returncode == 0, result.stderr
    assert "runs of the last 1h" in result.stdout
    assert 'label="next \u00d74"' in result.stdout  # weigh -> pack: four runs
    assert "4 attempts, 25% failed" in result.stdout
    assert parcel.name in result.stdout


def test_diagram_runs__bad_window_and_missing_file_are_one_line_errors(sqlite_url: str) -> None:
    parcels(sqlite_url, 1)
    bad = flowloop(f"{UIKIT}:parcel", "--runs", "--since", "soon", "--db", sqlite_url)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --since")
    alone = flowloop("--lifecycle", "--runs", "--db", sqlite_url)
    assert alone.returncode == 2 and "--runs draws FILE" in alone.stderr


def test_diagram_runs__a_database_that_does_not_exist_is_refused_not_created(
    tmp_path: Path,
) -> None:
    typo = tmp_path / "flowlop.db"
    done = flowloop(UIKIT, "--runs", "--db", str(typo))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: no database at") and "Traceback" not in done.stderr
    assert not typo.exists()
