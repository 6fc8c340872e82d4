"""A run migrated out of a call state and back starts a new child (SQLite and PostgreSQL).

A call or map state's join and children are named by the parent, the state and its visit
(flowloop/compose.py). ``flowloop migrate`` moved a run's visit count from the state it
left to the state it was mapped to, so a run migrated out of a call state while its child
ran, and later back into that state, counted visit 1 again: it found the first visit's
join — complete by then — and went on at once with the old child's result instead of
calling a new one. A state left that the new version still has now keeps its count
(``kept_visits`` in the ``run_migrated`` entry); entries written before fold as they did.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop.errors import DefinitionMismatch


class Kid(BaseModel):
    n: int = 0


kid = Workflow("kid_again", context=Kid)
kid.wait("hold", on={"go": "done"}, initial=True)
kid.final("done")


class Loopy(BaseModel):
    got: list[int] = []


def loopy(
    version: int, migrates_from: dict[int, dict[str, str]] | None = None, call: str = "ask"
) -> Workflow:
    """A parent that calls ``kid_again`` (in state ``call``), then waits to call it again or
    to finish."""
    workflow = Workflow("loopy", context=Loopy, version=version, migrates_from=migrates_from)
    workflow.call(
        call,
        child=kid,
        context=lambda ctx: Kid(n=len(ctx.got)),
        on={"succeeded": "between", "failed": "done", "stopped": "done"},
        result=lambda ctx, child: ctx.got.append(child.n),
        initial=True,
    )
    workflow.wait("between", on={"again": call, "finish": "done"})
    workflow.final("done")
    return workflow


def _kids(engine: Engine) -> dict[str, str]:
    return {run.id: run.status for run in engine.runs(workflow="kid_again", limit=10)}


def test_a_run_migrated_out_of_a_call_state_and_back_calls_a_new_child(store_url: str) -> None:
    with Engine(store_url, workflows=[loopy(1), kid]) as engine:
        parent = engine.start(engine.workflow("loopy"), Loopy())
        engine.run_until_idle()
        assert engine.get(parent.id).state == "ask"
        [first] = _kids(engine)
    with Engine(store_url, workflows=[loopy(2, {1: {"ask": "between"}}), kid]) as engine:
        [moved] = engine.migrate_workflow("loopy", to=2, by="deployer")
        assert (moved.problem, engine.get(parent.id).state) == (None, "between")
        engine.send(first, "go")  # the first child ends: its join completes, unused
        engine.run_until_idle()
        assert _kids(engine) == {first: "succeeded"}
        engine.send(parent.id, "again")  # back into the call state: a new visit
        engine.run_until_idle()
        info = engine.get(parent.id)
        assert (info.status, info.state) == ("scheduled", "ask"), info
        kids = _kids(engine)
        [second] = [run_id for run_id in kids if run_id != first]
        assert kids[second] == "scheduled"  # waiting for its own "go"
        engine.send(second, "go")
        engine.run_until_idle()
        info = engine.get(parent.id)
        assert (info.state, info.context.got) == ("between", [0])  # type: ignore[union-attr]
        assert info.visits == {"ask": 2, "between": 2}
        assert engine.replay(parent.id).matches


def test_a_renamed_state_moves_its_count(store_url: str) -> None:
    """A state the new version no longer has was renamed: its count goes on under the new
    name, and the old name keeps its own (a later version may bring it back)."""
    with Engine(store_url, workflows=[loopy(1), kid]) as engine:
        parent = engine.start(engine.workflow("loopy"), Loopy())
        engine.run_until_idle()
    renamed = loopy(2, {1: {"ask": "query"}}, call="query")
    with Engine(store_url, workflows=[renamed, kid]) as engine:
        engine.migrate(parent.id, to=2, by="deployer")
        assert engine.get(parent.id).visits == {"ask": 1, "query": 1}
        assert engine.history(parent.id)[-1].data["kept_visits"] is True
        # Waiting for its child, it is not made due (it was claimed for nothing and
        # journaled its children started again: review).
        engine.run_until_idle()
        assert engine.history(parent.id)[-1].kind == "run_migrated"
        assert engine.get(parent.id).next_run_at is None
    # Its child goes on under the new name: its end is the call's, no second child.
    [first] = _kids(engine)
    with Engine(store_url, workflows=[renamed, kid]) as engine:
        engine.send(first, "go")
        engine.run_until_idle()
        info = engine.get(parent.id)
        assert (info.state, info.context.got) == ("between", [0])  # type: ignore[union-attr]
        assert _kids(engine) == {first: "succeeded"}
        assert engine.replay(parent.id).matches


class Many(BaseModel):
    items: list[int] = []
    seen: list[int] = []


def spread(version: int, state: str, child: Workflow = kid) -> Workflow:
    """A map of ``child`` over ``ctx.items``, two at a time, named ``state``."""
    workflow = Workflow(
        "spread",
        context=Many,
        version=version,
        migrates_from={1: {"fan": state}} if version > 1 else None,
    )
    workflow.map(
        state,
        child=child,
        items=lambda ctx: ctx.items,
        context=lambda ctx, n: Kid(n=n),
        max_parallel=2,
        reduce=lambda ctx, results: ctx.seen.extend(r.context.n for r in results if r.ok),
        on={"done": "done"},
        initial=True,
    )
    workflow.final("done")
    return workflow


def test_a_map_migrated_into_its_renamed_state_keeps_its_children(store_url: str) -> None:
    """A map waiting for its children (one ended, two running, one held) migrated to a
    version that renames its state: its claim looked for the join under the new name,
    found none and started all four again — eight children, the ended one's work run
    twice (audit). The join goes with the state's name now."""
    with Engine(store_url, workflows=[spread(1, "fan"), kid]) as engine:
        parent = engine.start(engine.workflow("spread"), Many(items=[1, 2, 3, 4])).id
        engine.run_until_idle()
        kids = sorted(engine.runs(workflow="kid_again", limit=10), key=lambda r: r.context.n)  # type: ignore[attr-defined]
        engine.send(kids[0].id, "go")
        engine.run_until_idle()
    with Engine(store_url, workflows=[spread(2, "spread_out"), kid]) as engine:
        assert engine.migrate(parent, to=2, by="deployer").state == "spread_out"
        for child in kids[1:]:
            engine.send(child.id, "go")
            engine.run_until_idle()
        info = engine.get(parent)
        assert (info.status, info.context.seen) == ("succeeded", [1, 2, 3, 4])  # type: ignore[union-attr]
        assert len(_kids(engine)) == 4
        assert engine.replay(parent).matches


