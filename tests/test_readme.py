"""The README's Python samples run as written.

How it works (keep it this simple): every fenced block that opens with ```python in
README.md is executed, in the order of the file, in ONE namespace (a block may use names an
earlier block defined), in a fresh temporary working directory with FLOWLOOP_DB unset, so
``Engine()`` creates ./flowloop.db there. A failing block fails the test with its line in
README.md (tracebacks point at README lines too). Engines the samples leave open are
closed at the end.

Adding a sample: give it its own imports, or use names from blocks above it. Text that is
not meant to run (signatures, fragments with ``...``) goes in a ```text block instead.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

from flowloop import Engine

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(\S*)\s*$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the block's first code line, code) for each ```python block, in order."""
    blocks: list[tuple[int, str]] = []
    language: str | None = None
    start, lines = 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = FENCE.match(line)
        if language is None:
            if fence:
                language, start, lines = fence.group(1), number + 1, []
        elif line.rstrip() == "```":
            if language == "python":
                blocks.append((start, "\n".join(lines) + "\n"))
            language = None
        else:
            lines.append(line)
    assert language is None, f"README.md: the block opened at line {start - 1} is not closed"
    return blocks


def test_python_blocks__are_found_with_their_lines() -> None:
    text = "intro\n```python\nx = 1\n```\n```text\nnot run\n```\n```python\ny = x\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n"), (9, "y = x\n")]


def test_readme__every_python_block_runs_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWLOOP_DB", raising=False)
    blocks = python_blocks(README.read_text())
    assert blocks, "README.md has no ```python block"
    # Run as a script is: the first sample's engine lines sit under `if __name__ == ...`.
    namespace: dict[str, object] = {"__name__": "__main__"}
    failure = None
    try:
        for line, code in blocks:
            try:
                # Padded so that line numbers in a traceback are README.md's.
                exec(compile("\n" * (line - 1) + code, str(README), "exec"), namespace)
            except Exception as error:
                detail = "".join(traceback.format_exception(error)[-3:])
                failure = (
                    f"README.md line {line}: the ```python block there fails: "
                    f"{type(error).__name__}: {error}\n{detail}"
                )
                break
    finally:
        for value in namespace.values():
            if isinstance(value, Engine):
                value.close()
    if failure is not None:
        pytest.fail(failure, pytrace=False)


def _shape(line: str) -> str:
    """A progress line without what changes from run to run: ids, times and durations."""
    line = re.sub(r"\b[0-9a-f]{32}\b", "RUN", line)
    line = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}Z \(in [^)]*\)", "TIME (in N)", line)
    return re.sub(r" \d+\.\d ms$", " N ms", line.rstrip())


def test_readme__the_main_jobs_output_is_what_flowloop_run_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sample under "The main job, end to end" as `flowloop run` prints it today (it
    had drifted: the order workflow gained a call state the sample did not show)."""
    from click.testing import CliRunner

    from flowloop.cli import cli

    text = README.read_text()
    block = text.split("## The main job, end to end", 1)[1].split("```bash\n", 1)[1]
    command, *sample = block.split("```", 1)[0].strip().splitlines()
    assert command.startswith("$ flowloop run workflows/order.py --context '")
    context = command.split("--context ", 1)[1].strip("'")
    workflows = README.parent / "workflows" / "order.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWLOOP_DB", raising=False)
    result = CliRunner().invoke(cli, ["run", str(workflows), "--context", context])
    assert result.exit_code == 0, result.output
    # stdout only: a log line (the watchdog on a loaded machine) goes to stderr.
    assert [_shape(line) for line in result.stdout.splitlines()] == [_shape(s) for s in sample]


def test_readme__the_30_line_sample_is_a_workflow_file_the_cli_can_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saved as a file, the first sample is what a user gives `flowloop run` next. Its
    engine lines ran at import: `flowloop run order.py --db other.db` made ./flowloop.db,
    started order A1 there and drove every due run in it, before running its own on
    other.db."""
    from click.testing import CliRunner

    from flowloop.cli import cli

    _, code = python_blocks(README.read_text())[0]
    assert "order = Workflow(" in code and "Engine()" in code
    (tmp_path / "order.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FLOWLOOP_DB", raising=False)
    context = '{"order_id": "B2", "amount": 3}'
    result = CliRunner().invoke(cli, ["run", "order.py", "--db", "other.db", "--context", context])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir() if "flowloop.db" in p.name) == []
