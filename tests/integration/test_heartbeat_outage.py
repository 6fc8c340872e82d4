"""The heartbeat says "the database answers again" only when a call of its own answered
(flowloop/leasethread.py, flowloop/outagelog.py). Before, once an outage longer than the
lease had fenced every run off, its next tick — with nothing to renew, so no call at all —
logged ``heartbeat: the database answers again`` while the database was still read-only
or refusing connections (fault audit: a worker on PostgreSQL made read-only for 15 s said
so 4 s into the outage)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from polling import poll

from flowloop.leasethread import LeaseGuard

LEASE_S = 1.2
WAIT_S = 30.0


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.fenced = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if getattr(record, "self_fenced", False):
            self.fenced.set()


def test_no_answer_is_claimed_while_nothing_was_asked() -> None:
    outage = [True]
    asked_after_fence = threading.Semaphore(0)

    def renew(run_ids: Sequence[str]) -> set[str]:
        if outage[0]:
            raise ConnectionError("database is read-only")
        return set(run_ids)

    def released(run_id: str) -> bool:
        # r2 was let go of by the loop: the renewer skips it (no call), and tells us it
        # looked — each look is one tick of the renewer after the fence.
        if run_id == "r2":
            asked_after_fence.release()
            return True
        return False

    def no_controls() -> Mapping[str, str]:
        return {}

    handler = Lines()
    logging.getLogger("flowloop").addHandler(handler)

    async def main() -> None:
        guard = LeaseGuard(
            lease_seconds=LEASE_S,
            poll_seconds=0.1,
            renew=renew,
            poll=no_controls,
            lost=lambda _run_id, _why: None,
            controls=lambda _requests: None,
            released=released,
        )
        guard.start(asyncio.get_running_loop())
        try:
            guard.hold("r1", asyncio.get_running_loop().time())
            assert await asyncio.to_thread(handler.fenced.wait, WAIT_S), "r1 never fenced"
            guard.hold("r2", asyncio.get_running_loop().time())
            for _ in range(2):  # two full ticks with nothing to renew
                assert await asyncio.to_thread(asked_after_fence.acquire, True, WAIT_S)
            said_early = [line for line in handler.lines if "answers again" in line]
            outage[0] = False  # the database takes writes again; a run to renew comes
            guard.hold("r3", asyncio.get_running_loop().time())
            await asyncio.to_thread(
                poll,
                lambda: any("answers again" in line for line in handler.lines),
                timeout=WAIT_S,
                every=0.01,
                what="the heartbeat's renewal to say the database answers again",
            )
            assert said_early == [], f"the heartbeat claimed an answer it never got: {said_early}"
        finally:
            guard.stop(asyncio.get_running_loop())
            guard.close()

    try:
        asyncio.run(main())
    finally:
        logging.getLogger("flowloop").removeHandler(handler)
    assert "heartbeat failed (retrying): database is read-only" in handler.lines


def test_an_outage_after_an_unanswered_one_is_said_too(monkeypatch: Any) -> None:
    """Once an outage fenced every run, the heartbeat waits for a renewal to say it ended;
    a worker that then holds nothing makes none. A later outage's failure was then never
    logged (a failure was told only when not failing yet; a review). Each is told at the
    outage log's level (its reminders at once here)."""
    import flowloop.outagelog as outagelog

    monkeypatch.setattr(outagelog, "REMINDER_SECONDS", 0.0)
    outage = [True]
    second = threading.Event()

    def renew(run_ids: Sequence[str]) -> set[str]:
        if outage[0]:
            raise ConnectionError("second outage" if second.is_set() else "first outage")
        return set(run_ids)

    handler = Lines()
    logging.getLogger("flowloop").addHandler(handler)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        guard = LeaseGuard(
            lease_seconds=LEASE_S,
            poll_seconds=0.1,
            renew=renew,
            poll=dict,
            lost=lambda run_id, _why: guard.drop(run_id),
            controls=lambda _requests: None,
            released=lambda _run_id: False,
        )
        guard.start(loop)
        try:
            guard.hold("r1", loop.time())
            assert await asyncio.to_thread(handler.fenced.wait, WAIT_S), "r1 never fenced"
            outage[0] = False  # over; the worker holds nothing to renew
            second.set()
            outage[0] = True
            guard.hold("r2", loop.time())
            await asyncio.to_thread(
                poll,
                lambda: any("second outage" in line for line in handler.lines),
                timeout=WAIT_S,
                every=0.01,
                what="the second outage's heartbeat failure to be logged",
            )
        finally:
            guard.stop(loop)
            guard.close()

    try:
        asyncio.run(main())
    finally:
        logging.getLogger("flowloop").removeHandler(handler)
