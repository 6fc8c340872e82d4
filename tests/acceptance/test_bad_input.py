"""Bad input gets one line and an exit code, never a traceback (issue 20, item 8): bytes
that are not UTF-8 in an id, a key, a JSON option or a file; an unknown driver; a negative
--limit; keys and names longer than the schema's columns or holding NUL — with the same
limits on SQLite and PostgreSQL."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from pathlib import Path

import pytest
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.cli import main
from flowloop.errors import DefinitionError, FlowloopError

FLOW = """
from pydantic import BaseModel
from flowloop import Workflow

class Ctx(BaseModel):
    note: str = ""

wf = Workflow("bad_input", context=Ctx)

@wf.step(initial=True, next="done")
def work(ctx: Ctx) -> None:
    pass

wf.final("done")
"""
NOT_UTF8 = "\udcff"  # how Python hands a command line's 0xff byte to the program


class Ctx(BaseModel):
    note: str = ""


def flow() -> Workflow:
    wf = Workflow("bad_input", context=Ctx)

    @wf.step(initial=True, next="done")
    def work(ctx: Ctx) -> None:
        pass

    wf.final("done")
    return wf


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = 0
    try:
        main(list(args))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err, captured.err
    lines = captured.err.strip().splitlines()
    assert code == 0 or len(lines) == 1, captured.err
    return code, captured.err.strip()


@pytest.fixture
def flow_file(tmp_path: Path) -> Path:
    path = tmp_path / "flow.py"
    path.write_text(FLOW)
    return path


def test_keys_and_names_are_checked_against_the_schema(store_url: str) -> None:
    wf = flow()
    with Engine(store_url, workflows=[wf]) as engine:
        with pytest.raises(FlowloopError, match="401 characters long; at most 400 fit"):
            engine.start(wf, Ctx(), key="k" * 401)
        with pytest.raises(FlowloopError, match="contains a NUL"):
            engine.start(wf, Ctx(), key="a\x00b")
        with pytest.raises(FlowloopError, match="idempotency key"):
            engine.start(wf, Ctx(), idempotency_key="i" * 401)
        assert engine.start(wf, Ctx(), key="k" * 400).key == "k" * 400
        with pytest.raises(FlowloopError, match="negative"):
            engine.runs(limit=-1)
    with pytest.raises(DefinitionError, match="at most 200"):
        Workflow("w" * 201, context=Ctx)
    with pytest.raises(DefinitionError):
        flow().step(name="s" * 201, next="done")(lambda ctx: None)


class IndexOnly:
    """A whole number that is no int (as numpy's integers): it has ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_due_times_and_priorities_are_checked_the_same_on_both_databases(store_url: str) -> None:
    """`run_at=nan` stored a run with no due time (never run), `inf` broke `status` and
    the dashboard, a datetime reached the driver as a StatementError; a priority past 2**63
    was a traceback on SQLite, and 3e9 worked there while PostgreSQL refused it (new-user
    audit). Each is one line now, nothing written; an aware datetime is a due time."""
    wf = flow()
    with Engine(store_url, workflows=[wf]) as engine:
        for bad, problem in (
            (math.nan, "is not a time from the epoch"),
            (math.inf, "is not a time from the epoch"),
            (time.time() + 11 * 365 * 86400, "is not a time from the epoch"),
            ("tomorrow", "is not a time: give seconds since the epoch"),
            (datetime(2030, 1, 1), "has no time zone"),
            (10**400, "run_at 'a huge number' is not a time"),  # (float() overflowed: review)
        ):
            with pytest.raises(FlowloopError, match=problem):
                engine.start(wf, Ctx(), run_at=bad)  # type: ignore[arg-type]
        for priority in (2**31, -(2**31) - 1, 2**64, True, 1.0, "1"):
            with pytest.raises(FlowloopError, match="is not a whole number from -2147483648"):
                engine.start(wf, Ctx(), priority=priority)
        assert engine.runs(limit=5) == []
        # Any whole number a column holds (an int subclass, a numpy integer: __index__).
        assert engine.start(wf, Ctx(), priority=IndexOnly(7), run_at=Fraction(1)).id
        later = datetime.now(UTC) + timedelta(hours=1)
        run = engine.start(wf, Ctx(), run_at=later, priority=2**31 - 1)
        assert run.next_run_at == pytest.approx(later.timestamp())
        engine.run_until_idle()  # (the one due at epoch 1 runs, not the one due in an hour)
        assert engine.get(run.id).status == "scheduled"


def test_cli_bad_input_is_one_line(
    store_url: str, flow_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ["--db", store_url]
    Engine(store_url).close()  # read commands refuse a database that does not exist yet
    code, err = cli(capsys, "status", f"abc{NOT_UTF8}", *db)
    assert code == 2 and "not valid UTF-8 text (byte 0xff)" in err, err
    code, err = cli(capsys, "start", str(flow_file), "--key", f"k{NOT_UTF8}", *db)
    assert code == 2 and "UTF-8" in err, err
    code, err = cli(capsys, "start", str(flow_file), "--context", f'{{"note": "{NOT_UTF8}"}}', *db)
    assert code == 2 and "UTF-8" in err, err
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"note": "\xff"}')
    code, err = cli(capsys, "start", str(flow_file), "--context", f"@{bad}", *db)
    assert code == 2 and "UTF-8" in err, err
    code, err = cli(capsys, "start", str(flow_file), "--key", "k" * 401, *db)
    assert code == 2 and "at most 400" in err, err
    code, err = cli(capsys, "start", str(flow_file), "--key", "a\x00b", *db)
    assert code == 2 and "NUL" in err, err
    code, err = cli(capsys, "start", str(flow_file), "--priority", str(2**63), *db)
    assert code == 2 and "priority 9223372036854775808 is not a whole number" in err, err
    # --limit is range-checked by click (its usage message; exit 2, no traceback).
    with pytest.raises(SystemExit) as exited:
        main(["status", "--limit", "-1", *db])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "-1 is not in the range" in err and "Traceback" not in err


def test_cli_unknown_driver_and_bad_config(
    flow_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = cli(capsys, "status", "--db", "postgresql+nosuchdriver://u@127.0.0.1/x")
    assert code == 2 and "unknown database driver 'postgresql+nosuchdriver'" in err, err
    config = tmp_path / "flowloop.toml"
    config.write_bytes(b'lease = "\xff"\n')
    code, err = cli(
        capsys, "--config", str(config), "status", "--db", f"sqlite:///{tmp_path / 'x.db'}"
    )
    assert code in (1, 2) and err, err