def test_a_renamed_map_that_starts_another_workflow_is_not_migrated(store_url: str) -> None:
    other = Workflow("other_kid", context=Kid)
    other.step(name="work", initial=True, next="done")(lambda ctx: None)
    other.final("done")
    with Engine(store_url, workflows=[spread(1, "fan"), kid]) as engine:
        parent = engine.start(engine.workflow("spread"), Many(items=[1])).id
        engine.run_until_idle()
    with Engine(store_url, workflows=[spread(2, "spread_out", other), kid, other]) as engine:
        with pytest.raises(DefinitionMismatch, match="starts runs of 'other_kid'"):
            engine.migrate(parent, to=2, by="deployer")
        assert engine.get(parent).state == "fan"


def test_a_call_state_merged_into_one_visited_before_keeps_its_child(store_url: str) -> None:
    """v2 drops call state ``a`` and maps it onto ``b``, which the run had left: the move
    adds a's visit to b's (b's second visit), but the join moved kept visit 1 — the claim
    found nothing under (b, 2) and called a third child (review). The join moves to the
    visit the run has there after the move."""
    kid_n = Workflow("merge_kid", context=Kid)
    kid_n.wait("hold", on={"go": "done"}, initial=True)
    kid_n.final("done")

    def merged(version: int) -> Workflow:
        workflow = Workflow(
            "merged",
            context=Loopy,
            version=version,
            migrates_from={1: {"a": "b"}} if version == 2 else None,
        )
        workflow.call(
            "b",
            child=kid_n,
            context=lambda ctx: Kid(n=10),
            on={"succeeded": "a" if version == 1 else "done"},
            result=lambda ctx, child: ctx.got.append(child.n),
            initial=True,
        )
        if version == 1:
            workflow.call(
                "a",
                child=kid_n,
                context=lambda ctx: Kid(n=20),
                on={"succeeded": "done"},
                result=lambda ctx, child: ctx.got.append(child.n),
            )
        workflow.final("done")
        return workflow

    def kids(engine: Engine) -> list[Any]:
        return engine.runs(workflow="merge_kid", limit=10)

    with Engine(store_url, workflows=[merged(1), kid_n]) as engine:
        parent = engine.start(engine.workflow("merged"), Loopy()).id
        engine.run_until_idle()
        (first,) = kids(engine)
        engine.send(first.id, "go")
        engine.run_until_idle()
        assert engine.get(parent).state == "a"
    with Engine(store_url, workflows=[merged(2), kid_n]) as engine:
        engine.migrate(parent, to=2, by="deployer")
        assert engine.get(parent).visits == {"a": 1, "b": 2}
        (second,) = [k for k in kids(engine) if k.status == "scheduled"]
        engine.send(second.id, "go")
        engine.run_until_idle()
        info = engine.get(parent)
        assert (info.status, info.context.got) == ("succeeded", [10, 20])  # type: ignore[union-attr]
        assert len(kids(engine)) == 2


