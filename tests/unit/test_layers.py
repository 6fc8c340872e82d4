"""Imports point one way: the pure core (every module that says it "imports neither
sqlalchemy nor asyncio") reaches, through its module-level imports and those of the
flowloop modules it imports, no database, no event loop, no graphviz and nothing of the
runtime or the store; the diagram model and overlay need no graphviz. Read from the source
(imports under ``if TYPE_CHECKING`` and inside functions are lazy by design)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import flowloop

PACKAGE = Path(flowloop.__file__).parent
PURE_MARK = "imports neither sqlalchemy nor asyncio"
IO_PACKAGES = ("sqlalchemy", "asyncio", "graphviz", "socket", "subprocess", "threading")
RUNTIME = ("flowloop.engine", "flowloop.executor", "flowloop.worker", "flowloop.scheduler")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def eager_imports(path: Path) -> Iterator[str]:
    """The modules ``path`` imports when it is imported (not lazily)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for found in ast.walk(node):
            if isinstance(found, ast.Import):
                yield from (alias.name for alias in found.names)
            elif isinstance(found, ast.ImportFrom) and found.module:
                yield found.module
                # `from flowloop import journal` imports the module flowloop.journal.
                yield from (f"{found.module}.{alias.name}" for alias in found.names)


def reached(start: str) -> dict[str, str]:
    """Every module ``start`` imports eagerly, transitively: name -> the module importing it."""
    seen: dict[str, str] = {}
    todo = [start]
    while todo:
        current = todo.pop()
        for name in eager_imports(MODULES[current]):
            if name in seen or name == "flowloop":  # the package itself: its __init__ is the API
                continue
            seen[name] = current
            if name in MODULES:
                todo.append(name)
    return seen


def offences(start: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{name} (imported by {by})"
        for name, by in reached(start).items()
        if name.split(".")[0] in forbidden or name.startswith(forbidden)
    )


def test_layers__the_pure_core_reaches_no_io_no_runtime_and_no_store() -> None:
    pure = sorted(name for name, path in MODULES.items() if PURE_MARK in path.read_text())
    assert {"flowloop.definition", "flowloop.specs", "flowloop.structure"} <= set(pure)
    found = {
        name: bad
        for name in pure
        if (bad := offences(name, (*IO_PACKAGES, *RUNTIME, "flowloop.store", "flowloop.cli")))
    }
    assert not found, found


def test_layers__the_diagram_model_and_overlay_need_no_graphviz() -> None:
    for name in ("flowloop.render_model", "flowloop.render_overlay"):
        assert not offences(name, ("graphviz", *RUNTIME, "flowloop.store")), name


def test_layers__the_check_sees_an_offence() -> None:
    assert offences("flowloop.render", ("graphviz",))  # render is where graphviz comes in
    assert offences("flowloop.stats", ("sqlalchemy",))
