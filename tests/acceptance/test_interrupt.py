"""Ctrl-C during `flowloop run` (a real process, a real SIGINT while a non-idempotent step is
known to be in flight): the first drains (the step finishes, is journaled, the run is handed
back and `flowloop resume` finishes it), a second one cuts the step off and says so.

The step announces itself with a file and waits for a gate file (bounded): the test sends
SIGINT only once the step is in flight, and opens the gate only once the worker said what
the signal does.
"""

from __future__ import annotations

import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from loopkit_proc import engine, wait_exists, write_module
from polling import poll

pytestmark = pytest.mark.crash

EXIT_WAIT_S = 60.0

PARCEL = """
    import os
    import time
    from pathlib import Path

    from pydantic import BaseModel

    from flowloop import Step, Workflow

    GATE = Path(os.environ["PARCEL_DIR"])


    class Parcel(BaseModel):
        order_id: str
        tracking: str | None = None
        notified: bool = False


    parcel = Workflow("parcel", context=Parcel, key="order_id")


    @parcel.step(initial=True, next="notify", idempotent=False)
    def ship(ctx: Parcel, step: Step) -> None:
        (GATE / f"in-flight-{step.attempt}").touch()
        deadline = time.monotonic() + 60
        while not (GATE / "open").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the test never opened the gate")
            time.sleep(0.01)
        with (GATE / "shipments").open("a") as ledger:
            ledger.write(f"{step.run_id}\\n")
        ctx.tracking = "TRK1"


    @parcel.step(next="delivered")
    def notify(ctx: Parcel) -> None:
        ctx.notified = True


    parcel.final("delivered")
"""


class FlowloopRun:
    """`flowloop run` in its own process; its stderr read line by line as it comes."""

    def __init__(
        self,
        module: Path,
        db: Path,
        gate: Path,
        *options: str,
        resume: bool = False,
        retry: str | None = None,
    ) -> None:
        env = {**os.environ, "PARCEL_DIR": str(gate), "PYTHONUNBUFFERED": "1"}
        command = [sys.executable, "-m", "flowloop.cli", "run", str(module), "--db", str(db)]
        if resume:  # `flowloop resume` of what `flowloop start` queued
            command = [sys.executable, "-m", "flowloop.cli", "resume", "-w", str(module)]
            options = ("--db", str(db), *options)
        elif retry is not None:  # `flowloop retry RUN` of a failed run, driven here
            command = [sys.executable, "-m", "flowloop.cli", "retry", retry, "-w", str(module)]
            options = ("--db", str(db), *options)
        else:
            options = (*options, "--context", json.dumps({"order_id": "A1"}))
        self.process = subprocess.Popen(
            [*command, *options],
            cwd=gate,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.err: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        assert self.process.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stderr,))
        self._reader.daemon = True
        self._reader.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self._lines.put(line.rstrip("\n"))

    def _drain(self) -> None:
        while True:
            try:
                self.err.append(self._lines.get_nowait())
            except queue.Empty:
                return

    def said(self, text: str) -> bool:
        self._drain()
        return any(text in line for line in self.err)

    def wait(self) -> int:
        try:
            code = self.process.wait(timeout=EXIT_WAIT_S)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        assert self.process.stdout is not None
        self.out = self.process.stdout.read()
        self._reader.join(timeout=EXIT_WAIT_S)  # stderr's end of file
        self._drain()
        return code

    def describe(self) -> str:
        self._drain()
        return "stderr:\n" + "\n".join(self.err)

    def first_ctrl_c(self, *, notice: str, signum: int = signal.SIGINT) -> None:
        """Send SIGINT (or ``signum``) and wait (bounded) until the process says ``notice``
        in reply."""
        self.process.send_signal(signum)
        poll(
            lambda: self.said(notice),
            timeout=EXIT_WAIT_S,
            what="the notice of the first Ctrl-C",
            every=0.01,
            describe=self.describe,
        )


def start(tmp_path: Path, *options: str) -> tuple[FlowloopRun, Path, Path]:
    module = write_module(tmp_path / "parcel.py", PARCEL)
    db = tmp_path / "runs.db"
    run = FlowloopRun(module, db, tmp_path, *options)
    wait_exists(tmp_path / "in-flight-1")
    return run, db, tmp_path


def command_in(line: str) -> list[str]:
    """The command a message names between backticks."""
    return shlex.split(line.split("`")[1])


