"""Real worker processes for the acceptance tests: start ``flowloop worker``, run CLI
commands, send signals, and always clean up the processes a test started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from flowloop import Engine

ROOT = Path(__file__).resolve().parent.parent
EXIT_WAIT_S = 20.0


class WorkerProcess:
    """One ``flowloop worker`` child; its log (stdout and stderr) goes to a file."""

    def __init__(
        self,
        paths: Sequence[str | Path],
        db: Path,
        *args: str,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> None:
        self.log = log
        self._log_file = log.open("ab")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flowloop.cli",
                "worker",
                *map(str, paths),
                "--db",
                str(db),
                *args,
            ],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=str(db.parent),
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=EXIT_WAIT_S)

    def wait(self, timeout: float = EXIT_WAIT_S) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"worker {self.pid} did not exit within {timeout:g}s; log:\n{self.text()}"
            ) from None

    def stop(self, timeout: float = EXIT_WAIT_S) -> int:
        """SIGTERM, then the exit code (the test fails if it does not exit in time)."""
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def text(self) -> str:
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        self.kill()
        self._log_file.close()


@contextmanager
def workers() -> Iterator[list[WorkerProcess]]:
    """Collects the workers a test starts and kills whatever is left at the end."""
    started: list[WorkerProcess] = []
    try:
        yield started
    finally:
        for worker in started:
            worker.close()


def report(started: Sequence[WorkerProcess]) -> str:
    """Each worker's exit status and log, for a failure message."""
    return "\n".join(
        f"--- worker {worker.pid} (exit {worker.process.poll()}):\n{worker.text()}"
        for worker in started
    )


def cli(*args: str, db: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", *args, "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(db.parent),
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"flowloop {' '.join(args)} exited {result.returncode}:\n{result.stdout}{result.stderr}"
        )
    return result


def cli_here(*args: str, db: Path) -> str:
    """A read-only CLI command run in this process (quicker than a new interpreter); the
    output it printed."""
    from click.testing import CliRunner

    from flowloop.cli import cli as command

    result = CliRunner().invoke(command, [*args, "--db", str(db)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def write_module(path: Path, source: str) -> Path:
    path.write_text(textwrap.dedent(source).lstrip())
    return path


def engine(db: Path) -> Engine:
    """A reader on the workers' database (its own connections; WAL lets it read alongside)."""
    return Engine(str(db))


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def wait_exists(path: Path, timeout: float = EXIT_WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout:g}s")
        time.sleep(0.01)
