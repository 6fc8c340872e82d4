"""A write that clears a run's control request is fenced on the request its writer saw
(``Boundary.seen_control``): a stop asked for after the writer looked, or a pause
withdrawn, is never cleared unseen. On SQLite files and PostgreSQL, written alone and in
a batch."""

from __future__ import annotations

import time
from typing import Any

import pytest
from storekit import event, new_run, pause, start_step

from flowloop import journal as j
from flowloop.children import _control_child
from flowloop.store import Boundary, SQLStore, StoredRun


def _running(store: SQLStore, count: int = 1) -> list[Boundary]:
    """``count`` runs claimed by worker ``a``, their first step started (rows written)."""
    created = [store.create_run(new_run())[0] for _ in range(count)]
    claimed = store.claim(
        worker="a", now=time.time(), limit=count, lease_seconds=30, run_ids=[c.id for c in created]
    )
    assert len(claimed) == count
    starts = [start_step(run, "a") for run in claimed]
    assert store.write(starts) == [True] * count
    return starts


def _honouring(start: Boundary, seen: str | None) -> Boundary:
    """The owner's pause of a run whose step ``start`` began, honouring ``seen``."""
    record = start.record
    paused = event(record, j.RUN_PAUSED, state=record.state)
    return Boundary(
        events=[paused],
        record=j.apply(record, paused),
        fence=start.fence,
        release=True,
        clear_control=True,
        seen_control=seen,
    )


def _row(store: SQLStore, run_id: str) -> StoredRun:
    row = store.get_run(run_id)
    assert row is not None
    return row


def test_honouring_a_pause_replaced_by_a_stop_is_refused_and_the_stop_stays(
    store: SQLStore,
) -> None:
    (start,) = _running(store)
    assert store.request_control(start.run_id, "pause")
    assert store.request_control(start.run_id, "stop")  # after the owner read the pause
    assert store.write([_honouring(start, "pause")]) == [False]
    row = _row(store, start.run_id)
    assert (row.control, row.record.status, row.owner) == ("stop", "running", "a")
    assert row.record.last_seq == start.record.last_seq  # nothing journaled
    # Honouring what the row holds is written, and clears it.
    stop = _honouring(start, "stop")
    assert store.write([stop]) == [True]
    assert _row(store, start.run_id).control is None


def test_honouring_a_withdrawn_pause_is_refused(store: SQLStore) -> None:
    (start,) = _running(store)
    assert store.request_control(start.run_id, "pause")
    assert store.withdraw_control(start.run_id, "pause")
    assert store.write([_honouring(start, "pause")]) == [False]
    row = _row(store, start.run_id)
    assert (row.control, row.record.status) == (None, "running")


