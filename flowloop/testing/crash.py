"""In-process crash injection: a store that "dies" at a chosen journal commit.

A real crash (SIGKILL) keeps exactly what the database committed and nothing of the
process. :class:`CrashingStore` reproduces that inside one test process: it is the real
SQLite store, except that at the armed point it raises *before* or *after* the real commit,
and from then on refuses every call — so the dead engine can write nothing more (no
``step_interrupted`` cut-off, no release, no lease renewal), exactly as after SIGKILL. The
kit then abandons that engine and continues on a fresh one (:meth:`TestEngine.resume`).

Journal commits are the store calls that append journal events or keep a sent event
(``create_run``, ``create_runs``, ``write``, ``deliver``; with composition also the calls
that open joins and create children). They are numbered from 1 per engine, and each is
recorded as a :class:`Commit` (what it carried), so a test can name a crash point by number
or by state.
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
        "wait_join",
    }
)
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

    def describe(self) -> str:
        """One line: ``#3 write: step_succeeded charge->ship, step_started ship``."""
        parts = [_describe_event(event) for event in self.events]
        if not parts:
            parts = ["an event kept for later" if self.call == "deliver" else "no journal entry"]
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
    commit ``number`` of ``commits`` carried: its journal entries, named by run and seq.

    Group commit shares a transaction among the boundaries that are ready together, which
    depends on timing (steps run in threads): the same script's runs may group the same
    entries otherwise, so a commit's number does not name the same point in each. ``before``
    fires at the first commit carrying one of the entries (none of them is committed);
    ``after``, after the commit that completes them (all are). A commit with no journal entry
    (an event kept for later) is named by its call and its rank among such commits."""
    target = commits[number - 1]
    label = f"{when} the commit of {target.describe()}"
    if not target.events:

        def entryless(commit: Commit) -> bool:
            return commit.call == target.call and not commit.events

        rank = sum(1 for commit in commits[:number] if entryless(commit))
        return Trigger(matches=entryless, after=when == "after", label=label, occurrence=rank)
    left = {(event.run_id, event.seq) for event in target.events}

    def carries(commit: Commit) -> bool:
        carried = left.intersection((event.run_id, event.seq) for event in commit.events)
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


def _applied(result: Any) -> bool | None:
    """Whether a journal call changed something, when its result says so."""
    if isinstance(result, bool):
        return result
    if isinstance(result, str):
        return result in ("applied", "buffered")
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], bool):
        return result[1]  # create_run: (run, created)
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

    def _die(self, label: str) -> None:
        self._crash.at_crash = snapshot(self)
        self._crash.crashed = label
        self._crash.trigger = None
        self._dead = True
        if self._checkpointer is not None:  # a killed process checkpoints nothing either
            self._checkpointer.stop()
        self._crash.on_crash()
        raise self._death()
