"""The composition examples, imported the way the CLI imports them and run on SQLite and
PostgreSQL: workflows/order.py (packing child, rollback with compensations) and
workflows/etl_fanout.py (one child per file, joined into a report)."""

from __future__ import annotations

import csv
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowloop import Engine, FakeClock
from flowloop import journal as j
from flowloop.loader import load_target

ROOT = Path(__file__).resolve().parents[2]
ITEMS = [{"sku": "book", "qty": 2}, {"sku": "pen", "qty": 3}]


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    with Engine(store_url, clock=FakeClock()) as engine:
        yield engine


def test_order__packed_by_a_child_then_delivered(engine: Engine) -> None:
    order, _ = load_target(str(ROOT / "workflows" / "order.py"))
    info = engine.run(order, {"order_id": "A1", "items": ITEMS})
    assert (info.status, info.state) == ("succeeded", "delivered")
    assert info.context.parcel == "P-A1-5"  # type: ignore[union-attr]
    assert info.context.reserved and info.context.refund_id is None  # type: ignore[union-attr]


def test_order__packing_fails_and_the_order_rolls_back(engine: Engine) -> None:
    order, _ = load_target(str(ROOT / "workflows" / "order.py"))
    info = engine.run(order, {"order_id": "A2", "items": ITEMS, "pack_fails": True})
    assert (info.status, info.state) == ("succeeded", "rolled_back")
    assert info.reason == "compensated: charge, reserve"
    ctx = info.context
    assert ctx.refund_id is not None and not ctx.reserved  # type: ignore[union-attr]
    undone = [e.state for e in engine.history(info.id) if e.kind == j.COMPENSATION_SUCCEEDED]
    assert undone == ["charge", "reserve"]


def test_etl_fanout__one_child_per_file_joined_into_the_report(
    engine: Engine, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    shutil.copytree(ROOT / "workflows" / "data", data)
    (data / "orders_2024-03-04.csv").write_text("")  # an empty file fails its child
    etl, _ = load_target(str(ROOT / "workflows" / "etl_fanout.py"))
    info = engine.run(etl, {"input_dir": str(data)})
    assert (info.status, info.state) == ("succeeded", "done")
    ctx = info.context
    assert len(ctx.files) == 5  # type: ignore[union-attr]
    assert ctx.failed_files == ["orders_2024-03-04.csv"]  # type: ignore[union-attr]
    expected = sum(  # CSV records: a quoted field may span lines (they counted as records)
        len([row for row in csv.reader(p.open(newline=""))][1:])
        for p in (ROOT / "workflows" / "data").glob("*.csv")
    )
    assert ctx.records == expected == 50  # type: ignore[union-attr]
    assert ctx.report.endswith("failed: orders_2024-03-04.csv")  # type: ignore[union-attr]


def test_etl_fanout__a_folder_that_does_not_exist_fails_the_run(
    engine: Engine, tmp_path: Path
) -> None:
    # It succeeded with "0 file(s), 0 record(s) loaded": a typo looked like an empty day.
    etl, _ = load_target(str(ROOT / "workflows" / "etl_fanout.py"))
    info = engine.run(etl, {"input_dir": str(tmp_path / "nope")})
    assert (info.status, info.state) == ("failed", "discover")
    assert info.error is not None and "nope does not exist" in info.error
