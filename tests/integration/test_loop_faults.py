"""Loops under faults and races: a deploy that changes a loop's schedule while another
worker runs an iteration of it, an iteration that raises a BaseException, and the CLI's
answers to bad input. On SQLite and PostgreSQL where a database is involved."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine
from typing import Any

import pytest
from loopkit import T0, LoopHarness, SteppedClock, describe, drive, settle

from flowloop import Engine
from flowloop.errors import FlowloopError
from flowloop.loops import Iteration, Loop
from flowloop.store.loops import LoopEvent, LoopStoreMixin


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def test_schedule_changed_while_another_worker_runs_an_iteration__its_outcome_is_kept(
    store_url: str,
) -> None:
    """A deploy: worker "new" starts with `every=5` while worker "old" (`every=10`) runs an
    iteration. Before, registering the new schedule moved the row's `last_seq` under the
    running iteration: its outcome write was fenced off ("lost its lease"), the loop stayed
    running until the lease ran out, and the iteration that had succeeded was journaled
    interrupted — a failure. Now the new schedule waits for the iteration's end."""

    async def main() -> None:
        clock = SteppedClock()
        release = asyncio.Event()

        async def fn(it: Iteration) -> None:
            await release.wait()

        async with LoopHarness(store_url, [Loop("tick", fn, every=10)], clock=clock) as old:
            await drive(clock, 1)
            assert old.row("tick").status == "running"
            new_loop = Loop("tick", fn, every=5)
            async with LoopHarness(store_url, [new_loop], clock=clock, worker_id="new"):
                await drive(clock, 1)
                row = old.row("tick")
                assert (row.status, row.owner, row.schedule) == (
                    "running",
                    "w1",
                    "every 10s (fixed_rate)",
                ), row
                release.set()
                await drive(clock, 20)
                events = old.journal("tick")
                kinds = [e.kind for e in events]
                assert kinds[:4] == [
                    "loop_created",
                    "iteration_started",
                    "iteration_succeeded",
                    "loop_rescheduled",
                ], describe(events)
                assert "iteration_interrupted" not in kinds, describe(events)
                assert events[3].worker == "new"
                assert events[3].data["was"] == "every 10s (fixed_rate)"
                row = old.row("tick")
                assert row.last_result == "ok" and row.consecutive_failures == 0, row
                # The new schedule fires: slots 5 apart from the rescheduled one.
                started = [e.slot for e in events if e.kind == "iteration_started"]
                gaps = [round(b - a, 3) for a, b in itertools.pairwise(started[1:])]
                assert gaps == [5.0] * (len(started) - 2), describe(events)
                assert len(started) >= 3, describe(events)
                await settle()

    run(main())


class Boom(BaseException):
    """A loop function's own BaseException (not an Exception)."""


@pytest.mark.parametrize(
    ("raised", "timeout"),
    [(Boom("custom base"), None), (KeyboardInterrupt("from the function"), 30.0)],
    ids=["own-base-exception", "keyboard-interrupt-with-timeout"],
)
def test_iteration_raising_a_base_exception__fails_the_iteration_only(
    store_url: str, raised: BaseException, timeout: float | None
) -> None:
    """Before: a KeyboardInterrupt raised by a loop's function left the event loop and ended
    the worker (exit 130, "interrupted", every other iteration cancelled); any other
    BaseException ended the iteration's task unrecorded, the loop left running until its
    lease ran out and then journaled interrupted, "self-fenced". Now the iteration fails
    with it, like with any error, and the other loops go on."""
    ticks: list[int] = []

    async def bad(it: Iteration) -> None:
        raise raised

    async def good(it: Iteration) -> None:
        ticks.append(it.number)

    async def main() -> None:
        clock = SteppedClock()
        loops = [Loop("bad", bad, every=10, timeout=timeout), Loop("good", good, every=10)]
        async with LoopHarness(store_url, loops, clock=clock) as h:
            await drive(clock, 25)
            events = h.journal("bad")
            kinds = [e.kind for e in events]
            assert kinds == ["loop_created"] + ["iteration_started", "iteration_failed"] * 3, (
                describe(events)
            )
            name = type(raised).__name__
            assert events[2].error_message == (
                f"RaisedBaseException: loop 'bad' raised {name}: {raised}, a BaseException "
                "that would end the worker: raise an Exception"
            )
            row = h.row("bad")
            assert (row.status, row.last_result, row.consecutive_failures) == (
                "scheduled",
                "failed",
                3,
            )
            assert ticks == [1, 2, 3]

    try:
        run(main())
    except KeyboardInterrupt:
        pytest.fail("the iteration's KeyboardInterrupt ended the worker's event loop")


