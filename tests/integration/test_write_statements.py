"""The store's write statements are built on its first write and shared by every store on
the same dialect (flowloop/store/sql.py, SQLStore._prepare_statements): a store that only
reads (`flowloop status`) never builds them, a process that opens many stores builds them
once, and each store keeps its own per-run state."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from storekit import new_run, start_step

from flowloop.store import SQLStore, StoredRun, sql

THREADS = 8
BUILT_BY_WRITING = ("_append_stmt", "_row_stmt", "_raw_batch", "_insert_run", "_insert_events")


def test_write_statements__a_store_that_only_reads_builds_none(store_url: str) -> None:
    writer = SQLStore(store_url)
    reader = SQLStore(store_url, create=False)
    try:
        stored, _ = writer.create_run(new_run(key="k-1"))
        assert reader.get_run(stored.id) is not None
        assert [e.kind for e in reader.journal(stored.id)] == ["run_created"]
        assert not [name for name in BUILT_BY_WRITING if name in vars(reader)]
        # Its first write builds nothing new: it takes what the writer's first write built.
        again, created = reader.create_run(new_run(key="k-2"))
        assert created and reader.get_run(again.id) is not None
        for name in BUILT_BY_WRITING:
            assert getattr(reader, name) is getattr(writer, name), name
        assert reader._contexts is not writer._contexts  # per-run state stays the store's
        assert reader._pg_cache is not writer._pg_cache
    finally:
        reader.close()
        writer.close()


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


def test_write_statements__a_missing_attribute_is_still_an_attribute_error(
    sqlite_url: str,
) -> None:
    store = SQLStore(sqlite_url)
    try:
        with pytest.raises(AttributeError, match="has no attribute 'no_such_thing'"):
            store.no_such_thing  # type: ignore[attr-defined]  # noqa: B018
        assert not hasattr(store, "no_such_thing")
        assert store._raw_batch is not None  # the lookup built the statements once
    finally:
        store.close()


def test_write_statements__threads_that_write_first_at_once_all_write(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first writes of a new store from many threads at once (a threaded app, the
    dashboard's actions): each waits for the one build, none sees a half-built store."""
    monkeypatch.setattr(sql, "_PREPARED", {})  # nothing built yet: the build takes a while
    setup = SQLStore(sqlite_url)
    runs = [setup.create_run(new_run(key=f"k-{i}"))[0] for i in range(THREADS)]
    claimed = setup.claim(
        worker="w", now=time.time(), limit=THREADS, lease_seconds=30, run_ids=[r.id for r in runs]
    )
    setup.close()
    monkeypatch.setattr(sql, "_PREPARED", {})
    store = SQLStore(sqlite_url)
    barrier = threading.Barrier(THREADS)

    def first_write(run: StoredRun) -> bool:
        barrier.wait(timeout=10)
        return store.write([start_step(run, "w")]) == [True]

    try:
        with ThreadPoolExecutor(THREADS) as pool:
            assert list(pool.map(first_write, claimed)) == [True] * THREADS
    finally:
        store.close()
