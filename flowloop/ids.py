"""Run ids as people type them: any unique prefix of at least :data:`MIN_PREFIX` characters
names a run (like git's short hashes), and the short form shown for a run is one that works.

The lookups go through :meth:`Store.run_ids_with_prefix`, an indexed range query on the
primary key, so resolving a prefix costs one index probe whatever the number of runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from flowloop.errors import FlowloopError, UnknownRun

if TYPE_CHECKING:
    from flowloop.store.base import RunSource

MIN_PREFIX: Final = 4
"""Shortest prefix accepted for a run id (characters)."""
SHORT_ID: Final = 8
"""Shortest form ``flowloop status`` prints on a narrow terminal (longer when needed)."""
MAX_CANDIDATES: Final = 5
"""Candidates named when a prefix is ambiguous."""


class AmbiguousRunId(FlowloopError):
    """A prefix matches several runs; give more characters (the message lists some)."""

    def __init__(self, prefix: str, candidates: Sequence[str], more: bool) -> None:
        listed = ", ".join(candidates) + (", …" if more else "")
        super().__init__(
            f"run id prefix {prefix!r} is ambiguous: it matches {listed}; give more characters"
        )
        self.prefix = prefix
        self.candidates = tuple(candidates)


def prefix_bounds(prefix: str) -> tuple[str, str]:
    """``[low, high)`` such that exactly the strings starting with ``prefix`` lie in it
    (codepoint order, which is what SQLite and a C collation compare by)."""
    return prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)


def resolve(store: RunSource, text: str) -> str:
    """The id of the one run whose id is ``text`` or starts with it.

    Raises UnknownRun (none, or a prefix shorter than :data:`MIN_PREFIX` that is not a
    whole id) and AmbiguousRunId (several)."""
    prefix = text.strip()
    if len(prefix) < MIN_PREFIX:
        raise UnknownRun(text, hint=f"a run id prefix needs at least {MIN_PREFIX} characters")
    found = store.run_ids_with_prefix(prefix, limit=MAX_CANDIDATES + 1)
    if prefix in found:
        return prefix
    if not found:
        raise UnknownRun(text)
    if len(found) > 1:
        raise AmbiguousRunId(text, found[:MAX_CANDIDATES], more=len(found) > MAX_CANDIDATES)
    return found[0]


def short_id(store: RunSource, run_id: str, *, minimum: int = SHORT_ID) -> str:
    """The shortest prefix of ``run_id`` (at least ``minimum`` characters) that names no
    other run in ``store`` now, or the whole id."""
    length = max(minimum, MIN_PREFIX)
    while length < len(run_id):
        if store.run_ids_with_prefix(run_id[:length], limit=2) == [run_id]:
            return run_id[:length]
        length += 2
    return run_id
