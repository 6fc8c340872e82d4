"""Context versions: upcasters that carry a stored context forward, and the schema part of
a workflow's fingerprint.

A workflow declares ``context_version=N`` and ``migrate={1: v1_to_v2, 2: v2_to_v3, ...}``:
each upcaster is a pure function from the JSON object of one version to the next. A
stored context remembers the version it was written with; loading an older one runs the
chain before the model validates it. The journal keeps what was written; the next
boundary writes the current version.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any, Final

from pydantic import BaseModel

from flowloop.errors import DefinitionError, FlowloopError
from flowloop.journal import CONTEXT_VERSION

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
"""One step of the chain: the JSON object of version ``v`` → that of version ``v + 1``."""

VERSION_KEY: Final = CONTEXT_VERSION
"""The key of an entry's ``data`` that holds its context's version (absent: version 1)."""

_DOC_KEYS: Final = frozenset({"title", "description", "examples"})
"""Schema keys that document and do not change what validates."""
_UNFINGERPRINTED_KEYS: Final = _DOC_KEYS | {"default"}
"""What the fingerprint leaves out of a context's schema: the documentation, and the
defaults. A default only fills a field missing from a context being *created*; a stored
context has every field (it is written whole), so a changed default strands no stored run,
while a default that depends on the environment (a path, a host name) would give the same
definition another fingerprint in every checkout folder. Whether a field is required, its
name and its type stay in."""
_NAMED_SCHEMAS: Final = frozenset({"properties", "$defs", "definitions", "patternProperties"})
"""Schema keys whose value maps names (a field called ``title`` too) to schemas."""


class ContextMigrationError(FlowloopError):
    """A stored context cannot be brought to the workflow's context version: no upcaster
    from its version, an upcaster that raised or returned something other than an object."""

    def __init__(self, workflow: str, problem: str) -> None:
        super().__init__(f"workflow {workflow!r}: {problem}")
        self.workflow = workflow
        self.problem = problem


def check_chain(workflow: str, version: int, migrate: Mapping[int, Upcaster]) -> None:
    """Refuse a chain with a gap or a step outside ``1 .. version - 1`` (DefinitionError).

    The chain may start above 1 (contexts older than its first step cannot be migrated:
    their runs are parked), but from there it must reach ``version`` without a gap."""
    if not isinstance(version, int) or version < 1:
        raise DefinitionError(workflow, "context_version must be an integer of at least 1")
    wrong = sorted(k for k in migrate if not (isinstance(k, int) and 1 <= k < version))
    if wrong:
        raise DefinitionError(
            workflow,
            f"migrate= has step(s) {', '.join(map(str, wrong))} outside 1..{version - 1} "
            f"(a step v upgrades a version-v context to v+1; context_version is {version})",
        )
    for key, function in migrate.items():
        if not callable(function):
            raise DefinitionError(workflow, f"migrate[{key}] is not a function")
    if migrate:
        missing = [v for v in range(min(migrate), version) if v not in migrate]
        if missing:
            raise DefinitionError(
                workflow,
                f"migrate= misses step(s) {', '.join(map(str, missing))} of the chain "
                f"{min(migrate)} -> {version}: add migrate={{{missing[0]}: "
                f"v{missing[0]}_to_v{missing[0] + 1}, ...}}",
            )


def upcast(
    workflow: str,
    data: dict[str, Any],
    *,
    from_version: int,
    to_version: int,
    migrate: Mapping[int, Upcaster],
) -> dict[str, Any]:
    """``data`` (a context of ``from_version``) carried to ``to_version`` through the chain.
    The input is not changed. Raises ContextMigrationError."""
    if from_version == to_version:
        return data
    if from_version > to_version:
        raise ContextMigrationError(
            workflow,
            f"the stored context is version {from_version}, newer than this definition's "
            f"context_version {to_version} (deploy the newer definition again)",
        )
    current = copy.deepcopy(data)
    for version in range(from_version, to_version):
        step = migrate.get(version)
        if step is None:
            raise ContextMigrationError(
                workflow,
                f"no upcaster from context version {version} to {version + 1} "
                f"(add migrate={{{version}: ...}})",
            )
        try:
            result = step(current)
        except Exception as error:
            raise ContextMigrationError(
                workflow,
                f"upcaster {version}->{version + 1} raised {type(error).__name__}: {error}",
            ) from error
        if not isinstance(result, dict):
            raise ContextMigrationError(
                workflow,
                f"upcaster {version}->{version + 1} returned {type(result).__name__}, "
                "not a JSON object",
            )
        current = result
    return current


def schema_of(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema without what only documents it (titles, descriptions —
    docstrings —, examples) and without default values: what the fingerprint covers of
    the context (see ``_UNFINGERPRINTED_KEYS``)."""
    normalized: dict[str, Any] = _normalized(model.model_json_schema())
    return normalized


def _normalized(node: Any, *, names: bool = False) -> Any:
    if isinstance(node, dict):
        if names:
            return {key: _normalized(value) for key, value in sorted(node.items())}
        return {
            key: _normalized(value, names=key in _NAMED_SCHEMAS)
            for key, value in sorted(node.items())
            if key not in _UNFINGERPRINTED_KEYS
        }
    if isinstance(node, list):
        return [_normalized(item) for item in node]
    return node
