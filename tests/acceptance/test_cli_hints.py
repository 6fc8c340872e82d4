"""The commands `flowloop run`, `send` and `retry` print for what to type next work as
printed (new-user audit): `run approve.py --db other.db` said ``flowloop send RUN EVENT``
(no -w: "unknown workflow 'approve'", no --db: another database), and a run due later
``flowloop resume -w FILE_OR_DIR`` though the command knew the file. Each printed command
is run here, as a user would type it, in the same folder."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
from polling import poll

from flowloop import Engine
from flowloop.loader import load_target

APPROVE = """
    from datetime import timedelta

    from pydantic import BaseModel

    from flowloop import Step, Workflow


    class Order(BaseModel):
        order_id: str
        amount: float


    wf = Workflow("approve", context=Order, key="order_id")


    @wf.step(initial=True, on={"small": "pay", "large": "awaiting"})
    def check(ctx: Order) -> str:
        return "large" if ctx.amount > 500 else "small"


    wf.wait("awaiting", on={"approve": "pay", "reject": "cancelled"})


    @wf.step(next="paid")
    def pay(ctx: Order) -> None: ...


    wf.final("paid", "cancelled")


    later = Workflow("later", context=Order)


    @later.step(initial=True, next="b")
    def a(ctx: Order, step: Step):
        return step.sleep(timedelta(hours=1), "next")


    @later.step(next="done")
    def b(ctx: Order) -> None: ...


    later.final("done")
"""


def flowloop(*args: str, cwd: Path, code: int = 0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FLOWLOOP_")}
    env.pop("COLUMNS", None)
    result = subprocess.run(
        [sys.executable, "-m", "flowloop", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == code, (
        f"flowloop {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    )
    return result


def typed(line: str, n: int = 0, **placeholders: str) -> list[str]:
    """The ``n``-th command a line names between backticks, as a user types it (its
    placeholders filled), without the leading ``flowloop``."""
    words = shlex.split(line.split("`")[1 + 2 * n])
    assert words[0] == "flowloop", line
    return [placeholders.get(word, word) for word in words[1:]]


@pytest.fixture
def here(tmp_path: Path) -> Path:
    (tmp_path / "approve.py").write_text(textwrap.dedent(APPROVE).lstrip())
    return tmp_path


@pytest.mark.parametrize("on", ["other", "default"])
def test_run_and_send__print_commands_that_work_as_typed(here: Path, on: str) -> None:
    """`run … --db other.db` of a run that waits prints a send with -w and --db; the send
    prints a resume with them; each, run as printed, does its work on that database. On
    ./flowloop.db (the default) no --db is printed, and none is needed."""
    db = ["--db", "other.db"] if on == "other" else []
    context = '{"order_id": "A1", "amount": 900}'
    shown = flowloop("run", "approve.py:approve", *db, "--context", context, cwd=here).stdout
    last = shown.splitlines()[-1]
    assert " waits in awaiting for approve or reject" in last, shown
    send = typed(last, EVENT="approve")
    assert ("--db" in send) is (on == "other") and "-w" in send, last
    sent = flowloop(*send, cwd=here).stdout
    assert "approve: applied" in sent and " scheduled at pay" in sent, sent
    resume = typed(sent, 1)  # (the worker's is the first)
    assert resume[0] == "resume" and "FILE_OR_DIR" not in resume, sent
    assert typed(sent, 0)[0] == "worker" and "FILE_OR_DIR" not in typed(sent, 0), sent
    flowloop(*resume, cwd=here)
    url = str(here / ("other.db" if on == "other" else "flowloop.db"))
    with Engine(url) as engine:
        (info,) = engine.runs()
    assert (info.status, info.state) == ("succeeded", "paid")
    assert not (here / ("flowloop.db" if on == "other" else "other.db")).exists()


def test_run__a_run_due_later_names_its_file_and_database(here: Path, store_url: str) -> None:
    """A run asleep for an hour: `run` names the worker and the resume that continue it,
    with the file and the database (SQLite file or PostgreSQL); the resume, as printed,
    opens that database (it finds the run not due yet) and creates no other."""
    context = '{"order_id": "L1", "amount": 1}'
    shown = flowloop("run", "approve.py:later", "--db", store_url, "--context", context, cwd=here)
    last = shown.stdout.splitlines()[-1]
    assert " sleeps in b until " in last, last
    worker, resume = typed(last, 0), typed(last, 1)
    assert worker == ["worker", "-w", "approve.py", "--db", store_url], last
    assert resume == ["resume", "-w", "approve.py", "--db", store_url], last
    resumed = flowloop(*resume, cwd=here).stdout
    assert "resumed: 0 interrupted run(s) recovered, 0 step attempt(s) run" in resumed
    made = ["flowloop.db"] if store_url.startswith("sqlite") else []  # (the fixture's file)
    assert sorted(path.name for path in here.glob("*.db")) == made
    with Engine(store_url) as engine:
        (info,) = engine.runs()
    assert (info.status, info.state) == ("scheduled", "b")


# -- `flowloop resume` says what it waits for ------------------------------------------------

BACKOFF = """
    import os

    from pydantic import BaseModel

    from flowloop import Retry, Workflow


    class Order(BaseModel):
        order_id: str


    backoff = Workflow("backoff", context=Order)
    EVERY = float(os.environ["BACKOFF_S"])


    @backoff.step(initial=True, next="done", retry=Retry(attempts=3, backoff="fixed", base=EVERY))
    def charge(ctx: Order) -> None:
        raise ConnectionError("down")


    backoff.final("done")
