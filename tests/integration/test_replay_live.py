"""`flowloop replay` of a run a worker moves on meanwhile (SQLite and PostgreSQL).

Replay reads the run's row, then its journal: two reads. A worker's boundary committed
between them made the fold one boundary ahead of the row, and replay said the journal
differed from the stored row (exit 1, "last_seq: journal says 5, row says 3") about a
healthy running run.
"""

from __future__ import annotations

import json
import time
from typing import Any

from storekit import new_run, start_step, succeed_and_start

from flowloop.journal import JournalEvent
from flowloop.reading import Reader
from flowloop.store import Boundary, SQLStore


class WorkerBetweenReads:
    """``store``, where a worker writes ``boundary`` just before the first journal read."""

    def __init__(self, store: SQLStore, boundary: Boundary) -> None:
        self._store = store
        self._boundary: Boundary | None = boundary

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def journal(self, run_id: str, **kwargs: Any) -> list[JournalEvent]:
        if self._boundary is not None:
            assert self._store.write([self._boundary]) == [True]
            self._boundary = None
        return self._store.journal(run_id, **kwargs)


def test_replay_of_a_run_that_moves_on_between_its_reads(store: SQLStore) -> None:
    created, _ = store.create_run(new_run())
    [claimed] = store.claim(
        worker="a", now=time.time(), limit=1, lease_seconds=60, run_ids=[created.id]
    )
    started = start_step(claimed, "a")
    assert store.write([started]) == [True]
    step = succeed_and_start(started.record, started.fence, json.dumps({"n": 1}))
    reader: Any = WorkerBetweenReads(store, step)
    replay = Reader(reader).replay(created.id)
    assert replay.differences == []
    assert replay.record.last_seq == step.record.last_seq
    assert replay.record.context == json.dumps({"n": 1})
