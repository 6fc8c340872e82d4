"""`flowloop worker` as a real process: SIGKILL and restart, SIGTERM with work in flight,
a second signal, pause/unpause/stop from another process, two workers on one SQLite file,
and the example workflows (poll, converge) run for real.

Waits are bounded polls of the database or of files the loop functions write; nothing
passes by sleeping long enough.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from loopkit import assert_no_duplicate_slots, assert_slots_accounted, describe, wait_for
from loopkit_proc import (
    ROOT,
    WorkerProcess,
    cli,
    cli_here,
    engine,
    lines,
    report,
    wait_exists,
    workers,
    write_module,
)

from flowloop.errors import UnknownLoop
from flowloop.loader import load_paths
from flowloop.store.loops import LoopEvent

pytestmark = pytest.mark.crash

BEAT_EVERY = 0.25
KILLS = 1
"""Workers SIGKILLed mid-iteration before the last one runs on (each start costs ~1 s)."""
BEAT = """
    import asyncio
    import os
    from pathlib import Path

    from flowloop.loops import loop

    LOG = Path(os.environ["BEAT_LOG"])


    def note(what: str, slot: float) -> None:
        with LOG.open("a") as f:
            f.write(f"{what} {slot:.3f} {os.getpid()}\\n")


    @loop(every=%(every)s)
    async def beat(it):
        note("start", it.slot)
        await asyncio.sleep(%(duration)s)
        note("end", it.slot)
"""


def beat_module(tmp_path: Path, *, every: float = BEAT_EVERY, duration: float = 0.15) -> Path:
    return write_module(tmp_path / "beat.py", BEAT % {"every": every, "duration": duration})


def loop_journal(db: Path, name: str) -> list[LoopEvent]:
    """The loop's journal ([] until a worker has registered it)."""
    if not db.exists():
        return []
    with engine(db) as e:
        try:
            return e.loop_history(name, limit=100_000)
        except UnknownLoop:
            return []


def count(db: Path, name: str, kind: str) -> int:
    return sum(1 for e in loop_journal(db, name) if e.kind == kind)


def succeeded_at_least(db: Path, n: int) -> Callable[[], bool]:
    return lambda: count(db, "beat", "iteration_succeeded") >= n


def in_flight(log: Path, pid: int) -> bool:
    """An iteration of worker ``pid`` has started and not ended (per the loop function's
    own notes)."""
    notes = [line.split() for line in lines(log)]
    started = {slot for what, slot, who in notes if what == "start" and who == str(pid)}
    ended = {slot for what, slot, who in notes if what == "end" and who == str(pid)}
    return bool(started - ended)


# -- crash and restart -----------------------------------------------------------------------


def test_worker__sigkill_mid_iteration_then_restart_no_duplicate_no_gap(tmp_path: Path) -> None:
    db, log = tmp_path / "loops.db", tmp_path / "beat.log"
    module = beat_module(tmp_path)
    env = {"BEAT_LOG": str(log)}
    with workers() as started:
        for round_ in range(KILLS):
            worker = WorkerProcess([module], db, log=tmp_path / f"w{round_}.log", env=env)
            started.append(worker)
            done_before = count(db, "beat", "iteration_succeeded")
            wait_for(
                succeeded_at_least(db, done_before + 2),
                what="two iterations",
                describe=partial(report, started),
            )
            wait_for(
                partial(in_flight, log, worker.pid),
                what="an iteration in flight",
                describe=partial(report, started),
            )
            worker.kill()  # SIGKILL: mid-iteration
        final = WorkerProcess([module], db, log=tmp_path / "final.log", env=env)
        started.append(final)
        done_before = count(db, "beat", "iteration_succeeded")
        wait_for(
            succeeded_at_least(db, done_before + 3),
            what="iterations after the restart",
            describe=partial(report, started),
        )
        assert final.stop() == 0, final.text()

    events = loop_journal(db, "beat")
    interrupted = [e for e in events if e.kind == "iteration_interrupted"]
    assert len(interrupted) == KILLS, describe(events)
    assert_slots_accounted(events, BEAT_EVERY)
    # Each slot ran at most once (the side effects agree with the journal) …
    starts = Counter(line.split()[1] for line in lines(log) if line.startswith("start"))
    assert max(starts.values()) == 1
    # … and the interrupted slots never finished anywhere.
    ended = {line.split()[1] for line in lines(log) if line.startswith("end")}
    assert not {f"{e.slot:.3f}" for e in interrupted} & ended