"""
WAITING = "waiting for run "


class Resume:
    """`flowloop resume -w backoff.py --db URL` in its own process; stderr read as it comes."""

    def __init__(self, here: Path, url: str, every: float) -> None:
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FLOWLOOP_")}
        env |= {"BACKOFF_S": str(every), "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flowloop", "resume", "-w", "backoff.py", "--db", url],
            cwd=here,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.err: list[str] = []
        assert self.process.stderr is not None
        self._reader = threading.Thread(target=self._read, args=(self.process.stderr,))
        self._reader.daemon = True
        self._reader.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.err.append(line.rstrip("\n"))

    def waiting_lines(self) -> list[str]:
        return [line for line in list(self.err) if line.startswith(WAITING)]

    def ended(self) -> int:
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self._reader.join(timeout=60)

    def ctrl_c_once_waiting(self) -> str:
        """SIGINT once it said what it waits for: its waiting line."""
        (line,) = poll(self.waiting_lines, timeout=30, what="the waiting line", every=0.02)
        self.process.send_signal(signal.SIGINT)
        assert self.ended() == 130, self.err
        return line


def started_backoff(here: Path, url: str) -> str:
    (here / "backoff.py").write_text(textwrap.dedent(BACKOFF).lstrip())
    with Engine(url) as engine:
        workflow, _ = load_target(str(here / "backoff.py"))
        return engine.start(workflow, {"order_id": "B1"}).id


def test_resume__says_which_run_it_waits_for_at_each_wait(
    here: Path, store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, `resume` of a run retrying 60 s apart printed nothing between attempts
    (up to five minutes): now a line per wait, each once (SQLite file and PostgreSQL)."""
    monkeypatch.setenv("BACKOFF_S", "1")
    run_id = started_backoff(here, store_url)
    resume = Resume(here, store_url, every=1)
    assert resume.ended() == 0, resume.err  # (its run failed after three attempts)
    lines = resume.waiting_lines()
    assert len(lines) == 2, resume.err  # after the first attempt and the second
    for line in lines:
        assert line.startswith(f"waiting for run {run_id} (retry of charge at "), line
        assert line.endswith("s); Ctrl-C leaves it to a worker"), line
    assert lines[0] != lines[1]  # (each its own attempt's time)


def test_resume__a_run_due_later_is_named_at_once_and_ctrl_c_leaves_it(
    here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The audit's case: Ctrl-C after the first failure, then `resume` had nothing due for
    31 s and said nothing. It names the run at once; Ctrl-C still leaves the run retrying
    and says how to continue."""
    monkeypatch.setenv("BACKOFF_S", "60")
    url = str(here / "backoff.db")
    run_id = started_backoff(here, url)
    first = Resume(here, url, every=60).ctrl_c_once_waiting()
    assert first.startswith(f"waiting for run {run_id} (retry of charge at "), first
    again = Resume(here, url, every=60)
    line = again.ctrl_c_once_waiting()  # (nothing due now: the line comes first)
    assert line.startswith(f"waiting for run {run_id} (retry of charge at "), line
    assert int(line.rsplit(", in ", 1)[1].split("s)")[0]) <= 60, line
    assert "continue with `flowloop resume -w backoff.py --db " in again.err[-1], again.err
    with Engine(url) as engine:
        info = engine.get(run_id)
    assert (info.status, info.state, info.attempt) == ("retrying", "charge", 1)


# -- a context refused creates no database ---------------------------------------------------


def tables(url: str) -> list[str]:
    """The tables of a database (a SQLite file that is not there: none, and not made)."""
    import sqlalchemy as sa

    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        return []
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return sa.inspect(conn).get_table_names()
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("command", "context", "problem"),
    [
        ("run", "{}", "order_id: Field required; amount: Field required"),
        ("start", '"x"', "expected an object of fields, got str"),  # (was "Invalid JSON")
        ("run", '"{}"', "expected an object of fields, got str"),  # (was taken as {})
    ],
)
def test_run_and_start__a_refused_context_creates_no_database(
    here: Path, store_url: str, command: str, context: str, problem: str
) -> None:
    """New-user audit: `run … --db fresh.db --context '{}'` refused the context (exit 2)
    and left fresh.db behind; a JSON string was decoded a second time, as JSON text."""
    result = flowloop(
        command, "approve.py:later", "--db", store_url, "--context", context, cwd=here, code=2
    )
    assert result.stderr == f"error: context for workflow 'later' is invalid: {problem}\n"
    assert tables(store_url) == []  # (SQLite: no file; PostgreSQL: no table)


def test_ctrl_c_while_starting_up__says_nothing_was_started(here: Path) -> None:
    """A Ctrl-C while `run` loaded its workflow file (here: the file's import is what the
    Ctrl-C interrupts) said "the journal holds every committed step (`flowloop resume`)"
    though nothing was started; nor is a database created."""
    (here / "slow_import.py").write_text("raise KeyboardInterrupt\n")
    result = flowloop("run", "slow_import.py", "--db", "fresh.db", cwd=here, code=130)
    # (click ends the line a Ctrl-C interrupted first)
    assert result.stderr.strip() == "interrupted before anything was started; nothing to continue"
    assert not (here / "fresh.db").exists()
