"""The pure fold: a journal replayed from seq 1 gives the run's record."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from flowloop import journal as j
from flowloop.journal import FoldError, JournalEvent, RunRecord

T0 = 1_000.0


class Log:
    """Builds one run's journal, seq by seq."""

    def __init__(self, state: str = "a", context: str = '{"n":0}') -> None:
        self.events: list[JournalEvent] = []
        self.add(
            j.RUN_CREATED,
            state=state,
            context=context,
            data={"workflow": "w", "version": 1, "fingerprint": "fp", "key": "k", "due": T0},
        )

    def add(self, kind: str, **fields: Any) -> Log:
        seq = len(self.events) + 1
        self.events.append(JournalEvent(run_id="r", seq=seq, kind=kind, at=T0 + seq, **fields))
        return self

    def started(self, state: str, attempt: int = 1) -> Log:
        return self.add(j.STEP_STARTED, state=state, attempt=attempt)

    def succeeded(self, state: str, nxt: str, context: str, *, final: bool = False) -> Log:
        return self.add(
            j.STEP_SUCCEEDED,
            state=state,
            event="next",
            next_state=nxt,
            context=context,
            data={"final": True} if final else {},
        )

    def failed(self, state: str, *, retry_at: float | None = None, reason: str = "error") -> Log:
        data: dict[str, Any] = (
            {"retry_at": retry_at} if retry_at is not None else {"reason": reason}
        )
        return self.add(
            j.STEP_FAILED, state=state, error_type="ValueError", error_message="bad", data=data
        )

    def fold(self, **kwargs: Any) -> RunRecord:
        return j.fold(self.events, **kwargs)


def test_fold__created_run_is_scheduled_at_its_due_time() -> None:
    record = Log().fold()
    assert (record.status, record.state, record.context) == ("scheduled", "a", '{"n":0}')
    assert record.next_run_at == T0 and record.last_seq == 1
    assert (record.workflow, record.version, record.fingerprint, record.key) == ("w", 1, "fp", "k")
    assert record.visits == {"a": 1}


def test_fold__retry_then_success_to_final() -> None:
    log = (
        Log()
        .started("a")
        .succeeded("a", "b", '{"n":1}')
        .started("b", 1)
        .failed("b", retry_at=T0 + 50)
        .started("b", 2)
        .succeeded("b", "done", '{"n":2}', final=True)
    )
    after_failure = log.fold(until_seq=5)
    assert after_failure.status == "retrying" and after_failure.next_run_at == T0 + 50
    assert after_failure.attempt == 1 and after_failure.error == "ValueError: bad"
    record = log.fold()
    assert (record.status, record.state, record.context) == ("succeeded", "done", '{"n":2}')
    assert record.attempt == 0 and record.next_run_at is None and record.error is None
    assert record.visits == {"a": 1, "b": 1, "done": 1}
    assert record.last_seq == 7


def test_fold__failure_without_retry_is_failed_with_reason() -> None:
    record = Log().started("a").failed("a").fold()
    assert record.status == "failed" and record.reason == "error"
    assert record.next_run_at is None


def test_fold__interrupted_step_fails_or_retries() -> None:
    retried = (
        Log()
        .started("a")
        .add(j.STEP_INTERRUPTED, state="a", attempt=1, data={"retry_at": T0 + 9})
        .fold()
    )
    assert retried.status == "retrying" and retried.attempt == 1
    failed = (
        Log()
        .started("a")
        .add(
            j.STEP_INTERRUPTED,
            state="a",
            attempt=1,
            error_type="Interrupted",
            error_message="cut",
            data={"reason": "interrupted"},
        )
        .fold()
    )
    assert failed.status == "failed" and failed.reason == "interrupted"
    assert failed.error == "Interrupted: cut"


def test_fold__visits_count_each_entry() -> None:
    log = Log().started("a").succeeded("a", "b", "{}")
    for n in range(3):
        log.started("b").succeeded("b", "a" if n < 2 else "done", "{}", final=n == 2)
        if n < 2:
            log.started("a").succeeded("a", "b", "{}")
    assert log.fold().visits == {"a": 3, "b": 3, "done": 1}


