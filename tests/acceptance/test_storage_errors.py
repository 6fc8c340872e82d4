"""Storage errors reach the user as one line naming the cause and the database, exit 1,
no traceback (issue 20, item 6): ``start`` on a full disk, ``resume`` on a read-only
file system — each a real small tmpfs the test mounts (skipped where it cannot)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

FLOW = """
from pydantic import BaseModel
from flowloop import Workflow

class Ctx(BaseModel):
    blob: str = ""

wf = Workflow("disk", context=Ctx)

@wf.step(initial=True, next="done")
def work(ctx: Ctx) -> None:
    ctx.blob += "x"

wf.final("done")
"""


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def flowloop(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowloop.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(cwd),
    )


def assert_one_line(done: subprocess.CompletedProcess[str], *words: str) -> str:
    text = done.stderr.strip()
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert len(text.splitlines()) == 1, text
    for word in words:
        assert word in text, text
    return text


def test_start_on_a_full_disk_says_so_in_one_line(tmp_path: Path) -> None:
    flow = tmp_path / "flow.py"
    flow.write_text(FLOW)
    with tmpfs(tmp_path / f"mnt-{uuid.uuid4().hex[:6]}", "1m") as disk:
        db = disk / "flowloop.db"
        first = flowloop("start", str(flow), "--db", str(db), cwd=tmp_path)
        assert first.returncode == 0, first.stderr
        with contextlib.suppress(OSError), (disk / "filler").open("wb") as filler:
            while True:  # fill the disk up to the last block
                filler.write(b"\0" * 4096)
                filler.flush()
        # Room to open the database (its -shm and WAL header), not to store the context.
        filler_size = (disk / "filler").stat().st_size
        with (disk / "filler").open("r+b") as filler:
            filler.truncate(filler_size - 128 * 1024)
        big = tmp_path / "big.json"
        big.write_text('{"blob": "' + "y" * 200_000 + '"}')
        done = flowloop("start", str(flow), "--db", str(db), "--context", f"@{big}", cwd=tmp_path)
        line = assert_one_line(done, str(db), "full")
        print(line)


def test_resume_on_a_read_only_file_system_says_so_in_one_line(tmp_path: Path) -> None:
    flow = tmp_path / "flow.py"
    flow.write_text(FLOW)
    with tmpfs(tmp_path / f"mnt-{uuid.uuid4().hex[:6]}", "4m") as disk:
        db = disk / "flowloop.db"
        assert flowloop("start", str(flow), "--db", str(db), cwd=tmp_path).returncode == 0
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        done = flowloop("resume", "-w", str(flow), "--db", str(db), cwd=tmp_path)
        line = assert_one_line(done, str(db), "read-only")
        print(line)
