"""In-process crash injection: a store that "dies" at a chosen journal commit.

A real crash (SIGKILL) keeps exactly what the database committed and nothing of the
process. :class:`CrashingStore` reproduces that inside one test process: it is the real
SQLite store, except that at the armed point it raises *before* or *after* the real commit,
and from then on refuses every call — so the dead engine can write nothing more (no
``step_interrupted`` cut-off, no release, no lease renewal), exactly as after SIGKILL. The
kit then abandons that engine and continues on a fresh one (:meth:`TestEngine.resume`).

Journal commits are the store calls that append journal events or keep a sent event
(``create_run``, ``create_runs``, ``write``, ``deliver``), the fan-out of a call or map
state (``start_children``: the join, the children and the parent's ``children_started`` in
one transaction; a large map's ``open_join`` and ``create_children`` batches; ``wait_join``),
the admission of a start (``debounce_start``, ``throttled_start``, ``start_bounded``) or of
a kept event (``keep_bounded``), and a claim that takes runs of a workflow with limits
(``max_concurrency``, ``concurrency_key``): its slots are counted and taken in that
commit. They are numbered from 1 per engine, and each is recorded as a :class:`Commit`
(what it carried: a fan-out its children's ``run_created`` too; a claim the runs it took),
so a test can name a crash point by number or by state.

A claim is a crash point only *after* it (then the runs are held by the dead worker until
its lease is expired): before it, the database is as after the commit before, and whether
a claim takes anything is known only once it has.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from sqlalchemy import select

from flowloop import journal as j
from flowloop.errors import FlowloopError
from flowloop.journal import JournalEvent
from flowloop.store import Boundary, NewRun, SQLStore
from flowloop.store.schema import journal, runs

When = Literal["before", "inside", "after"]
WHENS: Final = ("before", "inside", "after")
OUTCOME_KINDS: Final = frozenset({j.STEP_SUCCEEDED, j.STEP_FAILED, j.EVENT_RECEIVED})
"""The journal entries that end a visit of a state (a step's outcome, a wait's event)."""
JOURNAL_WRITES: Final = frozenset(
    {
        "create_run",
        "create_runs",
        "write",
        "deliver",
        # Composition (child runs and joins), where the store has them.
        "open_join",
        "create_children",
        "start_children",
        "wait_join",
        # Admission (flowloop/store/admission.py), where the store has it.
        "debounce_start",
        "throttled_start",
        "start_bounded",
        "keep_bounded",
    }
)
FAN_OUTS: Final = frozenset({"start_children", "create_children"})
"""Journal commits that create children with a ``build(runnable)`` of theirs."""
CLAIM: Final = "claim"
"""The store call a claim is: a crash point (after it) when it takes runs of a workflow
with limits."""
_STILL_ALLOWED: Final = frozenset({"close", "commits", "crashed", "url", "engine", "now_sql"})
"""What a dead store still answers: closing (no write), and what the kit reads of it."""


class SimulatedCrash(FlowloopError):
    """The test engine "died" at the crash point it was armed with (see ``crash_at``):
    what was committed is in the database, nothing else. Call ``resume()`` to go on with a
    fresh engine on the same database, as a restarted worker would."""

    exit_code = 1

    def __init__(self, point: str) -> None:
        super().__init__(
            f"simulated crash {point}: this engine is dead as after SIGKILL; "
            "call resume() to continue on a fresh engine"
        )
        self.point = point


class _Death(BaseException):
    """Raised inside the engine's own event-loop machinery at (and after) the crash: a
    BaseException, so no ``except Exception`` of the executor can turn the crash into a
    journaled failure or keep a dead engine beating. The kit turns it into SimulatedCrash."""


DRIVING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "flowloop_testing_driving", default=False
)
"""True inside the kit's drive calls (and every task they start)."""


@dataclass(frozen=True)
class Commit:
    """One journal commit the engine made (or was about to make): its number from 1,
    the store call, the events it carried and whether a run's row took them."""

    number: int
    call: str
    events: tuple[JournalEvent, ...]
    applied: bool | None = None
    """Whether the write was applied (``None``: not known, the crash came before it)."""
    claimed: tuple[tuple[str, str, int], ...] = ()
    """A claim's: the (workflow, run id, last seq) of each run it took under its workflow's
    limits."""

    @property
    def marks(self) -> frozenset[tuple[str, str, int]]:
        """What names this commit in another run of the same script: its journal entries
        by run and seq, a claim's runs by run and the seq they were claimed at."""
        entries = {("entry", event.run_id, event.seq) for event in self.events}
        return frozenset(entries | {("claim", run_id, seq) for _, run_id, seq in self.claimed})

    def describe(self) -> str:
        """One line: ``#3 write: step_succeeded charge->ship, step_started ship``."""
        parts = [_describe_event(event) for event in self.events]
        parts += [f"{wf} run {run_id[:8]} at seq {seq}" for wf, run_id, seq in self.claimed]
        if not parts:
            kept = self.call in ("deliver", "keep_bounded")
            parts = ["an event kept for later" if kept else "no journal entry"]
        return f"#{self.number} {self.call}: {', '.join(parts)}"


