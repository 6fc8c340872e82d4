"""Journal rows and journal events, and contexts journaled as splices.

A step usually changes a small part of its context, yet each entry used to carry the whole
context: a 100 KB context cost 100 KB per boundary. An entry's context is now stored as a
*splice* of the run's previous context when that saves at least half: the length of the
common prefix, of the common suffix, and the text between them. The splice is exact to the
character (no JSON re-serialization), so a folded journal compares equal to the very text
the step wrote. Every ``SNAPSHOT_EVERY``-th context of a run is stored whole, and so is
any context this process has no previous one of. After a claim a run's next context is
spliced against the claimed one, unless the journal alone keeps it (longer than
``ROW_CONTEXT_MAX``): readers of such a run start at its latest whole context, so the
claimer's next one is whole (flowloop/store/sql.py ``_note_claimed``).

Readers undo splices in seq order from a whole context: :meth:`Decoder` starts at seq 1
(``run_created`` is always whole) or, for a live run's tail, at its row's snapshot; a
context kept in the journal only is read from its latest whole one (journaled.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from flowloop import journal as j
from flowloop.journal import JournalEvent, RunRecord, load_data
from flowloop.store.base import StoredRun

SPLICE_KEY: Final = "~ctx"
"""The ``data`` key of an entry whose ``context`` column is a splice: ``[prefix, suffix]``
(lengths kept from the previous context); the column holds the text between them."""
THEN_KEY: Final = "~then"
"""The ``data`` key of a ``step_succeeded`` row that also holds the next step's start (seq
one past the row's): ``[at, attempt]`` or ``[at, attempt, data]`` (see :func:`joinable`)."""
SPLICE_MIN: Final = 512
"""Contexts shorter than this are stored whole: a splice would not pay for its bookkeeping."""
SNAPSHOT_EVERY: Final = 32
"""Every this many contexts of a run one is stored whole (bounds the damage of a bad row)."""
ROW_CONTEXT_MAX: Final = 4000
"""A context longer than this (characters) is kept in the journal only: the run row holds
:data:`JOURNALED` instead. A row holds a context up to about a SQLite page; a longer one
spills into an overflow chain that every write of the row — its creation, its end, a
release — would copy (and, with Debian's ``secure_delete``, zero the old chain too): a
100 KB context cost 60 WAL pages at creation and 55 at the end, where the journal already
holds it whole or as a splice."""
JOURNALED: Final = ""
"""A run row's context that is its journal's (never a context: a context is JSON)."""
CACHE_RUNS: Final = 4096
"""Runs whose latest context a store remembers (the base of its next splice)."""
JSON_SEPARATORS: Final = (",", ":")

log = logging.getLogger("flowloop.store")


