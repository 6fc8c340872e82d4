"""The difference between two contexts of a run, as a flat list of changed JSON paths."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

Change = Literal["added", "removed", "changed"]


@dataclass(frozen=True, kw_only=True)
class Difference:
    path: str
    """``$.items[0].qty`` style path of the value that differs."""
    change: Change
    before: Any = None
    after: Any = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "change": self.change,
            "before": self.before,
            "after": self.after,
        }


def diff(before: Any, after: Any, path: str = "$") -> list[Difference]:
    """Every path where ``after`` differs from ``before`` (objects by key, lists by index),
    in a stable order: keys sorted, then indexes ascending."""
    if isinstance(before, dict) and isinstance(after, dict):
        found: list[Difference] = []
        for key in sorted(set(before) | set(after), key=str):
            where = f"{path}.{key}" if _plain(key) else f"{path}[{json.dumps(key)}]"
            if key not in after:
                found.append(Difference(path=where, change="removed", before=before[key]))
            elif key not in before:
                found.append(Difference(path=where, change="added", after=after[key]))
            else:
                found += diff(before[key], after[key], where)
        return found
    if isinstance(before, list) and isinstance(after, list):
        found = []
        for index in range(max(len(before), len(after))):
            where = f"{path}[{index}]"
            if index >= len(after):
                found.append(Difference(path=where, change="removed", before=before[index]))
            elif index >= len(before):
                found.append(Difference(path=where, change="added", after=after[index]))
            else:
                found += diff(before[index], after[index], where)
        return found
    if before == after and type(before) is type(after):
        return []
    return [Difference(path=path, change="changed", before=before, after=after)]


def _plain(key: str) -> bool:
    return key.isidentifier()
