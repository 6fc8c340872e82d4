"""Backpressure on SQLite and PostgreSQL: a run's inbox of kept events and a workflow's
queue of runs not yet started, each bound rejecting, dropping or blocking as declared."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Workflow
from flowloop.backpressure import InboxFull, QueueFull
from flowloop.errors import DefinitionError


class Ticket(BaseModel):
    id: str
    notes: list[int] = []


class Note(BaseModel):
    n: int


def ticket_workflow(name: str, **bounds: Any) -> Workflow:
    """Parked in a wait state; ``note`` events are taken only later, so they are kept."""
    wf = Workflow(name, context=Ticket, key="id", **bounds)
    wf.wait("parked", initial=True, on={"go": "work"})

    @wf.step(next="noting")
    def work(ctx: Ticket) -> None:
        return None

    wf.wait(
        "noting",
        on={"note": "done"},
        payloads={"note": Note},
        handlers={"note": lambda ctx, note: ctx.notes.append(note.n)},
    )
    wf.final("done")
    return wf


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    with Engine(store_url, clock=FakeClock(), poll_seconds=0.02) as e:
        yield e


def kept(engine: Engine, run_id: str) -> list[int]:
    return [
        Note.model_validate_json(m.payload or "{}").n for m in engine.store.pending_events(run_id)
    ]


def test_inbox__reject_newest_refuses_the_sender_and_keeps_nothing(engine: Engine) -> None:
    wf = ticket_workflow("reject", max_inbox=2)
    run = engine.start(wf, Ticket(id="t1"))
    for n in (1, 2):
        assert engine.send(run.id, "note", {"n": n}, buffer=True).status == "buffered"
    with pytest.raises(InboxFull, match=r"inbox holds 2 kept events \(max_inbox=2"):
        engine.send(run.id, "note", {"n": 3}, buffer=True)
    assert kept(engine, run.id) == [1, 2]


def test_inbox__drop_oldest_journals_the_dropped_event(engine: Engine) -> None:
    wf = ticket_workflow("drop", max_inbox=2, inbox_overflow="drop_oldest")
    run = engine.start(wf, Ticket(id="t1"))
    for n in (1, 2, 3, 4):
        assert engine.send(run.id, "note", {"n": n}, buffer=True).status == "buffered"
    assert kept(engine, run.id) == [3, 4]
    dropped = [e for e in engine.history(run.id) if e.kind == "event_dropped"]
    assert [(e.event, e.data["reason"]) for e in dropped] == [("note", "max_inbox=2")] * 2
    assert engine.replay(run.id).matches
    engine.send(run.id, "go")
    engine.run_until_idle()
    assert engine.get(run.id).context.notes == [3]  # the oldest kept one that was left


def test_inbox__block_waits_for_room_then_gives_up(store_url: str, engine: Engine) -> None:
    wf = ticket_workflow("block", max_inbox=1, inbox_overflow="block", overflow_timeout=0.2)
    run = engine.start(wf, Ticket(id="t1"))
    engine.send(run.id, "note", {"n": 1}, buffer=True)
    with pytest.raises(InboxFull, match=r"waited 0\.\d+s for room"):
        engine.send(run.id, "note", {"n": 2}, buffer=True)
    assert kept(engine, run.id) == [1]


def test_inbox__block_keeps_the_event_once_the_run_takes_one(store_url: str) -> None:
    wf = ticket_workflow("block2", max_inbox=1, inbox_overflow="block", overflow_timeout=30)
    clock = FakeClock()
    with Engine(store_url, clock=clock) as engine, Engine(store_url, clock=clock) as producer:
        producer.register(wf)
        run = engine.start(wf, Ticket(id="t1"))
        engine.send(run.id, "note", {"n": 1}, buffer=True)
        outcome: list[object] = []
        sending = threading.Thread(
            target=lambda: outcome.append(producer.send(run.id, "note", {"n": 2}, buffer=True))
        )
        sending.start()
        engine.send(run.id, "go")
        engine.run_until_idle()  # the run takes note 1: room for note 2
        sending.join(timeout=30)
        assert not sending.is_alive() and [r.status for r in outcome] == ["buffered"]  # type: ignore[attr-defined]
        assert engine.get(run.id).context.notes == [1] and kept(engine, run.id) == [2]


def order_like(name: str, **bounds: Any) -> Workflow:
    wf = Workflow(name, context=Ticket, key="id", **bounds)

    @wf.step(initial=True, next="done")
    def work(ctx: Ticket) -> None:
        return None

    wf.final("done")
    return wf


def test_queue__reject_newest_refuses_the_start(engine: Engine) -> None:
    wf = order_like("q-reject", max_queued=2)
    first = engine.start(wf, Ticket(id="a"))
    engine.start(wf, Ticket(id="b"))
    with pytest.raises(QueueFull, match=r"2 runs wait to start \(max_queued=2"):
        engine.start(wf, Ticket(id="c"))
    assert engine.start(wf, Ticket(id="a")).id == first.id  # a taken key still returns its run
    assert len(engine.runs()) == 2
    engine.run_until_idle()
    engine.start(wf, Ticket(id="c"))  # room again once they have started
    assert len(engine.runs()) == 3


def test_queue__start_many_honours_the_bound_too(engine: Engine) -> None:
    """``start_many`` (and ``flowloop start --contexts``) created every run in batches,
    past ``max_queued``. It starts them one at a time under the bound now: those before a
    refusal stay, the error says how many; a taken key still returns its run."""
    wf = order_like("q-many", max_queued=2)
    seen: list[tuple[int, int]] = []
    with pytest.raises(
        QueueFull,
        match=r"max_queued=2.*\(2 run\(s\) of 3 were created before it, 0 found by their key\)",
    ):
        engine.start_many(wf, [Ticket(id=k) for k in "abc"], progress=lambda *p: seen.append(p))
    assert sorted(r.context.id for r in engine.runs()) == ["a", "b"]  # type: ignore[attr-defined]
    assert seen == [(1, 3), (2, 3)]
    again = engine.start_many(wf, [Ticket(id="a"), Ticket(id="b")])
    assert (again.created, len(engine.runs())) == (0, 2)
    dropping = order_like("q-many-drop", max_queued=2, queue_overflow="drop_oldest")
    started = engine.start_many(dropping, [Ticket(id=k) for k in "xyz"])
    assert started.created == 3
    # (One of them dropped: they were created at the same instant, so which is the oldest
    # is the store's to say.)
    statuses = sorted(engine.get(r.id).status for r in started)
    assert statuses == ["scheduled", "scheduled", "stopped"]


def test_queue__drop_oldest_never_stops_a_maps_child(engine: Engine) -> None:
    """A map's children of a workflow with ``max_queued`` and ``drop_oldest`` count as
    queued; a start of that workflow stopped the oldest — a held child, without its join
    hearing of it: the map waited for ever (review). Only a run of its own is dropped; with
    none, the start is refused."""
    from flowloop.testing import TestEngine

    child = Workflow(
        "q-child", context=Ticket, key="id", max_queued=1, queue_overflow="drop_oldest"
    )
    child.wait("hold", on={"go": "done"}, initial=True)
    child.final("done")

    class Batch(BaseModel):
        ids: list[str] = []

    fan = Workflow("q-fan", context=Batch)
    fan.map(
        "each",
        child=child,
        items=lambda ctx: ctx.ids,
        context=lambda ctx, item: Ticket(id=item),
        max_parallel=1,
        on={"done": "done"},
        initial=True,
    )
    fan.final("done")
    store_url = engine.url
    with TestEngine(store_url, workflows=[child, fan]) as tests:
        top = tests.start(fan, Batch(ids=["m1", "m2"])).id
        tests.run_until_idle(idle_horizon=0)  # m1 waits for "go", m2 is held
        with pytest.raises(QueueFull):
            tests.start(child, Ticket(id="direct"))
        queued = {r.context.id: r for r in tests.runs(workflow="q-child")}  # type: ignore[attr-defined]
        assert {run.status for run in queued.values()} == {"scheduled"}
        for item in ("m1", "m2"):
            assert tests.send(queued[item].id, "go").status == "applied"
            tests.run_until_idle(idle_horizon=0)
        assert tests.get(top).status == "succeeded"


def test_queue__drop_oldest_stops_the_oldest_queued_run(engine: Engine) -> None:
    wf = order_like("q-drop", max_queued=2, queue_overflow="drop_oldest")
    ids = []
    for k in "abc":
        ids.append(engine.start(wf, Ticket(id=k)).id)
        engine.clock.advance(1)  # type: ignore[attr-defined]
    assert [engine.get(i).status for i in ids] == ["stopped", "scheduled", "scheduled"]
    assert engine.get(ids[0]).reason == "dropped: max_queued=2"
    assert engine.replay(ids[0]).matches


def test_queue__block_gives_up_after_the_timeout(engine: Engine) -> None:
    wf = order_like("q-block", max_queued=1, queue_overflow="block", overflow_timeout=0.2)
    engine.start(wf, Ticket(id="a"))
    with pytest.raises(QueueFull, match=r"waited 0\.\d+s for room"):
        engine.start(wf, Ticket(id="b"))


@pytest.mark.parametrize(
    ("bounds", "message"),
    [
        ({"max_inbox": 0}, r"max_inbox=0 must be an integer >= 1"),
        ({"max_queued": "10"}, r"max_queued='10' must be an integer"),
        ({"inbox_overflow": "drop_newest"}, r"inbox_overflow='drop_newest' must be one of"),
        ({"queue_overflow": None}, r"queue_overflow=None must be one of"),
        ({"overflow_timeout": -1}, r"overflow_timeout=-1 must be a duration >= 0"),
    ],
)
def test_bounds__bad_values_fail_at_definition(bounds: dict[str, Any], message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        Workflow("bad", context=Ticket, **bounds)


def test_backpressure__visible_in_status_and_metrics(store_url: str, engine: Engine) -> None:
    from click.testing import CliRunner
    from prometheus_client import generate_latest

    from flowloop import backpressure_metrics
    from flowloop.cli import cli
    from flowloop.metrics import Metrics
    from flowloop.store.admission import AdmissionStoreMixin

    inbox = ticket_workflow("shown-inbox", max_inbox=1, inbox_overflow="drop_oldest")
    run = engine.start(inbox, Ticket(id="t1"))
    for n in (1, 2, 3):
        engine.send(run.id, "note", {"n": n}, buffer=True)
    queue = order_like("shown-queue", max_queued=1, queue_overflow="drop_oldest")
    engine.start(queue, Ticket(id="a"))
    engine.clock.advance(1)  # type: ignore[attr-defined]
    engine.start(queue, Ticket(id="b"))
    shown = CliRunner().invoke(cli, ["status", "--db", store_url], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert (
        "backpressure shown-inbox: 0 run(s) waiting to start, 1 kept event(s) (at most 1 on one "
        "run); dropped: 2 kept event(s), 0 queued run(s)"
    ) in shown.output
    assert "backpressure shown-queue: 1 run(s) waiting to start, 0 kept event(s)" in shown.output
    metrics = Metrics()
    assert isinstance(engine.store, AdmissionStoreMixin)
    backpressure_metrics.track(metrics.registry, engine.store.backpressure_usage)
    text = generate_latest(metrics.registry).decode()
    assert 'flowloop_backpressure_dropped_total{what="event",workflow="shown-inbox"} 2.0' in text
    assert 'flowloop_backpressure_dropped_total{what="run",workflow="shown-queue"} 1.0' in text
    assert 'flowloop_inbox_kept_max{workflow="shown-inbox"} 1.0' in text
    assert 'flowloop_runs_queued{workflow="shown-queue"} 1.0' in text
    # A finished run's events are never taken: they were counted as kept for ever (an
    # alert on the gauge never cleared).
    engine.stop(run.id)
    shown = CliRunner().invoke(cli, ["status", "--db", store_url], env={"COLUMNS": "200"})
    assert "backpressure shown-inbox: 0 run(s) waiting to start, 0 kept event(s)" in shown.output
    text = generate_latest(metrics.registry).decode()
    assert 'flowloop_inbox_kept{workflow="shown-inbox"} 1.0' not in text


def test_queue__bound_holds_for_engines_starting_at_once(store_url: str) -> None:
    clock = FakeClock()
    wf = order_like("q-race", max_queued=6)
    engines = [Engine(store_url, clock=clock) for _ in range(4)]
    gate = threading.Barrier(len(engines))
    outcomes: list[str] = []

    def starter(engine: Engine, base: int) -> None:
        gate.wait()
        for n in range(5):
            try:
                engine.start(wf, Ticket(id=f"{base}-{n}"))
                outcomes.append("created")
            except QueueFull:
                outcomes.append("refused")

    threads = [threading.Thread(target=starter, args=(e, i)) for i, e in enumerate(engines)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(outcomes) == 20 and outcomes.count("created") == 6
        assert len(engines[0].runs()) == 6
    finally:
        for engine in engines:
            engine.close()
