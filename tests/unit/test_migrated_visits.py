"""How a ``run_migrated`` entry folds a run's visit counts (flowloop/journal.py)."""

from __future__ import annotations

from flowloop import journal as j
from flowloop.journal import JournalEvent


def test_migrated_entries_fold_their_visits_as_written() -> None:
    """An entry with ``kept_visits`` leaves the state it moves from its count; one without
    (written before) moves the count, as the rows written then say."""
    record = j.create(
        JournalEvent(
            run_id="r",
            seq=1,
            kind=j.RUN_CREATED,
            at=1.0,
            state="ask",
            context="{}",
            data={"workflow": "w", "version": 1, "fingerprint": "f" * 16, "key": None},
        )
    )
    base = {"to": 2, "fingerprint": "g" * 16, "from_state": "ask"}

    def migrated(data: dict[str, object]) -> dict[str, int]:
        event = JournalEvent(
            run_id="r", seq=2, kind=j.RUN_MIGRATED, at=2.0, state="between", data=data
        )
        return dict(j.apply(record, event).visits)

    assert migrated({**base, "kept_visits": True}) == {"ask": 1, "between": 1}
    assert migrated(base) == {"between": 1}
    # Back to a name whose count holds this very visit (a rename rolled back): nothing added.
    assert migrated({**base, "kept_visits": True, "same_visit": True}) == {"ask": 1}