def _common_prefix(a: str, b: str, limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b`` (at most ``limit``): a bisection on
    slice equality, each comparison at C speed."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str, limit: int) -> int:
    lo, hi = 0, limit
    la, lb = len(a), len(b)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[la - mid :] == b[lb - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def splice(old: str, new: str) -> tuple[int, int, str] | None:
    """``(prefix, suffix, middle)`` with ``old[:prefix] + middle + old[len(old) - suffix:]
    == new``, or ``None`` when storing ``new`` whole is about as cheap."""
    if len(new) < SPLICE_MIN:
        return None
    shortest = min(len(old), len(new))
    prefix = _common_prefix(old, new, shortest)
    suffix = _common_suffix(old, new, shortest - prefix)
    middle = new[prefix : len(new) - suffix]
    if len(middle) * 2 > len(new):
        return None
    return prefix, suffix, middle


def unsplice(base: str, prefix: int, suffix: int, middle: str) -> str:
    return base[:prefix] + middle + base[len(base) - suffix :]


def context_after(previous: str | None, stored: str, data: str | None) -> str:
    """The whole context an entry wrote: its ``context`` column as ``stored`` (whole, or a
    splice of ``previous`` when its ``data`` says so). For readers of raw rows."""
    cut = load_data(data).get(SPLICE_KEY)
    if cut is None:
        return stored
    if previous is None:
        raise j.FoldError("a context stored as a change of an earlier one that is missing")
    return unsplice(previous, int(cut[0]), int(cut[1]), stored)


def row_context(context: str) -> str:
    """What a run row stores of ``context``: itself, or :data:`JOURNALED` when long."""
    return JOURNALED if len(context) > ROW_CONTEXT_MAX else context


class ContextCache:
    """Per run: the seq of its latest entry this store wrote or read, the context as of
    that seq, and how many contexts were spliced since the last whole one."""

    def __init__(self, size: int = CACHE_RUNS) -> None:
        self._runs: OrderedDict[str, tuple[int, str, int]] = OrderedDict()
        self._size = size

    def note(self, run_id: str, seq: int, context: str, spliced: int = 0) -> None:
        self._runs[run_id] = (seq, context, spliced)
        self._runs.move_to_end(run_id)
        if len(self._runs) > self._size:
            self._runs.popitem(last=False)

    def forget(self, run_id: str) -> None:
        self._runs.pop(run_id, None)

    def get(self, run_id: str) -> tuple[int, str, int] | None:
        return self._runs.get(run_id)


_SORTED_JSON: Final = json.JSONEncoder(sort_keys=True, separators=JSON_SEPARATORS)
_MAKE_C_ENCODER: Any = getattr(json.encoder, "c_make_encoder", None)  # (not in typeshed)
_C_ENCODE: Final = (
    None
    if _MAKE_C_ENCODER is None
    else _MAKE_C_ENCODER(
        None,  # no circular check: journal data and visits are plain trees
        _SORTED_JSON.default,
        json.encoder.encode_basestring_ascii,
        None,
        ":",
        ",",
        True,  # sort_keys
        False,  # skipkeys
        True,  # allow_nan
    )
)
"""``json.dumps(value, sort_keys=True, separators=…)`` builds an encoder object, then a C
encoder, at every call: for the few keys of a journal entry's ``data`` or a run's
``visits`` that set-up cost more than the encoding. The C encoder, built once, writes the
same text (``JSONEncoder.iterencode`` builds it with these arguments)."""


def dumps_sorted(value: Mapping[str, Any]) -> str:
    """``value`` as compact JSON with sorted keys: how journal ``data`` and run ``visits``
    are stored."""
    if _C_ENCODE is None:
        return _SORTED_JSON.encode(value)
    return "".join(_C_ENCODE(value, 0))


def event_row(event: JournalEvent, *, dump: bool = True) -> dict[str, Any]:
    """The journal row of ``event``, its context whole (``dump=False``: ``data`` is left
    for the caller to fill in)."""
    # An event's attributes are the journal's columns (checked below): copied at C speed.
    row = dict(vars(event))
    data = event.data
    row["data"] = (dumps_sorted(data) if data else None) if dump else None
    return row


def encode(events: Iterable[JournalEvent], cache: ContextCache) -> list[dict[str, Any]]:
    """The journal rows of ``events`` (in seq order, any runs), contexts spliced against the
    cached previous context where that saves, and a step's success with the next step's
    start in one row (:func:`joinable`). The cache moves on as if they were written: a
    caller whose write is refused or fails forgets the runs (:meth:`ContextCache.forget`)."""
    rows: list[dict[str, Any]] = []
    datas: list[dict[str, Any]] = []
    previous: JournalEvent | None = None
    for event in events:
        if previous is not None and joinable(previous, event):
            _join(datas[-1], previous, event, cache)
            previous = None  # at most two entries per row
            continue
        previous = event
        row, data = _entry(event, cache)
        rows.append(row)
        datas.append(data)
    for row, data in zip(rows, datas, strict=True):
        row["data"] = _data_text(data) if data else None
    return rows


def encode_joined(first: JournalEvent, then: JournalEvent, cache: ContextCache) -> dict[str, Any]:
    """:func:`encode` of the usual boundary alone — a step's success and the next step's
    start, :func:`joinable` — as its one row, without the general loop."""
    row, data = _entry(first, cache)
    _join(data, first, then, cache)
    row["data"] = _data_text(data)
    return row


def _entry(event: JournalEvent, cache: ContextCache) -> tuple[dict[str, Any], dict[str, Any]]:
    """``event``'s row (its ``data`` left to fill in) and data, its context spliced
    against the run's cached previous one where that saves; the cache moves on."""
    row = event_row(event, dump=False)
    data: dict[str, Any] = dict(event.data) if event.data else {}
    known = cache.get(event.run_id)
    if known is None or known[0] != event.seq - 1:
        if event.context is not None:
            cache.note(event.run_id, event.seq, event.context)
        else:
            cache.forget(event.run_id)
        return row, data
    _, context, spliced = known
    if event.context is None:
        cache.note(event.run_id, event.seq, context, spliced)
        return row, data
    cut = splice(context, event.context) if spliced + 1 < SNAPSHOT_EVERY else None
    if cut is None:
        spliced = 0
    else:
        prefix, suffix, middle = cut
        row["context"] = middle
        data[SPLICE_KEY] = [prefix, suffix]
        spliced += 1
    cache.note(event.run_id, event.seq, event.context, spliced)
    return row, data


def _join(
    data: dict[str, Any], first: JournalEvent, then: JournalEvent, cache: ContextCache
) -> None:
    """``then`` (a start joinable to ``first``) into ``first``'s row data; the cache moves on."""
    data[THEN_KEY] = _then(then)
    known = cache.get(then.run_id)
    if known is not None and known[0] == first.seq:
        cache.note(then.run_id, then.seq, known[1], known[2])


def _data_text(data: Mapping[str, Any]) -> str:
    """:func:`dumps_sorted` of a row's ``data``. The usual boundary's is a joined start
    alone, ``{"~then": [at, attempt]}``, written here directly: the JSON encoder's set-up
    cost more than the rest of the row's encoding (a float's JSON text is its repr)."""
    if len(data) == 1:
        then = data.get(THEN_KEY)
        if (
            type(then) is list
            and len(then) == 2
            and type(then[0]) is float
            and type(then[1]) is int
            and math.isfinite(then[0])
        ):
            return f'{{"{THEN_KEY}":[{then[0]!r},{then[1]}]}}'
    return dumps_sorted(data)


ERROR_FIELDS: Final = frozenset({"error_type", "error_message", "traceback", "retryable"})
"""The journal's columns that only a failure fills in (:func:`errorless` reads each)."""


def errorless(event: JournalEvent) -> bool:
    """Whether ``event``'s :data:`ERROR_FIELDS` are all empty (a step's success's are)."""
    return (
        event.error_type is None
        and event.error_message is None
        and event.traceback is None
        and event.retryable is None
    )


def joinable(first: JournalEvent, then: JournalEvent) -> bool:
    """Whether ``then`` is stored in ``first``'s row: the next step's start right after a
    step's success, written by the same worker in the same boundary (the usual boundary
    of a run going on: one row instead of two)."""
    return (
        first.kind == j.STEP_SUCCEEDED
        and then.kind == j.STEP_STARTED
        and then.run_id == first.run_id
        and then.seq == first.seq + 1
        and then.context is None
        and then.worker == first.worker
        and then.state is not None
        and then.state == first.next_state
        # What a joined start keeps is its time, attempt and data: nothing else is set.
        and then.event is None
        and then.next_state is None
        and then.duration is None
        and then.error_type is None
        and then.error_message is None
        and then.traceback is None
        and then.retryable is None
    )


def _then(event: JournalEvent) -> list[Any]:
    """A joined ``step_started`` as its row's ``data[THEN_KEY]``: ``[at, attempt]``, then
    its own ``data`` when it has any (its state is the success's ``next_state``)."""
    return [event.at, event.attempt, event.data] if event.data else [event.at, event.attempt]


def _readable_then(then: Any) -> bool:
    return (
        isinstance(then, list)
        and len(then) in (2, 3)
        and isinstance(then[0], (int, float))
        and isinstance(then[1], int)
        and (len(then) == 2 or isinstance(then[2], dict))
    )


def last_seq_of(seq: int, kind: str, data: str | None) -> int:
    """The seq of the last entry a journal row holds (a joined start is one past it)."""
    if kind != j.STEP_SUCCEEDED or not data or THEN_KEY not in data:
        return seq
    return seq + 1 if THEN_KEY in load_data(data) else seq


JOURNAL_FIELDS: Final = (
    "run_id",
    "seq",
    "kind",
    "at",
    "state",
    "attempt",
    "event",
    "next_state",
    "context",
    "duration",
    "error_type",
    "error_message",
    "traceback",
    "retryable",
    "worker",
    "data",
)
"""The journal's columns in table order (``select(journal)``): :meth:`Decoder.values`.
Spelled out so that decoding needs no SQLAlchemy; schema.py checks it is the table's."""
if {f.name for f in dataclasses.fields(JournalEvent)} != set(JOURNAL_FIELDS):
    raise RuntimeError("JournalEvent's fields must be the journal's columns (event_row)")
if not ERROR_FIELDS.issubset(JOURNAL_FIELDS):
    raise RuntimeError("ERROR_FIELDS must be journal columns (errorless, Raw.with_nulls)")


class Decoder:
    """Journal rows of ONE run, in seq order, back to events (splices undone, joined
    starts split off)."""

    def __init__(self, base: str | None = None, *, strict: bool = True) -> None:
        self.context = base
        self.strict = strict
        """False (showing a journal): a damaged joined start stays in its row's data."""

    def events(self, row: Any) -> list[JournalEvent]:
        """The one or two entries ``row`` (a ``select(journal)`` row) holds."""
        return self._entries({name: getattr(row, name) for name in JOURNAL_FIELDS})

    def values(self, values: Sequence[Any]) -> list[JournalEvent]:
        """:meth:`events` for a row given as its values in :data:`JOURNAL_FIELDS` order (a
        tuple of a ``select(journal)`` row): a row's attributes cost more than the rest of
        the decoding (each claim of interrupted runs folds every run's tail)."""
        return self._entries(dict(zip(JOURNAL_FIELDS, values, strict=True)))

    def _entries(self, fields: dict[str, Any]) -> list[JournalEvent]:
        data = fields["data"] = load_data(fields["data"])
        named = (fields["run_id"], fields["seq"], fields["kind"])
        then = data.pop(THEN_KEY, None) if fields["kind"] == j.STEP_SUCCEEDED else None
        if then is not None and not _readable_then(then):
            if not self.strict:  # shown as it is: the fold names what is missing
                data[THEN_KEY], then = then, None
            else:
                # The row holds two seqs (the append's probe says so): a fold that went on
                # from the first would write onto the second. The run fails (invalid_row).
                run_id, seq, kind = named
                raise j.FoldError(
                    f"run {run_id} seq {seq} ({kind}): its joined step start ({THEN_KEY}) "
                    "is unreadable"
                )
        fields["context"] = self._context(fields["context"], data, named)
        first = _new_event(fields)
        if then is None:
            return [first]
        return [first, _new_event(_started(fields, then))]

    def _context(
        self, context: str | None, data: dict[str, Any], named: tuple[str, int, str]
    ) -> str | None:
        """The entry's whole context (its splice undone, ``data`` rid of the splice's key);
        ``named`` (its ``(run_id, seq, kind)``) names the entry in an error."""
        cut = data.pop(SPLICE_KEY, None) if SPLICE_KEY in data else None
        if cut is not None:
            if self.context is None or not isinstance(cut, list) or len(cut) != 2:
                run_id, seq, kind = named
                raise j.FoldError(
                    f"run {run_id} seq {seq} ({kind}): its context is a change "
                    "of an earlier one that is missing (see `flowloop history`)"
                )
            context = unsplice(self.context, int(cut[0]), int(cut[1]), context or "")
        if context is not None:
            self.context = context
        return context


def _started(row: Mapping[str, Any], then: list[Any]) -> dict[str, Any]:
    """The fields of the ``step_started`` a row (its columns by name) holds as ``then``
    (its readable ``data[THEN_KEY]``); ``data`` a dict."""
    return {
        "run_id": row["run_id"],
        "seq": row["seq"] + 1,
        "kind": j.STEP_STARTED,
        "at": then[0],
        "state": row["next_state"],
        "attempt": then[1],
        "event": None,
        "next_state": None,
        "context": None,
        "duration": None,
        "error_type": None,
        "error_message": None,
        "traceback": None,
        "retryable": None,
        "worker": row["worker"],
        "data": then[2] if len(then) == 3 else {},
    }


def _new_event(fields: dict[str, Any]) -> JournalEvent:
    # A frozen dataclass without __post_init__, filled field by field: its generated
    # __init__ costs more than the rest of this (live runs' tails are read by claims).
    event = object.__new__(JournalEvent)
    event.__dict__.update(fields)
    return event


def decode(
    rows: Iterable[Any], base: str | None = None, *, strict: bool = True
) -> list[JournalEvent]:
    """Rows of one run in seq order (from seq 1, or after a snapshot ``base``)."""
    decoder = Decoder(base, strict=strict)
    return [event for row in rows for event in decoder.events(row)]


def until(events: list[JournalEvent], seq: int | None) -> list[JournalEvent]:
    """A journal read up to ``seq`` (its rows ``seq <= seq``, decoded): without the joined
    step start one past ``seq`` that its last row may hold."""
    if seq is not None and events and events[-1].seq > seq:
        events.pop()
    return events


class UnreadableVisits(dict[str, int]):
    """A visits column that cannot be read: no visits for the run, and the stored text,
    which a write of the row puts back as it was (:func:`visits_text`): an operator's
    pause, unpause or stop of the run (and its ``invalid_row`` failure) must not replace
    the visit counts with ``{}``."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


def visits_text(visits: Mapping[str, int]) -> str:
    """The visits column for ``visits``: the text read for an unreadable one."""
    if type(visits) is UnreadableVisits:
        return visits.text
    return dumps_sorted(visits)


def _visits(text: str) -> tuple[dict[str, int], str | None]:
    """The visits column, or (:class:`UnreadableVisits`, why) when it is corrupt: one bad
    row must not make every claim (and so every other run) fail."""
    try:
        visits = json.loads(text)
    except ValueError as error:
        return UnreadableVisits(text), f"stored visits are not valid JSON: {error}"
    if not isinstance(visits, dict):
        return UnreadableVisits(text), "stored visits are not a JSON object"
    return visits, None


def stored_from_row(row: Any) -> StoredRun:
    """A run row (``select(runs)``) as a :class:`StoredRun` (a running run: its snapshot).

    Read through the row's mapping and filled field by field (frozen dataclasses without
    ``__post_init__``, every field given): a Row's attributes and the generated
    ``__init__``s cost more than the rest (a claim of 500 interrupted runs reads 500)."""
    return stored_from_mapping(row._mapping)


def stored_from_mapping(m: Mapping[str, Any]) -> StoredRun:
    """:func:`stored_from_row` for a run row's columns by name (a ``sqlite3.Row`` too)."""
    visits, problem = _visits(m["visits"])
    record = object.__new__(RunRecord)
    record.__dict__.update(
        id=m["id"],
        workflow=m["workflow"],
        version=m["version"],
        fingerprint=m["fingerprint"],
        key=m["key"],
        status=m["status"],
        state=m["state"],
        context=m["context"],
        attempt=m["attempt"],
        visits=visits,
        next_run_at=m["next_run_at"],
        last_seq=m["last_seq"],
        reason=m["reason"],
        error=m["error"],
        context_version=m["context_version"],
        deadline=m["deadline_at"],
        join=m["join_id"],
    )
    stored = object.__new__(StoredRun)
    stored.__dict__.update(
        record=record,
        idempotency_key=m["idempotency_key"],
        priority=m["priority"],
        owner=m["owner"],
        lease_expires_at=m["lease_expires_at"],
        lease_epoch=m["lease_epoch"],
        control=m["control"],
        created_at=m["created_at"],
        updated_at=m["updated_at"],
        problem=problem,
        limit_key=m["limit_key"],
    )
    return stored


def definition_structure(text: str | None, fingerprint: str) -> dict[str, Any] | None:
    """A stored definition's structure (its ``structure`` column), or ``None`` when there
    is none or it is damaged: a damaged row concerns the runs of that one definition only,
    which are then judged as if it were unknown (a run whose state still exists goes on)."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning(
            "definition %s: its stored structure is not a JSON object; runs started "
            "under it are checked against the current definition only",
            fingerprint,
        )
        return None
    return value


def stored_waits(structure: Mapping[str, Any] | None) -> dict[str, tuple[str, ...]]:
    """The wait states of a stored definition's structure (as flowloop/structure.py writes
    it), each with the events it takes, its timeout aside; none for a damaged one."""
    states = (structure or {}).get("states")
    if not isinstance(states, dict):
        return {}
    return {
        name: tuple(event for event in state.get("on") or {} if event != j.TIMEOUT_EVENT)
        for name, state in states.items()
        if isinstance(state, dict) and state.get("kind") == "wait"
    }


def replaced_run(stored: StoredRun, **change: Any) -> StoredRun:
    """``stored`` with ``change`` (a frozen dataclass copied field by field: a tail's fold
    runs for every claimed run)."""
    new = object.__new__(StoredRun)
    new.__dict__.update(stored.__dict__)
    new.__dict__.update(change)
    return new


# -- a run as of its latest entry (shared by SQLStore and the stdlib reader, lite.py) -------

RUN_ID: Final = JOURNAL_FIELDS.index("run_id")
SEQ: Final = JOURNAL_FIELDS.index("seq")
KIND: Final = JOURNAL_FIELDS.index("kind")
DATA: Final = JOURNAL_FIELDS.index("data")


@dataclasses.dataclass(frozen=True, slots=True)
class Unreadable:
    """A journaled context that cannot be read back: why (names the entry)."""

    problem: str


def context_of(rows: Iterable[Sequence[Any]], seq: int) -> str | Unreadable:
    """The context ``rows`` — ``(run_id, seq, context, data)`` of one run in seq order,
    from a whole context on — end with: only contexts are folded (the entries' other
    fields are not needed here)."""
    context: str | None = None
    for _run_id, row_seq, row_context_text, data in rows:
        try:
            context = context_after(context, row_context_text, data)
        except Exception as error:  # one broken entry must not make every read raise
            why = str(error) or type(error).__name__
            return Unreadable(f"its context (in the journal, seq {row_seq}) is unreadable: {why}")
    if context is None:
        return Unreadable(f"its context (in the journal up to seq {seq}) is missing")
    return context


def with_contexts(
    stored: Sequence[StoredRun], found: Mapping[str, str | Unreadable]
) -> list[StoredRun]:
    """``stored`` with the journaled contexts ``found`` (by run id, as of each row's
    snapshot) in place; one that cannot be read becomes the run's problem (the executor
    fails such a run, as it does a run whose tail cannot be folded)."""
    out = []
    for s in stored:
        context = found.get(s.id) if s.record.context == JOURNALED else None
        if context is None:
            out.append(s)
        elif isinstance(context, Unreadable):
            out.append(replaced_run(s, problem=context.problem))
        else:
            out.append(replaced_run(s, record=dataclasses.replace(s.record, context=context)))
    return out


def with_tails(stored: Sequence[StoredRun], tails: Mapping[str, Sequence[Any]]) -> list[StoredRun]:
    """``stored`` with each run's journal tail (rows in :data:`JOURNAL_FIELDS` order) folded
    in: a running run's row is a snapshot as of its ``last_seq``."""
    out = []
    for s in stored:
        tail = tails.get(s.id)
        out.append(s if not tail else folded(s, tail))
    return out


