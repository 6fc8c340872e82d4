"""Persistence: the store interface and its SQLAlchemy implementation."""

from flowloop.store.base import Boundary, Fence, NewRun, RunFilter, Store, StoredRun
from flowloop.store.sql import SQLStore

__all__ = ["Boundary", "Fence", "NewRun", "RunFilter", "SQLStore", "Store", "StoredRun"]
