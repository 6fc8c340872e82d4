"""The CLI on runs a new definition cannot take (issue 16): ``check`` tells the truth
(exit 1, --json), every command on a run whose context does not validate answers in one
line — never a traceback — and ``migrate`` moves runs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploykit import OrderV1, order, renamed_state

from flowloop import Engine
from flowloop.cli import main
from flowloop.clock import FakeClock
from flowloop.runinfo import RunInfo

TESTS = Path(__file__).resolve().parents[1]


def _file(here: Path, name: str, body: str) -> Path:
    path = here / f"{name}.py"
    path.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import deploykit
            {body}
            """
        )
    )
    return path


@dataclass
class Result:
    exit_code: int
    output: str
    """stdout and stderr."""
    stdout: str


def _cli(here: Path, *args: str) -> Result:
    """``flowloop ARGS --db here/flowloop.db`` through ``main()`` in this process (it turns
    errors into one line and an exit code as the real command does); any other exception
    escapes and fails the test."""
    buffer, errors = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(errors):
        try:
            main([*args, "--db", str(here / "flowloop.db")])
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    output = buffer.getvalue() + errors.getvalue()
    assert "Traceback" not in output, output
    return Result(code, output, buffer.getvalue())


@pytest.fixture
def here(tmp_path: Path) -> Path:
    """A database with one v1 run waiting in ``confirm`` and one queued in ``reserve``."""
    url = str(tmp_path / "flowloop.db")
    with Engine(url, clock=FakeClock(time.time()), workflows=[order()]) as engine:
        wf = engine.workflow("order")
        engine.start(wf, OrderV1(order_id="w"))
        engine.run_until_idle(idle_horizon=10)
        engine.start(wf, OrderV1(order_id="q"))
    return tmp_path


def _ids(here: Path) -> list[str]:
    with Engine(str(here / "flowloop.db")) as engine:
        return sorted((r.id for r in engine.runs(limit=10)), key=lambda i: i)


def test_check__tells_what_each_run_would_do_and_exits_1(here: Path) -> None:
    v1 = _file(here, "v1", "order = deploykit.order()")
    assert _cli(here, "check", str(v1)).exit_code == 0
    broken = _file(here, "v2", "order = deploykit.added_field(migrated=False)")
    result = _cli(here, "check", str(broken))
    assert result.exit_code == 1
    assert "2 live run(s): 0 continues as is, 0 continues after migration, 0 would be parked, "
    assert "2 would fail" in result.output
    assert "context field 'currency' added (required)" in result.output
    assert "context_mismatch: no upcaster from context version 1 to 2" in result.output
    data = json.loads(_cli(here, "check", str(broken), "--json").stdout)
    assert data["ok"] is False
    (report,) = data["workflows"]
    assert report["counts"] == {"continues": 0, "migrates": 0, "parks": 0, "fails": 2}
    assert sorted(r["run_id"] for r in data["stranded"]) == _ids(here)
    fixed = _file(here, "v2ok", "order = deploykit.added_field(migrated=True)")
    data = json.loads(_cli(here, "check", str(fixed), "--json").stdout)
    assert data["ok"] is True and data["workflows"][0]["counts"]["migrates"] == 2
    removed = _file(here, "v2rm", "order = deploykit.removed_state()")
    result = _cli(here, "check", str(removed))
    assert result.exit_code == 1
    assert "1 continues as is, 0 continues after migration, 1 would be parked" in result.output
    assert "state 'confirm' removed" in result.output


def test_every_command__on_a_run_whose_context_does_not_validate__no_traceback(
    here: Path,
) -> None:
    broken = _file(here, "v2", "order = deploykit.added_field(migrated=False)")
    w = ("-w", str(broken))
    # A worker under the broken definition parks the queued run, and status says why.
    assert _cli(here, "resume", *w).exit_code == 0
    data = json.loads(_cli(here, "status", "--json").stdout)
    reasons = sorted(str(row.get("reason")) for row in data["runs"])
    assert reasons[-1].startswith("context_mismatch: no upcaster"), reasons
    for run_id in _ids(here):
        for args in (
            ("status", run_id),
            ("status",),
            ("history", run_id),
            ("replay", run_id),
            ("send", run_id, "confirmed", *w),
            ("retry", run_id, *w),
            ("pause", run_id),
            ("unpause", run_id),
            ("stop", run_id),
            ("retry", run_id, *w),
            ("resume", *w),
            ("migrate", run_id, "--to", "2", *w),
        ):
            result = _cli(here, *args)
            assert result.exit_code in (0, 1, 2), (args, result.output)
            assert len(result.output.strip().splitlines()) >= 1, args


