"""Every alert flowloop raises is one of ``flowloop.alerts.KINDS`` (the metrics create a
series for each at 0): built only through its kind, never with a ``what`` of its own."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from storekit import new_run

from flowloop import alerts
from flowloop import journal as j
from flowloop.alerts import KINDS, SKIP_ALERT_EVERY, loop_alerts
from flowloop.journal import JournalEvent

PACKAGE = Path(alerts.__file__).parent


def kind_of(alert: alerts.Alert) -> alerts.AlertKind:
    return alerts.AlertKind(alert.level, alert.what)


def test_kinds__are_distinct() -> None:
    assert len({kind.what for kind in KINDS}) == len(KINDS)


def test_kinds__every_source_raises_a_known_kind() -> None:
    created = new_run("r1", state="charge").record
    record = dataclasses.replace(created, status="failed", reason="interrupted")
    stepped = JournalEvent(run_id="r1", seq=3, kind=j.STEP_INTERRUPTED, at=0.0, state="charge")
    raised = [
        *alerts.run_alerts(record, [stepped]),
        *alerts.run_alerts(record, [stepped], idempotent=lambda w, s: False),
        alerts.lease_lost_alert("run", "r1", "lost its lease", "w1"),
        alerts.loop_held_alert("tick", "held: its function did not end"),
        *loop_alerts(
            "tick", paused="3 failures", error=None, skipped_before=9, skipped_now=SKIP_ALERT_EVERY
        ),
    ]
    for kind in ("opened", "closed"):
        found = alerts.breaker_alert("b", kind, "w1", None)
        assert found is not None
        raised.append(found)
    assert {kind_of(alert) for alert in raised} == set(KINDS)


def test_loop_alerts__skips_alert_once_per_threshold() -> None:
    def skipping(before: int, now: int) -> int:
        return len(
            loop_alerts("t", paused=None, error=None, skipped_before=before, skipped_now=now)
        )

    assert skipping(0, SKIP_ALERT_EVERY - 1) == 0
    assert skipping(SKIP_ALERT_EVERY - 1, 1) == 1
    assert skipping(SKIP_ALERT_EVERY, 1) == 0
    assert skipping(0, 3 * SKIP_ALERT_EVERY) == 1


def test_kinds__no_module_builds_an_alert_with_a_what_of_its_own() -> None:
    """A new alert must be added to KINDS (else its series is missing until it fires)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Alert"
                and any(keyword.arg == "what" for keyword in node.keywords)
                and not (path.name == "alerts.py" and _inside_alert_kind(node, path))
            ):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not offenders, offenders


def _inside_alert_kind(call: ast.Call, path: Path) -> bool:
    tree = ast.parse(path.read_text())
    kind = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "AlertKind")
    return kind.lineno <= call.lineno <= (kind.end_lineno or kind.lineno)
