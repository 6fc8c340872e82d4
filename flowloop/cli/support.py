"""What several `flowloop` commands share beyond flowloop/cli/common.py (loaded when a
command runs, so it may import SQLAlchemy): refusing a database that does not exist for
commands that only read, timestamps in JSON output, how a waiting run is shown, and telling
a user that the business key they passed already has a run."""

from __future__ import annotations

import contextlib
import difflib
import json
import sqlite3
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from flowloop.errors import FlowloopError, MissingDatabase, WrongDatabase
from flowloop.journal import ASLEEP
from flowloop.store.base import VERSION_TABLE
from flowloop.store.entries import stored_waits
from flowloop.store.urls import normalize_url

if TYPE_CHECKING:
    from flowloop.definition import Workflow
    from flowloop.dues import Due
    from flowloop.engine import Engine
    from flowloop.reading import RunReading
    from flowloop.runinfo import RunInfo
    from flowloop.store.sql import SQLStore

DATABASE_SUFFIXES: Final = (".db", ".sqlite", ".sqlite3")
CLOSE_NAMES: Final = 3
DEFAULT_WHERE: Final = " -w FILE_OR_DIR"
"""The ``-w``/``--db`` of a command named to continue a run, when the caller knows none."""
WAITING: Final = "waiting"
"""The status shown (never stored) for a run that rests in a wait state."""
HELD: Final = "held"
"""The status shown for a map's child held back: flowloop.lifecycle.HELD, its ``join_state``
(its stored status stays scheduled; not imported: that module needs `transitions`)."""


# -- databases that must exist ------------------------------------------------------------


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (``None``: not SQLite, or in memory)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(normalize_url(url))
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    if database.startswith("file:"):
        return None
    return Path(database)


def close_names(path: Path) -> list[str]:
    """Files in ``path``'s folder whose names are close to its name (databases first)."""
    folder = path.parent if str(path.parent) else Path(".")
    try:
        names = [p.name for p in folder.iterdir() if p.is_file()]
    except OSError:
        return []
    names = [n for n in names if not n.endswith(("-wal", "-shm", "-journal"))]
    databases = [n for n in names if n.endswith(DATABASE_SUFFIXES)]
    found = difflib.get_close_matches(path.name, databases, n=CLOSE_NAMES, cutoff=0.5)
    if not found:
        found = difflib.get_close_matches(path.name, names, n=CLOSE_NAMES, cutoff=0.6)
    return [str(folder / name) if str(path.parent) not in ("", ".") else name for name in found]


def require_database(url: str) -> None:
    """Refuse (MissingDatabase, exit 2) a SQLite file that does not exist: a command that
    only reads must not create an empty database because of a typo in ``--db``. An
    existing file without flowloop's schema is refused too (WrongDatabase or
    MissingDatabase), read-only."""
    path = sqlite_path(url)
    if path is None:
        return
    if path.exists():
        _refuse_foreign_sqlite(path)
        return
    guesses = close_names(path)
    hint = (
        f"did you mean {' or '.join(guesses)}?"
        if guesses
        else "commands that write (run, start, worker, db upgrade) create it"
    )
    raise MissingDatabase(f"no database at {path}; {hint}")


def _refuse_foreign_sqlite(path: Path) -> None:
    """Refuse a SQLite file without flowloop's schema by reading it read-only: opening it
    as a store would switch it to WAL mode first, changing a file that is not ours."""
    if not path.is_file():
        return  # a directory: the store says so
    uri = f"{path.resolve().as_uri()}?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as conn:
            rows = conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            tables = {str(row[0]) for row in rows}
    except sqlite3.DatabaseError:
        return  # not SQLite at all: the store's own check names it
    if VERSION_TABLE in tables:
        return
    if tables:
        foreign = sorted(t for t in tables if not t.startswith("flowloop_"))
        shown = ", ".join((foreign or sorted(tables))[:5])
        raise WrongDatabase(
            f"{path} is not a flowloop database (it has tables {shown}); "
            "point --db at a flowloop database"
        )
    raise MissingDatabase(
        f"{path} has no flowloop schema yet (a command that writes, or "
        "`flowloop db upgrade`, creates it)"
    )


