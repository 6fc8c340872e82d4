"""Pure graph walks over a state graph given as ``{state: {successor, ...}}``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set


def reachable(edges: Mapping[str, Set[str]], start: Iterable[str]) -> set[str]:
    """Every state reachable from ``start`` (``start`` included)."""
    seen: set[str] = set()
    stack = list(start)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(edges.get(node, ()))
    return seen


def reverse(edges: Mapping[str, Set[str]]) -> dict[str, set[str]]:
    """The same graph with every edge turned around."""
    back: dict[str, set[str]] = {node: set() for node in edges}
    for node, successors in edges.items():
        for successor in successors:
            back.setdefault(successor, set()).add(node)
    return back


def can_reach(edges: Mapping[str, Set[str]], targets: Iterable[str]) -> set[str]:
    """Every state from which at least one of ``targets`` can be reached."""
    return reachable(reverse(edges), targets)


def on_cycle(edges: Mapping[str, Set[str]]) -> set[str]:
    """States that can reach themselves again (self loops included)."""
    return {node for node, successors in edges.items() if node in reachable(edges, successors)}
