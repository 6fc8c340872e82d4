"""Reading a run's journal in tests: the path it took, its events, each step's attempts,
its context at any seq — and assertions whose failure shows expected vs actual, diffed."""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel

from flowloop import journal as j
from flowloop.engine import Engine, RunInfo
from flowloop.errors import FlowloopError
from flowloop.journal import JournalEvent

RunRef = RunInfo | str
"""A run, as the RunInfo that ``start``/``run``/``get`` return or as its id."""


def _run_id(run: RunRef) -> str:
    return run if isinstance(run, str) else run.id


def _events(engine: Engine, run: RunRef) -> list[JournalEvent]:
    return engine.history(_run_id(run))


def _known_state(engine: Engine, run: RunRef, state: str) -> None:
    info = engine.get(_run_id(run))
    workflow = engine.workflows.get(info.workflow)
    if workflow is not None and state not in workflow.states:
        raise FlowloopError(
            f"workflow {info.workflow!r} has no state {state!r} "
            f"(its states: {', '.join(workflow.states)})"
        )


def path(engine: Engine, run: RunRef) -> list[str]:
    """The states the run entered, in order, from its initial state (a state entered twice
    appears twice; an operator's retry from a past state appears as a jump to it)."""
    states: list[str] = []
    for event in _events(engine, run):
        if event.kind == j.RUN_CREATED and event.state is not None:
            states.append(event.state)
        elif event.next_state is not None:
            states.append(event.next_state)
        elif (
            event.kind == j.RUN_RETRIED and event.state is not None and states[-1:] != [event.state]
        ):
            states.append(event.state)
    return states


def kinds(engine: Engine, run: RunRef) -> list[str]:
    """The kinds of the run's journal entries in seq order (``run_created``, …)."""
    return [event.kind for event in _events(engine, run)]


@dataclass(frozen=True, kw_only=True)
class Attempt:
    """One execution of a step as the journal tells it."""

    state: str
    attempt: int
    started_seq: int
    outcome: str | None
    """``step_succeeded``, ``step_failed``, ``step_interrupted``; ``None`` while it runs."""
    event: str | None = None
    error_type: str | None = None
    error_message: str | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    retry_at: float | None = None
    """When a retried attempt was due again (its backoff end)."""


def attempts(engine: Engine, run: RunRef, state: str | None = None) -> list[Attempt]:
    """Every attempt of every step (of ``state`` only, if given), in journal order. A
    ``state`` the run's workflow does not have is refused (a typo found nothing)."""
    if state is not None:
        _known_state(engine, run, state)
    found: list[Attempt] = []
    open_: dict[str, int] = {}  # state -> index in found of its attempt without an outcome
    for event in _events(engine, run):
        if event.state is None:
            continue
        if event.kind == j.STEP_STARTED:
            open_[event.state] = len(found)
            found.append(
                Attempt(
                    state=event.state,
                    attempt=event.attempt,
                    started_seq=event.seq,
                    outcome=None,
                    started_at=event.at,
                )
            )
        elif event.kind in (j.STEP_SUCCEEDED, j.STEP_FAILED, j.STEP_INTERRUPTED):
            index = open_.pop(event.state, None)
            if index is None:
                continue
            retry_at = event.data.get("retry_at")
            found[index] = Attempt(
                state=event.state,
                attempt=found[index].attempt,
                started_seq=found[index].started_seq,
                outcome=event.kind,
                event=event.event,
                error_type=event.error_type,
                error_message=event.error_message,
                started_at=found[index].started_at,
                ended_at=event.at,
                retry_at=None if retry_at is None else float(retry_at),
            )
    return [a for a in found if state is None or a.state == state]


def context_at(engine: Engine, run: RunRef, seq: int) -> dict[str, Any]:
    """The run's context as it was after journal entry ``seq`` (a dict, as stored)."""
    record = engine.replay(_run_id(run), at=seq).record
    value: dict[str, Any] = json.loads(record.context)
    return value


def _diff(expected: Sequence[str], actual: Sequence[str]) -> str:
    lines = difflib.unified_diff(
        list(expected), list(actual), fromfile="expected", tofile="actual", lineterm=""
    )
    return "\n".join(lines)