def test_a_state_renamed_away_and_brought_back_calls_a_new_child(store_url: str) -> None:
    """v2 renamed call state ``ask`` to ``query`` while the run waited there (its join went
    along); v3 brings ``ask`` back. The rename had moved ask's count away, so the run's next
    visit of ``ask`` was visit 1 again, whose join's id (and its child's) the first visit's
    had taken: the run waited there for ever (review). The state left keeps its count."""
    with Engine(store_url, workflows=[loopy(1), kid]) as engine:
        parent = engine.start(engine.workflow("loopy"), Loopy()).id
        engine.run_until_idle()
        [first] = _kids(engine)
    with Engine(store_url, workflows=[loopy(2, {1: {"ask": "query"}}, call="query"), kid]) as e2:
        e2.migrate(parent, to=2, by="deployer")
        e2.send(first, "go")
        e2.run_until_idle()
        assert e2.get(parent).state == "between"
    with Engine(store_url, workflows=[loopy(3, {2: {}}), kid]) as engine:
        engine.migrate(parent, to=3, by="deployer")
        engine.send(parent, "again")  # into the ask of v3
        engine.run_until_idle()
        kids = _kids(engine)
        [second] = [run_id for run_id in kids if run_id != first]
        assert kids == {first: "succeeded", second: "scheduled"}
        engine.send(second, "go")
        engine.run_until_idle()
        info = engine.get(parent)
        assert (info.state, info.context.got) == ("between", [0, 1])  # type: ignore[union-attr]
        assert info.visits == {"ask": 2, "query": 1, "between": 2}
        assert engine.replay(parent).matches


def test_a_rename_rolled_back_while_the_run_is_in_it_is_the_same_visit(store_url: str) -> None:
    """v2 renames call state ``ask`` to ``query`` while the run waits there, v3 (a
    rollback) renames it back, the run still there: one visit, not two. A first version of
    the kept count added it again — ``{'ask': 2}`` for one visit, a retried step's
    idempotency_key changed from ``:ask:1`` to ``:ask:2`` (review). The join goes along
    both ways: the first child's end is the call's, no second child."""
    with Engine(store_url, workflows=[loopy(1), kid]) as engine:
        parent = engine.start(engine.workflow("loopy"), Loopy()).id
        engine.run_until_idle()
        [first] = _kids(engine)
    with Engine(store_url, workflows=[loopy(2, {1: {"ask": "query"}}, call="query"), kid]) as e2:
        e2.migrate(parent, to=2, by="deployer")
    with Engine(store_url, workflows=[loopy(3, {2: {"query": "ask"}}), kid]) as engine:
        engine.migrate(parent, to=3, by="deployer")
        assert engine.history(parent)[-1].data["same_visit"] is True
        assert engine.get(parent).visits == {"ask": 1, "query": 1}
        engine.send(first, "go")
        engine.run_until_idle()
        info = engine.get(parent)
        assert (info.state, info.context.got) == ("between", [0])  # type: ignore[union-attr]
        assert _kids(engine) == {first: "succeeded"}
        assert engine.replay(parent).matches