def _describe_event(event: JournalEvent) -> str:
    if event.next_state is not None:
        return f"{event.kind} {event.state}->{event.next_state}"
    return f"{event.kind} {event.state}" if event.state else event.kind


@dataclass
class Trigger:
    """When the armed crash fires: the ``occurrence``-th commit ``matches`` accepts, before
    or after it is committed."""

    matches: Callable[[Commit], bool]
    after: bool
    label: str
    occurrence: int = 1
    seen: int = 0

    def fires(self, commit: Commit) -> bool:
        if not self.matches(commit):
            return False
        self.seen += 1
        return self.seen == self.occurrence


def at_commit(number: int, when: Literal["before", "after"]) -> Trigger:
    """Crash before or after the ``number``-th journal commit (from 1)."""
    if number < 1:
        raise FlowloopError("crash_at_commit: commits are numbered from 1")
    if when not in ("before", "after"):
        raise FlowloopError(f"crash_at_commit: when must be 'before' or 'after', not {when!r}")
    return Trigger(
        matches=lambda commit: commit.number == number,
        after=when == "after",
        label=f"{when} journal commit #{number}",
    )


def like_commit(
    commits: Sequence[Commit], number: int, when: Literal["before", "after"]
) -> Trigger:
    """Crash before or after the commit of another run of the same script that carries what
    commit ``number`` of ``commits`` carried: its journal entries, named by run and seq (a
    claim: the runs it took, by run and the seq they were at).

    Group commit shares a transaction among the boundaries that are ready together, which
    depends on timing (steps run in threads): the same script's runs may group the same
    entries otherwise, so a commit's number does not name the same point in each. ``before``
    fires at the first commit carrying one of the entries (none of them is committed);
    ``after``, after the commit that completes them (all are). A commit with no journal entry
    (an event kept for later) is named by its call and its rank among such commits. A claim
    has no ``before`` (see the module docstring)."""
    target = commits[number - 1]
    if target.claimed and when == "before":
        raise FlowloopError(
            f"{target.describe()}: a claim is a crash point only after it (before it, the "
            "database is as after the commit before)"
        )
    label = f"{when} the commit of {target.describe()}"
    if not target.marks:

        def entryless(commit: Commit) -> bool:
            return commit.call == target.call and not commit.marks

        rank = sum(1 for commit in commits[:number] if entryless(commit))
        return Trigger(matches=entryless, after=when == "after", label=label, occurrence=rank)
    left = set(target.marks)

    def carries(commit: Commit) -> bool:
        carried = left.intersection(commit.marks)
        if not carried or when == "before":
            return bool(carried)
        left.difference_update(carried)
        return not left  # the last of them: once, as ``left`` is empty from then on

    return Trigger(matches=carries, after=when == "after", label=label)


def at_state(state: str, when: When, *, is_step: bool, occurrence: int = 1) -> Trigger:
    """Crash at a state's journal point.

    ``before``: just before the commit that starts it (its ``step_started``; for a wait or
    final state the transition into it) — the step has not run. ``inside``: the step
    function has run, and the process dies before its outcome is committed (for a wait
    state: before the event or timeout it takes is committed). ``after``: just after the
    outcome is committed.
    """
    if when not in WHENS:
        raise FlowloopError(f"crash_at: when must be one of {', '.join(WHENS)}, not {when!r}")
    if occurrence < 1:
        raise FlowloopError("crash_at: occurrence counts from 1")

    def starts(commit: Commit) -> bool:
        for event in commit.events:
            if is_step and event.kind == j.STEP_STARTED and event.state == state:
                return True
            if not is_step and (
                event.next_state == state or (event.kind == j.RUN_CREATED and event.state == state)
            ):
                return True
        return False

    def ends(commit: Commit) -> bool:
        return any(e.kind in OUTCOME_KINDS and e.state == state for e in commit.events)

    nth = "" if occurrence == 1 else f" (occurrence {occurrence})"
    return Trigger(
        matches=starts if when == "before" else ends,
        after=when == "after",
        label=f"{when} {state!r}{nth}",
        occurrence=occurrence,
    )


def _events_of(args: tuple[Any, ...]) -> tuple[JournalEvent, ...]:
    """The journal events a store call carries: those of its NewRun(s) and Boundary(s)."""
    found: list[JournalEvent] = []
    for arg in args:
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        for item in items:
            if isinstance(item, (NewRun, Boundary)):
                found.extend(item.events)
    return tuple(found)


