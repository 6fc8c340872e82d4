"""Deploying a changed workflow over live runs (issue 16), on SQLite and PostgreSQL.

Runs of ``order`` v1 sit at every kind of position — queued, retrying, sleeping, waiting
with a timeout, interrupted by a SIGKILL inside a step — then v2 is deployed with (a) an
added required field and its upcaster, (b) the same without one, (c) a renamed state with
a declared mapping, (d) a removed state. ``check`` judges each run first; then a worker
runs them all, and each run must end as its verdict said: ``continues``/``migrates`` →
succeeded; ``parks``/``fails`` → paused with the very reason check gave. Nothing fails.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from deploykit import (
    OrderV1,
    OrderV2,
    added_field,
    order,
    removed_state,
    renamed_state,
    run_killed_in_charge,
)

from flowloop import Engine, Workflow
from flowloop.checking import check_runs
from flowloop.clock import FakeClock
from flowloop.store.sql import SQLStore

LATER_S = 5_000.0
"""Past every due time of the v1 runs: backoff 500 s, sleep 600 s, wait timeout 3600 s."""

VERDICT_COUNTS: Counter[str] = Counter()
"""Every verdict these tests checked against a worker (printed by the last test)."""


def _settle(engine: Engine, clock: FakeClock) -> None:
    """Run everything due; then once more past the wait timeout (for runs that went on to
    wait in ``confirm`` meanwhile)."""
    engine.run_until_idle()
    clock.advance(LATER_S)
    engine.run_until_idle()


def _v1_runs(url: str) -> tuple[dict[str, str], float]:
    """One v1 run at each position; returns {position: run id} and the time now."""
    runs: dict[str, str] = {}
    now = time.time()
    clock = FakeClock(now)
    with Engine(url, clock=clock, workflows=[order()]) as engine:
        wf = engine.workflow("order")
        runs["retrying"] = engine.start(wf, OrderV1(order_id="r", fail_reserve=1)).id
        runs["sleeping"] = engine.start(wf, OrderV1(order_id="s", sleep=True)).id
        runs["waiting"] = engine.start(wf, OrderV1(order_id="w")).id
        engine.run_until_idle(idle_horizon=10)
        # A real worker process dies inside a step (the others are not due yet for it).
        runs["interrupted"] = run_killed_in_charge(url)
        runs["queued"] = engine.start(wf, OrderV1(order_id="q")).id
        where = {p: (engine.get(r).status, engine.get(r).state) for p, r in runs.items()}
    assert where == {
        "interrupted": ("running", "charge"),
        "retrying": ("retrying", "reserve"),
        "sleeping": ("scheduled", "charge"),
        "waiting": ("scheduled", "confirm"),
        "queued": ("scheduled", "reserve"),
    }
    return runs, now


def _deploy(url: str, new: Workflow, now: float, runs: dict[str, str]) -> dict[str, str]:
    """Check, then let a worker run everything; assert each run ends as judged. Returns
    {position: verdict}."""
    clock = FakeClock(now + LATER_S)
    with Engine(url, clock=clock, workflows=[new]) as engine:
        assert isinstance(engine.store, SQLStore)
        report = check_runs(engine.store, new, every=True)
        verdicts = {run.run_id: run for run in report.runs}
        assert set(verdicts) == set(runs.values())
        _settle(engine, clock)
        for position, run_id in runs.items():
            verdict, info = verdicts[run_id], engine.get(run_id)
            VERDICT_COUNTS[verdict.kind] += 1
            if verdict.kind in ("continues", "migrates"):
                assert info.status == "succeeded", (position, info)
            else:
                assert (info.status, info.reason) == ("paused", verdict.reason), position
            assert engine.replay(run_id).matches
        assert report.ok == all(v.kind in ("continues", "migrates") for v in verdicts.values())
    return {position: verdicts[run_id].kind for position, run_id in runs.items()}


def test_deploy__added_field_with_upcaster__every_run_migrates(store_url: str) -> None:
    runs, now = _v1_runs(store_url)
    new = added_field(migrated=True)
    assert set(_deploy(store_url, new, now, runs).values()) == {"migrates"}
    with Engine(store_url, workflows=[new]) as engine:
        for run_id in runs.values():
            info = engine.get(run_id)
            assert isinstance(info.context, OrderV2) and info.context.currency == "EUR"
            journal = engine.history(run_id)
            # The journal keeps what was written: the first entry is the v1 context ...
            assert "currency" not in json.loads(journal[0].context or "{}")
            assert "cv" not in journal[0].data
            # ... and the next boundary wrote version 2.
            written = [e for e in journal if e.context is not None]
            assert written[-1].data["cv"] == 2
            assert json.loads(written[-1].context or "{}")["currency"] == "EUR"


def test_deploy__added_field_without_upcaster__every_run_parked_not_failed(
    store_url: str,
) -> None:
    runs, now = _v1_runs(store_url)
    assert set(_deploy(store_url, added_field(migrated=False), now, runs).values()) == {"fails"}
    # The fix: deploy the upcaster, unpause: each run goes on.
    fixed = added_field(migrated=True)
    clock = FakeClock(now + 3 * LATER_S)
    with Engine(store_url, clock=clock, workflows=[fixed]) as engine:
        reasons = {engine.get(r).reason for r in runs.values()}
        assert reasons == {
            "context_mismatch: no upcaster from context version 1 to 2 "
            "(add migrate={1: ...}) (context v1 -> v2)"
        }
        for run_id in runs.values():
            engine.unpause(run_id)
        _settle(engine, clock)
        assert {engine.get(r).status for r in runs.values()} == {"succeeded"}


def test_deploy__renamed_state__parked_then_migrated(store_url: str) -> None:
    runs, now = _v1_runs(store_url)
    verdicts = _deploy(store_url, renamed_state(), now, runs)
    assert verdicts == {
        "interrupted": "parks",  # state 'charge' is gone: parked, not failed "interrupted"
        "sleeping": "parks",
        "retrying": "parks",  # reserve's next -> charge is gone
        "queued": "parks",
        "waiting": "continues",
    }
    new = renamed_state()
    clock = FakeClock(now + 3 * LATER_S)
    with Engine(store_url, clock=clock, workflows=[new]) as engine:
        moved = engine.migrate_workflow("order", to=2, by="deployer")
        # Every parked run moves (the waiting one went on and has finished).
        parked = sorted(r for p, r in runs.items() if verdicts[p] == "parks")
        assert sorted(m.run_id for m in moved) == parked
        assert [m.problem for m in moved] == [None] * len(moved)
        entry = engine.history(runs["interrupted"])[-1]
        assert (entry.kind, entry.state) == ("run_migrated", "bill")
        assert {k: entry.data[k] for k in ("by", "from", "to", "from_state")} == {
            "by": "deployer",
            "from": 1,
            "to": 2,
            "from_state": "charge",
        }
        _settle(engine, clock)
        for position, run_id in runs.items():
            info = engine.get(run_id)
            assert info.status == "succeeded", position
            assert engine.replay(run_id).matches
        assert engine.get(runs["sleeping"]).version == 2
        trail = engine.get(runs["sleeping"]).context.trail  # type: ignore[union-attr]
        assert trail == ["reserve@v1", "bill@v2", "ship@v2"]


def test_deploy__removed_state__parked_and_unparked_by_the_old_definition(
    store_url: str,
) -> None:
    runs, now = _v1_runs(store_url)
    verdicts = _deploy(store_url, removed_state(), now, runs)
    assert verdicts == {
        "interrupted": "parks",  # charge's next -> confirm is gone
        "sleeping": "parks",
        "waiting": "parks",  # state 'confirm' is gone
        "retrying": "continues",
        "queued": "continues",
    }
    # Roll back (v1 again) and unpause: the parked runs go on where they were.
    clock = FakeClock(now + 3 * LATER_S)
    with Engine(store_url, clock=clock, workflows=[order()]) as engine:
        for position in ("interrupted", "sleeping", "waiting"):
            engine.unpause(runs[position])
        _settle(engine, clock)
        assert {engine.get(r).status for r in runs.values()} == {"succeeded"}


def test_deploy__both_versions_loaded__runs_stay_on_theirs(store_url: str) -> None:
    runs, now = _v1_runs(store_url)
    old, new = order(), renamed_state()
    clock = FakeClock(now + LATER_S)
    with Engine(store_url, clock=clock, workflows=[old, new]) as engine:
        assert isinstance(engine.store, SQLStore)
        report = check_runs(engine.store, new, pinned={old.fingerprint: old})
        assert report.ok and report.counts["continues"] == len(runs)
        assert engine.check(new) == []
        fresh = engine.start(engine.workflow("order"), OrderV1(order_id="new")).id
        _settle(engine, clock)
        for run_id in runs.values():
            info = engine.get(run_id)
            assert (info.status, info.version) == ("succeeded", 1)
            assert "charge@v1" in info.context.trail  # type: ignore[union-attr]
        info = engine.get(fresh)
        assert (info.version, info.status) == (2, "succeeded")
        assert info.context.trail == ["reserve@v2", "bill@v2", "ship@v2"]  # type: ignore[union-attr]
    VERDICT_COUNTS["continues"] += len(runs)


def _approval(with_wait: bool) -> Workflow:
    wf = Workflow("approval", context=OrderV1, version=2 if not with_wait else 1)
    wf.step(name="ask", initial=True, next="approve" if with_wait else "done")(lambda ctx: None)
    if with_wait:
        wf.wait("approve", on={"approved": "done"})  # no timeout: never claimed
    wf.final("done")
    return wf


def test_deploy__waiting_without_timeout__parked_when_a_worker_starts(store_url: str) -> None:
    with Engine(store_url, workflows=[_approval(True)]) as engine:
        run_id = engine.start(engine.workflow("approval"), OrderV1(order_id="a")).id
        engine.run_until_idle()
        assert engine.get(run_id).next_run_at is None  # waits, with nothing due
    new = _approval(False)
    with Engine(store_url, workflows=[new]) as engine:
        assert isinstance(engine.store, SQLStore)
        (verdict,) = check_runs(engine.store, new).runs
        assert verdict.kind == "parks"
        engine.run_until_idle()
        info = engine.get(run_id)
        assert (info.status, info.reason) == ("paused", verdict.reason)
        VERDICT_COUNTS["parks"] += 1
    with Engine(store_url, workflows=[_approval(True)]) as engine:  # rolled back
        engine.unpause(run_id)
        engine.send(run_id, "approved")
        assert engine.get(run_id).status == "succeeded"


def test_deploy__verdict_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """Not a check of its own: prints how many verdicts of each kind were matched against
    a worker above (for the closing note)."""
    with capsys.disabled():
        print(f"\ndeploy verdicts matched against a worker: {dict(VERDICT_COUNTS)}")
    assert all(count >= 0 for count in VERDICT_COUNTS.values())
