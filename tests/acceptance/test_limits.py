"""Flow control across worker processes (GitHub issue 15): a workflow's max_concurrency and
a per-key limit hold for every worker sharing the database, a rate limit for all of them,
and a breaker opened by the failures of two workers keeps every worker from calling.

Real ``flowloop worker`` processes — 3 on a PostgreSQL schema, 2 on one SQLite file — run
the workflows of tests/limitkit.py; every step call appends its start and end time to a
ledger file, and the assertions read the ledger (what the steps saw), not the database.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import limitkit
import mwkit
import pytest
import sqlalchemy as sa

from flowloop import Engine
from flowloop.loader import import_file

DEADLINE_S = 120.0


@pytest.fixture
def workers() -> Iterator[mwkit.Workers]:
    procs = mwkit.Workers()
    yield procs
    procs.stop_all()


def _start_workers(
    url: str,
    tmp_path: Path,
    workers: mwkit.Workers,
    *,
    concurrency: int = 8,
    lease: float = 30.0,
    env: dict[str, str] | None = None,
) -> tuple[Path, list[mwkit.WorkerProc]]:
    flow = limitkit.write_flow(tmp_path)
    ledger = tmp_path / "ledger"
    ledger.mkdir(exist_ok=True)
    count = 3 if url.startswith("postgresql") else 2
    environment = {"LIMIT_LEDGER_DIR": str(ledger), **(env or {})}
    with Engine(url, workflows=_flows(flow)):
        pass  # the schema, before the workers open it
    procs = [
        workers.add(
            mwkit.spawn_worker(
                flow, url, tmp_path, f"w{i}", concurrency=concurrency, lease=lease, env=environment
            )
        )
        for i in range(count)
    ]
    for proc in procs:
        mwkit.wait_for(f"{proc.name} to start", proc.is_up, timeout=60, describe=workers.logs)
    return flow, procs


def _flows(flow: Path) -> list[object]:
    module = import_file(flow)
    return [module.capped, module.keyed, module.fair, module.paced, module.guarded]


def _finish(url: str, total: int, workers: mwkit.Workers) -> None:
    mwkit.wait_for(
        f"{total} runs to finish",
        lambda: mwkit.all_finished(url, total),
        timeout=DEADLINE_S,
        describe=lambda: f"{mwkit.statuses(url)}\n{workers.logs()}",
    )


def test_limits__workflow_limit_of_two_and_key_limit_of_one_hold_across_workers(
    store_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    flow, procs = _start_workers(store_url, tmp_path, workers)
    module = import_file(flow)
    with Engine(store_url, workflows=_flows(flow)) as engine:
        engine.start_many(module.capped, [{"n": i} for i in range(30)])
        engine.start_many(module.keyed, [{"customer": f"k{i % 50}", "n": i} for i in range(150)])
    _finish(store_url, 180, workers)
    for proc in procs:
        assert proc.stop() == 0, workers.logs()
    assert mwkit.statuses(store_url) == Counter({"succeeded": 180})

    rows = limitkit.ledger(tmp_path / "ledger")
    capped = [(r["start"], r["end"]) for r in rows if r["wf"] == "capped"]
    assert len(capped) == 60
    assert limitkit.max_overlap(capped) <= 2
    assert limitkit.max_overlap(capped) == 2  # and it was used

    keyed = [r for r in rows if r["wf"] == "keyed"]
    assert len(keyed) == 300
    per_key = {
        key: limitkit.max_overlap([(r["start"], r["end"]) for r in keyed if r["key"] == key])
        for key in {r["key"] for r in keyed}
    }
    assert len(per_key) == 50
    assert max(per_key.values()) == 1, {k: v for k, v in per_key.items() if v > 1}
    # ... while different keys ran at the same time.
    assert limitkit.max_overlap([(r["start"], r["end"]) for r in keyed]) > 1
    # FIFO per key: a key's runs were started in the order they were queued.
    with mwkit.db(store_url) as db, db.connect() as conn:
        created = dict(
            (row[0], row[1])
            for row in conn.execute(sa.text("SELECT id, created_at FROM flowloop_runs"))
        )
    for key in per_key:
        firsts = sorted(
            (r["start"], r["run"]) for r in keyed if r["key"] == key and r["state"] == "a"
        )
        assert [created[run] for _, run in firsts] == sorted(created[run] for _, run in firsts)


def test_limits__a_run_cut_off_by_a_crash_keeps_its_place_in_its_keys_queue(
    store_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    """Five runs of one key (``key_limit=1``); the worker inside the first run's step is
    SIGKILLed. Recovery (every 1.5 s: half the lease) makes the run due at once
    (``step_interrupted``), later than the four others were due: it is still the key's
    next run (it went last: tests/integration/test_key_order.py), and the key's runs go
    in the order they were queued."""
    env = {"LIMIT_STEP_SLEEP": "0.3"}
    flow, procs = _start_workers(store_url, tmp_path, workers, lease=3.0, env=env)
    module = import_file(flow)
    with Engine(store_url, workflows=_flows(flow)) as engine:
        ids = [engine.start(module.keyed, {"customer": "k", "n": n}).id for n in range(5)]

    def in_its_step() -> tuple[str, str] | None:
        with mwkit.db(store_url) as db, db.connect() as conn:
            row = conn.execute(
                sa.text("SELECT status, state, owner FROM flowloop_runs WHERE id = :id"),
                {"id": ids[0]},
            ).one()
        return (row.owner, row.state) if row.status == "running" and row.owner else None

    owner, state = mwkit.wait_for("run 0 in its step", in_its_step, timeout=60, every=0.01)
    (holder,) = [proc for proc in procs if str(proc.pid) == owner.split(":")[1]]
    holder.kill()
    _finish(store_url, 5, workers)
    for proc in procs:
        if proc is not holder:
            assert proc.stop() == 0, workers.logs()
    assert mwkit.statuses(store_url) == Counter({"succeeded": 5})
    cut_off = [e for e in mwkit.journal_rows(store_url) if e.kind == "step_interrupted"]
    assert [(e.run_id, e.state) for e in cut_off] == [(ids[0], state)]
    # The calls that finished (the cut-off one wrote nothing), one at a time, in order.
    calls = sorted(limitkit.ledger(tmp_path / "ledger"), key=lambda r: r["start"])
    assert [(ids.index(r["run"]), r["state"]) for r in calls] == [
        (n, step) for n in range(5) for step in "ab"
    ]


def test_limits__rate_limit_of_20_per_second_holds_across_workers_and_is_reached(
    store_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    """100 calls queued at once against 20/s: about 5 s of calls. A window of 5 s instead of
    the issue's 30 s keeps the suite fast; bench/limits.py runs longer windows."""
    flow, procs = _start_workers(store_url, tmp_path, workers, concurrency=4)
    module = import_file(flow)
    runs = 100
    with Engine(store_url, workflows=_flows(flow)) as engine:
        engine.start_many(module.paced, [{"n": i} for i in range(runs)])
    _finish(store_url, runs, workers)
    for proc in procs:
        assert proc.stop() == 0, workers.logs()
    assert mwkit.statuses(store_url) == Counter({"succeeded": runs})

    # The grants, by the database's clock, from the journal: never more than 20 in any
    # window of one second, and at 20/s (at least 90 %) while runs were queued.
    with mwkit.db(store_url) as db, db.connect() as conn:
        deferred = conn.execute(
            sa.text("SELECT count(*) FROM flowloop_journal WHERE kind = 'run_deferred'")
        ).scalar_one()
        grants = conn.execute(sa.text("SELECT grants FROM flowloop_rate_limits")).scalar_one()
    granted = sorted(  # entries as the store splits rows (a start may share a row)
        entry.data["granted_at"]
        for entry in mwkit.journal_rows(store_url)
        if entry.kind == "step_started" and entry.data
    )
    assert grants == len(granted) == runs
    assert deferred >= runs - 20  # the burst was rescheduled, not held by workers
    assert limitkit.max_in_window(granted, 1.0 - 1e-6) <= 20
    rate = (len(granted) - 1) / (granted[-1] - granted[0])
    gaps = " ".join(f"{b - a:.3f}" for a, b in itertools.pairwise(granted))
    assert rate >= 0.9 * 20, (rate, gaps)
    # What the steps saw: every call, at the rate. Each starts a scheduling delay after its
    # grant (the step_started commit, a thread): that delay varies, so the limit's promise
    # is stated on the grants above; the most calls seen in one second is only reported.
    calls = sorted(r["start"] for r in limitkit.ledger(tmp_path / "ledger"))
    assert len(calls) == runs
    assert (len(calls) - 1) / (calls[-1] - calls[0]) >= 0.9 * 20
    print(
        f"rate 20/s: {rate:.2f}/s granted; calls seen in 1 s: at most",
        limitkit.max_in_window(calls, 1.0),
    )
    assert len({r["pid"] for r in limitkit.ledger(tmp_path / "ledger")}) >= 2


