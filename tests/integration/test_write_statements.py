"""The store's write statements are built once per dialect and process and shared by
every store on that dialect (flowloop/store/sql.py, SQLStore._prepare_statements): a
process that opens many stores builds them once, and each store keeps its own per-run
state."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from storekit import new_run, start_step

from flowloop.store import RunFilter, SQLStore, StoredRun, sql

THREADS = 8
BUILT = ("_append_stmt", "_row_stmt", "_raw_batch", "_insert_run", "_insert_events")


def test_write_statements__a_second_store_takes_what_the_first_built(store_url: str) -> None:
    first = SQLStore(store_url)
    second = SQLStore(store_url, create=False)
    try:
        for name in BUILT:
            assert getattr(second, name) is getattr(first, name), name
        assert second._contexts is not first._contexts  # per-run state stays the store's
        assert second._pg_cache is not first._pg_cache
        stored, created = second.create_run(new_run(key="k-1"))
        assert created and first.get_run(stored.id) is not None
    finally:
        second.close()
        first.close()


def test_write_statements__shared_statements_write_each_stores_own_runs(store_url: str) -> None:
    first, second = SQLStore(store_url), SQLStore(store_url)
    try:
        for store, worker in ((first, "w-1"), (second, "w-2")):
            run, _ = store.create_run(new_run(key=worker))
            [claimed] = store.claim(
                worker=worker, now=time.time(), limit=1, lease_seconds=30, run_ids=[run.id]
            )
            # Another store writing without the lease: refused, shared statements or not.
            stranger = second if store is first else first
            assert stranger.write([start_step(claimed, "someone-else")]) == [False]
            assert store.write([start_step(claimed, worker)]) == [True]
            kinds = [e.kind for e in store.journal(run.id)]
            assert kinds[-1] == "step_started", kinds
    finally:
        first.close()
        second.close()


def test_write_statements__stores_opened_at_once_by_threads_all_write(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores opened by many threads at once in a process that has built nothing yet (a
    threaded app): one build, every store complete."""
    setup = SQLStore(sqlite_url)
    runs = [setup.create_run(new_run(key=f"k-{i}"))[0] for i in range(THREADS)]
    claimed = setup.claim(
        worker="w", now=time.time(), limit=THREADS, lease_seconds=30, run_ids=[r.id for r in runs]
    )
    setup.close()
    monkeypatch.setattr(sql, "_PREPARED", {})  # nothing built yet: the build takes a while
    barrier = threading.Barrier(THREADS)

    def open_and_write(run: StoredRun) -> bool:
        barrier.wait(timeout=10)
        store = SQLStore(sqlite_url)
        try:
            return store.write([start_step(run, "w")]) == [True]
        finally:
            store.close()

    with ThreadPoolExecutor(THREADS) as pool:
        assert list(pool.map(open_and_write, claimed)) == [True] * THREADS
    assert len(sql._PREPARED) == 1


def test_write_statements__a_store_for_reads_only_builds_none(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the reading commands' Reader opens: every read works, nothing is built."""
    writer = SQLStore(store_url)
    try:
        stored, _ = writer.create_run(new_run(key="k-1"))
    finally:
        writer.close()
    monkeypatch.setattr(sql, "_PREPARED", {})
    reader = SQLStore(store_url, create=False, reads_only=True)
    try:
        assert reader.get_run(stored.id) is not None
        assert [r.id for r in reader.find_runs(RunFilter(limit=10))] == [stored.id]
        assert [e.kind for e in reader.journal(stored.id)] == ["run_created"]
        assert not [name for name in BUILT if hasattr(reader, name)]
        assert sql._PREPARED == {}
    finally:
        reader.close()
