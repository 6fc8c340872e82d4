"""Persistence: the store interface and its SQLAlchemy implementation."""

from flowloop.store.base import (
    Boundary,
    Fence,
    InboxEvent,
    NewRun,
    RunFilter,
    Store,
    StoredRun,
)
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
