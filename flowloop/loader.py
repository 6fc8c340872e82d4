"""Find workflows in user files: ``path/to/file.py[:name]`` or a directory of such files."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import sysconfig
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Final

from flowloop.definition import Workflow
from flowloop.errors import FlowloopError
from flowloop.loops import Loop

if TYPE_CHECKING:
    import ast


class LoadError(FlowloopError):
    """A workflow file could not be loaded; the message names the file and the problem."""


@dataclass
class Loaded:
    """What a set of files defines, in file order."""

    workflows: dict[str, Workflow] = field(default_factory=dict)
    """The newest version of each workflow, by name."""
    older: list[Workflow] = field(default_factory=list)
    """Older versions loaded beside the newest (several versions live, issue 16)."""
    loops: dict[str, Loop] = field(default_factory=dict)
    modules: list[ModuleType] = field(default_factory=list)

    def all_versions(self) -> list[Workflow]:
        """Every workflow loaded: the newest of each name and the older versions."""
        return [*self.workflows.values(), *self.older]

    def add(self, module: ModuleType, path: Path) -> None:
        self.modules.append(module)
        for value in vars(module).values():
            if isinstance(value, Workflow):
                self._add_workflow(value, path)
            elif isinstance(value, Loop):
                known = self.loops.get(value.name)
                if known is not None and known is not value:
                    raise LoadError(f"{path}: loop {value.name!r} is defined twice")
                self.loops[value.name] = value
                if value.workflow is not None:
                    self.workflows.setdefault(value.workflow.name, value.workflow)

    def _add_workflow(self, value: Workflow, path: Path) -> None:
        existing = self.workflows.get(value.name)
        if existing is value or any(w is value for w in self.older):
            return
        try:
            value.validate()
        except FlowloopError as error:  # (which file, when -w names a folder: review)
            raise LoadError(f"{path}: {error}") from error
        versions = [w for w in (existing, *self.older) if w is not None and w.name == value.name]
        if any(w.version == value.version for w in versions):
            raise LoadError(
                f"{path}: workflow {value.name!r} version {value.version} is defined twice "
                "(several versions live need distinct version=)"
            )
        if existing is None or value.version > existing.version:
            if existing is not None:
                self.older.append(existing)
            self.workflows[value.name] = value
        else:
            self.older.append(value)


_NOT_USER_CODE: tuple[Path, ...] = (
    Path(__file__).resolve().parent,  # flowloop itself
    *{Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "purelib", "platlib")},
)


def _where(error: BaseException) -> str:
    """`` (at FILE:LINE)``: the line of the user's code the error came from — the last
    frame of its traceback outside flowloop, the standard library and installed packages
    (an error in a neighbour module the file imports names that module). A SyntaxError
    says where itself."""
    if isinstance(error, SyntaxError):
        return ""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename.startswith("<"):
            continue  # importlib's frozen frames
        file = Path(frame.filename).resolve()
        if any(place == file or place in file.parents for place in _NOT_USER_CODE):
            continue
        try:
            shown = file.relative_to(Path.cwd())
        except ValueError:
            shown = file
        return f" (at {shown}:{frame.lineno})"
    return ""


def split_target(target: str) -> tuple[Path, str | None]:
    """``file.py:name`` → (file.py, name); a Windows-free split on the last colon."""
    path_text, sep, name = target.rpartition(":")
    if sep and path_text and not name.endswith(".py") and "/" not in name:
        return Path(path_text), name or None
    return Path(target), None


def _did_you_mean(path: Path) -> str:
    """``; did you mean FILE?`` for a missing workflow file: the name with ``.py`` added,
    the one in ./workflows, or a close spelling beside it (``ordr.py`` → ``order.py``)."""
    import difflib

    file = path if path.suffix == ".py" else Path(f"{path}.py")
    tried = [file] if file != path else []
    if path.parent == Path("."):
        tried.append(Path("workflows") / file.name)
    found = next((p for p in tried if p.is_file()), None)
    for folder in (path.parent, *([Path(DEFAULT_FOLDER)] if path.parent == Path(".") else [])):
        if found is None and folder.is_dir():
            names = [p.name for p in folder.glob("*.py")]
            close = difflib.get_close_matches(file.name, names, n=1, cutoff=0.75)
            found = folder / close[0] if close else None
    return f"; did you mean {found}?" if found is not None else ""


DEFAULT_FOLDER = "workflows"
"""Where a bare name is looked for (flowloop.cli.common.DEFAULT_WORKFLOWS)."""


def _workflow_meant(name: str) -> str | None:
    """``workflows/orders.py:order`` for a bare name given as a target (``flowloop run
    ordr``) that is, or is spelt close to, a workflow defined in ./workflows: the name of
    a workflow is not a file, and a misspelt one had no suggestion. The files are read,
    not imported (:func:`workflow_names_in`): a hint runs no user code."""
    from flowloop.suggest import close_names

    folder = Path(DEFAULT_FOLDER)
    if not folder.is_dir():
        return None
    defined: dict[str, Path] = {}
    for file in sorted(folder.glob("*.py")):
        if not file.name.startswith("_"):
            for workflow in workflow_names_in(file):
                defined.setdefault(workflow, file)
    close = close_names(name, defined, n=1)
    return f"{defined[close[0]]}:{close[0]}" if close else None


MAX_SCANNED_BYTES: Final = 1 << 20
"""Files larger than this (generated data, most likely) are not parsed for workflow names:
parsing a 36 MB module took 47 s and 5.5 GB on the error path of a misspelt name."""


WORKFLOW_MODULES: Final = ("flowloop", "flowloop.definition")
"""The modules a ``Workflow`` is imported from (``from flowloop import Workflow as W``)."""


def workflow_names_in(file: Path) -> list[str]:
    """The names of the workflows ``file`` defines as its text shows them — each call of
    ``Workflow(...)`` or ``flowloop.Workflow(...)``, under the names the file imports them
    as too (``from flowloop import Workflow as W``, ``import flowloop as fl``), whose
    first argument or ``name=`` is a string literal — without importing it (importing runs
    the file: a ``sys.exit`` hid the error being explained, a thread it started kept the
    process alive, a print went into the output). A file that cannot be read or parsed
    defines none here."""
    import ast

    try:
        if file.stat().st_size > MAX_SCANNED_BYTES:
            return []
        text = file.read_bytes()
        if b"Workflow" not in text:  # (a module of data or helpers: nothing to parse)
            return []
        tree = ast.parse(text, filename=str(file))
    except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    classes, modules = _workflow_aliases(tree)
    names: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if not (
            (isinstance(func, ast.Name) and func.id in classes)
            or (
                isinstance(func, ast.Attribute)
                and func.attr == "Workflow"
                and _dotted(func.value) in modules
            )
        ):
            continue
        given = [node.args[0]] if node.args else []
        given += [kw.value for kw in node.keywords if kw.arg == "name"]
        names += [
            arg.value
            for arg in given[:1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
        ]
    return names


def _workflow_aliases(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The names ``tree`` (a module's ast) calls the Workflow class by (``Workflow``, and
    each ``as`` it is imported under) and the dotted names of the modules it is an
    attribute of (``flowloop``, ``flowloop.definition``, and each ``as`` they are imported
    under, ``from flowloop import definition`` included)."""
    import ast

    classes, modules = {"Workflow"}, set(WORKFLOW_MODULES)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in WORKFLOW_MODULES:
            classes |= {a.asname or a.name for a in node.names if a.name == "Workflow"}
            if node.module == "flowloop":
                modules |= {a.asname or a.name for a in node.names if a.name == "definition"}
        elif isinstance(node, ast.Import):
            modules |= {a.asname for a in node.names if a.name in WORKFLOW_MODULES and a.asname}
    return classes, modules