def read_store(url: str, synchronous: str, *, reads_only: bool = False) -> SQLStore:
    """A store for a command that only reads: the database must exist and have flowloop's
    schema (on PostgreSQL: an empty schema is refused, not created). ``reads_only``: for a
    Reader, which never writes: the store's write statements are not built."""
    from flowloop.store.sql import SQLStore

    require_database(url)
    return SQLStore(
        normalize_url(url), synchronous=synchronous, create=False, reads_only=reads_only
    )


# -- JSON ---------------------------------------------------------------------------------


def iso8601(ts: float | None) -> str | None:
    """Epoch seconds as ISO-8601 UTC (``2026-12-01T09:16:08.974123+00:00``), or None."""
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def with_times(data: Mapping[str, Any], *keys: str) -> dict[str, Any]:
    """``data`` with each time in ``keys`` as ISO-8601 and the epoch kept as ``KEY_epoch``."""
    out = dict(data)
    for key in keys:
        if key in out:
            value = out[key]
            out[key] = iso8601(value)
            out[f"{key}_epoch"] = value
    return out


def dumps(value: Any) -> str:
    """One line of JSON (what ``--json`` prints)."""
    return json.dumps(value)


# -- waiting runs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Waiting:
    """A run resting in a wait state: the events that move it on and its timeout."""

    state: str
    events: tuple[str, ...]
    until: float | None

    def describe(self) -> str:
        from flowloop.clock import iso

        until = f" until {iso(self.until)}" if self.until is not None else ""
        return f"waiting in {self.state} for {' or '.join(self.events) or 'an event'}{until}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "events": list(self.events),
            "until": iso8601(self.until),
            "until_epoch": self.until,
        }


class WaitStates:
    """Which runs wait, judged by each run's own definition (the registered workflow, else
    the structure stored when the run started), read once per definition."""

    def __init__(self, engine: RunReading) -> None:
        self.engine = engine
        self._waits: dict[str, dict[str, tuple[str, ...]]] = {}

    def _of(self, info: RunInfo) -> dict[str, tuple[str, ...]]:
        fingerprint = info.fingerprint
        if fingerprint not in self._waits:
            workflow: Workflow | None = self.engine.workflows.get(info.workflow)
            waits: dict[str, tuple[str, ...]] = {}
            if workflow is not None and workflow.fingerprint == fingerprint:
                waits = {name: tuple(spec.on) for name, spec in workflow.waits.items()}
            else:
                waits = stored_waits(self.engine.store.definition(fingerprint))
            self._waits[fingerprint] = waits
        return self._waits[fingerprint]

    def of(self, info: RunInfo) -> Waiting | None:
        """How ``info`` waits, or None when it does not (only a ``scheduled`` run waits;
        a paused one is shown paused, one asleep before its wait state scheduled)."""
        if info.status != "scheduled" or info.reason == ASLEEP:
            return None
        events = self._of(info).get(info.state)
        if events is None:
            return None
        return Waiting(info.state, events, info.next_run_at)

    def status(self, info: RunInfo) -> str:
        """The status to show: ``waiting`` for a waiting run, else the stored one."""
        return WAITING if self.of(info) is not None else info.status


def run_due(reader: RunReading, info: RunInfo) -> Due | None:
    """When ``info``'s run is due next and whether its deadline comes first (its journal
    read: flowloop/dues.py); ``None`` for a run not due (not scheduled or retrying)."""
    from flowloop import dues

    if info.status not in ("scheduled", "retrying") or info.next_run_at is None:
        return None
    return dues.due(
        status=info.status,
        state=info.state,
        next_run_at=info.next_run_at,
        events=reader.store.journal(info.id),
        structure=lambda: reader.store.definition(info.fingerprint),
    )