def paying(
    name: str,
    version: int,
    state: str,
    migrates_from: dict[int, dict[str, str]] | None,
    keys: list[str],
    *,
    failures: int,
    attempts: int,
) -> Workflow:
    """One step, ``state``, that notes its idempotency key (after the run id) in ``keys``
    and fails its first ``failures`` calls, an hour between attempts."""
    workflow = Workflow(name, context=Kid, version=version, migrates_from=migrates_from)

    @workflow.step(name=state, initial=True, next="done", retry=Retry(attempts=attempts, base=3600))
    def charge(ctx: Kid, step: Step) -> None:
        keys.append(step.idempotency_key.split(":", 1)[1])
        if len(keys) <= failures:
            raise ConnectionError("the provider timed out (after it took the charge, perhaps)")

    workflow.final("done")
    return workflow


def test_a_step_retried_across_a_rolled_back_rename_keeps_its_idempotency_key(
    store_url: str,
) -> None:
    keys: list[str] = []

    def pay(version: int, name: str, migrates_from: dict[int, dict[str, str]] | None) -> Workflow:
        return paying("pay_back", version, name, migrates_from, keys, failures=1, attempts=3)

    clock = FakeClock(auto_advance=False)
    with Engine(store_url, workflows=[pay(1, "charge", None)], clock=clock) as engine:
        run = engine.start(engine.workflow("pay_back"), Kid()).id
        engine.run_until_idle()  # the first attempt fails; the next is an hour away
        engine.pause(run)
    with Engine(
        store_url, workflows=[pay(2, "bill", {1: {"charge": "bill"}})], clock=clock
    ) as engine:
        engine.migrate(run, to=2, by="deployer")
    with Engine(
        store_url, workflows=[pay(3, "charge", {2: {"bill": "charge"}})], clock=clock
    ) as engine:
        engine.migrate(run, to=3, by="deployer")
        engine.unpause(run)  # (due when its backoff ends: the unpaused step is tried again)
        clock.advance(3600)
        engine.run_until_idle()
        info = engine.get(run)
        assert (info.status, dict(info.visits)) == (
            "succeeded",
            {"bill": 1, "charge": 1, "done": 1},
        )
        assert engine.replay(run).matches
    assert keys == ["charge:1", "charge:1"]  # the same visit's key, as the provider saw it


def test_a_kept_move_back_into_a_call_state_is_a_new_visit(store_url: str) -> None:
    """v2 maps the run from call state ``ask`` (its child running) to ``between``, a state
    it still has; v3 maps it back. A first version took that for a rolled-back rename:
    the same visit, whose join the child's end had completed — the run went on with the
    old result (review). A move between states a version has is no rename: a new visit, a
    new child."""
    with Engine(store_url, workflows=[loopy(1), kid]) as engine:
        parent = engine.start(engine.workflow("loopy"), Loopy()).id
        engine.run_until_idle()
        [first] = _kids(engine)
    with Engine(store_url, workflows=[loopy(2, {1: {"ask": "between"}}), kid]) as e2:
        e2.migrate(parent, to=2, by="deployer")
        e2.send(first, "go")
        e2.run_until_idle()
    with Engine(store_url, workflows=[loopy(3, {2: {"between": "ask"}}), kid]) as engine:
        engine.migrate(parent, to=3, by="deployer")
        assert "same_visit" not in engine.history(parent)[-1].data
        engine.run_until_idle()
        kids = _kids(engine)
        assert len(kids) == 2 and kids[first] == "succeeded", kids
        assert engine.get(parent).visits["ask"] == 2


