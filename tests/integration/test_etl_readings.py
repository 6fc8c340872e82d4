"""workflows/etl_readings.py on its sample data: a sniffed ';' dialect, BOM and CRLF,
"NA" as NULL, a header in other words, no natural key (rows keyed by file and line)."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import ModuleType

import etlkit
import pytest
import sqlalchemy as sa

from flowloop import Engine
from flowloop.loader import import_file


@pytest.fixture(scope="module")
def readings() -> ModuleType:
    return import_file(etlkit.READINGS_FILE)


def rows(url: str, table: str) -> list[tuple[object, ...]]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY 1, 2"))]
    finally:
        engine.dispose()


def test_etl_readings__sample__na_as_null_rejects_and_rows_keyed_by_position(
    readings: ModuleType, tmp_path: Path, sqlite_url: str
) -> None:
    sample = tmp_path / "sensors"
    shutil.copytree(etlkit.SAMPLE_DIR / "sensors", sample)
    with Engine(sqlite_url) as engine:
        info = engine.run(readings.readings, {"input_dir": str(sample)})
        again = engine.run(readings.readings, {"input_dir": str(sample)})
    assert info.status == "succeeded", info.error
    ctx = info.context
    assert ctx.target == f"sqlite:///{sample / 'readings_target.db'}"
    assert ctx.loaded == ["readings_2024-03-01.csv", "readings_2024-03-02.csv"]
    assert (ctx.rows_done, ctx.rows_loaded, ctx.rejects) == (14, 11, 3)
    assert (again.context.skipped, again.context.rows_done) == (2, 0)
    got = {(r[6], r[7]): r[:6] for r in rows(ctx.target, "readings")}
    assert len(got) == 11
    assert got[("readings_2024-03-01.csv", 4)][2:6] == (
        None,
        None,
        None,
        "sensor restarted; values lost",
    )
    assert got[("readings_2024-03-01.csv", 8)][5] == "frost on the mast\r\n(checked at 07:00)"
    # The same record twice in a file is two rows: there is no natural key to merge them.
    assert got[("readings_2024-03-01.csv", 11)] == got[("readings_2024-03-01.csv", 12)]
    assert got[("readings_2024-03-02.csv", 4)][2:5] == (None, 70.0, 5.5)  # BOM, other header
    reasons = {(r[0], r[1]): r[2] for r in rows(ctx.target, "rejects")}
    assert reasons == {
        ("readings_2024-03-01.csv", 7): "temperature_c: Input should be a valid number, "
        "unable to parse string as a number (got 'hot')",
        ("readings_2024-03-01.csv", 10): "humidity_pct: Input should be less than or equal to "
        "100 (got '140')",
        ("readings_2024-03-02.csv", 5): "station: not a station id like BER-01 (got 'XX')",
    }
