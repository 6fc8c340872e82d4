"""``flowloop check``: what a new definition does to every live run, before it is deployed.

It compares the new definition (structure and context model) with each definition the
live runs were written under, then judges every live run with the same function the
worker uses (flowloop/verdicts.py), so the report says what a worker will do, run by run:
continues as is, continues after migration, would be parked, would fail.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flowloop.definition import Workflow
from flowloop.errors import FlowloopError
from flowloop.store import Store
from flowloop.store.scan import SCAN_BATCH, live_runs
from flowloop.store.sql import SQLStore
from flowloop.verdicts import KINDS, Kind, judge

LABELS: Mapping[Kind, str] = {
    "continues": "continues as is",
    "migrates": "continues after migration",
    "parks": "would be parked",
    "fails": "would fail",
}
REPORT_RUNS_LIMIT = 1_000
"""Runs listed one by one per verdict in the report (the counts cover all of them)."""


@dataclass(frozen=True, kw_only=True)
class RunVerdict:
    run_id: str
    status: str
    state: str
    kind: Kind
    reason: str | None
    fingerprint: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "status": self.status,
            "state": self.state,
            "verdict": self.kind,
            "reason": self.reason,
            "fingerprint": self.fingerprint,
        }


@dataclass(kw_only=True)
class CheckReport:
    """The verdicts of one workflow's live runs under one definition."""

    workflow: str
    version: int
    fingerprint: str
    changes: dict[str, list[str]] = field(default_factory=dict)
    """Per stored fingerprint of live runs: how this definition differs from it."""
    counts: Counter[str] = field(default_factory=Counter)
    runs: list[RunVerdict] = field(default_factory=list)
    """Every run that does not continue as is (up to REPORT_RUNS_LIMIT per verdict), or
    every run with ``every=True``."""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Nothing would be stranded or fail."""
        return not (self.counts["parks"] or self.counts["fails"])

    def as_dict(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "ok": self.ok,
            "counts": {kind: self.counts[kind] for kind in KINDS},
            "changes": self.changes,
            "runs": [run.as_dict() for run in self.runs],
            "seconds": round(self.seconds, 3),
        }


def check_runs(
    store: Store,
    workflow: Workflow,
    *,
    pinned: Mapping[str, Workflow] | None = None,
    every: bool = False,
    validate: bool = False,
    batch: int = SCAN_BATCH,
) -> CheckReport:
    """Judge every live run of ``workflow.name`` under ``workflow``. A run whose own
    definition is in ``pinned`` (fingerprint → workflow: older versions loaded beside the
    new one) is judged under that one: it stays on its version. Without ``validate`` a
    context is trusted where its model is unchanged (as the fingerprint sees it: not a
    validator's code); with it, every context is validated as a worker would."""
    if not isinstance(store, SQLStore):  # (typed Store: `check_runs(engine.store, wf)`)
        raise FlowloopError("check_runs reads a SQL store's live runs (engine.store of a URL)")
    workflow.validate()
    started = time.perf_counter()
    report = CheckReport(
        workflow=workflow.name, version=workflow.version, fingerprint=workflow.fingerprint
    )
    loaded = {w.version: w for w in (pinned or {}).values() if w.name == workflow.name}
    loaded[workflow.version] = workflow
    olds: dict[str, Mapping[str, Any] | None] = {}
    structures: dict[tuple[str, str], str | None] = {}
    listed: Counter[str] = Counter()
    for page in live_runs(store, workflow.name, batch=batch):
        for run in page:
            target = (pinned or {}).get(run.fingerprint, workflow)
            if run.fingerprint not in olds:
                olds[run.fingerprint] = store.definition(run.fingerprint)
                if run.fingerprint != workflow.fingerprint:
                    report.changes[run.fingerprint] = describe_changes(
                        olds[run.fingerprint], workflow
                    )
            verdict = judge(
                target,
                state=run.state,
                fingerprint=run.fingerprint,
                context=run.context,
                context_version=run.context_version,
                old=olds[run.fingerprint],
                validate=validate,
                cache=structures if target is workflow else None,
                journal=functools.partial(store.journal, run.id),
                versions=loaded.get,
            )
            report.counts[verdict.kind] += 1
            if every or (verdict.kind != "continues" and listed[verdict.kind] < REPORT_RUNS_LIMIT):
                listed[verdict.kind] += 1
                report.runs.append(
                    RunVerdict(
                        run_id=run.id,
                        status=run.status,
                        state=run.state,
                        kind=verdict.kind,
                        reason=verdict.reason,
                        fingerprint=run.fingerprint,
                    )
                )
    report.seconds = time.perf_counter() - started
    return report


def check_workflows(
    store: Store, versions: Iterable[Workflow], *, every: bool = False, validate: bool = False
) -> list[tuple[Workflow, CheckReport]]:
    """One report per workflow name, for its newest version among ``versions``; the
    older versions given are loaded beside it, so their runs stay on them (pinning).
    ``validate``: every context through its model (see :func:`check_runs`)."""
    by_name: dict[str, list[Workflow]] = {}
    for workflow in versions:
        by_name.setdefault(workflow.name, []).append(workflow.validate())
    reports = []
    for loaded in by_name.values():
        newest = max(loaded, key=lambda w: w.version)
        pinned = {w.fingerprint: w for w in loaded if w is not newest}
        report = check_runs(store, newest, pinned=pinned, every=every, validate=validate)
        reports.append((newest, report))
    return reports


def describe_changes(old: Mapping[str, Any] | None, new: Workflow) -> list[str]:
    """How ``new`` differs from a stored definition record, one line per difference:
    states, transitions, the context version and the context's fields."""
    if not old:
        return ["the stored definition is unknown (written before this flowloop kept it)"]
    record = new.definition_record()
    lines: list[str] = []
    old_states: Mapping[str, Any] = old.get("states", {})
    new_states: Mapping[str, Any] = record["states"]
    old_all = set(old_states) | set(old.get("finals", []))
    new_all = set(new_states) | set(record["finals"])
    lines += [f"state {s!r} removed" for s in sorted(old_all - new_all)]
    lines += [f"state {s!r} added" for s in sorted(new_all - old_all)]
    for state in sorted(set(old_states) & set(new_states)):
        was_kind = old_states[state].get("kind", "step")
        now_kind = new_states[state].get("kind", "step")
        if was_kind != now_kind:  # (compatible() parks a run there for it)
            lines.append(f"state {state!r} changed from a {was_kind} to a {now_kind}")
        before, after = old_states[state].get("on", {}), new_states[state].get("on", {})
        for event in sorted(set(before) | set(after)):
            if before.get(event) != after.get(event):
                was = before.get(event, "nothing")
                now = after.get(event, "nothing")
                lines.append(f"transition {state}.{event}: {was} -> {now}")
    old_context: Mapping[str, Any] = old.get("context") or {}
    new_context = record["context"]
    if not old_context:
        lines.append("the stored definition has no context schema (kept before issue 16)")
        return lines
    if old_context.get("version") != new_context["version"]:
        lines.append(f"context version {old_context.get('version')} -> {new_context['version']}")
    before_schema, after_schema = old_context.get("schema", {}), new_context["schema"]
    before_fields = before_schema.get("properties", {})
    after_fields = after_schema.get("properties", {})
    before_required = set(before_schema.get("required", []))
    after_required = set(after_schema.get("required", []))
    for name in sorted(set(before_fields) | set(after_fields)):
        if name not in after_fields:
            lines.append(f"context field {name!r} removed")
        elif name not in before_fields:
            required = " (required)" if name in after_required else ""
            lines.append(f"context field {name!r} added{required}")
        elif before_fields[name] != after_fields[name]:
            lines.append(f"context field {name!r} changed")
        elif (name in after_required) != (name in before_required):
            now = "required" if name in after_required else "optional"
            lines.append(f"context field {name!r} is now {now}")
    if before_schema.get("$defs") != after_schema.get("$defs"):
        lines.append("nested context models changed")
    return lines