def test_a_rename_rolled_back_after_a_retry_in_it_is_still_the_same_visit(
    store_url: str,
) -> None:
    """An operator's retry in the renamed state (the same state: no new visit) ended the
    walk back to the rename, and the rollback counted the visit again (review)."""
    keys: list[str] = []

    def pay(version: int, name: str, migrates_from: dict[int, dict[str, str]] | None) -> Workflow:
        return paying("pay_retry", version, name, migrates_from, keys, failures=2, attempts=2)

    clock = FakeClock(auto_advance=False)
    with Engine(store_url, workflows=[pay(1, "charge", None)], clock=clock) as engine:
        run = engine.start(engine.workflow("pay_retry"), Kid()).id
        engine.run_until_idle()  # attempt 1 fails; attempt 2 an hour away
        engine.pause(run)
    with Engine(
        store_url, workflows=[pay(2, "bill", {1: {"charge": "bill"}})], clock=clock
    ) as engine:
        engine.migrate(run, to=2, by="deployer")
        engine.unpause(run)  # (due when its backoff ends)
        clock.advance(3600)
        engine.run_until_idle()  # attempt 2 fails: the run fails
        assert engine.get(run).status == "failed"
        engine.retry(run)
        engine.pause(run)
    with Engine(
        store_url, workflows=[pay(3, "charge", {2: {"bill": "charge"}})], clock=clock
    ) as engine:
        engine.migrate(run, to=3, by="deployer")
        engine.unpause(run)
        engine.run_until_idle()
        info = engine.get(run)
        assert (info.status, info.visits["charge"]) == ("succeeded", 1)
        assert engine.replay(run).matches
    assert keys == ["charge:1", "bill:1", "charge:1"]


def test_a_run_moved_out_of_a_wait_with_no_timeout_is_due(store_url: str) -> None:
    """Moved from a wait without a timeout (no due time) to a step, it stayed scheduled with
    no due time: never claimed, never run (review)."""

    def flow(version: int) -> Workflow:
        workflow = Workflow(
            "parked_wait",
            context=Kid,
            version=version,
            migrates_from={1: {"hold": "work"}} if version == 2 else None,
        )
        if version == 1:
            workflow.wait("hold", on={"go": "done"}, initial=True)
        else:
            workflow.step(name="work", initial=True, next="done")(lambda ctx: None)
        workflow.final("done")
        return workflow

    with Engine(store_url, workflows=[flow(1)]) as engine:
        run = engine.start(engine.workflow("parked_wait"), Kid()).id
        engine.run_until_idle()
        assert engine.get(run).next_run_at is None
    with Engine(store_url, workflows=[flow(2)]) as engine:
        engine.migrate(run, to=2, by="deployer")
        engine.run_until_idle()
        assert engine.get(run).status == "succeeded"
        assert engine.replay(run).matches


def _timed_wait_flow(version: int, target: str) -> Workflow:
    """v1 waits in ``hold`` for a day; v2 maps ``hold`` onto ``target``: the step ``work`` or
    the wait ``hold2``, whose timeout is a minute."""
    workflow = Workflow(
        "timed_wait",
        context=Kid,
        version=version,
        migrates_from={1: {"hold": target}} if version == 2 else None,
    )
    if version == 1:
        workflow.wait("hold", on={"go": "done"}, timeout=86_400, on_timeout="done", initial=True)
    elif target == "work":
        workflow.step(name="work", initial=True, next="done")(lambda ctx: None)
    else:
        workflow.wait("hold2", on={"go": "done"}, timeout=60, on_timeout="done", initial=True)
    workflow.final("done")
    return workflow


@pytest.mark.parametrize("target", ["work", "hold2"])
def test_a_run_moved_out_of_a_wait_with_a_timeout_is_due_as_its_new_state_says(
    store_url: str, target: str
) -> None:
    """Moved from a wait with a timeout, it kept that timeout as its due time: a step ran a
    day late, a wait timed out by the old wait's timeout. Due now (a step) or at the new
    wait's timeout, as a run moved out of a wait without one."""
    with Engine(store_url, workflows=[_timed_wait_flow(1, target)]) as engine:
        run = engine.start(engine.workflow("timed_wait"), Kid()).id
        engine.run_until_idle()
        assert engine.get(run).next_run_at == pytest.approx(time.time() + 86_400, abs=60)
    with Engine(store_url, workflows=[_timed_wait_flow(2, target)]) as engine:
        moved_at = time.time()
        engine.migrate(run, to=2, by="deployer")
        engine.run_until_idle(idle_horizon=0)
        info = engine.get(run)
        if target == "work":
            assert info.status == "succeeded"
        else:
            assert (info.status, info.state) == ("scheduled", "hold2")
            assert info.next_run_at == pytest.approx(moved_at + 60, abs=30)
        assert engine.replay(run).matches


