"""Persistence: the store interface and its SQLAlchemy implementation.

:class:`SQLStore` is imported on first use (PEP 562): the store contract's types and the
stdlib read path (flowloop/store/lite.py) load without SQLAlchemy (issue 13, cold start)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowloop.store.base import (
    Boundary,
    Fence,
    InboxEvent,
    NewRun,
    RunFilter,
    Store,
    StoredRun,
)

if TYPE_CHECKING:
    from flowloop.store.sql import SQLStore

__all__ = [
    "Boundary",
    "Fence",
    "InboxEvent",
    "NewRun",
    "RunFilter",
    "SQLStore",
    "Store",
    "StoredRun",
]


def __getattr__(name: str) -> Any:
    if name != "SQLStore":
        raise AttributeError(f"module 'flowloop.store' has no attribute {name!r}")
    from flowloop.store.sql import SQLStore

    globals()[name] = SQLStore
    return SQLStore
