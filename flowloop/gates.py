"""What a worker checks before it calls a step: the step's circuit breaker and the rate
limits it takes (flowloop/flowcontrol.py holds the definitions and maths, the database holds
their state: flowloop/store/limits.py).

A step that may not be called now is not started: no ``step_started`` is written, so its
attempt does not count. Its run gets one ``run_deferred`` entry (due when a token is free,
or when the breaker's cool-down ends) and is handed back to the queue — durable, no worker
or thread held; a breaker declared ``when_open="fail"`` fails the run instead
(``run_failed``, reason ``breaker_open``). An operator's ``retry`` starts it again.

Breakers count the failures of the calls behind them, whichever worker made them; opening,
the trial after the cool-down (``half_opened``) and closing are journaled in the breaker's
own journal and told to :attr:`Gates.changed` (the worker raises alerts and metrics). The
trial is one call, named by its run and the seq of its ``step_started``: only its outcome
closes or reopens the breaker (flowloop/flowcontrol.py says when another replaces it).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from flowloop import journal as j
from flowloop.clock import Clock
from flowloop.dbclock import SKEW_IGNORED
from flowloop.definition import StepSpec, Workflow
from flowloop.flowcontrol import BREAKER_REASON, RATE_REASON, Breaker, RateLimit, admit, call_id
from flowloop.journal import JournalEvent, RunRecord
from flowloop.store import Store
from flowloop.store.limits import ClaimLimits

log = logging.getLogger("flowloop")

SHORT_WAIT_SECONDS: Final = 0.2
"""A token due within this long is waited for by the worker instead of rescheduling."""
SHORT_WAITS: Final = 5


def share_limits(store: Store, workflows: Mapping[str, Workflow]) -> None:
    """Tell the store which workflows' claims count slots (cluster-wide limits)."""
    setter = getattr(store, "set_claim_limits", None)
    if setter is None:
        return
    setter(
        {
            name: ClaimLimits(
                max_concurrency=w.max_concurrency,
                key_limit=w.key_limit,
                keyed=w.concurrency_key is not None,
            )
            for name, w in workflows.items()
            if w.limited
        }
    )


def gated_start(workflow: Workflow) -> bool:
    """A new run of ``workflow`` must be claimed like any other, not created claimed: its
    claim counts slots, or its first call takes a limit."""
    spec = workflow.steps.get(workflow.initial)
    return (
        workflow.limited
        or workflow.rate_limit is not None
        or (spec is not None and (spec.rate_limit is not None or spec.breaker is not None))
    )


@dataclass(frozen=True)
class BreakerChange:
    """A breaker opened, let a trial through (``half_opened``) or closed."""

    name: str
    kind: str
    worker: str
    error: str | None = None
    until: float | None = None


def rate_limits_of(
    workflow: Workflow, spec: StepSpec, state: str, visit: int, attempt: int
) -> list[RateLimit]:
    """The rate limits a call of ``state``'s step takes: the step's, and the workflow's
    before the first call of the run (initial state, first visit, first attempt)."""
    found = [] if spec.rate_limit is None else [spec.rate_limit]
    first_call = state == workflow.initial and visit <= 1 and attempt == 0
    if workflow.rate_limit is not None and first_call and workflow.rate_limit not in found:
        found.append(workflow.rate_limit)
    return found


def gated(workflow: Workflow, spec: StepSpec) -> bool:
    """Whether a call of ``spec``'s step may be held by a gate (a breaker or a rate limit):
    if not, :meth:`Gates.check` has nothing to decide (callers skip its coroutine)."""
    return (
        spec.breaker is not None or spec.rate_limit is not None or workflow.rate_limit is not None
    )


_GATE_REASONS: Final = (f"{BREAKER_REASON}:", f"{RATE_REASON}:")
"""How a run a gate deferred says why (its ``reason``)."""


def _call(record: RunRecord) -> str:
    """The call a check of ``record`` admits: its next entry is the ``step_started``."""
    return call_id(record.id, record.last_seq + 1)


def _queued(reason: str | None) -> set[str]:
    if reason is None or not reason.startswith(RATE_REASON + ":"):
        return set()
    return set(reason.split(":", 1)[1].split(","))