def _batch_verdicts(store: SQLStore, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What each batch written at once (not one by one) came to: applied as a whole, or
    refused (then written one by one)."""
    verdicts: list[bool] = []
    at_once = store._write_batch_driver

    def noted(*args: Any) -> bool:
        verdicts.append(at_once(*args))
        return verdicts[-1]

    monkeypatch.setattr(store, "_write_batch_driver", noted)
    return verdicts


def test_a_batch_of_honours_whose_requests_hold_is_written_at_once(
    store: SQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Honours that saw a pause, a parent's pause and no request (NULL) alike, in one
    batch: applied as a batch (one statement per kind on PostgreSQL), not one by one."""
    starts = _running(store, 6)
    seen = ["pause", "parent pause", None, "pause", None, "parent pause"]
    for start, request in zip(starts, seen, strict=True):
        if request is not None:
            assert store.request_control(start.run_id, request)
    verdicts = _batch_verdicts(store, monkeypatch)
    honours = [_honouring(start, request) for start, request in zip(starts, seen, strict=True)]
    assert store.write(honours) == [True] * 6
    assert verdicts == [True]
    for start in starts:
        row = _row(store, start.run_id)
        assert (row.control, row.record.status) == (None, "paused")


def test_a_batch_refuses_only_the_honour_whose_request_changed(
    store: SQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six runs pause in one batch (on PostgreSQL one statement per kind, on SQLite an
    executemany); the third's request became a stop meanwhile: the batch is refused, and
    written one by one that one is refused and keeps its stop, the other five are paused
    with their requests cleared."""
    starts = _running(store, 6)
    for start in starts:
        assert store.request_control(start.run_id, "pause")
    assert store.request_control(starts[2].run_id, "stop")
    verdicts = _batch_verdicts(store, monkeypatch)
    written = store.write([_honouring(start, "pause") for start in starts])
    assert verdicts == [False]
    assert written == [True, True, False, True, True, True]
    for start, ok in zip(starts, written, strict=True):
        row = _row(store, start.run_id)
        expected = (None, "paused") if ok else ("stop", "running")
        assert (row.control, row.record.status) == expected


def test_an_operators_entry_is_refused_when_a_request_landed_after_its_read(
    store: SQLStore,
) -> None:
    """An operator's pause of a queued run, written as the run was read (no request), after
    a stop was asked for: refused, and the stop stays for the run's next claim."""
    stored, _ = store.create_run(new_run())
    assert store.request_control(stored.id, "stop")
    unfenced = pause(stored)
    operators = Boundary(
        events=unfenced.events,
        record=unfenced.record,
        fence=unfenced.fence,
        clear_control=True,
        seen_control=stored.control,
    )
    assert stored.control is None
    assert store.write([operators]) == [False]
    assert _row(store, stored.id).control == "stop"
    seen_stop = Boundary(
        events=unfenced.events,
        record=unfenced.record,
        fence=unfenced.fence,
        clear_control=True,
        seen_control="stop",
    )
    assert store.write([seen_stop]) == [True]
    row = _row(store, stored.id)
    assert (row.control, row.record.status) == (None, "paused")


@pytest.mark.parametrize("seen", ["pause", None])
def test_a_write_that_does_not_clear_the_request_is_not_fenced_on_it(
    store: SQLStore, seen: str | None
) -> None:
    """Only a write that clears the request looks at it: a release that leaves it (the run
    goes to wait, a worker drains) is written whatever the row holds, and the request
    stays for the next claim."""
    (start,) = _running(store)
    assert store.request_control(start.run_id, "stop")
    record = start.record
    released = event(record, j.RUN_RELEASED, state=record.state, data={"due": time.time()})
    boundary = Boundary(
        events=[released],
        record=j.apply(record, released),
        fence=start.fence,
        release=True,
        seen_control=seen,
    )
    assert store.write([boundary]) == [True]
    assert _row(store, start.run_id).control == "stop"


def _stop_child(store: SQLStore, stored: Any) -> bool:
    return _control_child(store, stored, "stop", now=time.time(), worker="w", reason="test")


def test_a_childs_stop_refused_looks_at_the_child_again(store: SQLStore) -> None:
    """A child read with no request, asked to stop meanwhile (its parent's deadline path):
    the stop entry, fenced on what was read, is refused; the child is read again and
    stopped, its request cleared."""
    stored, _ = store.create_run(new_run())
    assert store.request_control(stored.id, "stop")  # after the read below was made
    assert _stop_child(store, stored)
    row = _row(store, stored.id)
    assert (row.record.status, row.control) == ("stopped", None)


def test_a_child_claimed_meanwhile_is_asked_to_stop(store: SQLStore) -> None:
    stored, _ = store.create_run(new_run())
    claimed = store.claim(
        worker="a", now=time.time(), limit=1, lease_seconds=30, run_ids=[stored.id]
    )
    assert [c.id for c in claimed] == [stored.id]
    assert _stop_child(store, stored)  # as read: nobody's
    row = _row(store, stored.id)
    assert (row.owner, row.control) == ("a", "stop"), row
    assert row.record.last_seq == stored.record.last_seq  # nothing journaled: its owner stops it


def test_a_child_that_ended_meanwhile_is_left_alone(store: SQLStore) -> None:
    """Ended after it was read: not counted, and no stop left on its row (a later retry
    would otherwise be stopped by it)."""
    stored, _ = store.create_run(new_run())
    record = stored.record
    stopped = event(record, j.RUN_STOPPED, state=record.state)
    ending = Boundary(events=[stopped], record=j.apply(record, stopped), fence=pause(stored).fence)
    assert store.write([ending]) == [True]
    assert not _stop_child(store, stored)
    row = _row(store, stored.id)
    assert (row.record.status, row.control) == ("stopped", None)