def test_loops_journal_limit_below_zero__refused_as_bad_input(store_url: str) -> None:
    """`flowloop loops NAME --limit -3` printed the whole journal on SQLite (LIMIT -1 is no
    limit there) and "a value does not fit the database column" on PostgreSQL; the API
    likewise. Now both refuse it, saying what a limit must be."""
    from click.testing import CliRunner

    from flowloop.cli import cli as command

    with Engine(store_url) as engine:
        store = engine.store
        assert isinstance(store, LoopStoreMixin)
        store.sync_loop(name="tick", schedule="every 10s", first_slot=T0, at=T0, worker="w")
        with pytest.raises(FlowloopError, match=r"limit=-3 must be a whole number"):
            engine.loop_history("tick", limit=-3)
        assert [e.kind for e in engine.loop_history("tick", limit=0)] == []
    result = CliRunner().invoke(command, ["loops", "tick", "--limit", "-3", "--db", store_url])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--limit': -3 is not in the range x>=0." in result.output
    assert "Traceback" not in result.output and "loop_created" not in result.output


def fire(store: LoopStoreMixin, name: str, slot: float, *, lease_seconds: float) -> None:
    """Fire ``slot`` as worker "gone", holding the lease ``lease_seconds`` from now (by the
    database's clock; negative: run out already)."""
    row = store.get_loop(name)
    assert row is not None
    started = LoopEvent(loop=name, kind="iteration_started", at=slot, slot=slot, worker="gone")
    fired = store.fire_loop(
        name=name,
        follows_seq=row.last_seq,
        worker="gone",
        lease_seconds=lease_seconds,
        events=[started],
        changes={"last_slot": slot, "last_started_at": slot, "next_fire_at": None},
    )
    assert fired is not None


@pytest.mark.parametrize("action", ["stop", "pause"])
def test_stop_a_loop_its_dead_worker_left_running__applies_at_once(
    store_url: str, action: str
) -> None:
    """A worker killed in an iteration of a loop no running worker defines (removed from
    the code, or its workers not started): before, `flowloop stop`/`pause` only recorded a
    request for "its worker", which nothing would ever honour — the loop showed `running`
    forever. Now, once the dead worker's lease has run out, the operator's command settles
    the iteration (journaled interrupted, as a worker's recovery would) and applies."""
    target = "stopped" if action == "stop" else "paused"
    with Engine(store_url) as engine:
        store = engine.store
        assert isinstance(store, LoopStoreMixin)
        for name in ("held", "lapsed"):
            store.sync_loop(name=name, schedule="every 10s", first_slot=T0, at=T0, worker="w")
        fire(store, "held", T0, lease_seconds=60)  # its worker may be alive: a request
        fire(store, "lapsed", T0, lease_seconds=-60)
        held = getattr(engine, f"{action}_loop")("held")
        assert (held.status, held.control) == ("running", action)
        row = getattr(engine, f"{action}_loop")("lapsed")
        assert (row.status, row.control, row.owner) == (target, None, None), row
        assert (row.last_result, row.iterations, row.consecutive_failures) == ("interrupted", 1, 1)
        events = engine.loop_history("lapsed")
        assert [(e.kind, e.slot) for e in events[-2:]] == [
            ("iteration_interrupted", T0),
            (f"loop_{target}", None),
        ], describe(events)
        assert events[-1].worker is not None and events[-1].worker.startswith("operator:")