def continued_by(line: str, db: Path, gate: Path, run_id: str) -> None:
    """Run the command ``line`` names: it finishes the run, whose parcel shipped once."""
    resumed = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", *command_in(line)[1:]],
        cwd=gate,
        env={**os.environ, "PARCEL_DIR": str(gate)},
        capture_output=True,
        text=True,
        timeout=EXIT_WAIT_S,
    )
    assert resumed.returncode == 0, resumed.stderr
    with engine(db) as e:
        done = e.get(run_id)
    assert (done.status, done.state, done.context["notified"]) == ("succeeded", "delivered", True)
    assert (gate / "shipments").read_text().split() == [run_id]  # not shipped twice


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_run__first_ctrl_c_lets_the_step_finish_and_resume_continues(
    tmp_path: Path, signum: int
) -> None:
    """SIGTERM as Ctrl-C (before, it killed the process, the run left running), exit 143."""
    run, db, gate = start(tmp_path)
    run.first_ctrl_c(notice="letting the step in flight finish", signum=signum)
    assert run.process.poll() is None  # still finishing the step
    (gate / "open").touch()
    assert run.wait() == 128 + signum, run.describe()
    last = run.err[-1]
    assert "Traceback" not in "\n".join(run.err), run.describe()
    assert last.startswith("interrupted: run "), last
    assert "stopped after its step finished: scheduled in state notify" in last
    assert f"`flowloop resume -w {tmp_path / 'parcel.py'} --db " in last

    with engine(db) as e:
        (info,) = e.runs()
        history = e.history(info.id)
    # The shipment happened once and is journaled; the run is resumable, not failed.
    assert (gate / "shipments").read_text().split() == [info.id]
    assert (info.status, info.state, info.context["tracking"]) == ("scheduled", "notify", "TRK1")
    assert [ev.kind for ev in history][-2:] == ["step_succeeded", "run_released"]
    assert history[-1].data["reason"] == "released on shutdown"

    continued_by(last, db, gate, info.id)


def test_run__second_ctrl_c_cuts_the_step_off_and_says_so(tmp_path: Path) -> None:
    run, db, gate = start(tmp_path)
    run.first_ctrl_c(notice="Ctrl-C again to cut it off")
    run.process.send_signal(signal.SIGINT)
    # Exits although the step's thread is still blocked on the gate.
    assert run.wait() == 130, run.describe()
    last = run.err[-1]
    assert "Traceback" not in "\n".join(run.err), run.describe()
    assert "cutting its step off: failed in state ship" in last, last
    assert "cut off by shutdown" in last and "not idempotent" in last, last
    assert "`flowloop retry " in last and f"-w {tmp_path / 'parcel.py'}" in last, last

    with engine(db) as e:
        (info,) = e.runs()
        history = e.history(info.id)
    cut = history[-1]
    assert (cut.kind, cut.data["cause"], cut.data["reason"]) == (
        "step_interrupted",
        "cut_off",
        "interrupted",
    )
    assert "died" not in (cut.error_message or "")
    assert (info.status, info.reason) == ("failed", "interrupted")
    assert not (gate / "shipments").exists()
    (gate / "open").touch()  # nothing left to release it: the process is gone


def test_run__json_after_ctrl_c_prints_the_run_as_handed_back(tmp_path: Path) -> None:
    run, db, gate = start(tmp_path, "--json")
    run.first_ctrl_c(notice="letting the step in flight finish")
    (gate / "open").touch()
    assert run.wait() == 130, run.describe()
    assert run.err[-1].startswith("interrupted: run "), run.describe()
    shown = json.loads(run.out)  # one JSON object on stdout, nothing else
    with engine(db) as e:
        (info,) = e.runs()
    assert shown["run"]["id"] == info.id
    assert (shown["run"]["status"], shown["run"]["state"]) == ("scheduled", "notify")
    assert shown["run"]["context"]["tracking"] == "TRK1"
    assert shown["interrupted"] == {"signals": 1} and shown["existing"] is False


# -- `flowloop resume`: the same, for every run it drives ------------------------------------


def resume_started(tmp_path: Path) -> tuple[FlowloopRun, Path, Path]:
    """`flowloop start` queues a parcel, `flowloop resume` drives it: its step in flight."""
    module = write_module(tmp_path / "parcel.py", PARCEL)
    db = tmp_path / "runs.db"
    context = json.dumps({"order_id": "A1"})
    subprocess.run(
        [
            sys.executable,
            "-m",
            "flowloop.cli",
            "start",
            str(module),
            "--db",
            str(db),
            "--context",
            context,
        ],
        cwd=tmp_path,
        env={**os.environ, "PARCEL_DIR": str(tmp_path)},
        check=True,
        capture_output=True,
        timeout=EXIT_WAIT_S,
    )
    run = FlowloopRun(module, db, tmp_path, resume=True)
    wait_exists(tmp_path / "in-flight-1")
    return run, db, tmp_path


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_resume__first_signal_lets_the_step_finish_and_hands_the_run_back(
    tmp_path: Path, signum: int
) -> None:
    """Before, one Ctrl-C cut the step off at once (an attempt used up: the parcel, not
    idempotent, failed), and SIGTERM killed the process with the run left running."""
    run, db, gate = resume_started(tmp_path)
    run.first_ctrl_c(notice="letting the step in flight finish", signum=signum)
    assert run.process.poll() is None  # still finishing the step
    (gate / "open").touch()
    assert run.wait() == 128 + signum, run.describe()
    assert "Traceback" not in "\n".join(run.err), run.describe()
    last = run.err[-1]
    assert last.startswith("interrupted after the steps in flight finished; continue with "), last
    with engine(db) as e:
        (info,) = e.runs()
        history = e.history(info.id)
    assert (info.status, info.state, info.context["tracking"]) == ("scheduled", "notify", "TRK1")
    assert [ev.kind for ev in history][-2:] == ["step_succeeded", "run_released"]
    continued_by(last, db, gate, info.id)


