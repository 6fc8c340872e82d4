"""The registry of loaded versions: runs stay on theirs, new runs take the newest."""

from __future__ import annotations

from deploykit import OrderV1, order, renamed_state

from flowloop.journal import RunRecord
from flowloop.versions import Registry, workflow_for


def _record(version: int, fingerprint: str) -> RunRecord:
    return RunRecord(
        id="r",
        workflow="order",
        version=version,
        fingerprint=fingerprint,
        key=None,
        status="scheduled",
        state="charge",
        context="{}",
        attempt=0,
        visits={},
        next_run_at=None,
        last_seq=1,
        reason=None,
        error=None,
    )


def test_registry__pins_by_fingerprint_then_version_else_newest() -> None:
    v1, v2 = order().validate(), renamed_state().validate()
    registry = Registry()
    registry.add(v2)
    registry.add(v1)  # an older version added later does not become the newest
    assert registry["order"] is v2 and registry.versions("order") == [v1, v2]
    assert registry.for_run(_record(1, v1.fingerprint)) is v1
    assert registry.for_run(_record(1, "changed-since")) is v1  # same version number
    assert registry.for_run(_record(7, "unknown")) is v2
    assert workflow_for({"order": v1}, _record(2, v2.fingerprint)) is v1  # a plain mapping
    assert registry.holds(v1) and not registry.holds(order())


def test_registry__the_same_version_again_replaces_it() -> None:
    first, again = order().validate(), order().validate()
    registry = Registry()
    registry.add(first)
    registry.add(again)
    assert registry["order"] is again and registry.versions("order") == [again]


def test_registry__versions_sharing_a_fingerprint_keep_their_own_runs() -> None:
    """Two versions that differ only in a context default (left out of the fingerprint)
    or in step code share a fingerprint: a run of v1 stays on v1, not on v2's steps."""

    class OrderV1Later(OrderV1):
        sleep: bool = True  # only a default changed

    v1 = order(version=1).validate()
    v2 = order(version=2, context=OrderV1Later).validate()
    assert v1.fingerprint == v2.fingerprint
    for loaded in ([v1, v2], [v2, v1]):
        registry = Registry()
        for workflow in loaded:
            registry.add(workflow)
        assert registry.for_run(_record(1, v1.fingerprint)) is v1
        assert registry.for_run(_record(2, v2.fingerprint)) is v2