def folded(stored: StoredRun, tail: Sequence[Sequence[Any]]) -> StoredRun:
    """``stored`` with its journal tail (rows in :data:`JOURNAL_FIELDS` order) folded in. A
    tail that cannot be folded (a missing seq, an unreadable or incomplete entry: any
    error) becomes the run's problem, naming the entry, and the record's ``last_seq`` is
    the tail's last: the failure the executor or recovery writes for it goes after the
    run's last entry, not onto a taken seq."""
    record = stored.record
    if stored.problem is not None:  # its context is unreadable: nothing to fold onto
        last = tail[-1]
        end = dataclasses.replace(record, last_seq=last_seq_of(last[SEQ], last[KIND], last[DATA]))
        return replaced_run(stored, record=end)
    decoder = Decoder(record.context)
    for row in tail:
        try:
            for event in decoder.values(row):
                record = j.apply(record, event)
        except Exception as error:  # one broken entry must not make every read raise
            why = str(error) or type(error).__name__
            problem = f"journal entry seq {row[SEQ]} ({row[KIND]}) cannot be folded: {why}"
            last = tail[-1]
            end = dataclasses.replace(
                record, last_seq=last_seq_of(last[SEQ], last[KIND], last[DATA])
            )
            return replaced_run(stored, record=end, problem=problem)
    return replaced_run(stored, record=record)
