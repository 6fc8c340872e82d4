"""Operating flowloop from the command line, as real processes: JSON logs of every step,
`stats`, `prune`, a worker serving Prometheus metrics until SIGTERM, and configuration from
flowloop.toml < FLOWLOOP_* < flags, with an invalid value reported in one line."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from flowloop import Engine
from flowloop.cli import cli
from flowloop.loader import load_target

WAIT_S = 20.0

FLAKY = """
    from pydantic import BaseModel

    from flowloop import Retry, Step, Workflow


    class Job(BaseModel):
        fail: bool = False


    jobs = Workflow("jobs", context=Job)


    @jobs.step(initial=True, next="check")
    def fetch(ctx: Job) -> None: ...


    @jobs.step(next="done", retry=Retry(attempts=2, backoff="fixed", base=0, cap=0))
    def check(ctx: Job, step: Step) -> None:
        if ctx.fail or step.attempt == 1:
            raise ConnectionError("upstream reset")


    jobs.final("done")
"""


@pytest.fixture
def here(tmp_path: Path) -> Path:
    (tmp_path / "jobs.py").write_text(textwrap.dedent(FLAKY).lstrip())
    return tmp_path


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("FLOWLOOP_")}
    return {**env, **extra}


def flowloop(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    code: int | None = 0,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", *args],
        cwd=cwd,
        env=env or clean_env(),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if code is not None:
        assert result.returncode == code, (
            f"flowloop {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
        )
    return result


def here_cli(here: Path, *args: str) -> str:
    """A read command run through the real CLI in this process (a new interpreter per
    command would triple these tests' time); its stdout."""
    result = CliRunner().invoke(cli, [*args, "--db", str(here / "jobs.db")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def make_runs(here: Path, *, ok: int = 0, failed: int = 0, queued: int = 0) -> list[str]:
    """Runs of jobs.py in jobs.db, made in this process (quicker than a CLI per run)."""
    workflow, _ = load_target(str(here / "jobs.py"))
    with Engine(str(here / "jobs.db")) as engine:
        ids = [engine.run(workflow, {}).id for _ in range(ok)]
        ids += [engine.run(workflow, {"fail": True}).id for _ in range(failed)]
        ids += [engine.start(workflow, {}).id for _ in range(queued)]
    return ids


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_cli__json_log_line_when_each_step_starts_and_ends(here: Path) -> None:
    result = flowloop(
        "--log-format", "json", "--log-level", "info", "run", "jobs.py", "--db", "jobs.db", cwd=here
    )
    entries = json_lines(result.stderr)  # every line parses: one object per line
    steps = [e for e in entries if e.get("event") in ("step_started", "step_finished")]
    assert [(e["event"], e["state"], e["attempt"], e.get("outcome")) for e in steps] == [
        ("step_started", "fetch", 1, None),
        ("step_finished", "fetch", 1, "succeeded"),
        ("step_started", "check", 1, None),
        ("step_finished", "check", 1, "retried"),
        ("step_started", "check", 2, None),
        ("step_finished", "check", 2, "succeeded"),
    ]
    run_id = steps[0]["run"]
    assert {e["run"] for e in steps} == {run_id}
    assert {e["workflow"] for e in steps} == {"jobs"}
    assert [e["seq"] for e in steps] == [2, 2, 4, 4, 6, 6]
    retried = steps[3]
    assert retried["error_type"] == "ConnectionError"
    assert retried["level"] == "info"
    assert all(isinstance(e["duration"], float) for e in steps if e["event"] == "step_finished")
    # The progress display is still on stdout, untouched by the log format.
    assert f"run {run_id} succeeded" in result.stdout


def test_cli__quiet_below_warning_by_default(here: Path) -> None:
    quiet = flowloop("run", "jobs.py", "--db", "jobs.db", cwd=here)
    assert quiet.stderr == ""
    assert "succeeded in state done" in quiet.stdout


def test_cli__stats_table_json_and_window(here: Path) -> None:
    make_runs(here, ok=3, failed=1)

    table = here_cli(here, "stats")
    assert "step attempts, since " in table and "(24h)" in table
    # The runs' own success rate: 3 of 4 runs succeeded, whatever their attempts did.
    runs_row = next(
        line for line in table.splitlines() if line.startswith("│ jobs ") and "75.0%" in line
    )
    assert "│        4 │         3 │      1 │       0 │       75.0% │" in runs_row
    check_row = next(line for line in table.splitlines() if " check " in line)
    # check: 3 runs fail once then succeed, 1 fails twice: 8 attempts, 3 succeeded.
    assert "│        8 │       37.5% │       4 │" in check_row

    data = json.loads(here_cli(here, "stats", "jobs", "--since", "1h", "--json"))
    states = {s["state"]: s for s in data["states"]}
    assert (states["check"]["count"], states["check"]["succeeded"]) == (8, 3)
    assert states["check"]["retries"] == 4
    assert (states["fetch"]["count"], states["fetch"]["success_rate"]) == (4, 1.0)
    assert set(states["fetch"]) >= {"p50", "p95", "p99", "slowest"}

    (runs,) = data["runs"]
    assert (runs["workflow"], runs["finished"], runs["succeeded"], runs["failed"]) == (
        "jobs",
        4,
        3,
        1,
    )
    assert runs["success_rate"] == 0.75
    assert 0 <= runs["latency_p50"] <= runs["latency_p95"] <= runs["latency_p99"]
    assert data["loops"] == []  # none ran here; test_stats checks loop statistics

    everything = json.loads(here_cli(here, "stats", "--since", "all", "--json"))
    assert everything["since"] is None and len(everything["states"]) == 2

    # A misspelt workflow was answered as if it had been quiet; then said so, exit 0.
    misspelt = flowloop("stats", "jbos", "--db", "jobs.db", cwd=here, code=2)
    assert misspelt.stderr.splitlines() == [
        "error: this database has no workflow 'jbos'; did you mean 'jobs'?"
    ]
    bad = flowloop("stats", "--since", "soon", "--db", "jobs.db", cwd=here, code=2)
    assert bad.stderr.strip().splitlines() == [
        "error: --since 'soon' is not a duration (30m, 12h, 30d)"
    ]


def test_cli__prune_keeps_live_failed_and_new_runs(here: Path) -> None:
    ok, _, queued = make_runs(here, ok=1, failed=1, queued=1)

    nothing = json.loads(here_cli(here, "prune", "--older-than", "30d", "--json"))
    assert (nothing["runs"], nothing["joins"]) == (0, 0)

    planned = here_cli(here, "prune", "--older-than", "0s", "--keep-failed", "--dry-run")
    assert planned.startswith("would delete 1 run(s) finished before ")
    done = flowloop(
        "prune", "--older-than", "0s", "--keep-failed", "--db", "jobs.db", cwd=here
    ).stdout
    assert done.startswith("deleted 1 run(s) finished before ")
    # The run's 7 entries are 6 rows: its one boundary that went on is one row (the next
    # step's start joined to the success).
    assert "(failed runs kept): 6 journal row(s)" in done

    left = json.loads(here_cli(here, "status", "--json"))["runs"]
    assert sorted(r["status"] for r in left) == ["failed", "scheduled"]
    assert queued in {r["id"] for r in left}
    assert ok not in {r["id"] for r in left}


class Worker:
    """A `flowloop worker` child whose stderr (JSON logs) is read line by line."""

    def __init__(self, cwd: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "flowloop.cli", "--log-format", "json", "worker", *args],
            cwd=cwd,
            env=env or clean_env(),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[dict[str, Any]] = []
        assert self.process.stderr is not None
        threading.Thread(target=self._read, args=(self.process.stderr,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line)

    def wait_for(self, event: str) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        for entry in self.seen:
            if entry.get("event") == event:
                return entry
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            entry = json.loads(line)  # every line of the worker's log is a JSON object
            self.seen.append(entry)
            if entry.get("event") == event:
                return entry
        raise AssertionError(f"no {event!r} log line; got {self.seen}")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=WAIT_S)


@pytest.fixture
def spawn() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for worker in started:
        worker.close()


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_cli__worker_serves_metrics_on_loopback_until_sigterm(
    here: Path, spawn: list[Worker]
) -> None:
    (run_id,) = make_runs(here, queued=1)
    worker = Worker(here, "jobs.py", "--db", "jobs.db", "--metrics-port", "0", "--grace", "2s")
    spawn.append(worker)
    serving = worker.wait_for("metrics_serving")
    assert serving["host"] == "127.0.0.1"
    port = int(serving["port"])

    deadline = time.monotonic() + WAIT_S
    key = (
        "flowloop_runs_finished_total",
        frozenset({("workflow", "jobs"), ("status", "succeeded")}),
    )
    while (samples := scrape(port)).get(key) != 1.0:
        assert time.monotonic() < deadline, samples
        time.sleep(0.05)
    outcomes = {
        dict(labels)["outcome"]: v
        for (name, labels), v in samples.items()
        if name == "flowloop_steps_total" and dict(labels)["state"] == "check"
    }
    # Every outcome's series exists (at 0 until it happens).
    assert outcomes == {
        "retried": 1.0,
        "succeeded": 1.0,
        "failed": 0.0,
        "timed_out": 0.0,
        "interrupted": 0.0,
    }
    assert samples[("flowloop_runs_started_total", frozenset({("workflow", "jobs")}))] == 1.0

    finished = [e for e in worker.seen if e.get("event") == "step_finished"]
    assert {e["run"] for e in finished} <= {run_id}

    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(timeout=WAIT_S) == 0
    with pytest.raises(OSError):
        scrape(port)


def test_cli__config_file_then_env_then_flag(here: Path) -> None:
    (here / "flowloop.toml").write_text(
        'db = "from-file.db"\nlog_format = "json"\nlog_level = "info"\n'
    )
    by_file = flowloop("run", "jobs.py", cwd=here)
    assert json_lines(by_file.stderr)  # JSON, from the file
    assert (here / "from-file.db").exists()

    env = clean_env(FLOWLOOP_DB=str(here / "from-env.db"), FLOWLOOP_LOG_FORMAT="text")
    by_env = flowloop("run", "jobs.py", cwd=here, env=env)
    started = [line for line in by_env.stderr.splitlines() if "fetch attempt 1 started" in line]
    assert len(started) == 1 and " INFO flowloop: run " in started[0]  # text, from the env
    assert (here / "from-env.db").exists()

    by_flag = flowloop(
        "--log-format", "json", "run", "jobs.py", "--db", "from-flag.db", cwd=here, env=env
    )
    assert json_lines(by_flag.stderr)
    assert (here / "from-flag.db").exists()
    for name in ("from-file.db", "from-env.db", "from-flag.db"):
        with Engine(str(here / name)) as engine:
            assert len(engine.runs()) == 1, name


def test_cli__invalid_config_is_one_line_and_exit_2(here: Path) -> None:
    path = here / "flowloop.toml"
    path.write_text("[workflows.jobs.steps.check]\ntimeout = -5\n")
    result = flowloop("status", cwd=here, code=2)
    assert result.stderr.splitlines() == [
        "error: invalid configuration: workflows.jobs.steps.check.timeout: Input should be "
        f"greater than 0 (got -5) [from {path}]"
    ]
    path.write_text("concurrency = 4\n")
    result = flowloop("worker", "jobs.py", "--concurrency", "0", cwd=here, code=2)
    assert result.stderr.splitlines() == [
        "error: invalid configuration: concurrency: Input should be greater than or equal to 1 "
        "(got 0) [from --concurrency]"
    ]


def test_cli__start_many_runs_from_json_lines_in_one_go(here: Path) -> None:
    (here / "runs.jsonl").write_text('{"fail": false}\n\n{}\n{"fail": true}\n')
    result = flowloop("start", "jobs.py", "--contexts", "runs.jsonl", "--db", "jobs.db", cwd=here)
    assert result.stdout.splitlines() == ["3 run(s) of jobs: 3 new, 0 already there (same key)"]
    result = flowloop(
        "start", "jobs.py", "--contexts", "-", "--json", "--db", "jobs.db", cwd=here, stdin="{}\n"
    )
    [created] = json.loads(result.stdout)
    assert (created["workflow"], created["status"]) == ("jobs", "scheduled")
    assert len(json_lines(here_cli(here, "status", "--json"))) == 1  # one JSON object
    assert len(json.loads(here_cli(here, "status", "--json"))["runs"]) == 4
    # A bad line: one line saying where, exit 2, nothing written.
    from_stdin = ("start", "jobs.py", "--contexts", "-", "--db", "jobs.db")
    result = flowloop(*from_stdin, cwd=here, code=2, stdin='{"fail": true}\n{"fail": \n')
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith("error: stdin line 2 is not valid JSON")
    result = flowloop(*from_stdin, cwd=here, code=2, stdin='{"fail": "sometimes"}\n')
    assert result.stderr.startswith(
        "error: stdin line 1: the context for workflow 'jobs' is invalid: fail"
    )
    # Named by its line, blank lines counted (before: "context #3" for line 4).
    (here / "bad.jsonl").write_text('{}\n\n{}\n{"fail": "sometimes"}\n')
    bad = ("start", "jobs.py", "--contexts", "bad.jsonl", "--db", "jobs.db")
    result = flowloop(*bad, cwd=here, code=2)
    [error] = result.stderr.splitlines()
    assert error.startswith("error: bad.jsonl line 4: the context for workflow 'jobs' is invalid")
    assert len(json.loads(here_cli(here, "status", "--json"))["runs"]) == 4


def test_cli__start_many_counts_runs_whose_key_was_taken_and_refuses_non_objects(
    tmp_path: Path,
) -> None:
    order = str(Path(__file__).resolve().parents[2] / "workflows" / "order.py")
    line = '{"order_id": "%s", "items": [{"sku": "pen", "qty": 1}]}\n'
    (tmp_path / "orders.jsonl").write_text(line % "A" + line % "A" + line % "B")
    args = ("start", order, "--contexts", "orders.jsonl", "--db", "o.db")
    result = flowloop(*args, cwd=tmp_path)
    assert result.stdout.splitlines() == ["3 run(s) of order: 2 new, 1 already there (same key)"]
    (tmp_path / "orders.jsonl").write_text(line % "B" + line % "C")
    result = flowloop(*args, cwd=tmp_path)
    assert result.stdout.splitlines() == ["2 run(s) of order: 1 new, 1 already there (same key)"]
    # A line whose key a run holds with another context (a corrected batch re-imported, a
    # key twice in one file) was counted "already there", exit 0, its context dropped
    # (new-user audit): named, exit 2; the other lines' runs are started.
    other = '{"order_id": "%s", "items": [{"sku": "ink", "qty": 2}]}\n'
    (tmp_path / "orders.jsonl").write_text(other % "A" + line % "E" + "\n" + other % "E")
    result = flowloop(*args, cwd=tmp_path, code=2)
    assert result.stdout.splitlines() == [
        "3 run(s) of order: 1 new, 0 already there (same key), 2 not started"
    ]
    [error] = result.stderr.splitlines()
    assert error.startswith("error: orders.jsonl line 1 (key 'A', run "), error
    assert "; orders.jsonl line 4 (key 'E', run " in error and "differs in items)" in error
    started = json.loads(flowloop("status", "--json", "--db", "o.db", cwd=tmp_path).stdout)
    assert sorted(run["key"] for run in started["runs"]) == ["A", "B", "C", "E"]
    # A JSON array where JSON Lines were wanted, a bare number, bytes that are not UTF-8:
    # one line each, exit 2.
    for content, message in (
        (b'[{"order_id": "D"}]\n', "line 1: a context must be a JSON object, not list"),
        (b"5\n", "line 1: a context must be a JSON object, not int"),
        (b'{"order_id": "\xff"}\n', "is not UTF-8 text"),
    ):
        (tmp_path / "orders.jsonl").write_bytes(content)
        result = flowloop(*args, cwd=tmp_path, code=2)
        [error] = result.stderr.splitlines()
        assert error.startswith("error: orders.jsonl") and message in error, error


STAMPED = """
    from datetime import UTC, datetime

    from pydantic import BaseModel, Field

    from flowloop import Workflow


    class Parcel(BaseModel):
        parcel_id: str
        weight: float = 1.0
        received_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


    parcels = Workflow("parcels", context=Parcel, key="parcel_id")
    parcels.step(name="weigh", initial=True, next="done")(lambda ctx: None)
    parcels.final("done")
"""


def test_cli__start_many_compares_only_what_a_line_gives(tmp_path: Path) -> None:
    """A context with a default factory (a time) differed from itself at every parse: a
    fresh file of two lines said "2 new, -2 already there, 2 not started", exit 2
    (review). A line's fields are compared with the run's start, its defaults are not."""
    (tmp_path / "parcels.py").write_text(textwrap.dedent(STAMPED).lstrip())
    (tmp_path / "in.jsonl").write_text('{"parcel_id": "P1"}\n{"parcel_id": "P2", "weight": 2}\n')
    args = ("start", "parcels.py", "--contexts", "in.jsonl", "--db", "p.db")
    assert flowloop(*args, cwd=tmp_path).stdout.splitlines() == [
        "2 run(s) of parcels: 2 new, 0 already there (same key)"
    ]
    assert flowloop(*args, cwd=tmp_path).stdout.splitlines() == [
        "2 run(s) of parcels: 0 new, 2 already there (same key)"
    ]
    (tmp_path / "in.jsonl").write_text('{"parcel_id": "P2", "weight": 3}\n')
    refused = flowloop(*args, cwd=tmp_path, code=2)
    assert "(key 'P2', run " in refused.stderr and "differs in weight)" in refused.stderr


def test_cli__check_has_json_output(here: Path) -> None:
    here_cli(here, "db", "upgrade")  # check reads a database; it creates none
    data = json.loads(here_cli(here, "check", str(here / "jobs.py"), "--json"))
    assert data["stranded"] == []
    assert [(w["name"], w["states"]) for w in data["workflows"]] == [("jobs", 3)]


def test_cli__db_current_tells_the_revision_without_changing_it(tmp_path: Path) -> None:
    """There was no read-only way to see a database's schema revision: `db upgrade` was the
    only `db` command for it."""
    import sqlite3

    from flowloop.store import migrate

    path = tmp_path / "rev.db"
    runner = CliRunner()
    missing = runner.invoke(cli, ["db", "current", "--db", str(path)])
    assert "no database at" in str(missing.exception) and not path.exists()
    assert runner.invoke(cli, ["db", "upgrade", "--db", str(path)]).exit_code == 0
    now = runner.invoke(cli, ["db", "current", "--db", str(path), "--json"])
    assert now.exit_code == 0
    head = migrate.head()
    assert json.loads(now.stdout) == {"revision": head, "head": head, "current": True}
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE {migrate.VERSION_TABLE} SET version_num = '0012'")
    conn.close()
    behind = runner.invoke(cli, ["db", "current", "--db", str(path)])
    assert behind.exit_code == 1
    assert " ".join(behind.stdout.split()) == (
        f"schema at revision 0012; this flowloop's is {head}: `flowloop db upgrade`"
    )
    with sqlite3.connect(path) as conn:  # and nothing was changed
        assert conn.execute(f"SELECT version_num FROM {migrate.VERSION_TABLE}").fetchall() == [
            ("0012",)
        ]
        conn.execute(f"UPDATE {migrate.VERSION_TABLE} SET version_num = '9999'")
    conn.close()
    newer = runner.invoke(cli, ["db", "current", "--db", str(path)])
    assert newer.exit_code == 1
    assert " ".join(newer.stdout.split()) == (
        f"schema at revision 9999, newer than this flowloop's {head}: upgrade flowloop"
    )


def test_cli__start_many_on_a_terminal_shows_its_bar_and_starts_the_runs(here: Path) -> None:
    """On a terminal (its stderr a pseudo-terminal) the progress bar entered the lazy
    console, which is no context manager: a TypeError, nothing started, exit 1, the
    cursor left hidden (new-user audit). Off a terminal it worked, so piped tests passed."""
    import pty

    (here / "runs.jsonl").write_text("{}\n" * 50)
    command = ["start", "jobs.py", "--contexts", "runs.jsonl", "--db", "jobs.db"]
    primary, secondary = pty.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "flowloop.cli", *command],
            cwd=here,
            env=clean_env(COLUMNS="100"),
            stdout=subprocess.PIPE,
            stderr=secondary,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(secondary)
        shown = b""
        with contextlib.suppress(OSError):  # (read until the terminal has nothing more)
            while chunk := os.read(primary, 65536):
                shown += chunk
        os.close(primary)
    assert result.returncode == 0, shown.decode(errors="replace")
    assert result.stdout.splitlines() == ["50 run(s) of jobs: 50 new, 0 already there (same key)"]
    assert b"Traceback" not in shown and b"TypeError" not in shown
    assert len(json.loads(here_cli(here, "status", "--json", "--limit", "100"))["runs"]) == 50


def test_cli__retry_drives_that_run_only(here: Path) -> None:
    """`flowloop retry RUN` drove every due run of the database to its end, a queued
    order of someone else's among them (new-user audit): it drives that run only."""
    failed, queued = make_runs(here, failed=1, queued=1)
    result = flowloop(
        "retry", failed, "--set", "fail=false", "-w", "jobs.py", "--db", "jobs.db", cwd=here
    )
    assert queued not in result.stdout + result.stderr
    shown = {
        run["id"]: run["status"] for run in json.loads(here_cli(here, "status", "--json"))["runs"]
    }
    assert shown == {failed: "succeeded", queued: "scheduled"}


def test_cli__a_window_of_history_needs_a_unit(here: Path) -> None:
    """`prune --older-than 30` read as 30 seconds and deleted every finished run (new-user
    audit: the README only ever shows `30d`); `stats --since 3` read as 3 seconds too."""
    make_runs(here, ok=2)
    for args in (("prune", "--older-than", "30"), ("stats", "--since", "3")):
        result = flowloop(*args, "--db", "jobs.db", cwd=here, code=2)
        [line] = result.stderr.splitlines()
        n = args[2]
        assert line == f"error: {args[1]} {n}: give a unit — {n}s, {n}m, {n}h or {n}d"
    assert len(json.loads(here_cli(here, "status", "--json"))["runs"]) == 2  # nothing deleted
    assert (
        "deleted 2 run(s)"
        in flowloop("prune", "--older-than", "0s", "--db", "jobs.db", cwd=here).stdout
    )


def test_cli__a_failed_attempt_says_when_the_next_one_comes(here: Path) -> None:
    """`flowloop run` printed `step_failed` and then nothing through the backoff (ten
    silent minutes in the new-user audit): the line says when the next attempt comes."""
    result = flowloop("run", "jobs.py", "--db", "jobs.db", cwd=here)
    [failed] = [line for line in result.stdout.splitlines() if "step_failed" in line]
    assert "ConnectionError: upstream reset; attempt 2 at " in failed
    assert "(in 0s)" in failed
    [run_id] = [run["id"] for run in json.loads(here_cli(here, "status", "--json"))["runs"]]
    assert "; attempt 2 at " in here_cli(here, "history", run_id)


def test_cli__a_misspelt_name_or_a_key_as_a_run_id_says_what_to_give(here: Path) -> None:
    """New-user audit: `send W1 ...` with W1 a business key said a prefix needs 4
    characters; a misspelt --workflow in `send` said only that no run had the key, and in
    `migrate` "version 2 is not loaded (loaded: none)"."""
    workflow, _ = load_target(str(here / "jobs.py"))
    with Engine(str(here / "jobs.db")) as engine:
        engine.start(workflow, {}, key="W1")
    db = ("--db", "jobs.db")
    result = flowloop("send", "W1", "go", *db, cwd=here, code=2)
    assert result.stderr.splitlines() == [
        "error: no run 'W1'; it is the key of run(s) of jobs: "
        "flowloop send W1 go --workflow jobs -w FILE_OR_DIR --db jobs.db"
    ]
    result = flowloop("send", "W1", "go", "--workflow", "jbos", *db, cwd=here, code=2)
    assert result.stderr.splitlines() == [
        "error: no run of workflow 'jbos' has key 'W1'; this database has no workflow 'jbos'; "
        "did you mean 'jobs'?"
    ]
    migrate = ("migrate", "--workflow", "jbos", "--to", "2", "-w", "jobs.py", *db)
    result = flowloop(*migrate, cwd=here, code=2)
    assert "no workflow 'jbos' is loaded (loaded: jobs)" in result.stderr


def test_cli__a_failed_run_says_its_error_once_and_exits_1(here: Path) -> None:
    """`flowloop run` of a run that failed printed its error three times more than its
    failed attempts did: an ERROR log line, "run … failed in state check" and "error: run …
    ended failed: …" (new-user audit). The run's last line says how it ended, and why."""
    error = "ConnectionError: upstream reset"
    failing = ("jobs.py", "--context", '{"fail": true}', "--db", "jobs.db")

    def shown_once(result: subprocess.CompletedProcess[str]) -> None:
        lines = result.stdout.splitlines()
        assert result.stderr == "", result.stderr
        assert lines[-1].endswith(f"failed in state check: {error}"), lines
        # Two failed attempts (a retry has its own), then the run's last line.
        assert [error in line for line in lines].count(True) == 3, lines

    shown_once(flowloop("run", *failing, cwd=here, code=1))
    [run_id] = [run["id"] for run in json.loads(here_cli(here, "status", "--json"))["runs"]]
    shown_once(flowloop("retry", run_id, "-w", "jobs.py", "--db", "jobs.db", cwd=here, code=1))
    # Logging asked for is logging given: the engine's own line of the failure stays.
    verbose = flowloop("--log-level", "info", "run", *failing, cwd=here, code=1)
    assert "check attempt 2 failed in" in verbose.stderr, verbose.stderr
    # --json: the run on stdout and the one error line on stderr (no printer).
    quiet = flowloop("run", *failing, "--json", cwd=here, code=1)
    assert json.loads(quiet.stdout)["run"]["status"] == "failed"
    assert quiet.stderr.splitlines()[-1].startswith("error: run "), quiet.stderr


SAGA = """
from datetime import timedelta
from pydantic import BaseModel
from flowloop import Retry, Workflow

class C(BaseModel):
    late: bool = False

saga = Workflow("saga", context=C)

def undo_a(ctx: C) -> None:
    raise RuntimeError("refund api down")

@saga.step(initial=True, next="b", compensate=undo_a, compensate_retry=Retry(attempts=1))
def a(ctx: C) -> None:
    pass

@saga.step(next="done", retry=Retry(attempts=1), on_error={"*": "rolled_back"})
def b(ctx: C) -> None:
    raise ValueError("declined")

saga.final("done")
saga.final("rolled_back", compensate=True)
"""


def test_cli__a_failed_compensation_is_shown_once(tmp_path: Path) -> None:
    """A compensation's failure was printed by the run's lines and logged at ERROR on
    stderr besides, against the README's promise for a step's (new-user audit)."""
    (tmp_path / "saga.py").write_text(textwrap.dedent(SAGA).lstrip())
    result = flowloop("run", "saga.py", "--context", "{}", cwd=tmp_path, code=1)
    assert result.stderr == "", result.stderr
    assert "compensation_failed" in result.stdout and "refund api down" in result.stdout
    verbose = flowloop(
        "--log-level", "info", "run", "saga.py", "--context", "{}", cwd=tmp_path, code=1
    )
    assert "compensation of a attempt 1 failed: refund api down" in verbose.stderr
