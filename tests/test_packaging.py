"""Packaging: the metadata a package index shows, and what the sdist holds (built for
real with `python -m build`: the package, LICENSE, the README's pictures; no tests)."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNBOUNDED = {"rich"}
"""Dependencies without an upper bound, on purpose (see pyproject.toml)."""


def pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_metadata__spdx_license_file_classifiers_and_bounds() -> None:
    data = pyproject()
    project = data["project"]
    assert isinstance(project, dict)
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    build = data["build-system"]
    assert isinstance(build, dict)
    assert "setuptools>=77" in build["requires"]  # PEP 639 license expressions
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]  # PEP 639
    assert "Typing :: Typed" in project["classifiers"]
    for requirement in project["dependencies"]:
        name = re.split(r"[<>=\[ ]", requirement, maxsplit=1)[0]
        assert ">=" in requirement, requirement
        assert "<" in requirement or name in UNBOUNDED, requirement


def test_sdist__holds_license_and_readme_pictures_and_no_tests(tmp_path: Path) -> None:
    pytest.importorskip("build")
    built = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert "License classifiers are deprecated" not in built.stdout + built.stderr
    assert "`project.license` as a TOML table is deprecated" not in built.stdout + built.stderr
    (sdist,) = tmp_path.glob("flowloop-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "flowloop/__init__.py", "flowloop/py.typed"} <= names
    # The README's images, at the relative paths it uses, so they show off the repository.
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (ROOT / "README.md").read_text())
    assert pictures and set(pictures) <= names, pictures
    assert not [n for n in names if n.startswith(("tests/", "bench/"))], sorted(names)
