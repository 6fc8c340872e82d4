"""Cold start (issue 13): `flowloop --help` and `import flowloop` load no engine, database or
settings library. Checked deterministically on ``sys.modules`` in a fresh interpreter, not by
timing: each module named here was imported eagerly before and is loaded lazily now."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Each was imported by `import flowloop.cli` before the CLI became a package of lazy commands.
LAZY = (
    "sqlalchemy",
    "alembic",
    "mako",
    "pygments",
    "pydantic",
    "pydantic_settings",
    "transitions",
    "rich",
    "asyncio",
    "flowloop.engine",
    "flowloop.config",
    "flowloop.store",
)


def loaded_after(code: str, cwd: Path) -> list[str]:
    """The modules of LAZY (or under them) that ``code`` left in ``sys.modules``."""
    probe = (
        f"{code}\n"
        "import json, sys\n"
        f"lazy = {LAZY!r}\n"
        "print(json.dumps(sorted({m for m in lazy for name in sys.modules "
        "if name == m or name.startswith(m + '.')})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    found: list[str] = json.loads(result.stdout.splitlines()[-1])
    return found


def test_cold_start__importing_the_cli_loads_no_engine_or_database(tmp_path: Path) -> None:
    assert loaded_after("import flowloop.cli", tmp_path) == []


def test_cold_start__help_loads_no_engine_or_database(tmp_path: Path) -> None:
    code = (
        "import contextlib, io\n"
        "from flowloop.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as shown:\n"
        "    main(['--help'])\n"
        "assert 'Commands:' in shown.getvalue(), shown.getvalue()\n"
    )
    assert loaded_after(code, tmp_path) == []


def test_cold_start__public_names_load_when_first_used(tmp_path: Path) -> None:
    assert loaded_after("import flowloop", tmp_path) == []
    # `from flowloop import Engine` still works, and loads the engine then.
    code = "from flowloop import Engine, Workflow\nassert Engine.__module__ == 'flowloop.engine'\n"
    assert "flowloop.engine" in loaded_after(code, tmp_path)