def test_fold__pause_unpause_stop_release() -> None:
    log = Log().add(j.RUN_PAUSED, state="a", data={"reason": "definition_mismatch"})
    paused = log.fold()
    assert paused.status == "paused" and paused.reason == "definition_mismatch"
    assert paused.next_run_at is None
    unpaused = log.add(j.RUN_UNPAUSED, state="a").fold()
    assert unpaused.status == "scheduled" and unpaused.reason is None
    assert unpaused.next_run_at == T0 + 3
    released = log.started("a").add(j.RUN_RELEASED, state="a", data={"due": T0 + 99}).fold()
    assert released.status == "scheduled" and released.next_run_at == T0 + 99
    stopped = log.add(j.RUN_STOPPED, state="a").fold()
    assert stopped.status == "stopped" and stopped.reason == "stopped"


def test_fold__a_debounced_start_on_a_paused_run_leaves_it_paused_and_undue() -> None:
    log = Log().add(j.RUN_DEBOUNCED, state="a", context='{"n":1}', data={"due": T0 + 40})
    scheduled = log.fold()
    assert (scheduled.status, scheduled.next_run_at) == ("scheduled", T0 + 40)
    log.add(j.RUN_PAUSED, state="a")
    paused = log.add(j.RUN_DEBOUNCED, state="a", context='{"n":2}', data={"due": T0 + 50}).fold()
    assert (paused.status, paused.context, paused.next_run_at) == ("paused", '{"n":2}', None)


def test_fold__retried_from_a_past_state_takes_its_context() -> None:
    log = (
        Log()
        .started("a")
        .succeeded("a", "b", '{"n":1}')
        .started("b")
        .failed("b")
        .add(j.RUN_RETRIED, state="a", context='{"n":7}', data={"by": "ops", "from": "a"})
    )
    record = log.fold()
    assert (record.status, record.state, record.context) == ("scheduled", "a", '{"n":7}')
    assert record.visits == {"a": 2, "b": 1}  # a new visit: a new idempotency key
    same_state = (
        Log().started("a").failed("a").add(j.RUN_RETRIED, state="a", context='{"n":0}').fold()
    )
    assert same_state.visits == {"a": 1}  # retrying the failed visit keeps its key


def test_fold__invalid_context_failure() -> None:
    record = (
        Log().add(j.RUN_FAILED, error_message="bad json", data={"reason": "invalid_context"}).fold()
    )
    assert record.status == "failed" and record.reason == "invalid_context"
    assert record.error == "bad json"


def test_fold__until_seq_shows_an_earlier_point() -> None:
    log = Log().started("a").succeeded("a", "b", '{"n":1}')
    assert log.fold(until_seq=1).state == "a"
    assert log.fold(until_seq=3).context == '{"n":1}'


def test_fold__gap_in_seq_refused() -> None:
    log = Log().started("a")
    log.events[1] = dataclasses.replace(log.events[1], seq=3)
    with pytest.raises(FoldError, match="seq 3 follows 1"):
        log.fold()


def test_fold__lifecycle_violation_refused() -> None:
    log = Log().started("a").succeeded("a", "done", "{}", final=True).started("done")
    with pytest.raises(
        FoldError, match="seq 4 step_started: lifecycle does not allow succeeded -> running"
    ):
        log.fold()


def test_fold__must_start_with_run_created() -> None:
    with pytest.raises(FoldError, match="must start with run_created"):
        j.fold(Log().started("a").events[1:])
    with pytest.raises(FoldError, match="empty journal"):
        j.fold([])


def test_fold__unknown_kind_refused() -> None:
    with pytest.raises(FoldError, match="unknown event kind 'teleported'"):
        Log().add("teleported").fold()


def test_compare__names_each_difference() -> None:
    record = Log().started("a").fold()
    assert j.compare(record, record) == []
    tampered = dataclasses.replace(record, context='{"n":9}', status="failed")
    diffs = j.compare(record, tampered)
    assert diffs == [
        "status: journal says 'running', row says 'failed'",
        "context: journal says '{\"n\":0}', row says '{\"n\":9}'",
    ]