class Gates:
    """One worker's checks before calls (breakers, then rate limits) and its breaker
    bookkeeping after them."""

    def __init__(self, store: Store, worker: str, clock: Clock) -> None:
        self.store: Any = store
        self.worker = worker
        self.clock = clock
        self.changed: list[Callable[[BreakerChange], None]] = []
        self._trials: set[str] = set()
        """The trial calls (:func:`~flowloop.flowcontrol.call_id`) this worker was given."""
        self._wakeups: list[float] = []
        """The due times (by :attr:`clock`) of the runs this worker deferred."""
        self._grants: dict[str, dict[str, Any]] = {}

    def granted(self, run_id: str) -> dict[str, Any]:
        """For the ``step_started`` data of a call that took rate limits: when (by the
        database's clock) and which; ``{}`` for other calls."""
        return self._grants.pop(run_id, {}) if self._grants else {}

    async def check(
        self, workflow: Workflow, record: RunRecord, state: str, *, attempt: int
    ) -> JournalEvent | None:
        """``None``: call the step of ``state`` now (tokens taken). Else the entry that
        defers (``run_deferred``) or fails (``run_failed``) the run, following ``record``."""
        spec = workflow.steps.get(state)
        if spec is None:
            return None
        limits = rate_limits_of(workflow, spec, state, record.visit(state), attempt)
        if spec.breaker is None and not limits:
            return None
        await self._claimed_early(record)
        breaker = spec.breaker
        if breaker is not None:
            now_state = self.store.breaker_state(breaker.name)
            if now_state.status == "closed":
                breaker = None  # the fast path: a closed breaker has nothing to take
            else:
                look = admit(breaker, now_state, self.store.db_now(), _call(record))
                if not look.allowed:
                    # Open in its cool-down, or its trial runs elsewhere: refused as seen,
                    # before a token is taken (it would be spent on no call) — and not by
                    # the breaker's admission, which would give a cool-down that ended
                    # meanwhile's trial to a run its token may then defer.
                    return self._refused(breaker, record, state, look.due)
        if limits:
            deferred = await self._rate(limits, record, state)
            if deferred is not None:
                return deferred
        # The trial after a cool-down goes to a call that is made: taken after the tokens
        # (taken first, a run the rate limit then deferred held it for a whole cool-down,
        # and every other run was refused meanwhile).
        blocked = None if breaker is None else self._breaker(breaker, record, state)
        if blocked is not None:
            self._grants.pop(record.id, None)  # another worker took the trial: no call
        return blocked

    async def _claimed_early(self, record: RunRecord) -> None:
        """A run a gate deferred, claimed before its due time by the database's clock, is
        given that short span here. The claim judged it due by the engine's clock, which
        may run up to :data:`~flowloop.dbclock.SKEW_IGNORED` ahead of the database's (an
        offset under it is taken as none): looked at at once, the breaker or the rate limit
        deferred it to the same due time, and the next claim took it at once again — some
        400 ``run_deferred`` entries for one cool-down's end or one rate slot."""
        due, reason = record.next_run_at, record.reason
        if due is None or reason is None or not reason.startswith(_GATE_REASONS):
            return
        early = due - self.store.db_now()
        if 0.0 < early <= SKEW_IGNORED:
            await asyncio.sleep(early)

    def _breaker(self, breaker: Breaker, record: RunRecord, state: str) -> JournalEvent | None:
        call = _call(record)
        answer = self.store.breaker_admit(breaker, self.worker, call)
        if answer.change is not None:
            self._tell(
                BreakerChange(breaker.name, answer.change, self.worker, until=answer.state.until)
            )
        if answer.allowed:
            if answer.trial:
                self._trials.add(call)
            return None
        return self._refused(breaker, record, state, answer.due)

    def _refused(
        self, breaker: Breaker, record: RunRecord, state: str, due: float | None
    ) -> JournalEvent:
        """The entry of a run the breaker refuses: failed, or deferred until ``due``."""
        reason = f"{BREAKER_REASON}:{breaker.name}"
        if breaker.when_open == "fail":
            return self._entry(
                record,
                j.RUN_FAILED,
                state=state,
                error_message=f"breaker {breaker.name!r} is open; the step was not called",
                data={"reason": reason},
            )
        return self._defer(record, state, self.clock.now() if due is None else due, reason)

    async def _rate(
        self, limits: list[RateLimit], record: RunRecord, state: str
    ) -> JournalEvent | None:
        queued = _queued(record.reason)
        for _ in range(SHORT_WAITS):
            granted, due, now = self.store.take_tokens(
                limits, queued=queued, lead=SHORT_WAIT_SECONDS
            )
            if granted:
                # Granted for that instant: waited in real time, as ``due - now`` is a span
                # of the database's clock (a fake engine clock's sleep would call early).
                await asyncio.sleep(max(0.0, due - now))
                self._grants[record.id] = {
                    "granted_at": due,
                    "rate_limits": sorted(limit.name for limit in limits),
                }
                return None
            # A slot due very soon is waited for here: rescheduling costs a journal entry
            # and a claim, and the claim's latency would be lost from the limit's rate.
            wait = due - now
            if wait > SHORT_WAIT_SECONDS:
                break
            queued = {limit.name for limit in limits}  # it holds its slot in each queue
            await asyncio.sleep(max(0.0, wait))
        reason = f"{RATE_REASON}:{','.join(sorted(limit.name for limit in limits))}"
        return self._defer(record, state, due, reason)

    def _defer(self, record: RunRecord, state: str, due: float, reason: str) -> JournalEvent:
        # Wake this worker when the run is due again (another worker may claim it first):
        # ``due`` is by the database's clock, like every due time, and so is the engine's
        # clock the claims judge due times by — not this host's wall clock, which may be
        # skewed from it (a worker 90 s behind woke 90 s late, one ahead at once).
        heapq.heappush(self._wakeups, due)
        return self._entry(record, j.RUN_DEFERRED, state=state, data={"due": due, "reason": reason})

    def wake_in(self, horizon: float) -> float:
        """Seconds until the earliest run this worker deferred is due (at most ``horizon``),
        by the engine's clock."""
        now = self.clock.now()
        while self._wakeups and self._wakeups[0] <= now:
            heapq.heappop(self._wakeups)
        if not self._wakeups:
            return horizon
        return min(horizon, self._wakeups[0] - now)

    def called(self, spec: StepSpec, record: RunRecord, error: BaseException | None) -> None:
        """After the call of ``spec``'s step that ``record`` started (its last entry is
        the ``step_started``): count a failure against its breaker; the trial's outcome
        closes or reopens it — only the trial's: the outcome of a call let through before
        the breaker opened changes nothing while it is open or half open."""
        breaker = spec.breaker
        if breaker is None:
            return
        call = call_id(record.id, record.last_seq)
        trial = call in self._trials
        self._trials.discard(call)
        try:
            if error is not None:
                text = f"{type(error).__name__}: {error}"
                if self.store.breaker_failed(breaker, self.worker, text, call) == "opened":
                    state = self.store.breaker_state(breaker.name)
                    self._tell(
                        BreakerChange(breaker.name, "opened", self.worker, text, state.until)
                    )
            elif trial and self.store.breaker_succeeded(breaker, self.worker, call) == "closed":
                self._tell(BreakerChange(breaker.name, "closed", self.worker))
        except Exception as problem:  # the step's own outcome is journaled regardless
            log.warning("breaker %s: could not record a call: %s", breaker.name, problem)

    def _tell(self, change: BreakerChange) -> None:
        log.warning(
            "breaker %s %s (worker %s)%s",
            change.name,
            change.kind,
            change.worker,
            f": {change.error}" if change.error else "",
            extra={"event": f"breaker_{change.kind}", "breaker": change.name},
        )
        for hook in self.changed:
            try:
                hook(change)
            except Exception:  # a hook must never break the worker
                log.exception("breaker hook failed")

    def _entry(self, record: RunRecord, kind: str, **fields: Any) -> JournalEvent:
        return JournalEvent(
            run_id=record.id,
            seq=record.last_seq + 1,
            kind=kind,
            at=self.clock.now(),
            worker=self.worker,
            **fields,
        )
