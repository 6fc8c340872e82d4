"""The ETL workflow killed with SIGKILL at random batches, resumed each time, ends with
exactly the target an uninterrupted load gives, and each resume continues from the last
committed batch instead of the start of the file.

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

from flowloop import Engine
from flowloop.journal import JournalEvent

pytestmark = pytest.mark.crash

ROWS = 32_000
BATCH = 250
BATCHES = ROWS // BATCH
KILLS = 24


def _context(event: JournalEvent) -> dict[str, Any]:
    assert event.context is not None
    return dict(json.loads(event.context))


def test_etl__killed_at_random_batches_resumes_to_the_same_target(tmp_path: Path) -> None:
    seed = crashkit.seed("ETL_CRASH_SEED")
    rand = random.Random(seed)
    inbox = tmp_path / "inbox"
    etlkit.load_generator().generate(inbox, ROWS, seed=seed % 1000, bad_every=150)
    etl_module = etlkit.load_etl()
    db = tmp_path / "flowloop.db"
    target = etlkit.sqlite_target(tmp_path, "target.db")
    context = {"input_dir": str(inbox), "target_url": target, "batch_size": BATCH}
    with Engine(f"sqlite:///{db}") as engine:
        run_id = engine.start(etl_module.etl, context).id

    # Kill positions: increasing batch counts, at least 2 past the committed one, so every
    # worker commits a batch of its own before it dies (an interrupted step counts against
    # its retry budget). A kill from outside may land a little late: the next position then
    # moves up. The file has BATCHES batches; the last kill leaves a good margin. Modes:
    # "run" is killed by the test once its batch count reaches the position, the others
    # kill themselves at a precise point of the batch (see etlkit).
    positions, at = [], 1
    for _ in range(KILLS):
        at += rand.randint(2, 4)
        positions.append(at)
    modes = [etlkit.MODES[i % len(etlkit.MODES)] for i in range(KILLS)]
    rand.shuffle(modes)
    where = f"(seed {seed}; positions {positions}; modes {modes})"
    planned = iter(positions)

    with etlkit.zygote() as zygote, crashkit.replayable(seed, "ETL_CRASH_SEED"):
        kills = etlkit.kill_at_batches(
            zygote,
            db,
            run_id,
            modes,
            batch_after=lambda committed: max(next(planned), committed + 2),
            last=BATCHES - 5,
        )
    assert kills >= 20, where

    # The last resume goes through the CLI, as an operator would.
    done = etlkit.cli(["resume", "-w", str(etlkit.ETL_FILE), "--db", str(db)])
    assert done.returncode == 0, done.stdout + done.stderr

    info, events = etlkit.finished(db, etl_module.etl, run_id)
    assert info.status == "succeeded", f"{info.status}: {info.error} {where}"

    reference_url = etlkit.sqlite_target(tmp_path, "reference.db")
    reference = etl_module.run_plain({**context, "target_url": reference_url})
    got, want = etlkit.dump(target), etlkit.dump(reference_url)
    assert len(got["orders"]) == reference.rows_loaded  # one row per order id, no more
    assert got["orders"] == want["orders"], where
    assert got["rejects"] == want["rejects"], where
    assert got["loaded_files"] == want["loaded_files"], where
    assert len(want["rejects"]) > 100  # the file really had bad rows

    # The journal: batches form one chain of byte ranges, each starting where the committed
    # one before it ended; no file was read again from its start after a kill.
    batches = [e for e in events if e.kind == "step_succeeded" and e.state == "load_batch"]
    interrupted = [e for e in events if e.kind == "step_interrupted"]
    assert len(interrupted) == kills, where
    assert all(e.state == "load_batch" for e in interrupted), where
    final = _context(batches[-1])
    assert final["batches_done"] == reference.batches_done == len(batches), where
    first = _context(batches[0])
    assert first["batch_from"] == first["file_start"]
    for before, after in itertools.pairwise(batches):
        assert _context(after)["batch_from"] == _context(before)["offset"], where
    by_seq = {e.seq: e for e in events}
    resumed_from: list[int] = []
    for event in interrupted:
        committed = next(
            _context(by_seq[s])
            for s in range(event.seq - 1, 0, -1)
            if by_seq[s].kind == "step_succeeded"
        )
        redo = next(e for e in batches if e.seq > event.seq)
        assert _context(redo)["batch_from"] == committed["offset"], where
        resumed_from.append(committed["offset"])
    assert min(resumed_from) > first["file_start"], f"a resume restarted the file {where}"
    started = [e for e in events if e.kind == "step_started" and e.state == "load_batch"]
    assert len(started) == len(batches) + kills, where
