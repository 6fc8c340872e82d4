"""The store's held write connection under a broken driver handle, and its close racing a
write (flowloop/store/immediate.py, flowloop/store/sql.py). On SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.store.sql import SQLStore


class Nothing(BaseModel):
    n: int = 0


def _workflow() -> Workflow:
    workflow = Workflow("store_handles", context=Nothing)
    workflow.wait("w", on={"go": "done"}, initial=True)
    workflow.final("done")
    return workflow


class _Misused:
    """A driver cursor whose handle the driver says was misused, at every call (as a
    connection SQLite answers SQLITE_MISUSE would)."""

    def __init__(self, error: type[Exception]) -> None:
        self.error = error
        self.calls = 0

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        raise self.error("bad parameter or other API misuse")

    def executemany(self, *args: Any, **kwargs: Any) -> Any:
        return self.execute()

    def __iter__(self) -> Iterator[Any]:
        return iter(())


def test_an_interface_error_drops_the_held_write_connection(store_url: str) -> None:
    # Review: an InterfaceError on the hot path (sqlite3's SQLITE_MISUSE: the handle used
    # wrongly) did not drop the held connection, as an OperationalError does: a broken
    # handle failed every later write of the process (is_outage calls it an outage: a
    # worker retried for ever). Dropped, the next write connects again.
    workflow = _workflow()
    with Engine(store_url, workflows=[workflow]) as engine:
        store: Any = engine.store
        first = engine.start(workflow, Nothing()).id
        misused = _Misused(store.engine.dialect.dbapi.InterfaceError)
        with store._lock:
            store._driver_of(store._held_conn())
            store._driver_cursor = misused
        if store._postgres and store._numbered_cursor is None:
            pytest.skip("this driver's hot path keeps no cursor")
        with pytest.raises(sa.exc.InterfaceError):
            engine.start(workflow, Nothing())
        assert misused.calls >= 1
        second = engine.start(workflow, Nothing()).id  # a new handle
        assert [engine.get(i).state for i in (first, second)] == ["w", "w"]


def test_close_disposes_the_engine_with_no_write_between(store_url: str) -> None:
    # Review: close dropped the held connection under the store's lock, then disposed of
    # the engine outside it: a write landing between the two connected a new held
    # connection from the pool being disposed of, left open by the closed store.
    store = SQLStore(store_url)
    store.get_run("none")  # (the schema made, the pool used)
    with store.engine.connect():
        pass
    dispose = store.engine.dispose
    seen: list[bool] = []

    def racing_dispose(*args: Any, **kwargs: Any) -> None:
        owned = bool(store._lock._is_owned())  # type: ignore[attr-defined]
        seen.append(owned)
        if not owned:  # a write of another thread lands here
            writer = threading.Thread(target=lambda: store.request_control("none", "pause"))
            writer.start()
            writer.join(timeout=30)
        dispose(*args, **kwargs)

    store.engine.dispose = racing_dispose  # type: ignore[method-assign]
    store.close()
    assert store._writer is None  # (before: the racing write's connection, left open)
    assert seen == [True]