def _children(call: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[JournalEvent, ...]:
    """The ``run_created`` entries of the children a fan-out call creates: its ``build`` of
    them (a pure function of the runnable count: their ids and contexts do not depend on
    it), for the runnable count a new join starts with (``create_children``: its first)."""
    names = ("join", "build") if call == "start_children" else ("join_id", "first", "build")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    build = given.get("build")
    if not callable(build):
        return ()
    join = given.get("join")
    news = build(join.runnable() if join is not None else given.get("first", 0))
    return tuple(event for new in news for event in new.events)


def _applied(result: Any) -> bool | None:
    """Whether a journal call changed something, when its result says so."""
    if result is None:
        return False  # start_bounded: full
    if isinstance(result, bool):
        return result
    if isinstance(result, str):
        return result in ("applied", "buffered")
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], bool):
        return result[1]  # create_run: (run, created)
    if isinstance(result, tuple) and len(result) == 2 and result[0] is None:
        return False  # throttled_start: refused
    if isinstance(result, list):
        return any(item[1] if isinstance(item, tuple) else bool(item) for item in result)
    return None


@dataclass
class CrashState:
    """What the crashing stores of one test engine share across its incarnations."""

    commits: list[Commit] = field(default_factory=list)
    trigger: Trigger | None = None
    crashed: str | None = None
    """The crash point's label once the crash happened."""
    on_crash: Callable[[], None] = lambda: None
    at_crash: Snapshot | None = None
    """The database as the crash left it (to check that nothing was written after)."""


Snapshot = tuple[frozenset[tuple[Any, ...]], frozenset[tuple[Any, ...]]]
"""Every journal row and every run row of a database, as tuples."""


def snapshot(store: SQLStore) -> Snapshot:
    """The journal and run rows of ``store``'s database, read on a connection of its own."""
    with store.engine.connect() as conn:
        entries = frozenset(tuple(row) for row in conn.execute(select(journal)))
        rows = frozenset(tuple(row) for row in conn.execute(select(runs)))
    return entries, rows


class CrashingStore(SQLStore):
    """The real SQL store, recording its journal commits and dying at an armed trigger."""

    def __init__(
        self, url: str, *, state: CrashState, synchronous: str, check_schema: bool = True
    ) -> None:
        self._crash = state
        self._dead = False
        super().__init__(url, synchronous=synchronous, check_schema=check_schema)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("_") or name in _STILL_ALLOWED:
            return super().__getattribute__(name)
        # A dead process answers nothing: every public call after the crash fails, so the
        # abandoned engine cannot write a cut-off, a release or a renewal (SIGKILL semantics).
        if object.__getattribute__(self, "_dead"):
            raise object.__getattribute__(self, "_death")()
        attribute = super().__getattribute__(name)
        if name in JOURNAL_WRITES and callable(attribute):
            journal_call = object.__getattribute__(self, "_journal_call")
            return functools.partial(journal_call, name, attribute)
        if name == CLAIM:
            return functools.partial(object.__getattribute__(self, "_claim_call"), attribute)
        return attribute

    def _death(self) -> BaseException:
        label = self._crash.crashed or "earlier"
        return _Death(label) if DRIVING.get() else SimulatedCrash(label)

    @property
    def commits(self) -> list[Commit]:
        return self._crash.commits

    @property
    def crashed(self) -> bool:
        return self._dead

    def _journal_call(self, call: str, real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        state = self._crash
        carried = _events_of(args) + _events_of(tuple(kwargs.values()))
        if call in FAN_OUTS:
            carried += _children(call, args, kwargs)
        commit = Commit(number=len(state.commits) + 1, call=call, events=carried)
        trigger = state.trigger
        fire = trigger is not None and trigger.fires(commit)
        if fire and trigger is not None and not trigger.after:
            state.commits.append(commit)
            self._die(trigger.label)
        result = real(*args, **kwargs)
        state.commits.append(Commit(commit.number, call, carried, applied=_applied(result)))
        if fire and trigger is not None:
            self._die(trigger.label)
        return result

    def _claim_call(self, real: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A claim: recorded as a commit when it took runs of a workflow with limits (its
        admission), and a crash point after it."""
        result = real(*args, **kwargs)
        limited = self._claim_limits
        taken = tuple(
            (stored.record.workflow, stored.id, stored.record.last_seq)
            for stored in result
            if stored.record.workflow in limited
        )
        if not taken:
            return result
        state = self._crash
        commit = Commit(len(state.commits) + 1, CLAIM, (), applied=True, claimed=taken)
        state.commits.append(commit)
        trigger = state.trigger
        if trigger is not None and trigger.after and trigger.fires(commit):
            self._die(trigger.label)
        return result

    def _die(self, label: str) -> None:
        self._crash.at_crash = snapshot(self)
        self._crash.crashed = label
        self._crash.trigger = None
        self._dead = True
        if self._checkpointer is not None:  # a killed process checkpoints nothing either
            self._checkpointer.stop()
        self._crash.on_crash()
        raise self._death()
