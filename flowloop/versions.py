"""Several versions of a workflow live at once: which loaded definition a run follows.

A :class:`Registry` is the name → workflow mapping engines and executors always had (it
maps each name to its *newest* loaded version, so code that knows one workflow per name
reads it as before), and it also keeps every loaded version: :func:`workflow_for` gives
a stored run the definition it started with while that one is loaded (pinning: same
fingerprint, else same version number), the newest otherwise. New runs take the newest.

This module imports neither sqlalchemy nor asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from flowloop.definition import Workflow
from flowloop.journal import RunRecord


class Registry(dict[str, Workflow]):
    """``name → newest version``, plus every version loaded (by fingerprint and number)."""

    def __init__(self) -> None:
        super().__init__()
        self._by_fingerprint: dict[str, Workflow] = {}
        self._by_version: dict[tuple[str, int], Workflow] = {}

    def add(self, workflow: Workflow) -> None:
        """Load ``workflow`` (validated). The same version again replaces it (a changed
        definition re-registered); a higher version becomes the one new runs take."""
        replaced = self._by_version.get((workflow.name, workflow.version))
        if replaced is not None and replaced is not workflow:
            self._by_fingerprint.pop(replaced.fingerprint, None)
        self._by_version[(workflow.name, workflow.version)] = workflow
        self._by_fingerprint[workflow.fingerprint] = workflow
        current = self.get(workflow.name)
        if current is None or workflow.version >= current.version:
            self[workflow.name] = workflow

    def holds(self, workflow: Workflow) -> bool:
        """``workflow`` itself is loaded (as one of the versions)."""
        return self._by_version.get((workflow.name, workflow.version)) is workflow

    def versions(self, name: str) -> list[Workflow]:
        """Every loaded version of ``name``, oldest first."""
        found = [w for (n, _), w in self._by_version.items() if n == name]
        return sorted(found, key=lambda w: w.version)

    def version(self, name: str, number: int) -> Workflow | None:
        return self._by_version.get((name, number))

    def for_run(self, record: RunRecord) -> Workflow:
        """The definition ``record`` follows: its own (its version number with its
        fingerprint, then by fingerprint, then by version number) while loaded, else the
        newest. KeyError when the name is not loaded. The version comes first because two
        versions may share a fingerprint (they differ only in step code or in context
        defaults, which the fingerprint leaves out)."""
        numbered = self._by_version.get((record.workflow, record.version))
        if numbered is not None and numbered.fingerprint == record.fingerprint:
            return numbered
        own = self._by_fingerprint.get(record.fingerprint)
        if own is not None and own.name == record.workflow:
            return own
        return numbered if numbered is not None else self[record.workflow]


def workflow_for(workflows: Mapping[str, Workflow], record: RunRecord) -> Workflow:
    """The definition a stored run follows among ``workflows`` (a Registry pins runs to
    their version; a plain mapping has one per name)."""
    if isinstance(workflows, Registry):
        return workflows.for_run(record)
    return workflows[record.workflow]


def versions_of(
    workflows: Mapping[str, Workflow], name: str
) -> Callable[[int], Workflow | None] | None:
    """The loaded versions of workflow ``name`` by number (``None``: a plain mapping, which
    has one per name): what a compensating run reads the steps it owes off (flowloop/owed.py)."""
    if not isinstance(workflows, Registry):
        return None
    return lambda number: workflows.version(name, number)