def import_file(path: Path) -> ModuleType:
    if not path.exists():
        raise LoadError(f"{path}: no such file{_did_you_mean(path)}")
    if path.suffix != ".py":
        raise LoadError(f"{path}: not a Python file (expected FILE.py[:WORKFLOW])")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    module_name = f"flowloop_user_{resolved.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:
        raise LoadError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    # Let the file import its neighbours (workflows/ is usually not a package).
    parent = str(resolved.parent)
    if parent not in sys.path:
        sys.path.insert(0, parent)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except FlowloopError as error:
        sys.modules.pop(module_name, None)
        raise LoadError(f"{path}: {error}{_where(error)}") from error
    except Exception as error:
        sys.modules.pop(module_name, None)
        raise LoadError(
            f"{path}: import failed: {type(error).__name__}: {error}{_where(error)}"
        ) from error
    return module


def load_paths(paths: Iterable[str | Path]) -> Loaded:
    """Every workflow defined in the given files and directories (``*.py``, not ``_*.py``)."""
    loaded = Loaded()
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for file in sorted(path.glob("*.py")):
                if not file.name.startswith("_"):
                    loaded.add(import_file(file), file)
        else:
            loaded.add(import_file(path), path)
    return loaded


def load_target(target: str) -> tuple[Workflow, Loaded]:
    """The workflow named by ``FILE.py[:WORKFLOW]`` (the only one in the file if unnamed);
    WORKFLOW is the workflow's name or the module variable that holds it."""
    path, name = split_target(target)
    if name is None and path.parent == Path(".") and not path.suffix and not path.exists():
        meant = _workflow_meant(path.name)
        if meant is not None:
            raise LoadError(f"{path}: no such file; did you mean {meant}?")
    loaded = Loaded()
    loaded.add(import_file(path), path)
    if not loaded.workflows:
        if loaded.loops:  # (`flowloop run workflows/poll.py` said no more than this)
            names = ", ".join(loaded.loops)
            raise LoadError(
                f"{path}: defines no Workflow, only loops ({names}): "
                f"`flowloop worker {path}` runs them"
            )
        raise LoadError(f"{path}: defines no Workflow")
    if name is None:
        # A parent's child workflows (its call and map states') do not count: the file's
        # workflow is the one no other of the file starts.
        started = {child.name for wf in loaded.workflows.values() for child in wf.children}
        roots = [wf for wf in loaded.workflows.values() if wf.name not in started]
        if len(roots) == 1 and len(loaded.workflows) > 1:
            return roots[0], loaded
        if len(loaded.workflows) > 1:
            names = ", ".join(loaded.workflows)
            raise LoadError(f"{path} defines several workflows ({names}); use {path}:NAME")
        return next(iter(loaded.workflows.values())), loaded
    if name in loaded.workflows:
        return loaded.workflows[name], loaded
    # The Python variable, as uvicorn and prefect take it (`orders.py:order_flow`).
    variable = getattr(loaded.modules[-1], name, None)
    if isinstance(variable, Workflow):
        return variable, loaded
    from flowloop.suggest import did_you_mean

    names = ", ".join(loaded.workflows)
    meant = did_you_mean(name, loaded.workflows, n=1, shown=repr)
    meant = f"; {meant}" if meant else ""
    raise LoadError(
        f"{path}: no workflow {name!r}, by name or variable{meant} (it defines: {names})"
    )


