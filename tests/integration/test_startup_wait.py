"""What ``worker``/``resume`` do with a database that cannot be used at start-up
(flowloop/cli/startup.py): an outage is waited for, a mistake is one line at once.

The first version waited for ever on a database that does not exist, a role that does not
exist or a wrong password (libpq gives those no SQLSTATE: they read as outages), said it
waits once only, and took Ctrl-C for an interrupted run (review)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import pg_base_url, require_pg
from sqlalchemy.exc import DBAPIError

from flowloop.cli.startup import REMINDER_SECONDS, StoppedWaiting, when_reachable
from flowloop.errors import StoreError
from flowloop.store.outage import is_outage

FLOW = """
from pydantic import BaseModel
from flowloop import Workflow

class C(BaseModel):
    n: int = 0

flow = Workflow("startup_wait", context=C)
flow.step(name="work", initial=True, next="done")(lambda ctx: None)
flow.final("done")
"""


def _refused(url: str) -> BaseException:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect():
            pass
    except DBAPIError as error:
        return error
    finally:
        engine.dispose()
    raise AssertionError(f"{url} connected")


@pytest.mark.postgres
def test_a_missing_database_or_role_is_no_outage() -> None:
    require_pg()
    base = sa.make_url(pg_base_url())
    for url in (base.set(database="flowloop_no_such_db"), base.set(username="no_such_role")):
        assert not is_outage(_refused(url.render_as_string(hide_password=False)))
    assert is_outage(_refused(base.set(port=1).render_as_string(hide_password=False)))


@pytest.mark.postgres
@pytest.mark.parametrize("command", ["resume", "worker"])
def test_worker_and_resume_on_a_missing_database_say_so_at_once(
    tmp_path: Path, command: str
) -> None:
    require_pg()
    (tmp_path / "flow.py").write_text(FLOW)
    url = sa.make_url(pg_base_url()).set(database="flowloop_no_such_db")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowloop.cli",
            command,
            "-w",
            "flow.py",
            "--db",
            url.render_as_string(hide_password=False),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,  # (it waited for ever: the test's failure is this timeout)
        check=False,
    )
    assert done.returncode == 1, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: cannot use database") and "does not exist" in line


def _outage() -> StoreError:
    try:
        raise sa.exc.OperationalError("connect", {}, ConnectionRefusedError("refused"))
    except sa.exc.OperationalError as error:
        try:
            raise StoreError("cannot use database x") from error
        except StoreError as wrapped:
            return wrapped


def test_the_wait_says_so_again_each_minute_and_ctrl_c_ends_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += 25.0
        if len(slept) == 6:
            raise KeyboardInterrupt

    def never() -> object:
        raise _outage()

    with (
        caplog.at_level(logging.WARNING, logger="flowloop"),
        pytest.raises(StoppedWaiting) as stopped,
    ):
        when_reachable(never, "postgresql://x/y", sleep=sleep, monotonic=lambda: now[0])  # type: ignore[arg-type, return-value]
    assert stopped.value.exit_code == 130
    assert slept == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    said = [m for m in caplog.messages if m.startswith("cannot use the database yet")]
    # Failures at 0, 25, 50, 75, 100, 125 s: said at 0 s, then at 75 s (the first failure
    # at least REMINDER_SECONDS after).
    assert REMINDER_SECONDS == 60.0
    assert len(said) == 2, said
    assert said[-1].endswith("waiting for it, 75s so far (Ctrl-C to stop)")