def test_send__to_a_run_the_deployed_definition_cannot_take__one_line(here: Path) -> None:
    broken = _file(here, "v2", "order = deploykit.added_field(migrated=False)")
    with Engine(str(here / "flowloop.db")) as engine:
        waiting = next(r.id for r in engine.runs(limit=10) if r.state == "confirm")
    result = _cli(here, "send", waiting, "confirmed", "-w", str(broken))
    assert result.exit_code == 1
    assert "context_mismatch: no upcaster from context version 1 to 2" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_migrate__moves_parked_runs_and_refuses_without_a_mapping(here: Path) -> None:
    renamed = _file(here, "v2", "order = deploykit.renamed_state()")
    assert _cli(here, "resume", "-w", str(renamed)).exit_code in (0, 1)  # parks the queued run
    data = json.loads(
        _cli(
            here, "migrate", "--workflow", "order", "--to", "2", "-w", str(renamed), "--json"
        ).stdout
    )
    assert data["refused"] == [] and sorted(data["moved"]) == _ids(here)  # parked and waiting
    no_map = _file(here, "v3", "order = deploykit.order(version=3)")
    result = _cli(here, "migrate", "--workflow", "order", "--to", "3", "-w", str(no_map))
    assert result.exit_code == 1
    assert "declares no migrates_from={2: {...}}" in result.output
    result = _cli(here, "migrate", "--workflow", "order", "--to", "9", "-w", str(no_map))
    assert result.exit_code == 2 and "version 9 is not loaded" in result.output
    result = _cli(here, "migrate", "--to", "2", "-w", str(renamed))
    assert result.exit_code == 2


def test_check__old_and_new_version_in_one_file__runs_stay_on_theirs(here: Path) -> None:
    both = _file(here, "both", "order_v1, order_v2 = deploykit.order(), deploykit.renamed_state()")
    data = json.loads(_cli(here, "check", str(both), "--json").stdout)
    assert data["ok"] is True
    (report,) = data["workflows"]
    assert (report["version"], report["counts"]["continues"]) == (2, 2)
    twice = _file(here, "twice", "a, b = deploykit.order(), deploykit.order()")
    result = _cli(here, "check", str(twice))
    assert result.exit_code == 2 and "version 1 is defined twice" in result.output


@pytest.mark.parametrize("command", ["resume", "worker"])
def test_resume_and_worker__with_old_and_new_version__runs_stay_on_theirs(
    here: Path, command: str
) -> None:
    """``check`` passed a file holding both versions; ``resume`` and the worker registered
    the newest only, and parked the v1 run (``definition_mismatch``) the check had passed."""
    both = _file(here, "both", "order_v1, order_v2 = deploykit.order(), deploykit.renamed_state()")
    assert _cli(here, "check", str(both)).exit_code == 0

    def queued() -> RunInfo:
        with Engine(str(here / "flowloop.db"), workflows=[order(), renamed_state()]) as engine:
            return next(r for r in engine.runs(limit=10) if r.context.order_id == "q")  # type: ignore[attr-defined]

    if command == "resume":
        assert _cli(here, "resume", "-w", str(both)).exit_code == 0
    else:
        db = str(here / "flowloop.db")
        worker = subprocess.Popen(
            [sys.executable, "-m", "flowloop.cli", "worker", str(both), "--db", db],
            env={k: v for k, v in os.environ.items() if not k.startswith("FLOWLOOP_")},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while (now := queued()).state == "reserve" and now.status != "paused":
                assert worker.poll() is None, "the worker exited"
                assert time.monotonic() < deadline, "the worker did not take the queued run"
                time.sleep(0.05)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
    info = queued()
    assert (info.status, info.state, info.version) == ("scheduled", "confirm", 1), info
    assert info.context.trail == ["reserve@v1", "charge@v1"]  # type: ignore[attr-defined]


STRICTER = """
from pydantic import field_validator


class Stricter(deploykit.OrderV1):
    @field_validator("order_id")
    @classmethod
    def not_w(cls, value: str) -> str:
        if value == "q":
            raise ValueError("'q' is no order id any more")
        return value


order = deploykit.order(context=Stricter)
"""


def test_check_and_worker__a_validator_the_fingerprint_does_not_see(here: Path) -> None:
    """A validator added to the context model leaves the fingerprint as it is: ``check``
    said "continues as is", then the worker failed the run whose context it refused
    (``invalid_context``). ``check --validate`` tells; a worker parks the run."""
    stricter = here / "stricter.py"
    stricter.write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport deploykit\n{STRICTER}"
    )
    assert _cli(here, "check", str(stricter)).exit_code == 0  # trusted: model unchanged
    result = _cli(here, "check", str(stricter), "--validate")
    assert result.exit_code == 1, result.output
    assert "1 continues as is, 0 continues after migration, 0 would be parked, 1 would fail" in (
        result.output
    )
    assert "'q' is no order id any more" in result.output
    assert _cli(here, "resume", "-w", str(stricter)).exit_code == 0
    with Engine(str(here / "flowloop.db"), workflows=[order()]) as engine:
        queued = next(r for r in engine.runs(limit=10) if r.context.order_id == "q")  # type: ignore[attr-defined]
    assert queued.status == "paused", queued
    assert queued.reason is not None and "a validator may have changed" in queued.reason


