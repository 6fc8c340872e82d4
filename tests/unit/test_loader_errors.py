"""A workflow file that fails to import says where: the line of the user's code.

`flowloop run nameerr.py` said "import failed: NameError: name 'undefined_name' is not
defined" and no more, with `--log-level debug` too: a new user had no way to find the line
(new-user audit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flowloop.loader import LoadError, import_file


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_an_error_names_the_line_of_the_users_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "helpers.py", "def make():\n    return 1 / 0\n")
    cases = {
        "nameerr.py": ("def f():\n    return undefined_name\n\n\nf()\n", "(at nameerr.py:2)"),
        # In a neighbour it imports: that module's line.
        "neighbour.py": ("import helpers\n\nhelpers.make()\n", "(at helpers.py:2)"),
        # A flowloop error raised inside flowloop: the user's line that called it.
        "retry.py": ("from flowloop import Retry\n\nr = Retry(attempts='3')\n", "(at retry.py:3)"),
    }
    for name, (text, where) in cases.items():
        _write(tmp_path, name, text)
        with pytest.raises(LoadError) as error:
            import_file(Path(name))
        assert str(error.value).endswith(where), str(error.value)
        assert str(error.value).startswith(f"{name}: ")


def test_a_syntax_error_says_where_once(tmp_path: Path) -> None:
    path = _write(tmp_path, "syn.py", "def broken(:\n    pass\n")
    with pytest.raises(LoadError) as error:
        import_file(path)
    message = str(error.value)
    assert "SyntaxError" in message and "line 1" in message and "(at " not in message
    assert os.fspath(path) in message


def test_a_definition_error_names_the_file(tmp_path: Path) -> None:
    """One found when the definitions are checked after the import (a target that does not
    exist) named neither file nor line: with -w naming a folder, which file? (review)"""
    from flowloop.loader import load_paths

    folder = tmp_path / "flows"
    folder.mkdir()
    _write(folder, "fine.py", "x = 1\n")
    _write(
        folder,
        "broken.py",
        "from pydantic import BaseModel\nfrom flowloop import Workflow\n\n"
        "class C(BaseModel):\n    n: int = 0\n\n"
        "w = Workflow('dfn', context=C)\n"
        "w.step(name='s', initial=True, next='nowhere')(lambda ctx: None)\n"
        "w.final('done')\n",
    )
    with pytest.raises(LoadError) as error:
        load_paths([str(folder)])
    assert str(error.value).startswith(f"{folder / 'broken.py'}: workflow 'dfn': state 's' goes")
