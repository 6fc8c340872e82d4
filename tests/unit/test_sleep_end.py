"""``events.sleep_end``: when the sleep (``step.sleep``) before a run's state ends, read
from its journal alone — what a pause's unpause and a migration keep."""

from __future__ import annotations

from typing import Any

from flowloop import journal as j
from flowloop.events import sleep_end
from flowloop.journal import JournalEvent

END = 7200.0


def entry(seq: int, kind: str, **fields: Any) -> JournalEvent:
    return JournalEvent(run_id="r", seq=seq, kind=kind, at=float(seq), **fields)


def slept(next_state: str = "s2", **data: Any) -> list[JournalEvent]:
    return [
        entry(1, j.RUN_CREATED, state="first", context="{}"),
        entry(2, j.STEP_STARTED, state="first", attempt=1),
        entry(
            3,
            j.STEP_SUCCEEDED,
            state="first",
            next_state=next_state,
            context="{}",
            data={"due": END, **data},
        ),
    ]


def test_sleep_end__before_a_step_until_it_starts() -> None:
    events = slept()
    assert sleep_end("s2", events, wait=False) == END
    paused = [*events, entry(4, j.RUN_PAUSED, state="s2"), entry(5, j.RUN_UNPAUSED, state="s2")]
    assert sleep_end("s2", paused, wait=False) == END
    started = [*events, entry(4, j.STEP_STARTED, state="s2", attempt=1)]
    assert sleep_end("s2", started, wait=False) is None


def test_sleep_end__before_a_call_or_compensating_state_until_it_begins() -> None:
    begun = [*slept("c"), entry(4, j.CHILDREN_STARTED, state="c")]
    assert sleep_end("c", slept("c"), wait=False) == END
    assert sleep_end("c", begun, wait=False) is None
    undo = slept("cancelled", compensate=True)
    assert sleep_end("cancelled", undo, wait=False) == END
    undoing = [*undo, entry(4, j.COMPENSATION_STARTED, state="first", attempt=1)]
    assert sleep_end("cancelled", undoing, wait=False) is None


def test_sleep_end__a_waits_due_time_is_its_timeout_unless_asleep() -> None:
    assert sleep_end("w", slept("w"), wait=True) is None
    asleep = slept("w", **{j.ASLEEP: True})
    assert sleep_end("w", asleep, wait=True) == END
    ended = [*asleep, entry(4, j.SLEEP_ENDED, state="w", data={"due": END + 3600})]
    assert sleep_end("w", ended, wait=True) is None


def test_sleep_end__an_entry_of_an_older_version_only_when_it_says_asleep() -> None:
    """Renamed by a migration that kept no due time, the success into the old name may have
    set a wait's timeout (the state was a wait then): not a sleep. A migration's own due
    time (written for a sleep it kept) is."""
    renamed = {"to": 2, "fingerprint": "f", "from_state": "w", "renamed": True}
    moved = [*slept("w"), entry(4, j.RUN_MIGRATED, state="s2", data=renamed)]
    assert sleep_end("s2", moved, wait=False) is None
    kept = [*slept("w"), entry(4, j.RUN_MIGRATED, state="s2", data={**renamed, "due": END})]
    assert sleep_end("s2", kept, wait=False) == END
    asleep = slept("w", **{j.ASLEEP: True})
    assert sleep_end("s2", [*asleep, moved[-1]], wait=False) == END


def test_sleep_end__a_debounced_runs_window_is_no_sleep() -> None:
    """Its creation's or a later start's due time: a rate limit or breaker may have
    deferred the run since (the unpause's due_before_pause finds which one holds)."""
    created = entry(
        1, j.RUN_CREATED, state="first", context="{}", data={"due": END, "admission_key": "k"}
    )
    assert sleep_end("first", [created], wait=False) is None
    later = entry(2, j.RUN_DEBOUNCED, state="first", context="{}", data={"due": END + 5})
    paused = [created, later, entry(3, j.RUN_PAUSED, state="first")]
    assert sleep_end("first", paused, wait=False) is None


def test_sleep_end__over_once_a_claim_moved_the_due_time() -> None:
    """Claimed after the sleep and deferred by a rate limit or breaker (or a turn), or
    released due at another time: the sleep no longer says when the run is due (an unpause
    took its end, long past, and lost the deferral). A release due at the sleep's end (a
    shutdown's, an early claim's) keeps it."""
    deferred = entry(4, j.RUN_DEFERRED, state="s2", data={"due": END + 3600, "reason": "r"})
    assert sleep_end("s2", [*slept(), deferred], wait=False) is None
    moved = entry(4, j.RUN_RELEASED, state="s2", data={"due": END + 60})
    assert sleep_end("s2", [*slept(), moved], wait=False) is None
    kept = entry(4, j.RUN_RELEASED, state="s2", data={"due": END, "reason": "shutdown"})
    assert sleep_end("s2", [*slept(), kept], wait=False) == END
    asleep = slept("w", **{j.ASLEEP: True})
    early = entry(4, j.RUN_RELEASED, state="w", data={"due": END})
    assert sleep_end("w", [*asleep, early], wait=True) == END
