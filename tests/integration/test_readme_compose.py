"""The README's "Composing machines" section: its Python blocks run, in order, in one
namespace, in a fresh working directory (as tests/test_readme.py runs the whole file)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## Composing machines"


def blocks() -> list[str]:
    text = README.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.S)


def test_readme__composing_machines_blocks_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    found = blocks()
    assert len(found) == 6
    namespace: dict[str, object] = {"__name__": "readme_compose"}
    for number, code in enumerate(found, 1):
        exec(compile(code, f"README.md {SECTION!r} block {number}", "exec"), namespace)
