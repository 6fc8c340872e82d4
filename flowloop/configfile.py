"""Where the settings come from, without pydantic: finding and reading the configuration
file, and telling when there is nothing to read at all.

:mod:`flowloop.config` validates what is found here with pydantic-settings, whose import
and model building cost a brief command such as ``flowloop status`` about a tenth of its
time. When no file exists and no ``FLOWLOOP_*`` variable names a setting, the settings can
only be their defaults, so the ``flowloop`` command loads them when a command first asks
(issue 13, cold start)."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from flowloop.errors import ConfigError

ENV_PREFIX: Final = "FLOWLOOP_"
ENV_CONFIG: Final = "FLOWLOOP_CONFIG"
CONFIG_FILE: Final = "flowloop.toml"
PYPROJECT: Final = "pyproject.toml"

SETTING_NAMES: Final = frozenset(
    {
        "db",
        "concurrency",
        "lease",
        "grace",
        "log_format",
        "log_level",
        "metrics_port",
        "metrics_host",
        "ui_token",
        "alerts",
        "workflows",
        "loops",
    }
)
"""The fields of :class:`flowloop.config.Settings`, spelled here so telling whether the
environment sets one needs no pydantic (tests/unit/test_config.py keeps the two equal)."""

READ_BY_CLICK: Final = frozenset({"FLOWLOOP_DB"})
"""Variables the commands read themselves, spelled exactly so (``--db`` is
``$FLOWLOOP_DB``): a plain string that cannot fail validation, so it alone does not make
the settings load. pydantic-settings reads ``flowloop_db`` in any case too; click does
not, so another spelling does make them load."""


def find_config_file(
    explicit: str | os.PathLike[str] | None = None, cwd: Path | None = None
) -> tuple[Path, str] | None:
    """The configuration file and the table in it: ``explicit`` (or ``$FLOWLOOP_CONFIG``),
    else ``flowloop.toml``, else a ``pyproject.toml`` that has ``[tool.flowloop]``."""
    here = cwd or Path.cwd()
    named = explicit if explicit is not None else os.environ.get(ENV_CONFIG) or None
    if named is not None:
        path = Path(named)
        if not path.is_file():
            raise ConfigError(f"configuration file {path} does not exist")
        return path, "tool.flowloop" if path.name == PYPROJECT else ""
    if (here / CONFIG_FILE).is_file():
        return here / CONFIG_FILE, ""
    pyproject = here / PYPROJECT
    if pyproject.is_file() and "flowloop" in read_toml(pyproject).get("tool", {}):
        return pyproject, "tool.flowloop"
    return None


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror or error}") from None


def read_config_file(path: Path, table: str = "") -> dict[str, Any]:
    data = read_toml(path)
    for part in filter(None, table.split(".")):
        data = data.get(part, {})
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: [{table}] must be a table")
    return data


def _names_a_setting(variable: str, value: str) -> bool:
    """Whether environment ``variable`` is one pydantic-settings reads (case-insensitive,
    nested keys after ``__``; an empty one counts as unset, as the settings treat it)."""
    upper = variable.upper()
    if not value or not upper.startswith(ENV_PREFIX) or variable in READ_BY_CLICK:
        return False
    return upper[len(ENV_PREFIX) :].split("__", 1)[0].lower() in SETTING_NAMES


def misspelt_variables(environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """``FLOWLOOP_*`` variables that name no setting but come close to one: (the variable,
    the one it was likely meant as). pydantic-settings skips them without a word, so a
    misspelt ``FLOWLOOP_CONCURENCY`` left the concurrency at its default. Names far from
    any setting (a program's own ``FLOWLOOP_TEST_PG``) are none of flowloop's business."""
    names = {name.upper() for name in SETTING_NAMES} | {ENV_CONFIG[len(ENV_PREFIX) :]}
    found = []
    for variable in environ if environ is not None else os.environ:
        upper = variable.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        head = upper[len(ENV_PREFIX) :].split("__", 1)[0]
        if head in names or head.startswith("ALERT_"):  # (what alert commands are given)
            continue
        import difflib  # (only with such a variable: a brief command's start stays brief)

        close = difflib.get_close_matches(head, names, n=1, cutoff=0.75)
        if close:
            found.append((variable, ENV_PREFIX + close[0]))
    return found


def nothing_to_read(
    explicit: str | os.PathLike[str] | None = None, cwd: Path | None = None
) -> bool:
    """True when the settings can only be their defaults (and the flags): no configuration
    file, and no ``FLOWLOOP_*`` variable that sets anything but the database. Raises
    ConfigError as :func:`find_config_file` does (``--config`` naming no file)."""
    if find_config_file(explicit, cwd) is not None:
        return False
    return not any(_names_a_setting(name, value) for name, value in os.environ.items())
