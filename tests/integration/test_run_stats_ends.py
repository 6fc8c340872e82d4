"""`run_stats` (`flowloop stats`' runs table) counts every run that finished in the window,
whatever entry ended it — a call's or a map's join, a compensation, a compensation that
failed for good, a run deadline, an `on_error` route into a final state, an operator's
stop — on SQLite and PostgreSQL, with the succeeded ones' latency; and on SQLite it finds
the window's runs by `ix_flowloop_runs_updated`, not by reading every finished run."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.cli import cli
from flowloop.stats import RunStats, run_stats
from flowloop.store import SQLStore
from flowloop.store.schema import journal, runs

T0 = 1_800_000_000.0
HOUR = 3600.0


class Job(BaseModel):
    seconds: float = 0.0
    fails: bool = False
    items: list[int] = []


def working(clock: FakeClock, name: str) -> Workflow:
    """A step that takes ``seconds`` of the fake clock, then fails when ``fails``."""
    wf = Workflow(name, context=Job)

    @wf.step(initial=True, next="done", retry=Retry(attempts=1), on_error={"*": "declined"})
    def work(ctx: Job) -> None:
        clock.advance(ctx.seconds)
        if ctx.fails:
            raise RuntimeError("declined")

    wf.final("done", "declined")
    return wf


def ends(clock: FakeClock) -> dict[str, Workflow]:
    child = working(clock, "ends_child")
    call = Workflow("ends_call", context=Job)
    call.call(
        "call",
        child=child,
        context=lambda ctx: Job(seconds=ctx.seconds),
        on={"succeeded": "done"},
        initial=True,
    )
    call.final("done")
    fan = Workflow("ends_map", context=Job)
    fan.map(
        "each",
        child=child,
        items=lambda ctx: ctx.items,
        context=lambda ctx, item: Job(seconds=float(item)),
        on={"done": "done", "failed": "done"},
        initial=True,
    )
    fan.final("done")

    saga = Workflow("ends_saga", context=Job)

    def undo(ctx: Job, step: Step) -> None:
        if ctx.fails:
            raise ConnectionError("cannot undo")

    @saga.step(initial=True, next="ship", compensate=undo, compensate_retry=Retry(attempts=1))
    def book(ctx: Job) -> None:
        clock.advance(ctx.seconds)

    @saga.step(next="done", retry=Retry(attempts=1), on_error={"*": "cancelled"})
    def ship(ctx: Job) -> None:
        raise RuntimeError("sold out")

    saga.final("done")
    saga.final("cancelled", compensate=True)

    late = Workflow("ends_deadline", context=Job, deadline=timedelta(hours=2), on_deadline="late")
    late.wait("waiting", on={"go": "done"}, initial=True)
    late.final("done", "late")
    return {
        "call": call,
        "map": fan,
        "saga": saga,
        "deadline": late,
        "routed": working(clock, "ends_routed"),
    }


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def engine(store_url: str, clock: FakeClock) -> Iterator[Engine]:
    with Engine(store_url, clock=clock) as e:
        yield e


def db_of(engine: Engine) -> sa.Engine:
    assert isinstance(engine.store, SQLStore)
    return engine.store.engine


def counts(found: RunStats) -> tuple[int, int, int, int]:
    return found.finished, found.succeeded, found.failed, found.stopped


def test_run_stats__every_way_a_run_ends_is_counted(engine: Engine, clock: FakeClock) -> None:
    flows = ends(clock)
    last = {}
    for seconds in (1.0, 3.0):  # children_joined, each parent as long as its child
        last["call"] = engine.run(flows["call"], Job(seconds=seconds))
    last["map"] = engine.run(flows["map"], Job(items=[2, 5]))  # children_joined, 7 s
    last["saga"] = engine.run(flows["saga"], Job(seconds=4.0))  # run_compensated
    failed = engine.run(flows["saga"], Job(seconds=6.0, fails=True))  # compensation_failed
    last["routed"] = engine.run(flows["routed"], Job(seconds=8.0, fails=True))  # step_failed
    stopped = engine.start(flows["deadline"], Job())
    engine.stop(stopped.id)  # run_stopped
    late = engine.start(flows["deadline"], Job())
    clock.advance(3 * HOUR)
    engine.run_until_idle()
    last["deadline"] = engine.get(late.id)  # deadline_passed
    for name, info in last.items():
        assert (name, info.status) == (name, "succeeded")
    assert engine.get(failed.id).status == "failed"
    kinds = {name: engine.history(info.id)[-1].kind for name, info in last.items()}
    assert kinds == {
        "call": j.CHILDREN_JOINED,
        "map": j.CHILDREN_JOINED,
        "saga": j.RUN_COMPENSATED,
        "routed": j.STEP_FAILED,
        "deadline": j.DEADLINE_PASSED,
    }
    assert engine.history(failed.id)[-1].kind == j.COMPENSATION_FAILED

    for since in (None, T0):
        found = {s.workflow: s for s in run_stats(db_of(engine), since=since)}
        assert {name: counts(s) for name, s in found.items()} == {
            "ends_call": (2, 2, 0, 0),
            "ends_child": (4, 4, 0, 0),  # the call's two, the map's two
            "ends_map": (1, 1, 0, 0),
            "ends_saga": (2, 1, 1, 0),
            "ends_routed": (1, 1, 0, 0),
            "ends_deadline": (2, 1, 0, 1),
        }
        # Latency of the succeeded runs (whatever ended them), run_created to the end.
        assert (found["ends_call"].p50, found["ends_call"].p99) == (1.0, 3.0)
        assert found["ends_map"].p50 == 7.0
        assert found["ends_saga"].p50 == 4.0  # the failed one's 6 s is not a latency
        assert found["ends_routed"].p50 == 8.0
        assert found["ends_deadline"].p50 == 3 * HOUR
    (one,) = run_stats(db_of(engine), workflow="ends_call", since=T0)
    assert counts(one) == (2, 2, 0, 0)
    assert run_stats(db_of(engine), since=clock.now() + 1) == []


def test_run_stats__an_operators_retry_counts_the_run_once_by_its_new_end(
    engine: Engine, clock: FakeClock
) -> None:
    saga = ends(clock)["saga"]
    failed = engine.run(saga, Job(seconds=2.0, fails=True))
    assert engine.get(failed.id).status == "failed"
    clock.advance(10.0)
    engine.retry(failed.id, set_fields={"fails": False})
    engine.run_until_idle()
    assert engine.history(failed.id)[-1].kind == j.RUN_COMPENSATED
    (found,) = run_stats(db_of(engine), since=T0 + 5)
    assert counts(found) == (1, 1, 0, 0)
    assert found.p50 == 12.0


def test_cli__stats_of_a_workflow_whose_runs_end_by_a_join(
    engine: Engine, clock: FakeClock, store_url: str
) -> None:
    """The audit's case: `flowloop stats st_parent` said 'nothing journaled'."""
    engine.run(ends(clock)["call"], Job(seconds=1.0))
    result = CliRunner().invoke(
        cli, ["stats", "ends_call", "--since", "all", "--json", "--db", store_url]
    )
    assert result.exit_code == 0, result.output
    (found,) = json.loads(result.output)["runs"]
    assert (found["workflow"], found["finished"], found["succeeded"]) == ("ends_call", 1, 1)