def test_worker__two_workers_on_one_sqlite_file_never_fire_a_slot_twice(tmp_path: Path) -> None:
    db, log = tmp_path / "loops.db", tmp_path / "beat.log"
    module = beat_module(tmp_path, every=0.1, duration=0.02)
    env = {"BEAT_LOG": str(log)}
    with workers() as started:
        for name in ("a", "b"):
            started.append(
                WorkerProcess([module], db, "--lease", "1", log=tmp_path / f"{name}.log", env=env)
            )

        def both_fired() -> bool:
            if not db.exists():
                return False
            events = loop_journal(db, "beat")
            firing = {e.worker for e in events if e.kind == "iteration_started"}
            return len(firing) == 2 and len(events) >= 30

        wait_for(
            both_fired,
            timeout=20,
            what="both workers to fire slots",
            describe=partial(report, started),
        )
        for worker in started:
            worker.signal(signal.SIGTERM)
        assert [worker.wait() for worker in started] == [0, 0]

    events = loop_journal(db, "beat")
    assert_no_duplicate_slots(events)
    assert_slots_accounted(events, 0.1)
    pids = Counter(line.split()[1] for line in lines(log) if line.startswith("start"))
    assert max(pids.values()) == 1


# -- control from another process ----------------------------------------------------------

CONTROLLED = """
    import asyncio
    import os
    from pathlib import Path

    from flowloop.loops import loop

    MARKS = Path(os.environ["MARKS"])


    @loop(every=0.2)
    def tick(it):
        with (MARKS / "tick.log").open("a") as f:
            f.write(f"{it.slot}\\n")


    @loop(every=0.2)
    async def slow(it):
        (MARKS / "slow-started").touch()
        await asyncio.sleep(60)
        (MARKS / "slow-finished").touch()
"""


def test_worker__pause_unpause_stop_from_the_cli(tmp_path: Path) -> None:
    db = tmp_path / "loops.db"
    module = write_module(tmp_path / "controlled.py", CONTROLLED)
    with workers() as started:
        worker = WorkerProcess([module], db, log=tmp_path / "w.log", env={"MARKS": str(tmp_path)})
        started.append(worker)
        wait_for(lambda: count(db, "tick", "iteration_succeeded") >= 2, what="tick to run")
        wait_exists(tmp_path / "slow-started")

        paused = cli("pause", "tick", db=db)
        assert "loop tick" in paused.stdout
        with engine(db) as e:
            wait_for(lambda: e.loop("tick").status == "paused", what="tick paused")
        listing = json.loads(cli_here("loops", "--json", db=db))
        statuses = {row["name"]: row["status"] for row in listing["loops"]}
        assert statuses == {"tick": "paused", "slow": "running"}

        stopped = cli_here("stop", "slow", db=db)
        assert "loop slow running (stop requested" in stopped
        with engine(db) as e:
            wait_for(lambda: e.loop("slow").status == "stopped", what="slow stopped")
            kinds = [ev.kind for ev in e.loop_history("slow") if ev.kind != "skipped_overlap"]
        assert kinds[-3:] == ["iteration_started", "iteration_stopped", "loop_stopped"]
        assert not (tmp_path / "slow-finished").exists()

        cli_here("unpause", "tick", db=db)
        with engine(db) as e:
            wait_for(
                lambda: (
                    [ev.kind for ev in e.loop_history("tick")][-1] == "iteration_succeeded"
                    and e.loop("tick").status != "paused"
                ),
                what="tick to run again",
            )
        assert worker.stop() == 0, worker.text()

    events = loop_journal(db, "tick")
    kinds = [e.kind for e in events]
    paused_at, unpaused_at = kinds.index("loop_paused"), kinds.index("loop_unpaused")
    assert "iteration_started" not in kinds[paused_at:unpaused_at]
    assert "iteration_succeeded" in kinds[unpaused_at:]
    shown = cli_here("loops", "tick", db=db)
    assert "loop_paused" in shown and "loop_unpaused" in shown


