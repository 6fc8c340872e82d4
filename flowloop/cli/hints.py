"""The commands `flowloop run`, `retry`, `send` and `resume` print for the user to type
next (`flowloop send RUN EVENT …`, `flowloop resume …`): each with the ``-w`` and ``--db``
that make it find the definitions and the database this command used, so that it works
as printed. They said ``flowloop send RUN EVENT`` after ``run approve.py --db other.db``
(no -w: "unknown workflow"; no --db: another database) and ``-w FILE_OR_DIR`` where the
command knew the file."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Final

PLACEHOLDER: Final = "FILE_OR_DIR"
"""Said for ``-w`` when this command loaded no definitions to name."""


def db_flag(db: str | None) -> str:
    """`` --db DB`` (as given, quoted for the shell), or nothing when the next command
    finds the same database without it: the default ./flowloop.db, with no setting or
    configuration file naming another."""
    from flowloop.cli.common import database
    from flowloop.store.urls import DEFAULT_URL, normalize_url

    url = database(db)
    default = normalize_url(DEFAULT_URL)
    if normalize_url(url) == default and normalize_url(database(None)) == default:
        return ""
    return f" --db {shlex.quote(db or url)}"


def workflows_flags(paths: Sequence[str | Path], *, needed: bool = True) -> str:
    """`` -w PATH …`` for the definitions this command loaded from ``paths``; nothing when
    none were given and ./workflows (the default) holds them; `` -w FILE_OR_DIR`` when
    ``needed`` and there is nothing to name (no -w given, no ./workflows)."""
    from flowloop.cli.common import DEFAULT_WORKFLOWS

    if paths:
        return "".join(f" -w {shlex.quote(str(path))}" for path in paths)
    if Path(DEFAULT_WORKFLOWS).is_dir() or not needed:
        return ""
    return f" -w {PLACEHOLDER}"


def file_paths(file: Path) -> list[Path]:
    """The ``-w`` paths that load ``file`` (a `run` or `start` target): none when it lies
    in ./workflows, which a command without ``-w`` loads."""
    from flowloop.cli.common import DEFAULT_WORKFLOWS

    default = Path(DEFAULT_WORKFLOWS)
    if default.is_dir() and file.resolve().is_relative_to(default.resolve()):
        return []
    return [file]


def where(paths: Sequence[str | Path], db: str | None) -> str:
    """``-w …`` and ``--db …`` for a command to type next (see the module docstring)."""
    return workflows_flags(paths) + db_flag(db)


def send_command(run_id: str, where_flags: str) -> str:
    """`flowloop send RUN EVENT` with ``where_flags`` (:func:`where`): the run's workflow
    must be loaded for an event to be applied."""
    return f"flowloop send {run_id} EVENT{where_flags}"


def continues(where_flags: str) -> str:
    """What continues a run that is due later, with ``where_flags`` (:func:`where`)."""
    return f"a worker (`flowloop worker{where_flags}`) or `flowloop resume{where_flags}`"