def test_worker_names_the_loops_in_the_database_it_does_not_define(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop removed from the code keeps its row (`flowloop loops` lists it, scheduled);
    before, no worker said a word about it. Now a worker starting says which loops of the
    database it does not define (a stopped one aside) and how to end one."""

    async def fn(it: Iteration) -> None:
        return None

    async def main() -> None:
        clock = SteppedClock()
        with Engine(store_url) as engine:
            store = engine.store
            assert isinstance(store, LoopStoreMixin)
            for name in ("removed", "ended"):
                store.sync_loop(name=name, schedule="every 10s", first_slot=T0, at=T0, worker="w")
            engine.stop_loop("ended")
        with caplog.at_level("INFO", logger="flowloop.loops"):
            async with LoopHarness(store_url, [Loop("tick", fn, every=10)], clock=clock):
                await settle()
        said = [r.getMessage() for r in caplog.records if "does not define" in r.getMessage()]
        assert said == [
            "loops in the database this worker does not define (another worker's, or removed "
            "from the code: `flowloop stop NAME` ends one): removed"
        ]

    run(main())


def test_workers_starting_together_register_a_new_loop_once(store_url: str) -> None:
    """Workers started at the same moment (a deploy that adds a loop): on PostgreSQL each
    read the loop missing and inserted it, and every one but the first failed its start
    with a UniqueViolation — the worker exited with a traceback. Now the loser reads the
    row the winner wrote. (SQLite serialises the writes: it never raced.)"""
    import threading

    from flowloop.store.loops import LoopSpec

    engines = [Engine(store_url, worker_id=f"w{i}") for i in range(4)]
    errors: list[BaseException] = []
    try:
        for engine in engines:
            engine.loops()  # the schema is made before the race
        for trial in range(8):
            barrier = threading.Barrier(len(engines))
            spec = LoopSpec(name=f"new{trial}", schedule="every 5s", first_slot=T0)

            def register(engine: Engine, spec: LoopSpec = spec, b: threading.Barrier = barrier):
                store = engine.store
                assert isinstance(store, LoopStoreMixin)
                b.wait(timeout=10)
                try:
                    store.sync_loops([spec], at=T0, worker=engine.worker_id)
                except BaseException as error:
                    errors.append(error)

            threads = [threading.Thread(target=register, args=(e,)) for e in engines]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            assert [e.kind for e in engines[0].loop_history(spec.name)] == ["loop_created"]
        assert not errors, errors[:2]
    finally:
        for engine in engines:
            engine.close()


def test_schedule_changed_after_downtime__the_due_slots_are_caught_up_not_dropped(
    store_url: str,
) -> None:
    """An hourly cron loop, its workers down 3 h 10 min, comes back with `*/30`. Before, the
    pending slot (due for 3 h) was replaced by the new schedule's next time: nothing fired
    until then and the slots in between were journaled nowhere. Now the due slot is kept
    and handled under the new schedule as after any downtime: past the grace `missed`, the
    rest coalesced into one iteration, at once."""

    async def fn(it: Iteration) -> None:
        return None

    async def main() -> None:
        clock = SteppedClock()
        async with LoopHarness(store_url, [Loop("rep", fn, cron="0 * * * *")], clock=clock):
            await drive(clock, 3600, step=60)  # the slot at T0 + 1 h ran
        clock.advance(3 * 3600 + 600)  # down until T0 + 4 h 10 min
        new = Loop("rep", fn, cron="*/30 * * * *")
        async with LoopHarness(store_url, [new], clock=clock, worker_id="w2") as h:
            await drive(clock, 1)
            events = h.journal("rep")
            got = [(e.kind, None if e.slot is None else e.slot - T0, e.count) for e in events]
            assert got[3:] == [
                ("loop_rescheduled", 7200, 0),
                ("missed", 7200, 3),  # 2 h, 2 h 30, 3 h: more than the hour's grace late
                ("coalesced", 14400, 1),  # 3 h 30 folded into 4 h, which runs now
                ("iteration_started", 14400, 0),
                ("iteration_succeeded", 14400, 0),
            ], describe(events)
            assert h.row("rep").next_fire_at == T0 + 16200

    run(main())


def test_schedule_changed_after_downtime__a_loop_that_does_not_coalesce_catches_up_none(
    store_url: str,
) -> None:
    """Review of the test above: with `coalesce=False` the kept slot made the loop catch
    up, one by one, every slot the new schedule has between it and now — slots no schedule
    had while the workers were down (a daily loop down 20 minutes, back as `every=60`: 21
    iterations back to back). Such a loop starts the new schedule afresh, as before."""
    ran: list[float] = []

    async def fn(it: Iteration) -> None:
        ran.append(it.slot)

    async def main() -> None:
        clock = SteppedClock()
        daily = Loop("daily", fn, every=86400, coalesce=False)
        async with LoopHarness(store_url, [daily], clock=clock):
            await drive(clock, 1)  # the first slot ran; the next is a day on
        clock.advance(86400 + 1200)  # down until 20 minutes past it
        minutely = Loop("daily", fn, every=60, coalesce=False)
        async with LoopHarness(store_url, [minutely], clock=clock, worker_id="w2") as h:
            await drive(clock, 1)
            kinds = [e.kind for e in h.journal("daily")]
        assert kinds.count("iteration_started") <= 2, kinds
        assert len(ran) <= 2, ran

    run(main())


@pytest.mark.parametrize("action", ["pause", "stop"])
def test_pause_asked_during_an_iteration_its_worker_died_in__honoured_at_recovery(
    store_url: str, action: str
) -> None:
    """`flowloop pause` while the iteration ran (a request for its worker), then the worker
    died. Before, the recovering worker journaled the iteration interrupted and scheduled
    the next slot with the request still pending: the loop showed `scheduled`, "pause
    requested", until that slot came (an hour here). Now recovery honours it at once."""
    target = "paused" if action == "pause" else "stopped"

    async def fn(it: Iteration) -> None:
        return None

    async def main() -> None:
        clock = SteppedClock()
        hourly = Loop("hourly", fn, every=3600)
        with Engine(store_url) as engine:
            store = engine.store
            assert isinstance(store, LoopStoreMixin)
            store.sync_loop(
                name="hourly", schedule=hourly.schedule, first_slot=T0, at=T0, worker="w"
            )
            fire(store, "hourly", T0, lease_seconds=-60)
            store.request_loop_control("hourly", action)  # asked while its lease ran
        async with LoopHarness(store_url, [hourly], clock=clock) as h:
            await drive(clock, 2)
            events = h.journal("hourly")
            assert [e.kind for e in events[-2:]] == [
                "iteration_interrupted",
                f"loop_{target}",
            ], describe(events)
            row = h.row("hourly")
            assert (row.status, row.control, row.next_fire_at) == (target, None, None), row

    run(main())
