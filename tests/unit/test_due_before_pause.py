"""``events.due_before_pause``: when a paused run was due before its pause, and its reason
then, read from its journal alone — what an unpause makes it due at again."""

from __future__ import annotations

from typing import Any

from flowloop import journal as j
from flowloop.events import due_before_pause
from flowloop.journal import JournalEvent

LATER = 7200.0
CREATED = {"workflow": "w", "version": 1, "fingerprint": "f"}


def entry(seq: int, kind: str, **fields: Any) -> JournalEvent:
    return JournalEvent(run_id="r", seq=seq, kind=kind, at=float(seq), state="s", **fields)


def created(**data: Any) -> JournalEvent:
    return entry(1, j.RUN_CREATED, context="{}", data={**CREATED, **data})


def paused(seq: int, **data: Any) -> JournalEvent:
    return entry(seq, j.RUN_PAUSED, data=data)


def test_due_before_pause__a_run_started_for_later() -> None:
    assert due_before_pause([created(due=LATER), paused(2)]) == (LATER, None)


def test_due_before_pause__its_deadline_left_out() -> None:
    """Due by its deadline before its run_at: the run_at, the unpause holds it to the
    deadline again; a due time that was the deadline's alone is none."""
    assert due_before_pause([created(due=LATER, deadline=60.0), paused(2)]) == (LATER, None)
    assert due_before_pause([created(due=None, deadline=60.0), paused(2)]) == (None, None)


def test_due_before_pause__a_retry_backing_off() -> None:
    events = [
        created(),
        entry(2, j.STEP_STARTED, attempt=1),
        entry(3, j.STEP_FAILED, attempt=1, error_type="E", data={"retry_at": LATER}),
        paused(4),
    ]
    assert due_before_pause(events) == (LATER, None)


def test_due_before_pause__a_deferral_with_its_reason() -> None:
    reason = "rate_limit:api"
    deferred = entry(2, j.RUN_DEFERRED, data={"due": LATER, "reason": reason})
    assert due_before_pause([created(), deferred, paused(3)]) == (LATER, reason)


def debounced(seq: int, due: float) -> JournalEvent:
    return entry(seq, j.RUN_DEBOUNCED, context=f'{{"n":{seq}}}', data={"due": due})


def test_due_before_pause__a_debounced_runs_window_pushed_by_starts_while_paused() -> None:
    """The burst's last start's window, one taken while it was paused included (the row
    stays undue then)."""
    burst = [created(due=LATER, admission_key="k"), debounced(2, LATER + 5), paused(3)]
    assert due_before_pause(burst) == (LATER + 5, None)
    during = [*burst, debounced(4, LATER + 10), debounced(5, LATER + 20)]
    assert due_before_pause(during) == (LATER + 20, None)


def test_due_before_pause__a_debounced_or_throttled_runs_deferral_with_its_reason() -> None:
    """Deferred at its window's end (a rate limit, a breaker): the deferral's due time and
    reason, not the window's; a later start taken while paused pushes the due time as it
    would have unpaused (the reason kept)."""
    reason = "rate_limit:api"
    throttled = created(due=1.0, admission_key="k")
    deferred = entry(2, j.RUN_DEFERRED, data={"due": LATER, "reason": reason})
    assert due_before_pause([throttled, deferred, paused(3)]) == (LATER, reason)
    burst = [created(due=1.0, admission_key="k"), debounced(2, 2.0)]
    deferred = entry(3, j.RUN_DEFERRED, data={"due": LATER, "reason": reason})
    assert due_before_pause([*burst, deferred, paused(4)]) == (LATER, reason)
    pushed = [*burst, deferred, paused(4), debounced(5, LATER + 30)]
    assert due_before_pause(pushed) == (LATER + 30, reason)


def test_due_before_pause__the_first_pause_of_those_it_is_in() -> None:
    """Paused by its parent, then by an operator (a pause again): the due time before the
    first; paused, unpaused and paused again: the unpause's."""
    twice = [created(due=LATER), paused(2, reason="parent paused"), paused(3)]
    assert due_before_pause(twice) == (LATER, None)
    again = [created(), paused(2), entry(3, j.RUN_UNPAUSED, data={"due": LATER}), paused(4)]
    assert due_before_pause(again) == (LATER, None)


def test_due_before_pause__running_or_due_at_once() -> None:
    running = [created(), entry(2, j.STEP_STARTED, attempt=1), paused(3)]
    assert due_before_pause(running) == (None, None)
    assert due_before_pause([created(), paused(2)]) == (1.0, None)  # (its creation's time)


def test_due_before_pause__not_paused_or_unreadable() -> None:
    assert due_before_pause([created(due=LATER)]) == (None, None)
    unpaused = entry(3, j.RUN_UNPAUSED, data={"due": LATER})
    assert due_before_pause([created(due=LATER), paused(2), unpaused]) == (None, None)
    unreadable = entry(2, j.RUN_PAUSED, data={j.UNREADABLE: True, "reason": "bad"})
    assert due_before_pause([created(due=LATER), unreadable]) == (None, None)


def test_due_before_pause__a_waits_timeout_not_kept_once_migrated_out_of_it() -> None:
    """Paused waiting (``w`` a wait by the definition it was on, ``waited``): migrated to
    another state, or to a version where the same name is no wait, the due time then was
    the timeout of a wait it has left — due at once. Migrated from a step, its due time
    holds (a deferral, as a migration of an unpaused run keeps it)."""
    waits = {("f", "s")}

    def waited(fingerprint: str, state: str) -> bool:
        return (fingerprint, state) in waits

    migrated = {"from": 1, "to": 2, "fingerprint": "g", "from_state": "s"}
    timed = [created(due=LATER), paused(2)]
    other = JournalEvent(run_id="r", seq=3, kind=j.RUN_MIGRATED, at=3.0, state="t", data=migrated)
    same = entry(3, j.RUN_MIGRATED, data=migrated)
    for migration in (other, same):
        assert due_before_pause([*timed, migration], waited=waited) == (None, None)
        assert due_before_pause([*timed, migration]) == (LATER, None)  # (no definition)
    assert due_before_pause(timed, waited=waited) == (LATER, None)  # (still waiting there)
    waits.clear()  # (``s`` a step: its due time holds)
    assert due_before_pause([*timed, other], waited=waited) == (LATER, None)