def load_machine(target: str) -> tuple[Workflow | Loop, Loaded]:
    """The workflow or loop named by ``FILE.py[:NAME]`` — unnamed: the file's only workflow,
    else its only loop (a file with a workflow and a loop of it draws the workflow)."""
    path, name = split_target(target)
    loaded = Loaded()
    loaded.add(import_file(path), path)
    if name is None and not loaded.workflows and len(loaded.loops) == 1:
        return next(iter(loaded.loops.values())), loaded
    if name is not None and name in loaded.loops and name not in loaded.workflows:
        return loaded.loops[name], loaded
    variable = getattr(loaded.modules[-1], name, None) if name is not None else None
    if isinstance(variable, (Workflow, Loop)):  # the Python variable's name
        return variable, loaded
    if not loaded.workflows and not loaded.loops:
        raise LoadError(f"{path}: defines no Workflow and no Loop")
    if not loaded.workflows or (name is not None and name not in loaded.workflows):
        names = ", ".join([*loaded.workflows, *loaded.loops])
        what = "several loops" if name is None else f"no workflow or loop {name!r}"
        raise LoadError(f"{path}: {what} (it defines: {names}); use {path}:NAME")
    return load_target(target)


def _dotted(node: ast.expr, most: int = 8) -> str | None:
    """``a.b.c`` of a chain of at most ``most`` names, else ``None`` (``ast.unparse`` of a
    chain of hundreds of links ran out of recursion)."""
    import ast

    names: list[str] = []
    while isinstance(node, ast.Attribute) and len(names) < most:
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    names.append(node.id)
    return ".".join(reversed(names))
