"""A typed user's code passes ``mypy --strict`` on the README's own patterns.

``engine.run(wf, ctx).context.parcel`` failed (``union-attr``: the context was typed
``BaseModel | dict``) and so did ``check_runs(engine.store, wf)`` (``Store`` given,
``SQLStore`` expected): a typed user had to cast on every read (API audit)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

USER_CODE = """
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.checking import check_runs


class Pack(BaseModel):
    parcel: str = ""


wf = Workflow("typed_pack", context=Pack)


@wf.step(initial=True, next="done")
def pack(ctx: Pack) -> None:
    ctx.parcel = "box"


wf.final("done")


def main(url: str) -> str:
    with Engine(url, workflows=[wf]) as engine:
        parcel: str = engine.run(wf, Pack()).context.parcel
        assert check_runs(engine.store, wf).ok
        return parcel
"""

CONFIG = """
[mypy]
strict = True

[mypy-graphviz.*]
ignore_missing_imports = True
"""


def test_the_readme_patterns_pass_mypy_strict(tmp_path: Path) -> None:
    (tmp_path / "use.py").write_text(textwrap.dedent(USER_CODE).lstrip())
    (tmp_path / "mypy.ini").write_text(CONFIG)
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            "mypy.ini",
            "--cache-dir",
            ".cache",
            "use.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT)},  # flowloop as the user's mypy sees it
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # And it runs.
    ran = subprocess.run(
        [sys.executable, "-c", f"import use; print(use.main({str(tmp_path / 'typed.db')!r}))"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ran.stdout.strip() == "box", ran.stderr
