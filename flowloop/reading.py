"""Reading runs from a store: one run by its id or a unique prefix, listings, journals and
replays, as :class:`~flowloop.runinfo.RunInfo` and friends.

:class:`~flowloop.engine.Engine` reads through :class:`RunReading` (its registered
definitions load each run's context as their model). :class:`Reader` is the same reads on
a store alone: what ``flowloop status``, ``history`` and ``replay`` open, so a command that
only reads imports neither the executor nor pydantic (issue 13, cold start)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final

from flowloop import ids
from flowloop import journal as j
from flowloop.errors import FlowloopError, UnknownRun
from flowloop.limits import check_key
from flowloop.runinfo import Replay, RunInfo, run_info
from flowloop.store.base import RunFilter, RunSource, StoredRun

if TYPE_CHECKING:
    from pydantic import BaseModel

    from flowloop.definition import Workflow
    from flowloop.journal import JournalEvent, RunRecord


REREADS: Final = 5
"""How many times :meth:`RunReading.replay` reads a run again that moved on between its
row's read and its journal's (a busy run; past that, what was read is compared)."""


class RunReading:
    """The reads, over ``self.store``; a run's context is loaded by
    :meth:`_workflow_for` (here: none, the stored JSON as a dict)."""

    store: RunSource

    @property
    def workflows(self) -> Mapping[str, Workflow]:
        """The newest registered version of each workflow, by name (here: none)."""
        return {}

    def _workflow_for(self, record: RunRecord) -> Workflow | None:
        return None

    def _stored(self, run_id: str) -> StoredRun:
        """The run ``run_id`` names: its whole id or a unique prefix (see flowloop.ids)."""
        if not isinstance(run_id, str):  # (None failed deep in the store: "no attribute")
            raise TypeError(f"a run id is a string (RunInfo.id), not {run_id!r}")
        stored = self.store.get_run(run_id)
        if stored is None:
            stored = self.store.get_run(ids.resolve(self.store, run_id))
        if stored is None:
            raise UnknownRun(run_id)
        return stored

    def resolve(self, run_id: str) -> str:
        """The whole id of the run that ``run_id`` (an id or a unique prefix of at least
        four characters) names. Raises UnknownRun, AmbiguousRunId."""
        return self._stored(run_id).id

    def _info(self, stored: StoredRun, parsed: tuple[str, BaseModel] | None = None) -> RunInfo:
        return run_info(stored, self._workflow_for(stored.record), parsed)

    def get(self, run_id: str) -> RunInfo:
        return self._info(self._stored(run_id))

    def runs(
        self,
        *,
        workflow: str | None = None,
        status: str | Sequence[str] | None = None,
        key: str | None = None,
        limit: int = 100,
        after: str | None = None,
    ) -> list[RunInfo]:
        """Runs, newest first; ``after`` (a run id or prefix): the ones listed after it."""
        statuses = [status] if isinstance(status, str) else status
        if limit < 0:
            raise FlowloopError(f"limit {limit} is negative: give 0 or more")
        check_key("key", key)
        start = None
        if after is not None:
            stored = self._stored(after)
            start = (stored.created_at, stored.id)
        found = self.store.find_runs(
            RunFilter(workflow=workflow, statuses=statuses, key=key, limit=limit, after=start)
        )
        return [self._info(stored) for stored in found]

    def find(self, workflow: Workflow | str, *, key: str) -> RunInfo | None:
        """The newest run of ``workflow`` with business key ``key``."""
        name = workflow if isinstance(workflow, str) else workflow.name
        found = self.runs(workflow=name, key=key, limit=1)
        return found[0] if found else None

    def history(self, run_id: str) -> list[JournalEvent]:
        return self.store.journal(self._stored(run_id).id)

    def replay(self, run_id: str, *, at: int | None = None) -> Replay:
        """Fold the journal; the record at ``at`` (default: the end) and the differences
        between the full fold and the stored row (none, unless something is wrong)."""
        stored = self._stored(run_id)
        run_id = stored.id
        events = self.store.journal(run_id)
        full = j.fold(events)
        for _ in range(REREADS):
            if full.last_seq <= stored.record.last_seq:
                break
            # A worker moved the run on between the two reads (each its own transaction):
            # the row again, and the journal again, up to it — not a difference to report.
            stored = self._stored(run_id)
            events = self.store.journal(run_id)
            full = j.fold(events)
        if at is not None and not 1 <= at <= len(events):
            # (Said for the Python API and the CLI's --at alike.)
            raise FlowloopError(f"run {run_id} has seq 1..{len(events)}; seq {at} is outside")
        differences = j.compare(full, stored.record)
        record = full if at is None else j.fold(events, until_seq=at)
        return Replay(
            run_id=run_id,
            seq=record.last_seq,
            record=record,
            events=events,
            differences=differences,
        )


class Reader(RunReading):
    """The reads on ``store`` alone (closed with it): a store, or the stdlib reader of a
    SQLite file (flowloop/store/lite.py) that the reading commands open."""

    def __init__(self, store: RunSource) -> None:
        self.store = store

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.store.close()