class PathMismatch(AssertionError):
    """The run took another path than expected (the message shows both and a diff)."""


def _not_one_string(expected: object, what: str) -> None:
    # A str is a Sequence too: "" would pass unchecked, "charge" be read as "c", "h", ….
    if isinstance(expected, str):
        raise FlowloopError(f"expected {what}, not one string: put it in a list ([{expected!r}])")


def assert_path(engine: Engine, run: RunRef, expected: Sequence[str]) -> None:
    """Assert the states the run entered, in order (see :func:`path`)."""
    _not_one_string(expected, "a list of states")
    actual = path(engine, run)
    if actual != list(expected):
        raise PathMismatch(
            f"run {_run_id(run)} took another path\n"
            f"  expected: {' -> '.join(expected)}\n"
            f"  actual:   {' -> '.join(actual)}\n{_diff(expected, actual)}"
        )


EVENT_FIELDS: Final = tuple(f.name for f in dataclasses.fields(JournalEvent))
"""What a mapping expectation may name (besides ``data.KEY``)."""


def _check_fields(want: str | Mapping[str, Any]) -> None:
    if isinstance(want, str):
        return
    for name in want:
        if not name.startswith("data.") and name not in EVENT_FIELDS:
            raise FlowloopError(
                f"assert_events: a journal entry has no field {name!r}; use one of "
                f"{', '.join(EVENT_FIELDS)} or 'data.KEY'"
            )


def _matches(event: JournalEvent, want: str | Mapping[str, Any]) -> bool:
    if isinstance(want, str):
        kind, _, state = want.partition(":")
        return event.kind == kind and (not state or event.state == state)
    for name, value in want.items():
        actual = event.data.get(name[5:]) if name.startswith("data.") else getattr(event, name)
        if actual != value:
            return False
    return True


def _show(event: JournalEvent) -> str:
    return f"{event.kind}:{event.state}" if event.state else event.kind


def assert_events(
    engine: Engine,
    run: RunRef,
    expected: Sequence[str | Mapping[str, Any]],
    *,
    exact: bool = True,
) -> list[JournalEvent]:
    """Assert the run's journal entries.

    Each expectation is ``"kind"``, ``"kind:state"`` (e.g. ``"step_failed:charge"``) or a
    mapping of JournalEvent fields (``{"kind": "step_failed", "error_type":
    "ConnectionError"}``; ``"data.KEY"`` looks into ``data``). With ``exact`` (default) the
    journal must be exactly these entries; otherwise they must appear in this order with
    anything between. Returns the matched events.
    """
    _not_one_string(expected, "a list of entries")
    for want in expected:
        _check_fields(want)
    events = _events(engine, run)
    shown = [_show(e) for e in events]
    wanted = [w if isinstance(w, str) else json.dumps(dict(w), default=str) for w in expected]
    if exact:
        if len(events) == len(expected) and all(
            _matches(e, w) for e, w in zip(events, expected, strict=True)
        ):
            return events
        raise AssertionError(
            f"run {_run_id(run)}: journal differs from the expected entries\n{_diff(wanted, shown)}"
        )
    matched: list[JournalEvent] = []
    remaining = iter(events)
    for want in expected:
        for event in remaining:
            if _matches(event, want):
                matched.append(event)
                break
        else:
            raise AssertionError(
                f"run {_run_id(run)}: no journal entry {want!r} after "
                f"{_show(matched[-1]) if matched else 'the start'}\n"
                f"  journal: {', '.join(shown)}"
            )
    return matched


def same_context(a: BaseModel | Mapping[str, Any], b: BaseModel | Mapping[str, Any]) -> list[str]:
    """The differences between two contexts, one ``field: a != b`` line each."""
    left = a.model_dump(mode="json") if isinstance(a, BaseModel) else dict(a)
    right = b.model_dump(mode="json") if isinstance(b, BaseModel) else dict(b)
    return [
        f"{name}: {left.get(name)!r} != {right.get(name)!r}"
        for name in sorted(left.keys() | right.keys())
        if left.get(name) != right.get(name)
    ]