def own_time(info: RunInfo, due: Due | None) -> float | None:
    """What the run itself waits for (a sleep's end, a retry's attempt): its own due time
    (``due``: :func:`run_due`), not its deadline's (its ``next_run_at`` may be that)."""
    return due.own_at if due is not None else info.next_run_at


def deadline_first(due: Due | None) -> str:
    """``; its deadline passes first, at …: moves to STATE`` when ``due``'s deadline comes
    before what the run waits for, else nothing."""
    from flowloop.clock import iso

    if due is None or not due.deadline_first:
        return ""
    return "; " + due.deadline_words(f" first, at {iso(due.at)}")


def goes_on_after(info: RunInfo, due: Due) -> str:
    """``, before it goes on at STATE at …`` for a scheduled run whose deadline comes
    before its own time and whose status line does not say that time (a sleep before its
    state, not journaled ``asleep``: before a compensating state); else nothing."""
    from flowloop.clock import iso

    if info.status != "scheduled" or info.reason == ASLEEP or due.own is None:
        return ""
    return f", before it goes on at {info.state} at {iso(due.own)}"


def asleep_reason(info: RunInfo, due: Due | None) -> str | None:
    """The reason ``flowloop status RUN`` shows for a run asleep (``step.sleep``) before its
    wait or final state: when the sleep ends and the state it enters then (it said only
    "asleep", its state line naming a state it is not in yet); ``None`` for another run.
    The end is the run's own due time (``due``: :func:`run_due`); its next due time may be
    its deadline's, sooner (its "next run" line says so)."""
    from flowloop.clock import iso

    if info.status != "scheduled" or info.reason != ASLEEP:
        return None
    ends = own_time(info, due)
    ends = ends if ends is not None else info.next_run_at  # (a journal unread)
    return f"{ASLEEP} until {iso(ends)}, then enters {info.state}"


def what_continues(info: RunInfo, waiting: Waiting | None, where: str = DEFAULT_WHERE) -> str:
    """After an event: what moves the run on from here, in words; ``where``: the ``-w``
    and ``--db`` of the commands named (flowloop/cli/hints.py)."""
    from flowloop.cli import hints

    if info.finished:
        return ""
    if waiting is not None:
        return f"; {waiting.describe()}"
    if info.status in ("scheduled", "retrying"):
        return f"; {hints.continues(where)} continues it from {info.state}"
    return ""


def not_ended_line(info: RunInfo, due: Due | None = None, where: str = DEFAULT_WHERE) -> str:
    """What a run ``run``/``retry`` handed back unended, outside a wait state, waits for,
    and what continues it (exit 0: it did not fail); ``due``: :func:`run_due` (a retry's
    or a sleep's own time, and whether the run's deadline comes first); ``where``: as
    :func:`what_continues` takes it."""
    from flowloop.clock import iso

    own = own_time(info, due)
    at = iso(own) if own is not None else None
    if info.status == "running":  # another process drives it (found by its key)
        return f"run {info.id} is running in {info.state}, driven by {info.owner or 'a worker'}"
    if info.status == "paused":
        why = f" ({info.reason})" if info.reason else ""
        then = f"`flowloop unpause {info.id}` lets it go on"
        if (info.reason or "").startswith(("definition_mismatch", "context_mismatch")):
            then = f"deploy a definition that can take it (`flowloop check FILE`), then {then}"
        return f"run {info.id} is paused in {info.state}{why}; {then}"
    if info.status == "retrying" and at is not None:
        waits_for = f"retries {info.state} at {at}"
    elif info.reason == ASLEEP and at is not None:  # (step.sleep before a wait/final state)
        waits_for = f"is asleep until {at} before entering {info.state}"
    elif at is not None:
        waits_for = f"sleeps in {info.state} until {at}"
    else:
        waits_for = f"waits in {info.state} for its children"
    return f"run {info.id} {waits_for}" + deadline_first(due) + what_continues(info, None, where)