def test_check__a_file_without_workflows_or_an_unknown_name_is_refused(here: Path) -> None:
    empty = _file(here, "empty", "x = 1")
    result = _cli(here, "check", str(empty))
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [
        f"error: nothing to check: {empty} defines no workflow; pass the file that does"
    ]
    v1 = _file(here, "v1", "order = deploykit.order()")
    result = _cli(here, "check", f"{v1}:nosuch")
    assert result.exit_code != 0
    assert "no workflow 'nosuch' in" in result.output and "(it defines: order)" in result.output
    assert _cli(here, "check", f"{v1}:order").exit_code == 0


def test_check__file_variable_as_run_and_diagram_take_it(here: Path) -> None:
    """`check FILE:VARIABLE` was refused ("no workflow 'order_v2'") though run and diagram
    take a variable's name (new-user audit)."""
    both = _file(
        here, "both", "order_v1 = deploykit.order(); order_v2 = deploykit.order(version=2)"
    )
    result = _cli(here, "check", f"{both}:order_v2")
    assert result.exit_code in (0, 1), result.output
    assert "order v2" in result.output and "order v1" not in result.output


def test_check__a_new_project_without_a_database_checks_the_definitions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`check FILE` in a folder with no database refused ("no database at flowloop.db")
    though it is how a new definition is checked before anything runs (new-user audit). A
    database named and missing is still refused: a typo."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWLOOP_DB", raising=False)
    v1 = _file(tmp_path, "v1", "order = deploykit.order()")
    broken = _file(
        tmp_path, "broken", "order = deploykit.order(); order.step(name='x', next='nowhere')(print)"
    )

    def check(*args: str) -> int:
        try:
            main(["check", *args])
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else 1
        return 0

    assert check(str(v1)) == 0
    captured = capsys.readouterr()
    assert "ok order v1" in captured.out
    assert captured.err.strip() == (
        "no database at flowloop.db: no live runs to judge (--db names one)"
    )
    assert not (tmp_path / "flowloop.db").exists()  # nothing created
    assert check(str(broken)) == 2
    assert "goes to unknown state(s) 'nowhere'" in capsys.readouterr().err
    assert check(str(v1), "--db", "typo.db") == 2
    assert "no database at typo.db" in capsys.readouterr().err


def test_check__newest_version_alone_without_a_database_and_dir_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a database `check` reported every version of a workflow (with one, the
    newest: the same shape now); `check DIR:VARIABLE` looked in the folder's last file only
    (review)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWLOOP_DB", raising=False)
    folder = tmp_path / "flows"
    folder.mkdir()
    _file(folder, "a", "var_a = deploykit.order(); var_a2 = deploykit.order(version=2)")
    _file(
        folder,
        "b",
        "from flowloop import Workflow; var_b = Workflow('other', context=deploykit.OrderV1); "
        "var_b.step(name='s', initial=True, next='done')(print); var_b.final('done')",
    )

    def check(*args: str) -> int:
        try:
            main(["check", *args, "--json"])
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else 1
        return 0

    assert check(str(folder)) == 0
    shown = json.loads(capsys.readouterr().out)["workflows"]
    assert sorted((w["workflow"], w["version"]) for w in shown if w["workflow"] == "order") == [
        ("order", 2)
    ]
    for variable in ("var_a", "var_b"):
        assert check(f"{folder}:{variable}") == 0, variable
        assert len(json.loads(capsys.readouterr().out)["workflows"]) == 1
