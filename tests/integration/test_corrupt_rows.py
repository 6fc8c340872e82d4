"""Rows damaged by hand (issue 20, item 7): a run in a state its workflow does not have
fails at once saying so; a journal row that is not JSON, of an unknown kind, or missing
leaves the rest readable and is named; a damaged stored definition concerns the runs of
that definition only. Each on SQLite and PostgreSQL, the damage done with plain SQL."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from pydantic import BaseModel

from flowloop import Engine, Workflow
from flowloop.cli import main


class Ctx(BaseModel):
    n: int = 0


def flow(name: str = "damaged") -> Workflow:
    wf = Workflow(name, context=Ctx)

    @wf.step(initial=True, next="b")
    def a(ctx: Ctx) -> None:
        ctx.n += 1

    @wf.step(next="done")
    def b(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


def damage(url: str, sql: str, **params: object) -> None:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            assert conn.execute(sa.text(sql), params).rowcount == 1
    finally:
        engine.dispose()


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = 0
    try:
        main(list(args))
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_run_in_a_state_its_workflow_lacks_fails_at_once(store_url: str) -> None:
    wf = flow()
    with Engine(store_url, workflows=[wf]) as engine:
        run_id = engine.start(wf, Ctx()).id
        damage(store_url, "UPDATE flowloop_runs SET state = 'gone' WHERE id = :id", id=run_id)
        engine.run_until_idle()
        info = engine.get(run_id)
        assert info.status == "failed", info
        assert info.reason == "unknown_state: gone"
        assert "'gone'" in (info.error or "")
        assert info.owner is None
        assert engine.replay(run_id).events[-1].kind == "run_failed"


def test_damaged_journal_rows_are_named_and_the_rest_stays_readable(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    wf = flow()
    with Engine(store_url, workflows=[wf]) as engine:
        ids = [engine.run(wf, Ctx()).id for _ in range(3)]
    bad_json, bad_kind, gap = ids
    damage(
        store_url,
        "UPDATE flowloop_journal SET data = '{not json' WHERE run_id = :id AND seq = 2",
        id=bad_json,
    )
    damage(
        store_url,
        "UPDATE flowloop_journal SET kind = 'zzz' WHERE run_id = :id AND seq = 3",
        id=bad_kind,
    )
    damage(store_url, "DELETE FROM flowloop_journal WHERE run_id = :id AND seq = 3", id=gap)

    code, out, err = cli(capsys, "history", bad_json, "--db", store_url)
    assert code == 0, err
    assert "unreadable row: data is not a JSON object" in out
    assert "step_succeeded" in out  # the rows after it are shown too
    code, out, err = cli(capsys, "replay", bad_json, "--db", store_url)
    assert (code, out) == (1, ""), err
    assert err.count("\n") == 1 and f"run {bad_json} seq 2" in err and "not JSON" in err

    code, out, err = cli(capsys, "history", bad_kind, "--db", store_url)
    assert code == 0 and "zzz" in out, err
    code, out, err = cli(capsys, "replay", bad_kind, "--db", store_url)
    assert code == 1 and "unknown event kind 'zzz'" in err and "Traceback" not in err

    code, out, err = cli(capsys, "history", gap, "--db", store_url)
    assert code == 0, err
    code, out, err = cli(capsys, "replay", gap, "--db", store_url)
    # Row 3 held seq 3 and the joined start at seq 4 (one row per step boundary).
    assert code == 1 and "seq 5 follows 2" in err and "Traceback" not in err


def test_a_damaged_definition_row_concerns_its_own_runs_only(store_url: str) -> None:
    damaged, healthy = flow("damaged"), flow("healthy")
    with Engine(store_url, workflows=[damaged, healthy]) as engine:
        old = engine.start(damaged, Ctx()).id
    damage(
        store_url,
        "UPDATE flowloop_definitions SET structure = '{oops' WHERE name = 'damaged'",
    )
    # Start-up, start, send and a worker's run all go on; the damaged definition's own run
    # is judged against the current definition (its state still exists: it finishes).
    with Engine(store_url, workflows=[damaged, healthy]) as engine:
        fine = engine.start(healthy, Ctx()).id
        engine.run_until_idle()
        assert engine.get(fine).status == "succeeded"
        assert engine.get(old).status == "succeeded"
        assert engine.check(damaged) == []


def test_a_damaged_loop_journal_row_is_shown_and_named(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flowloop.store.loops import LoopSpec
    from flowloop.store.sql import SQLStore

    store = SQLStore(store_url)
    try:
        store.sync_loops(
            [LoopSpec(name="tick", schedule="every 60s", first_slot=0.0)], at=0.0, worker="w"
        )
    finally:
        store.close()
    damage(
        store_url,
        "UPDATE flowloop_loop_journal SET data = 'garbage' WHERE loop = 'tick' AND seq = 1",
    )
    code, out, err = cli(capsys, "loops", "tick", "--db", store_url)
    assert code == 0, err
    assert "unreadable" in out, out