# -- a business key that has a run already ------------------------------------------------


def start_differences(engine: Engine, workflow: Workflow, given: Any, info: RunInfo) -> list[str]:
    """The fields ``given`` (a parsed context) sets explicitly whose value differs from the
    context ``info``'s run was started with — not its defaults (a default factory's time or
    uuid differs at every parse), nor fields the stored context lacks that the model added
    since (the stored one is loaded as the model reads it now)."""
    from pydantic import BaseModel, RootModel  # (here: reading commands import no pydantic)

    from flowloop.journal import CONTEXT_VERSION

    whole = isinstance(given, RootModel)  # (its one field is the whole context)
    explicit = ["(the whole context)"] if whole else sorted(given.model_fields_set)
    dumped = given.model_dump(mode="json")
    want = {explicit[0]: dumped} if whole else {name: dumped.get(name) for name in explicit}

    def values(context: Any) -> dict[str, Any]:
        data = context.model_dump(mode="json") if isinstance(context, BaseModel) else context
        return {explicit[0]: data} if whole else dict(data)

    if all(values(info.context).get(name) == want[name] for name in explicit):
        return []  # (as it is now: its start need not be read)
    first = engine.store.journal(info.id, until_seq=1)
    text = first[0].context if first and first[0].context else "{}"
    try:
        stored = values(workflow.load_context(text, int(first[0].data.get(CONTEXT_VERSION, 1))))
    except (FlowloopError, IndexError, TypeError, ValueError):
        try:
            stored = values(json.loads(text))
        except (TypeError, ValueError):  # (not an object of fields: nothing is the same)
            return explicit
    return [name for name in explicit if stored.get(name) != want[name]]


def existing_for_key(
    engine: Engine, workflow: Workflow, context: Any, key: str | None
) -> tuple[RunInfo, list[str]] | None:
    """The run that already holds the business key of a run about to be started, with
    the fields given in ``context`` that differ from its starting context (empty: the
    same); None when the key is free (or the workflow has no key)."""
    parsed = workflow.parse_context(context)
    business_key = key if key is not None else workflow.business_key(parsed)
    if business_key is None:
        return None
    found = engine.find(workflow, key=business_key)
    if found is None:
        return None
    return found, start_differences(engine, workflow, parsed, found)


def started_otherwise(
    engine: Engine, workflow: Workflow, contexts: Sequence[Any], runs: Sequence[RunInfo]
) -> list[tuple[int, RunInfo, list[str]]]:
    """For ``start --contexts``: the positions (from 0) of the ``contexts`` whose run — one
    that held their key already, or took an earlier line's — was started with another
    context, that run, and the fields that differ."""
    found = []
    for position, (context, info) in enumerate(zip(contexts, runs, strict=True)):
        differences = start_differences(engine, workflow, workflow.parse_context(context), info)
        if differences:
            found.append((position, info, differences))
    return found


def refuse_or_note_existing(
    engine: Engine, workflow: Workflow, context: Any, key: str | None
) -> str | None:
    """For ``run``/``start``: when the business key has a run already, a line saying so
    (its context is the same: nothing new is started, the caller goes on with that run);
    raise a FlowloopError (exit 2) when that run was started with a different context,
    which would otherwise be ignored without a word. A ``--key`` other than the one the
    workflow takes from the context is refused: it replaced that key without a word, and a
    start without it made a second run of the same order."""
    if key is not None and workflow.key is not None:
        derived = workflow.business_key(workflow.parse_context(context))
        if derived is not None and derived != key:
            raise FlowloopError(
                f"workflow {workflow.name!r} takes its key from the context ({derived!r}); "
                f"--key {key!r} would replace it: drop --key"
            )
    existing = existing_for_key(engine, workflow, context, key)
    if existing is None:
        return None
    info, differences = existing
    where = f"{info.status} at {info.state}"
    if differences:
        raise FlowloopError(
            f"run {info.id} already exists for key {info.key!r} ({where}) with a different "
            f"context (differs in {', '.join(differences)}); nothing started: use another "
            f"key, or see it with `flowloop status {info.id}`"
        )
    return f"run {info.id} already exists for key {info.key!r} ({where}), same context"