def test_a_rename_before_a_move_between_states_is_not_this_visits(store_url: str) -> None:
    """v2 renames call state ``ask`` to ``ask2``; v3 moves the run on to ``between`` (a state
    it has); v4 renames ``between`` to ``ask``. The walk back went past the move and took
    ``ask`` for a name of this visit: visit 1 again, the old join's id, no child — the
    parent waited for ever (review). A move between states is a visit of its own."""

    def flow(version: int, call: str, wait: str, moves: dict[str, str] | None) -> Workflow:
        workflow = Workflow(
            "walked",
            context=Loopy,
            version=version,
            migrates_from={version - 1: moves} if moves is not None else None,
        )
        workflow.call(
            call,
            child=kid,
            context=lambda ctx: Kid(n=len(ctx.got)),
            on={"succeeded": wait, "failed": "done", "stopped": "done"},
            result=lambda ctx, child: ctx.got.append(child.n),
            initial=True,
        )
        workflow.wait(wait, on={"again": call, "finish": "done"})
        workflow.final("done")
        return workflow

    with Engine(store_url, workflows=[flow(1, "ask", "between", None), kid]) as engine:
        parent = engine.start(engine.workflow("walked"), Loopy()).id
        engine.run_until_idle()
        [first] = _kids(engine)
    with Engine(store_url, workflows=[flow(2, "ask2", "between", {"ask": "ask2"}), kid]) as e:
        e.migrate(parent, to=2, by="deployer")
    with Engine(store_url, workflows=[flow(3, "ask2", "between", {"ask2": "between"}), kid]) as e:
        e.migrate(parent, to=3, by="deployer")
        e.send(first, "go")
        e.run_until_idle()
    with Engine(store_url, workflows=[flow(4, "ask", "pause_here", {"between": "ask"}), kid]) as e:
        e.migrate(parent, to=4, by="deployer")
        assert "same_visit" not in e.history(parent)[-1].data
        e.run_until_idle()
        kids = _kids(e)
        [second] = [run_id for run_id in kids if run_id != first]
        e.send(second, "go")
        e.run_until_idle()
        info = e.get(parent)
        # (The first child's end came while the run was moved away: its join went unused.)
        assert (info.state, info.context.got) == ("pause_here", [0])  # type: ignore[union-attr]
        assert len(kids) == 2
        assert e.replay(parent).matches


def test_a_parent_moved_out_of_its_call_state_to_a_step_goes_on(store_url: str) -> None:
    """Moved from a call state (its child waiting for ever) to a step of the new version,
    it stayed scheduled with no due time until the child ended: with this child, never
    (review). Due at once: the step runs; the old child is left as it is."""

    def flow(version: int) -> Workflow:
        workflow = Workflow(
            "jumpy",
            context=Loopy,
            version=version,
            migrates_from={1: {"ask": "manual"}} if version == 2 else None,
        )
        workflow.call(
            "ask",
            child=kid,
            context=lambda ctx: Kid(n=0),
            on={"succeeded": "done", "failed": "manual"} if version == 2 else {"succeeded": "done"},
            initial=True,
        )
        if version == 2:  # (reached by hand, or when the child fails)
            workflow.step(name="manual", next="done")(lambda ctx: ctx.got.append(9))
        workflow.final("done")
        return workflow

    with Engine(store_url, workflows=[flow(1), kid]) as engine:
        parent = engine.start(engine.workflow("jumpy"), Loopy()).id
        engine.run_until_idle()
        [child] = _kids(engine)
    with Engine(store_url, workflows=[flow(2), kid]) as engine:
        engine.migrate(parent, to=2, by="deployer")
        engine.run_until_idle()
        info = engine.get(parent)
        assert (info.status, info.context.got) == ("succeeded", [9])  # type: ignore[union-attr]
        assert _kids(engine) == {child: "scheduled"}
        assert engine.replay(parent).matches
