"""`flowloop diagram` as users run it: a real process, real files, the real `dot` — and a
PATH without `dot`, where DOT still works and SVG/PNG fail in one line."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from flowloop import Engine, FakeClock, render, render_loops
from flowloop.loader import load_machine, load_paths, load_target
from flowloop.store.loops import LoopEvent, LoopStoreMixin

ROOT = Path(__file__).resolve().parents[2]
ORDER = ROOT / "workflows" / "order.py"
WORKFLOWS = ROOT / "workflows"
POLL = ROOT / "workflows" / "poll.py"
SVG_TEXT = "{http://www.w3.org/2000/svg}text"
ORDER_STATES = ("reserve", "awaiting_approval", "charge", "ship", "delivered", "cancelled")


def machines() -> list[str]:
    """What `--all` draws: the lifecycle, every example workflow and every example loop."""
    loaded = load_paths([WORKFLOWS])
    return [
        render.LIFECYCLE,
        *loaded.workflows,
        *(render_loops.diagram_name(name) for name in loaded.loops),
    ]


needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="needs Graphviz's dot")


def flowloop(*args: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "FLOWLOOP_DB": str(cwd / "cli.db")}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "flowloop.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def no_dot_path(tmp_path: Path) -> str:
    """A PATH holding only a python: no `dot` on it."""
    bin_dir = tmp_path / "bin-without-dot"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    return str(bin_dir)


def svg_texts(data: bytes) -> str:
    root = ET.fromstring(data)
    return " ".join(t.text or "" for t in root.iter(SVG_TEXT))


def test_diagram__workflow_file_prints_dot_to_stdout(tmp_path: Path) -> None:
    result = flowloop("diagram", f"{ORDER}:order", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == render.workflow_digraph(load_target(str(ORDER))[0]).source
    assert result.stderr == b""


@needs_dot
def test_diagram__svg_and_png_files_from_the_suffix(tmp_path: Path) -> None:
    result = flowloop("diagram", str(ORDER), "-o", "out/order.svg", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    texts = svg_texts((tmp_path / "out" / "order.svg").read_bytes())
    assert all(state in texts for state in ORDER_STATES)

    result = flowloop("diagram", str(ORDER), "-o", "order.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "order.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_diagram__lifecycle(tmp_path: Path) -> None:
    result = flowloop("diagram", "--lifecycle", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == render.lifecycle_digraph().source


def test_diagram__run_overlay_from_the_store(tmp_path: Path) -> None:
    workflow, _ = load_target(str(ORDER))
    with Engine(str(tmp_path / "cli.db"), clock=FakeClock()) as engine:
        info = engine.run(workflow, {"order_id": "A1", "items": [{"sku": "book", "qty": 1}]})
    assert info.status == "succeeded"

    result = flowloop("diagram", "--run", info.id, "-w", str(WORKFLOWS), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    dot = result.stdout.decode()
    assert f"run {info.id}: succeeded at delivered" in dot
    assert "1 visit, 2 attempts" in dot  # charge: the flaky provider, retried once
    for label in ("reserved", "charged", "succeeded", "next"):  # succeeded: the packing child
        assert f'label="{label} {render.TIMES}1"' in dot
    assert dot.count(render.TIMES) == 4
    assert "children: 1 succeeded" in dot


def _definitions(db: Path) -> list[str]:
    with sqlite3.connect(db) as conn:
        return sorted(row[0] for row in conn.execute("SELECT name FROM flowloop_definitions"))


def test_diagram__run_and_loop_store_no_definition_they_read(tmp_path: Path) -> None:
    """`diagram --run` and `--loop` with `-w workflows/` stored the definition of every
    workflow in it (etl, converge …) in a database where none of them ever ran — the
    dashboard then listed them — also when the command was refused."""
    workflow, _ = load_target(str(ORDER))
    with Engine(str(tmp_path / "cli.db"), clock=FakeClock()) as engine:
        info = engine.run(workflow, {"order_id": "A1", "items": [{"sku": "book", "qty": 1}]})
    before = _definitions(tmp_path / "cli.db")
    assert before == ["order", "packing"]
    for args in (["--run", info.id], ["--loop", "poll_feed"]):
        result = flowloop("diagram", *args, "-w", str(WORKFLOWS), cwd=tmp_path)
        assert result.returncode in (0, 2), result.stderr  # (no such loop here: refused)
        assert _definitions(tmp_path / "cli.db") == before, args


def test_diagram__a_file_that_defines_a_loop_draws_its_machine(tmp_path: Path) -> None:
    result = flowloop("diagram", str(POLL), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    loop, _ = load_machine(str(POLL))
    assert result.stdout.decode() == (ROOT / "diagrams" / "poll_feed.loop.dot").read_text()
    assert result.stdout.decode() == render_loops.loop_digraph(loop).source  # type: ignore[arg-type]
    dot = result.stdout.decode()
    assert "every 30s after each end (fixed_delay)" in dot and "3 attempts, 1s apart" in dot
    result = flowloop("diagram", f"{WORKFLOWS / 'etl.py'}:etl_inbox", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert 'URL="etl.svg"' in result.stdout.decode()


def test_diagram__stored_loop_overlay(tmp_path: Path) -> None:
    with Engine(str(tmp_path / "cli.db"), clock=FakeClock()) as engine:
        store = engine.store
        assert isinstance(store, LoopStoreMixin)
        row = store.sync_loop(
            name="poll_feed", schedule="every 30s (fixed_delay)", first_slot=1e9, at=1e9, worker="w"
        )
        fired = store.fire_loop(
            name="poll_feed",
            follows_seq=row.last_seq,
            worker="w",
            lease_seconds=30,
            events=[LoopEvent(loop="poll_feed", kind="iteration_started", at=1e9, slot=1e9)],
            changes={"last_slot": 1e9, "next_fire_at": None},
        )
        assert fired is not None
        done = LoopEvent(
            loop="poll_feed",
            kind="iteration_failed",
            at=1e9 + 1,
            slot=1e9,
            attempt=3,
            error_message="OSError: feed gone",
        )
        assert store.write_loop(
            name="poll_feed",
            owner="w",
            epoch=fired.lease_epoch,
            follows_seq=fired.last_seq,
            changes={
                "status": "scheduled",
                "next_fire_at": 1e9 + 31,
                "last_error": "OSError: feed gone",
                "iterations": 1,
            },
            events=[done],
        )
    result = flowloop("diagram", "--loop", "poll_feed", "-w", str(POLL), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    dot = result.stdout.decode()
    assert "loop poll_feed: now scheduled, next fire 2001-09-09 01:47:11Z" in dot
    assert "1 iteration: 0 succeeded, 1 failed" in dot and "2 retried" in dot
    assert "last error: OSError: feed gone" in dot
    assert f'label="failed {render.TIMES}1"' in dot

    empty = tmp_path / "none"
    empty.mkdir()
    result = flowloop("diagram", "--loop", "poll_feed", "-w", str(empty), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.decode() == (
        f"error: loop 'poll_feed': not defined in {empty}; pass -w FILE_OR_DIR that defines it\n"
    )
    result = flowloop("diagram", "--loop", "nope", "-w", str(POLL), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.decode().count("\n") == 1


def test_diagram__run_needs_its_workflow(tmp_path: Path) -> None:
    workflow, _ = load_target(str(ORDER))
    with Engine(str(tmp_path / "cli.db"), clock=FakeClock()) as engine:
        run_id = engine.start(workflow, {"order_id": "A1", "items": [{"sku": "pen", "qty": 1}]}).id
    empty = tmp_path / "none"
    empty.mkdir()
    result = flowloop("diagram", "--run", run_id, "-w", str(empty), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.decode().count("\n") == 1
    assert "unknown workflow 'order'" in result.stderr.decode() and "-w" in result.stderr.decode()


@needs_dot
def test_diagram__all_writes_dot_and_svg_for_every_workflow_loop_and_the_lifecycle(
    tmp_path: Path,
) -> None:
    out = tmp_path / "diagrams"
    out.mkdir()
    (out / "gone.dot").write_text("digraph gone {}\n")
    result = flowloop("diagram", "--all", "-w", str(WORKFLOWS), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    written = {f"{name}.{fmt}" for name in machines() for fmt in ("dot", "svg")}
    assert sorted(p.name for p in out.iterdir()) == sorted({"gone.dot", *written})
    assert "stale" in result.stderr.decode() and "gone.dot" in result.stderr.decode()
    assert (out / "order.dot").read_text() == (ROOT / "diagrams" / "order.dot").read_text()
    assert "poll_feed.loop.svg" in written and "etl_inbox.loop.svg" in written
    texts = svg_texts((out / "lifecycle.svg").read_bytes())
    assert all(status in texts for status in ("idle", "scheduled", "running", "succeeded"))


@needs_dot
def test_diagram__all_with_no_workflows_says_so(tmp_path: Path) -> None:
    """`diagram --all` in a folder with no ./workflows wrote the lifecycle machine alone and
    exited 0 without a word (new-user audit)."""
    result = flowloop("diagram", "--all", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.decode().splitlines() == [
        "no workflow or loop to draw (no -w given and no ./workflows here); the lifecycle "
        "machine alone is drawn — pass -w FILE_OR_DIR"
    ]
    assert sorted(p.name for p in (tmp_path / "diagrams").iterdir()) == [
        "lifecycle.dot",
        "lifecycle.svg",
    ]


def test_diagram__usage_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    for args in (
        ("diagram",),
        ("diagram", str(ORDER), "--lifecycle"),
        ("diagram", "--lifecycle", "--format", "png"),
        ("diagram", "--all", "--format", "svg"),
        ("diagram", "--lifecycle", "-o", "x.pdf"),
    ):
        result = flowloop(*args, cwd=tmp_path)
        assert result.returncode == 2, args
        assert result.stderr.decode().count("\n") == 1, (args, result.stderr)
        assert result.stderr.startswith(b"error: "), args
    assert not (tmp_path / "x.pdf").exists()


def test_diagram__an_out_path_that_cannot_be_written_is_one_line_exit_2(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "a-dir").mkdir()
    for args in (
        ("diagram", str(ORDER), "-o", "a-file/order.dot"),  # its "directory" is a file
        ("diagram", "--lifecycle", "-o", "a-dir", "--format", "dot"),  # a directory
        ("diagram", "--all", "-w", str(WORKFLOWS), "-o", "a-file"),  # --all's directory
    ):
        result = flowloop(*args, cwd=tmp_path)
        stderr = result.stderr.decode()
        assert result.returncode == 2, (args, stderr)
        assert stderr.count("\n") == 1 and stderr.startswith("error: cannot write "), stderr
        assert "Traceback" not in stderr
    assert (tmp_path / "a-file").read_text() == "not a directory"
    assert list((tmp_path / "a-dir").iterdir()) == []


def test_diagram__a_format_the_suffix_contradicts_is_refused(tmp_path: Path) -> None:
    # It wrote PNG bytes into order.svg and said "wrote order.svg".
    result = flowloop("diagram", str(ORDER), "-o", "order.svg", "--format", "png", cwd=tmp_path)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr
    assert stderr.count("\n") == 1 and "--format png" in stderr and ".svg" in stderr, stderr
    assert not (tmp_path / "order.svg").exists()
    # The same format twice, or a suffix that names none, is fine.
    result = flowloop("diagram", str(ORDER), "-o", "order.dot", "--format", "dot", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    result = flowloop("diagram", str(ORDER), "-o", "order.gv", "--format", "dot", cwd=tmp_path)
    assert result.returncode == 0, result.stderr


# -- without the dot program ----------------------------------------------------------------


def test_without_dot__dot_output_still_works(tmp_path: Path, no_dot_path: str) -> None:
    result = flowloop("diagram", str(ORDER), "-o", "order.dot", cwd=tmp_path, path=no_dot_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "order.dot").read_text() == (ROOT / "diagrams" / "order.dot").read_text()


@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_without_dot__svg_png_fail_in_one_line_and_write_nothing(
    tmp_path: Path, no_dot_path: str, fmt: str
) -> None:
    result = flowloop("diagram", str(ORDER), "-o", f"order.{fmt}", cwd=tmp_path, path=no_dot_path)
    assert result.returncode == 1
    stderr = result.stderr.decode()
    assert stderr.count("\n") == 1, stderr
    assert "`dot` program is not installed" in stderr and "apt-get install graphviz" in stderr
    assert result.stdout == b""
    assert not (tmp_path / f"order.{fmt}").exists()

    result = flowloop("diagram", "--lifecycle", "--format", "svg", cwd=tmp_path, path=no_dot_path)
    assert result.returncode == 1 and result.stdout == b""
    assert "apt-get install graphviz" in result.stderr.decode()


def test_without_dot__all_writes_the_dot_files_then_fails_in_one_line(
    tmp_path: Path, no_dot_path: str
) -> None:
    out = tmp_path / "diagrams"
    result = flowloop(
        "diagram",
        "--all",
        "-w",
        str(WORKFLOWS),
        "--out",
        str(out),
        cwd=tmp_path,
        path=no_dot_path,
    )
    assert result.returncode == 1
    stderr = result.stderr.decode()
    assert stderr.count("\n") == 1 and "apt-get install graphviz" in stderr, stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{name}.dot" for name in machines())


def test_import__definitions_and_engine_do_not_load_graphviz(tmp_path: Path) -> None:
    code = (
        "import sys, flowloop, flowloop.definition, flowloop.engine, flowloop.cli\n"
        "assert 'graphviz' not in sys.modules, 'graphviz imported at module level'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr.decode()


def test_diagram__draws_the_timeouts_flowloop_toml_sets(tmp_path: Path) -> None:
    """A step's timeout set in flowloop.toml ran (5 s) while the diagram drawn for review
    said the code's (1 s) (new-user audit): the diagram applies the overrides a worker
    does."""
    (tmp_path / "slow.py").write_text(
        "from pydantic import BaseModel\n"
        "from flowloop import Workflow\n\n\n"
        "class Ctx(BaseModel):\n    n: int = 0\n\n\n"
        'slow = Workflow("slow", context=Ctx)\n\n\n'
        '@slow.step(initial=True, next="done", timeout=1)\n'
        "def work(ctx: Ctx) -> None: ...\n\n\n"
        'slow.final("done")\n'
    )
    drawn = flowloop("diagram", "slow.py", cwd=tmp_path).stdout.decode()
    assert "timeout 1s" in drawn
    (tmp_path / "flowloop.toml").write_text('[workflows.slow.steps.work]\ntimeout = "5s"\n')
    drawn = flowloop("diagram", "slow.py", cwd=tmp_path).stdout.decode()
    assert "timeout 5s" in drawn and "timeout 1s" not in drawn