def short_ids(engine: RunReading, run_ids: Sequence[str]) -> dict[str, str]:
    """Each id's shortest unique prefix (8 characters or more): what fits a narrow table
    and still works as a run id."""
    from flowloop.ids import short_id

    return {run_id: short_id(engine.store, run_id) for run_id in run_ids}


SHOWN_STATUSES: Final = (
    WAITING,
    HELD,
    "scheduled",
    "running",
    "retrying",
    "paused",
    "succeeded",
    "failed",
    "stopped",
)
"""The statuses `status` shows a run in (``waiting``: scheduled in a wait state;
``held``: a map's child held back by its parent's ``max_parallel``, scheduled too)."""


def held_of(engine: RunReading, infos: Sequence[RunInfo]) -> set[str]:
    """The ids of the ``infos`` shown ``held`` (one read for them all: flowloop/family.py)."""
    from flowloop import family

    return family.held_among(engine.store, [i.id for i in infos if i.status == "scheduled"])


def shown_status(info: RunInfo, waits: WaitStates, held: Collection[str]) -> str:
    """The status to show: ``held`` for a child held back (its turn, not an event, moves
    it on: as the dashboard's run page), else ``waiting`` or the stored one."""
    return HELD if info.id in held else waits.status(info)


def checked_statuses(statuses: Sequence[str]) -> tuple[str, ...]:
    """``--status`` values, any case; one that is no status is refused (a typo listed
    nothing, as if no run had it)."""
    from flowloop.suggest import did_you_mean

    checked = tuple(status.lower() for status in statuses)
    for given, status in zip(statuses, checked, strict=True):
        if status not in SHOWN_STATUSES:
            meant = did_you_mean(status, SHOWN_STATUSES, n=1, shown=repr)
            raise FlowloopError(
                f"--status {given[:40]!r} is not a status{f'; {meant}' if meant else ''} "
                f"(one of {', '.join(SHOWN_STATUSES)})"
            )
    return checked


def list_runs(
    engine: RunReading,
    waits: WaitStates,
    *,
    workflow: str | None,
    statuses: Sequence[str],
    key: str | None,
    limit: int,
    after: str | None,
) -> tuple[list[RunInfo], bool]:
    """Up to ``limit`` runs, newest first, and whether more match. ``statuses`` are the
    statuses shown: ``waiting`` selects scheduled runs in a wait state, ``held`` the
    children held back and ``scheduled`` the others, so the stored status is asked for and
    the answer filtered (page by page)."""
    if not statuses or not {WAITING, HELD, "scheduled"} & set(statuses):
        found = engine.runs(
            workflow=workflow, status=list(statuses) or None, key=key, limit=limit + 1, after=after
        )
        return found[:limit], len(found) > limit
    stored = sorted({"scheduled" if s in (WAITING, HELD) else s for s in statuses})
    wanted = set(statuses)
    page = max(2 * (limit + 1), 200)
    matched: list[RunInfo] = []
    while len(matched) <= limit:
        batch = engine.runs(workflow=workflow, status=stored, key=key, limit=page, after=after)
        held = held_of(engine, batch)
        matched.extend(info for info in batch if shown_status(info, waits, held) in wanted)
        if len(batch) < page:
            break
        after = batch[-1].id
    return matched[:limit], len(matched) > limit