def _running(*, deadline: float | None = None, version: int = 1) -> RunRecord:
    """A run in its second step ``b`` (visits: a once, b twice)."""
    log = Log().started("a").succeeded("a", "b", '{"n":1}').started("b")
    log.succeeded("b", "b", '{"n":2}').started("b", attempt=2)
    return dataclasses.replace(log.fold(), deadline=deadline, context_version=version)


def _went_on(
    record: RunRecord,
    *,
    data: dict[str, Any] | None = None,
    started: dict[str, Any] | None = None,
) -> tuple[JournalEvent, JournalEvent, RunRecord]:
    """``record``'s running step succeeded into ``c`` at ``T0 + 50``, and ``c`` started."""
    return j.went_on(
        record,
        at=T0 + 50,
        worker="w1",
        event="next",
        next_state="c",
        context='{"n":3}',
        duration=0.25,
        data={} if data is None else data,
        started={} if started is None else started,
    )


@pytest.mark.parametrize(
    ("deadline", "version", "data", "started"),
    [
        (None, 1, {}, {}),
        (T0 + 5, 1, {"note": "half done"}, {}),  # a deadline: due by it while scheduled
        # a context carried to version 3 by the step (flowloop.upcast) says so
        (None, 2, {j.CONTEXT_VERSION: 3}, {"rate": {"at": T0, "limits": ["x"]}}),
        (None, 2, {}, {}),  # an entry without a version keeps the run's
    ],
)
def test_went_on__is_apply_of_the_success_then_the_start(
    deadline: float | None, version: int, data: dict[str, Any], started: dict[str, Any]
) -> None:
    record = _running(deadline=deadline, version=version)
    at = T0 + 50
    succeeded, start, after = _went_on(record, data=data, started=started)
    assert succeeded == JournalEvent(
        run_id="r",
        seq=record.last_seq + 1,
        kind=j.STEP_SUCCEEDED,
        at=at,
        state="b",
        attempt=2,
        event="next",
        next_state="c",
        context='{"n":3}',
        duration=0.25,
        worker="w1",
        data=data,
    )
    assert start == JournalEvent(
        run_id="r",
        seq=record.last_seq + 2,
        kind=j.STEP_STARTED,
        at=at,
        state="c",
        attempt=1,
        worker="w1",
        data=started,
    )
    assert after == j.apply(j.apply(record, succeeded), start)
    assert (after.state, after.status, after.attempt, dict(after.visits)) == (
        "c",
        "running",
        1,
        {"a": 1, "b": 2, "c": 1},
    )
    assert dict(record.visits) == {"a": 1, "b": 2}  # the record it started from is as it was


def test_went_on__clears_the_error_and_reason_its_start_kept() -> None:
    """A retried attempt runs with the error of the one before it, and a deferred start
    with its reason (a step_started leaves both): a success clears them."""
    log = Log().started("a").failed("a", retry_at=T0 + 10).started("a", attempt=2)
    log.add(j.RUN_DEFERRED, state="a", data={"due": T0 + 20, "reason": "rate_limited: api"})
    record = log.started("a", attempt=3).fold()
    assert (record.status, record.error, record.reason) == (
        "running",
        "ValueError: bad",
        "rate_limited: api",
    )
    succeeded, start, after = _went_on(record)
    assert after == j.apply(j.apply(record, succeeded), start)
    assert (after.error, after.reason, after.next_run_at) == (None, None, None)


@pytest.mark.parametrize(
    ("status", "data"),
    [
        ("running", {"final": True}),
        ("running", {"compensate": True}),
        ("running", {"due": T0 + 60}),  # a durable sleep: handed back, not started
        ("running", {j.UNREADABLE: True}),
        ("scheduled", {}),
    ],
)
def test_went_on__refuses_what_is_not_a_step_going_on(status: str, data: dict[str, Any]) -> None:
    record = dataclasses.replace(_running(), status=status)
    with pytest.raises(ValueError, match="went_on takes a running step's success"):
        _went_on(record, data=data)
