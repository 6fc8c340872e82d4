"""SVG for the pages, from the same renderer as ``flowloop diagram`` (:mod:`flowloop.render`
piped through Graphviz's ``dot``), cached by the DOT text: the same picture is drawn once."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Final

import graphviz

from flowloop import journal as j
from flowloop import render
from flowloop.definition import Workflow
from flowloop.heat import Heat, heat_digraph, structure_model
from flowloop.store.sql import SQLStore

CACHE_SIZE: Final = 256
"""Rendered SVGs kept (keyed by a hash of their DOT source)."""


class SvgCache:
    """``dot -Tsvg`` of a graph, remembered by its source (a thread-safe LRU)."""

    def __init__(self, size: int = CACHE_SIZE) -> None:
        self._size = size
        self._items: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def svg(self, graph: graphviz.Digraph) -> str:
        """The graph as inline SVG markup (no XML prolog or DOCTYPE). Raises RenderError."""
        key = hashlib.sha256(graph.source.encode()).hexdigest()
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
                return found
        text = render.render_bytes(graph, "svg").decode()
        start = text.find("<svg")
        text = text[start:] if start >= 0 else text
        with self._lock:
            self._items[key] = text
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return text


class Machines:
    """Where the pages find a workflow's machine: the definition given with ``-w`` or,
    for one they were not given, the structure stored in the database."""

    def __init__(self, store: SQLStore, workflows: Mapping[str, Workflow]) -> None:
        self.store = store
        self.workflows = dict(workflows)

    def model(
        self, name: str, fingerprint: str | None = None, version: int = 0
    ) -> render.DiagramModel | None:
        workflow = self.workflows.get(name)
        if workflow is not None:
            return render.workflow_model(workflow)
        if fingerprint is None:
            return None
        structure = self.store.definition(fingerprint)
        if not structure:
            return None
        return structure_model(structure, version=version)

    def run_graph(
        self,
        name: str,
        fingerprint: str,
        version: int,
        events: Sequence[j.JournalEvent],
        *,
        held: bool = False,
    ) -> graphviz.Digraph | None:
        """``held``: the run is a map's child held back (drawn so, as its badge says)."""
        model = self.model(name, fingerprint, version)
        if model is None:
            return None
        return render.to_digraph(
            render.apply_overlay(model, render.RunOverlay.from_journal(events, held=held))
        )

    def workflow_graph(
        self, name: str, fingerprint: str | None, version: int = 0
    ) -> graphviz.Digraph | None:
        model = self.model(name, fingerprint, version)
        return None if model is None else render.to_digraph(model)

    def definition_graph(
        self, name: str, fingerprint: str | None, version: int
    ) -> graphviz.Digraph | None:
        """One stored version of a workflow: the code given with ``-w`` when it is that
        version (it draws step settings too), else the structure stored for it."""
        workflow = self.workflows.get(name)
        if workflow is not None and (fingerprint is None or workflow.fingerprint == fingerprint):
            return render.to_digraph(render.workflow_model(workflow))
        if fingerprint is None:
            return None
        structure = self.store.definition(fingerprint)
        if not structure:
            return None
        return render.to_digraph(structure_model(structure, version=version))

    def heat_graph(
        self, name: str, fingerprint: str | None, version: int, found: Heat, window: str
    ) -> graphviz.Digraph | None:
        model = self.model(name, fingerprint, version)
        return None if model is None else heat_digraph(model, found, window=window)