def backpressure_lines(engine: RunReading, workflow: str | None = None) -> list[str]:
    """A line per workflow whose runs have kept events or whose bounds dropped something
    (flowloop/backpressure.py), for ``flowloop status``; nothing otherwise."""
    usage = getattr(engine.store, "backpressure_usage", None)  # SQLStore's, LiteStore's
    if usage is None:
        return []
    lines = []
    for name, use in sorted(usage().items()):
        if workflow is not None and name != workflow:
            continue
        if not (use["kept"] or use["dropped_events"] or use["dropped_runs"]):
            continue
        lines.append(
            f"backpressure {name}: {use['queued']} run(s) waiting to start, {use['kept']} "
            f"kept event(s) (at most {use['kept_max']} on one run); dropped: "
            f"{use['dropped_events']} kept event(s), {use['dropped_runs']} queued run(s)"
        )
    return lines


def unknown_workflow(db: Any, workflow: str | None) -> str:
    """``; this database has no workflow 'ordr'; did you mean 'order'?`` (the close names,
    else ``(known: …)``) when ``workflow`` names none this database has stored (a misspelt
    name answered "nothing journaled" as if it had been quiet; `send --workflow` listed
    the names where the other commands suggest the one meant)."""
    from sqlalchemy import select

    from flowloop.store.reads import reading
    from flowloop.store.schema import definitions
    from flowloop.suggest import did_you_mean

    if workflow is None:
        return ""
    with reading(db) as conn:
        known = sorted(set(conn.execute(select(definitions.c.name).distinct()).scalars()))
    if workflow in known:
        return ""
    meant = did_you_mean(workflow, known, shown=repr)
    hint = f"; {meant}" if meant else f" (known: {', '.join(known) or 'none'})"
    return f"; this database has no workflow {workflow!r}{hint}"


def knows_workflow(store: Any, workflow: str) -> bool:
    """Whether the database under ``store`` has a run of ``workflow`` or a stored
    definition of it: one EXISTS per table, the runs' through an index, the definitions'
    (a small table) without one (a :class:`~flowloop.store.lite.LiteStore`'s own query,
    else SQL on a SQLStore's)."""
    own = getattr(store, "knows_workflow", None)
    if own is not None:
        return bool(own(workflow))
    from sqlalchemy import exists, or_, select

    from flowloop.store.reads import reading
    from flowloop.store.schema import definitions, runs

    query = select(
        or_(
            exists().where(runs.c.workflow == workflow),
            exists().where(definitions.c.name == workflow),
        )
    )
    with reading(store.engine) as conn:
        return bool(conn.execute(query).scalar())


def workflow_names(store: Any) -> set[str]:
    """Every workflow the database under ``store`` knows: a stored definition's or a run's
    (a scan of the runs: only for a name :func:`knows_workflow` did not find)."""
    own = getattr(store, "workflow_names", None)
    if own is not None:
        return set(own())
    from sqlalchemy import select, union

    from flowloop.store.reads import reading
    from flowloop.store.schema import definitions, runs

    query = union(select(definitions.c.name), select(runs.c.workflow))
    with reading(store.engine) as conn:
        return {str(name) for name in conn.execute(query).scalars()}


def unknown_workflow_hint(store: Any, workflow: str) -> str | None:
    """``status --workflow NAME`` that listed nothing: for a name that neither a run nor a
    stored definition of this database has, the line to say on stderr with the close names
    (``no workflow 'ordr' in this database; did you mean 'order'?``); None for a name it
    knows. Only a hint: the listing stays valid (exit 0), since a workflow defined in code
    has neither before its first run, and a script may poll for it. ./workflows is not
    imported (its files are user code)."""
    from flowloop.suggest import did_you_mean

    if knows_workflow(store, workflow):
        return None
    known = workflow_names(store)  # (the scan, only for a name that is really unknown)
    meant = did_you_mean(workflow, sorted(known), shown=repr)
    if meant:
        hint = f"; {meant}"
    else:
        hint = f" (known: {', '.join(sorted(known))})" if known else " (it has none yet)"
    return f"no workflow {workflow!r} in this database{hint}"