def test_limits__breaker_opens_on_failures_of_two_workers_and_closes_after_cool_down(
    store_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    fail_flag = tmp_path / "failing"
    fail_flag.touch()
    flow, procs = _start_workers(
        store_url,
        tmp_path,
        workers,
        concurrency=1,
        env={"LIMIT_FAIL_FLAG": str(fail_flag), "LIMIT_COOL": "2"},
    )
    module = import_file(flow)
    with Engine(store_url, workflows=_flows(flow)) as engine:
        engine.start_many(module.guarded, [{"n": i} for i in range(4)])
        _finish(store_url, 4, workers)
        store = engine.store
        opened = mwkit.wait_for(
            "the breaker to open",
            lambda: [e for e in store.breaker_journal("provider") if e.kind == "opened"],  # type: ignore[attr-defined]
            timeout=30,
        )[0]
        # Four failed calls, from two workers or more, opened it.
        failures = [r for r in limitkit.ledger(tmp_path / "ledger") if not r["ok"]]
        assert len(failures) == 4
        assert len({r["pid"] for r in failures}) >= 2
        fail_flag.unlink()  # the provider is back; the breaker does not know yet

        later = engine.start_many(module.guarded, [{"n": i} for i in range(6)])
        _finish(store_url, 10, workers)
        journal = store.breaker_journal("provider")  # type: ignore[attr-defined]
    for proc in procs:
        assert proc.stop() == 0, workers.logs()

    assert [e.kind for e in journal] == ["opened", "half_opened", "closed"]
    trial_at = journal[1].at
    assert trial_at >= opened.data["until"]
    # While open, no step behind it was called: every later call started at the trial or
    # after it, and the runs that found it open were rescheduled (journaled), not failed.
    calls = [r for r in limitkit.ledger(tmp_path / "ledger") if r["ok"]]
    assert len(calls) == 6
    assert min(r["start"] for r in calls) >= trial_at - 0.05  # DB and worker clocks: one host
    later_ids = {info.id for info in later.runs}
    with mwkit.db(store_url) as db, db.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT run_id, data FROM flowloop_journal WHERE kind = 'run_deferred'")
        ).all()
    assert {run for run, _ in rows} <= later_ids
    assert rows and all(json.loads(data)["reason"] == "breaker_open:provider" for _, data in rows)
    assert mwkit.statuses(store_url) == Counter({"failed": 4, "succeeded": 6})
    # Alerted by the worker that opened it and the one that closed it; shown by `status`.
    logs = workers.logs(tail=10_000)
    assert "[critical] breaker opened provider" in logs
    assert "[warning] breaker closed provider" in logs
    shown = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", "status", "--db", store_url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "breaker provider: closed (opened 1 time(s)" in shown


def test_limits__a_sigkilled_trial_holder_is_replaced_once_its_run_is_taken_over(
    store_url: str, tmp_path: Path, workers: mwkit.Workers
) -> None:
    """The worker making the breaker's trial call is SIGKILLed: once its run's lease has
    ended (or its run was taken over) the next call is the trial, naming the one given up,
    and closes the breaker; nothing else was called before it. (This held before the trial
    was named by its call; kept.)"""
    fail_flag, hang_flag = tmp_path / "failing", tmp_path / "hanging"
    fail_flag.touch()
    hang_flag.touch()
    flow, procs = _start_workers(
        store_url,
        tmp_path,
        workers,
        concurrency=2,
        lease=3.0,
        env={
            "LIMIT_FAIL_FLAG": str(fail_flag),
            "LIMIT_HANG_FLAG": str(hang_flag),
            "LIMIT_COOL": "1",
        },
    )
    module = import_file(flow)
    ledger = tmp_path / "ledger"
    with Engine(store_url, workflows=_flows(flow)) as engine:
        store: Any = engine.store
        engine.start_many(module.guarded, [{"n": i} for i in range(4)])
        _finish(store_url, 4, workers)
        assert [e.kind for e in store.breaker_journal("provider")] == ["opened"]
        fail_flag.unlink()
        until = float(store.breaker_state("provider").until)
        mwkit.wait_for("the cool-down", lambda: store.db_now() >= until, timeout=30)
        hung = engine.start(module.guarded, {"customer": "hang"}).id
        marks = mwkit.wait_for("the trial call", lambda: list(ledger.glob("hang-*")), timeout=30)
        holder = next(proc for proc in procs if f"hang-{proc.pid}" == marks[0].name)
        holder.kill()
        hang_flag.unlink()
        later = engine.start_many(module.guarded, [{"n": i} for i in range(3)])
        _finish(store_url, 8, workers)
        journal = store.breaker_journal("provider")
    for proc in procs:
        if proc is not holder:
            assert proc.stop() == 0, workers.logs()

    assert [e.kind for e in journal] == ["opened", "half_opened", "half_opened", "closed"]
    first, second = journal[1].data, journal[2].data
    assert str(first["trial"]).startswith(f"{hung}:")
    assert second["given_up"] == first["trial"]
    assert str(second["trial"]).split(":")[0] in {info.id for info in later.runs}
    # Nothing behind the breaker was called between the kill and the new trial.
    calls = [r for r in limitkit.ledger(ledger) if r["ok"]]
    assert len(calls) == 3
    assert min(r["start"] for r in calls) >= journal[2].at - 0.05  # one host's clocks
    assert mwkit.statuses(store_url) == Counter({"failed": 5, "succeeded": 3})