def test_resume__second_ctrl_c_cuts_the_step_off(tmp_path: Path) -> None:
    run, db, gate = resume_started(tmp_path)
    run.first_ctrl_c(notice="Ctrl-C again to cut it off")
    run.process.send_signal(signal.SIGINT)
    assert run.wait() == 130, run.describe()
    assert "Traceback" not in "\n".join(run.err), run.describe()
    last = run.err[-1]
    assert last.startswith("interrupted cutting steps off; continue with "), run.describe()
    with engine(db) as e:
        (info,) = e.runs()
        cut = e.history(info.id)[-1]
    assert (cut.kind, cut.data["cause"]) == ("step_interrupted", "cut_off")
    assert (info.status, info.reason) == ("failed", "interrupted")  # not idempotent
    # It said "continue with `flowloop resume`", which does nothing for a failed run (new-user
    # audit): it names the failed run and `retry`.
    assert f"; 1 run(s) failed, e.g. {info.id} (`flowloop status {info.id}`): a step " in last
    assert "`flowloop retry RUN -w " in last and last.endswith("runs one again"), last
    assert not (gate / "shipments").exists()
    (gate / "open").touch()  # nothing left to release it: the process is gone


def test_retry__first_ctrl_c_lets_the_step_finish_and_resume_continues(tmp_path: Path) -> None:
    """`flowloop retry` drove the run with its plain `def` step on the main thread: one
    Ctrl-C did nothing until the step ended, then exited 130 although the run had
    succeeded; two raised KeyboardInterrupt inside the step (review). It takes Ctrl-C as
    `flowloop run` does."""
    run, db, gate = start(tmp_path)
    run.first_ctrl_c(notice="Ctrl-C again to cut it off")
    run.process.send_signal(signal.SIGINT)
    assert run.wait() == 130, run.describe()
    with engine(db) as e:
        (failed,) = e.runs()
    assert (failed.status, failed.reason) == ("failed", "interrupted")
    (gate / "in-flight-1").unlink()
    retried = FlowloopRun(gate / "parcel.py", db, gate, retry=failed.id)
    poll(
        lambda: any(gate.glob("in-flight-*")) or None,
        timeout=EXIT_WAIT_S,
        what="the retried step",
        every=0.02,
    )
    retried.first_ctrl_c(notice="letting the step in flight finish")
    assert retried.process.poll() is None  # still finishing the step
    (gate / "open").touch()
    assert retried.wait() == 130, retried.describe()
    last = retried.err[-1]
    assert "Traceback" not in "\n".join(retried.err), retried.describe()
    assert "stopped after its step finished: scheduled in state notify" in last, last
    continued_by(last, db, gate, failed.id)


BACKING_OFF = """
    from pydantic import BaseModel

    from flowloop import Retry, Workflow


    class Order(BaseModel):
        order_id: str


    flaky = Workflow("flaky", context=Order, key="order_id")


    @flaky.step(initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=120))
    def charge(ctx: Order) -> None:
        raise ConnectionError("the provider is down")


    flaky.final("done")
"""


def test_run__ctrl_c_in_a_retry_backoff_says_no_step_was_in_flight(tmp_path: Path) -> None:
    """Before: an empty line on stderr, then "stopped after its step finished" — no step
    ran (the run waited for its retry's backoff). The backoff is 2 minutes: one within the
    5-minute idle horizon is waited out by `flowloop run` (an hour's returns at once, exit
    0: the Ctrl-C then raced the process's exit, and lost it on a loaded machine)."""
    module = write_module(tmp_path / "flaky.py", BACKING_OFF)
    db = tmp_path / "runs.db"
    run = FlowloopRun(module, db, tmp_path)

    def backing_off() -> bool:
        if not db.exists():
            return False
        with engine(db) as e:
            return [i.status for i in e.runs()] == ["retrying"]

    poll(backing_off, timeout=EXIT_WAIT_S, what="the run's backoff", every=0.05)
    run.process.send_signal(signal.SIGINT)
    assert run.wait() == 130, run.describe()
    assert "" not in run.err and "Traceback" not in "\n".join(run.err), run.describe()
    assert run.err[-1].startswith("interrupted: run "), run.describe()
    assert "stopped with no step in flight: retrying in state charge" in run.err[-1], run.err
    assert f"`flowloop resume -w {module} --db {db}`" in run.err[-1], run.err
