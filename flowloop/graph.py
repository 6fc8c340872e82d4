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


def longest_chain(edges: Mapping[str, Set[str]], start: str) -> int:
    """The most edges on a path from ``start`` that never goes back (each cycle cut where a
    depth-first walk from ``start`` meets it): the ranks a layered drawing needs, less one."""
    order: list[str] = []  # postorder of the depth-first walk
    on_path: set[str] = set()
    done: set[str] = set()
    forward: dict[str, list[str]] = {}
    stack: list[tuple[str, list[str]]] = [(start, sorted(edges.get(start, ())))]
    on_path.add(start)
    while stack:
        node, pending = stack[-1]
        if pending:
            nxt = pending.pop()
            if nxt in on_path:
                continue  # a back edge: where the cycle is cut
            forward.setdefault(node, []).append(nxt)
            if nxt not in done:
                on_path.add(nxt)
                stack.append((nxt, sorted(edges.get(nxt, ()))))
            continue
        stack.pop()
        on_path.discard(node)
        done.add(node)
        order.append(node)
    depth = dict.fromkeys(order, 0)
    for node in reversed(order):  # a topological order of the walk's forward edges
        for nxt in forward.get(node, ()):
            depth[nxt] = max(depth[nxt], depth[node] + 1)
    return max(depth.values(), default=0)