# -- signals ---------------------------------------------------------------------------------

GATED = """
    import time
    from pathlib import Path

    from pydantic import BaseModel

    from flowloop import Workflow


    class Gated(BaseModel):
        started: str
        gate: str


    gated = Workflow("gated", context=Gated)


    @gated.step(initial=True, next="after")
    def wait_for_gate(ctx: Gated) -> None:
        Path(ctx.started).touch()
        deadline = time.monotonic() + 60
        while not Path(ctx.gate).exists() and time.monotonic() < deadline:
            time.sleep(0.01)


    @gated.step(next="done")
    def after(ctx: Gated) -> None:
        pass


    gated.final("done")
"""


def start_gated(module: Path, db: Path, tmp_path: Path, tag: str) -> tuple[str, Path, Path]:
    started, gate = tmp_path / f"{tag}-started", tmp_path / f"{tag}-gate"
    context = json.dumps({"started": str(started), "gate": str(gate)})
    out = cli_here("start", str(module), "--context", context, "--json", db=db)
    return json.loads(out)["id"], started, gate


def test_worker__sigterm_lets_the_step_in_flight_finish_and_releases_the_run(
    tmp_path: Path,
) -> None:
    db = tmp_path / "runs.db"
    module = write_module(tmp_path / "gated.py", GATED)
    run_id, started, gate = start_gated(module, db, tmp_path, "one")
    with workers() as running:
        worker = WorkerProcess([module], db, "--grace", "30", log=tmp_path / "w.log")
        running.append(worker)
        wait_exists(started)
        worker.signal(signal.SIGTERM)
        wait_for(lambda: "stopping: no new work" in worker.text(), what="the first signal")
        assert worker.process.poll() is None  # the step is still in flight: no exit yet
        gate.touch()
        assert worker.wait() == 0, worker.text()

    with engine(db) as e:
        info = e.get(run_id)
        history = e.history(run_id)
        kinds = [ev.kind for ev in history]
    assert (info.status, info.state, info.owner) == ("scheduled", "after", None)
    # The hand-off is journaled as what it was, not as a worker that died.
    assert kinds == ["run_created", "step_started", "step_succeeded", "run_released"]
    assert history[-1].data["reason"] == "released on shutdown"

    # Not lost: the next worker (here `flowloop resume`) finishes it.
    cli_here("resume", "-w", str(module), db=db)
    with engine(db) as e:
        assert e.get(run_id).status == "succeeded"