def history(engine: Engine, *, finished: int, per_minute: int) -> None:
    """``finished`` runs that ended ``per_minute`` a minute up to T0, written directly."""
    run_rows: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = []
    for i in range(finished):
        at = T0 - (finished - i) * 60.0 / per_minute
        run_id = f"{i:08d}{uuid.uuid4().hex[:24]}"
        status, kind = [
            ("succeeded", j.STEP_SUCCEEDED),
            ("succeeded", j.CHILDREN_JOINED),
            ("failed", j.STEP_FAILED),
            ("stopped", j.RUN_STOPPED),
        ][i % 4]
        run_rows.append(
            {
                "id": run_id,
                "workflow": ("etl", "order")[i % 2],
                "version": 1,
                "fingerprint": "f" * 16,
                "status": status,
                "state": "done",
                "context": "{}",
                "attempt": 0,
                "visits": "{}",
                "last_seq": 2,
                "priority": 0,
                "lease_epoch": 0,
                "created_at": at - 1,
                "updated_at": at,
            }
        )
        for seq, entry_kind in ((1, j.RUN_CREATED), (2, kind)):
            entries.append({"run_id": run_id, "seq": seq, "kind": entry_kind, "at": at - 2 + seq})
    with db_of(engine).begin() as conn:
        conn.execute(sa.insert(runs), run_rows)
        conn.execute(sa.insert(journal), entries)


@pytest.mark.parametrize("analyzed", [False, True], ids=["as_written", "analyzed"])
@pytest.mark.parametrize("workflow", [None, "etl"])
def test_run_stats__the_window_is_read_by_updated_at_on_sqlite(
    sqlite_url: str, analyzed: bool, workflow: str | None
) -> None:
    """Given the status (or the workflow), SQLite's planner read every finished run by the
    status or workflow index — the database as flowloop writes it, and after an ANALYZE —
    and `stats --since 10m` took a second over 330,000 runs; each statement of run_stats
    finds the window's runs by their `updated_at` instead."""
    with Engine(sqlite_url, clock=FakeClock(T0)) as e:
        history(e, finished=3000, per_minute=10)
        db = db_of(e)
        if analyzed:
            with db.begin() as conn:
                conn.exec_driver_sql("ANALYZE")
        statements: list[tuple[str, Any]] = []

        def seen(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
            if "flowloop_runs" in statement and not statement.startswith("EXPLAIN"):
                statements.append((statement, parameters))

        sa.event.listen(db, "before_cursor_execute", seen)
        try:
            found = run_stats(db, workflow=workflow, since=T0 - 600)
        finally:
            sa.event.remove(db, "before_cursor_execute", seen)
        assert sum(s.finished for s in found) == (100 if workflow is None else 50)
        assert len(statements) == 2  # the counts and the latencies
        with db.connect() as conn:
            for statement, parameters in statements:
                plan = [
                    str(row[-1])
                    for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
                ]
                runs_read = [line for line in plan if " flowloop_runs " in f"{line} "]
                assert runs_read == [
                    "SEARCH flowloop_runs USING INDEX ix_flowloop_runs_updated (updated_at>?)"
                ], plan
