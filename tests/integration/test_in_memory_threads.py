"""An in-memory SQLite store has one connection, the held writer's: the lease renewer's
thread writes on it (under the store's lock) while the loop reads on it. A read must not
land inside a renewal's transaction (or a renewal inside the read's): both threads would
use one connection at once — before the fix the read failed with "cannot start a
transaction within a transaction"."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.store import leases
from flowloop.store.sql import SQLStore

BOUND_S = 10.0
"""A safety net only: each wait below is ended by the other thread."""


class Ctx(BaseModel):
    n: int = 0


def _workflow() -> Workflow:
    wf = Workflow("in_memory_threads", context=Ctx)

    @wf.step(initial=True, next="done")
    async def first(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


class _Contended:
    """The store's lock, telling ``contended`` when a thread waits for it."""

    def __init__(self, lock: Any, contended: threading.Event) -> None:
        self._inner = lock
        self._contended = contended

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._inner.acquire(blocking=False):
            return True
        self._contended.set()
        return bool(self._inner.acquire(blocking, timeout))

    def release(self) -> None:
        self._inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *_: object) -> None:
        self.release()


def test_a_read_waits_for_a_renewal_on_the_one_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The renewer's thread is held inside its renewal's transaction (the store's lock
    held) until the loop's read either waits for that lock or is done: the read then sees
    the run, and the renewal commits."""
    wf = _workflow()
    with Engine("sqlite://", workflows=[wf], lease_seconds=30) as engine:
        store = engine.store
        assert isinstance(store, SQLStore)
        info = engine.start(wf, Ctx())
        assert info.next_run_at is not None
        claimed = store.claim(worker="w1", now=info.next_run_at + 1, limit=1, lease_seconds=30)
        assert [c.id for c in claimed] == [info.id]

        inside, released = threading.Event(), threading.Event()
        monkeypatch.setattr(store, "_lock", _Contended(store._lock, released))
        real_renew = leases.renew

        def held_renew(conn: Any, *args: Any, **kwargs: Any) -> set[str]:
            kept = real_renew(conn, *args, **kwargs)
            inside.set()
            released.wait(BOUND_S)  # in the renewal's transaction, the lock held
            return kept

        monkeypatch.setattr(leases, "renew", held_renew)
        outcome: dict[str, Any] = {}

        def renew(run_ids: Sequence[str]) -> None:
            try:
                outcome["renewed"] = store.renew(worker="w1", run_ids=run_ids, lease_seconds=30)
            except Exception as error:  # told by the assertion below
                outcome["renew_error"] = error

        renewer = threading.Thread(target=renew, args=([info.id],), daemon=True)
        renewer.start()
        assert inside.wait(BOUND_S)
        try:
            stored = store.get_run(info.id)  # the loop's read
        finally:
            released.set()
            renewer.join(BOUND_S)
        assert stored is not None and stored.owner == "w1"
        assert outcome == {"renewed": {info.id}}
