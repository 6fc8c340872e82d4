"""workflows/etl_readings.py (semicolon CSV with "NA", BOM, CRLF, quoted notes over two
lines, no natural key) killed with SIGKILL at random batches, resumed each time, ends with
exactly the target an uninterrupted load gives: the source-position key duplicates nothing.

Set ``ETL_CRASH_SEED`` to replay a failing sequence of kills (the seed is in the messages).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import crashkit
import etlkit
import pytest
import sqlalchemy as sa

from flowloop import Engine
from flowloop.loader import import_file

pytestmark = pytest.mark.crash

FILES = 2
ROWS = 4_000  # per file
BATCH = 100
KILLS = 9


def generate(folder: Path, seed: int) -> None:
    """Readings files: ~2 % NA values, a bad row in ~60, a quoted two-line note in ~50."""
    rand = random.Random(seed)
    folder.mkdir(parents=True)
    for f in range(1, FILES + 1):
        lines = ["Station;Measured at;Temperature (C);Humidity pct;Wind kmh;Note"]
        for n in range(ROWS):
            values = [f"{rand.uniform(-20, 35):.1f}", str(rand.randint(10, 100)), "4.5"]
            values = ["NA" if rand.random() < 0.02 else v for v in values]
            if n % 61 == 7:
                values[1] = "140"  # humidity out of range: a reject
            note = '"checked;\r\nby hand"' if n % 53 == 3 else ""
            station = ("BER-01", "HAM-02", "MUC-03")[n % 3]
            lines.append(f"{station};2024-03-0{f}T{n % 24:02d}:00:00Z;{';'.join(values)};{note}")
        data = ("\r\n".join(lines) + "\r\n").encode()
        (folder / f"readings_{f:02d}.csv").write_bytes(b"\xef\xbb\xbf" + data)


def dump(url: str) -> dict[str, list[tuple[Any, ...]]]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    queries = {
        "readings": "SELECT * FROM readings ORDER BY source_file, source_row",
        "rejects": "SELECT file, row_no, reason, raw FROM rejects ORDER BY file, row_no",
        "loaded_files": "SELECT file, sha256, status, rows_loaded, rows_rejected "
        "FROM loaded_files ORDER BY file",
    }
    try:
        with engine.connect() as conn:
            return {k: [tuple(r) for r in conn.execute(sa.text(q))] for k, q in queries.items()}
    finally:
        engine.dispose()


def test_etl_readings__killed_at_random_batches_resumes_to_the_same_target(
    tmp_path: Path,
) -> None:
    seed = crashkit.seed("ETL_CRASH_SEED")
    rand = random.Random(seed)
    inbox = tmp_path / "inbox"
    generate(inbox, seed)
    module = import_file(etlkit.READINGS_FILE)
    db = tmp_path / "flowloop.db"
    target = etlkit.sqlite_target(tmp_path, "target.db")
    context = {"input_dir": str(inbox), "target_url": target, "batch_size": BATCH}
    with Engine(f"sqlite:///{db}") as engine:
        run_id = engine.start(module.readings, context).id

    batches = FILES * ROWS // BATCH
    modes = [etlkit.MODES[i % len(etlkit.MODES)] for i in range(KILLS)]
    rand.shuffle(modes)
    where = f"(seed {seed}; modes {modes})"
    zygote = etlkit.zygote(etlkit.READINGS_FILE, "readings")
    with zygote, crashkit.replayable(seed, "ETL_CRASH_SEED"):
        kills = etlkit.kill_at_batches(
            zygote,
            db,
            run_id,
            modes,
            batch_after=lambda committed: committed + rand.randint(2, 6),
            last=batches - 5,
        )
        assert zygote.exit_code(zygote.fork(db=str(db))) == 0, where  # the last resume
    assert kills == KILLS, where

    info, events = etlkit.finished(db, module.readings, run_id)
    assert info.status == "succeeded", f"{info.status}: {info.error} {where}"

    reference_url = etlkit.sqlite_target(tmp_path, "reference.db")
    reference = module.run_plain({**context, "target_url": reference_url})
    got, want = dump(target), dump(reference_url)
    assert len(got["readings"]) == reference.rows_loaded  # one row per valid record, no more
    assert got == want, where
    assert len(want["rejects"]) >= 100  # the files really had bad rows
    assert sum(row[2] is None for row in want["readings"]) > 50  # and NA became NULL
    assert any(row[5] == "checked;\r\nby hand" for row in want["readings"])

    done = [e for e in events if e.kind == "step_succeeded" and e.state == "load_batch"]
    interrupted = [e for e in events if e.kind == "step_interrupted"]
    assert len(interrupted) == kills, where
    contexts = [json.loads(e.context or "{}") for e in done]
    assert contexts[-1]["batches_done"] == reference.batches_done == len(done), where
    for before, after in itertools.pairwise(contexts):  # one unbroken chain per file
        if after["file"] == before["file"]:
            assert after["batch_from"] == before["offset"], where