def test_worker__second_signal_exits_at_once_and_the_journal_holds(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    module = write_module(tmp_path / "gated.py", GATED)
    run_id, started, gate = start_gated(module, db, tmp_path, "two")
    with workers() as running:
        worker = WorkerProcess([module], db, "--grace", "60", log=tmp_path / "w.log")
        running.append(worker)
        wait_exists(started)
        worker.signal(signal.SIGTERM)
        wait_for(lambda: "stopping: no new work" in worker.text(), what="the first signal")
        worker.signal(signal.SIGINT)
        code = worker.wait(timeout=5)
    assert code == 130, worker.text()  # the shell's code for SIGINT (was 1)
    assert "second signal: exiting at once" in worker.text()

    with engine(db) as e:
        kinds = [ev.kind for ev in e.history(run_id)]
        assert (e.get(run_id).status, kinds) == ("running", ["run_created", "step_started"])
    gate.touch()
    cli_here("resume", "-w", str(module), db=db)
    with engine(db) as e:
        kinds = [ev.kind for ev in e.history(run_id)]
        assert e.get(run_id).status == "succeeded"
    assert kinds[:3] == ["run_created", "step_started", "step_interrupted"]
    # Found by recovery: the worker went away (it was not cut off, it exited at once).
    with engine(db) as e:
        interrupted = e.history(run_id)[2]
    assert interrupted.data["cause"] == "worker_gone", interrupted
    assert "died" not in (interrupted.error_message or "")


STUCK = """
    import time
    from pathlib import Path

    from flowloop.loops import loop


    @loop(every=60)
    def stuck(it):
        Path("stuck-started").touch()
        time.sleep(60)
"""


def test_worker__sigterm_cuts_off_a_sync_iteration_past_the_grace(tmp_path: Path) -> None:
    """A thread cannot be killed: the worker journals the cut-off and exits 0 on time
    instead of waiting for the thread."""
    db = tmp_path / "loops.db"
    module = write_module(tmp_path / "stuck.py", STUCK)
    with workers() as running:
        worker = WorkerProcess([module], db, "--grace", "0.3", log=tmp_path / "w.log")
        running.append(worker)
        wait_exists(tmp_path / "stuck-started")
        assert worker.stop(timeout=10) == 0, worker.text()
    kinds = [e.kind for e in loop_journal(db, "stuck")]
    assert kinds == ["loop_created", "iteration_started", "iteration_cancelled"]
    with engine(db) as e:
        row = e.loop("stuck")
    assert (row.status, row.owner, row.last_result) == ("scheduled", None, "cancelled")


# -- examples --------------------------------------------------------------------------------


def test_poll_example__runs_under_a_worker(tmp_path: Path) -> None:
    db, feed, seen = tmp_path / "poll.db", tmp_path / "feed.json", tmp_path / "seen.json"
    feed.write_text(json.dumps({"build": "green"}))
    env = {"POLL_EVERY": "0.2", "POLL_FEED": str(feed), "POLL_SEEN": str(seen)}
    with workers() as running:
        worker = WorkerProcess(
            [ROOT / "workflows" / "poll.py"], db, log=tmp_path / "w.log", env=env
        )
        running.append(worker)
        wait_for(
            lambda: seen.exists() and json.loads(seen.read_text()) == {"build": "green"},
            what="the first poll",
        )
        feed.write_text(json.dumps({"build": "red", "deploy": "done"}))
        wait_for(
            lambda: json.loads(seen.read_text()) == {"build": "red", "deploy": "done"},
            what="the change to be seen",
        )
        assert worker.stop() == 0, worker.text()
    with engine(db) as e:
        row = e.loop("poll_feed")
    assert row.schedule == "every 0.2s (fixed_delay)"
    assert row.iterations >= 2 and row.consecutive_failures == 0


def test_converge_example__runs_with_defaults_from_the_cli(tmp_path: Path) -> None:
    out = cli(
        "run", str(ROOT / "workflows" / "converge.py"), "--context", "{}", db=tmp_path / "c.db"
    )
    assert "succeeded" in out.stdout


def test_converge_example__patience_ends_a_run_that_stops_improving(tmp_path: Path) -> None:
    loaded = load_paths([ROOT / "workflows" / "converge.py"])
    converge = loaded.workflows["converge"]
    with engine(tmp_path / "c.db") as e:
        done = e.run(converge, {"target": 2.0})
        stuck = e.run(converge, {"target": 2.0, "tolerance": 0.0, "patience": 2})
    assert (done.status, done.state) == ("succeeded", "converged")
    assert abs(done.context.estimate - 2.0**0.5) < 1e-9  # type: ignore[union-attr]
    assert (stuck.status, stuck.state) == ("succeeded", "stalled")
    assert stuck.context.stale == 2  # type: ignore[union-attr]


def test_cli__loops_on_an_empty_database(tmp_path: Path) -> None:
    cli_here("db", "upgrade", db=tmp_path / "empty.db")  # loops reads; it creates nothing
    out = cli_here("loops", "--json", db=tmp_path / "empty.db")
    assert json.loads(out) == {"loops": [], "journal": []}
