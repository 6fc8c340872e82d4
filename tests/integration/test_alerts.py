"""Alerts from a real worker to real sinks: every source (a run failed, an interrupted
non-idempotent step, a loop paused after max_failures, a loop that keeps skipping slots, a
lost lease) reaches an HTTP webhook on 127.0.0.1 as JSON; a shell command and a Python
callable get the same alert; a failing sink never breaks the worker."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from loopkit import SteppedClock, drive, until, wait_for
from pydantic import BaseModel
from storekit import dead_owner

from flowloop import Engine, FakeClock, Retry, Workflow
from flowloop import journal as j
from flowloop.alerts import (
    Alert,
    Alerts,
    AlertSinkError,
    at_least,
    command_sink,
    import_sink,
    webhook_sink,
)
from flowloop.errors import ConfigError
from flowloop.journal import JournalEvent
from flowloop.loops import Iteration, Loop
from flowloop.store import Boundary, Fence
from flowloop.worker import Worker

T0 = 1_800_000_000.0
WAIT_S = 10.0


class Hook:
    """A webhook receiver on 127.0.0.1: keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.status = 204
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                assert self.headers["Content-Type"] == "application/json"
                hook.bodies.append(json.loads(self.rfile.read(length)))
                self.send_response(hook.status)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/alerts"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def received(self, what: str) -> list[dict[str, Any]]:
        return [body for body in self.bodies if body["what"] == what]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook() -> Iterator[Hook]:
    receiver = Hook()
    yield receiver
    receiver.close()


def alert(**fields: Any) -> Alert:
    base: dict[str, Any] = {
        "level": "critical",
        "what": "run failed",
        "subject": "r1",
        "message": "order failed in state charge (error)",
        "error": "ValueError: bad",
        "hint": "flowloop history r1",
    }
    return Alert(**{**base, **fields})


async def run_worker(worker: Worker, body: Callable[[], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await asyncio.sleep(0)
        await body()
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


class Order(BaseModel):
    fail: bool = False


def order() -> Workflow:
    wf = Workflow("order", context=Order)

    @wf.step(initial=True, next="ship", retry=Retry(attempts=1))
    def charge(ctx: Order) -> None:
        if ctx.fail:
            raise ValueError("card declined")

    @wf.step(next="done", idempotent=False)
    def ship(ctx: Order) -> None: ...

    wf.final("done")
    return wf


# -- each source, to the webhook ---------------------------------------------------------------


def test_alert__run_failed_reaches_the_webhook(sqlite_url: str, hook: Hook) -> None:
    with Engine(sqlite_url, clock=FakeClock(T0), poll_seconds=0.05) as engine:
        wf = order()
        run_id = engine.start(wf, {"fail": True}).id
        engine.start(wf, {})  # succeeds: no alert

        async def body() -> None:
            await until(lambda: engine.get(run_id).status == "failed", what="the failure")
            await until(lambda: hook.received("run failed"), what="the webhook call")

        asyncio.run(
            run_worker(
                Worker(engine, grace=1.0, alerts=Alerts([webhook_sink(hook.url)], background=True)),
                body,
            )
        )

    (body,) = hook.bodies
    assert body["level"] == "critical"
    assert body["what"] == "run failed"
    assert body["subject"] == run_id
    assert body["error"] == "ValueError: card declined"
    assert body["hint"] == f"flowloop history {run_id}"
    assert body["message"] == "order failed in state charge (error)"
    assert body["data"]["workflow"] == "order" and body["data"]["state"] == "charge"
    assert isinstance(body["at"], float)


def test_alert__interrupted_non_idempotent_step_says_so(sqlite_url: str, hook: Hook) -> None:
    with Engine(sqlite_url, clock=FakeClock(T0), poll_seconds=0.05) as engine:
        wf = order()
        engine.register(wf)
        # A run whose worker died while `ship` (not idempotent) ran.
        new = engine._new_run(
            wf, {}, key=None, idempotency_key=None, priority=0, run_at=None, owner=dead_owner()
        )
        engine.store.create_run(new)
        run_id = new.record.id
        stored = engine.store.get_run(run_id)
        assert stored is not None
        # Move it to `ship` as its dead worker would have: charge succeeded, ship started.
        record = stored.record
        done = JournalEvent(
            run_id=run_id,
            seq=3,
            kind=j.STEP_SUCCEEDED,
            at=T0,
            state="charge",
            attempt=1,
            event="next",
            next_state="ship",
            context="{}",
            duration=0.1,
            data={},
        )
        started = JournalEvent(
            run_id=run_id, seq=4, kind=j.STEP_STARTED, at=T0, state="ship", attempt=1
        )
        after = j.apply(j.apply(record, done), started)
        assert engine.store.write(
            [
                Boundary(
                    events=[done, started],
                    record=after,
                    fence=Fence(stored.owner, stored.lease_epoch),
                )
            ]
        )[0]

        async def body() -> None:
            await until(lambda: engine.get(run_id).status == "failed", what="the recovery")
            await until(lambda: hook.bodies, what="the webhook call")

        asyncio.run(
            run_worker(
                Worker(engine, grace=1.0, alerts=Alerts([webhook_sink(hook.url)], background=True)),
                body,
            )
        )
        assert engine.get(run_id).reason == "interrupted"

    (body,) = hook.bodies
    assert (body["level"], body["what"], body["subject"]) == (
        "critical",
        "interrupted step (not idempotent)",
        run_id,
    )
    assert "ship was cut off" in body["message"]
    assert body["hint"] == f"flowloop history {run_id}"
    assert body["error"].startswith("Interrupted: its worker went away during this step")
    assert "not idempotent, so not re-run" in body["error"]


def test_alert__loop_paused_after_max_failures(sqlite_url: str, hook: Hook) -> None:
    clock = SteppedClock(T0)

    async def broken(it: Iteration) -> None:
        raise ConnectionError("feed unreachable")

    async def body() -> None:
        await drive(clock, 30, step=5)
        await until(lambda: hook.received("loop paused"), what="the webhook call")

    with Engine(sqlite_url, clock=clock) as engine:
        loop = Loop("feed", broken, every=10, max_failures=2)
        asyncio.run(
            run_worker(
                Worker(
                    engine,
                    [loop],
                    grace=1.0,
                    alerts=Alerts([webhook_sink(hook.url)], background=True),
                ),
                body,
            )
        )
        assert engine.loop("feed").status == "paused"

    (body,) = hook.received("loop paused")
    assert body["level"] == "critical"
    assert body["subject"] == "feed"
    assert body["message"] == "2 consecutive failures (max_failures=2)"
    assert body["error"] == "ConnectionError: feed unreachable"
    assert body["hint"] == "flowloop loops feed"


def test_alert__loop_that_keeps_skipping_slots(sqlite_url: str, hook: Hook) -> None:
    clock = SteppedClock(T0)

    async def slow(it: Iteration) -> None:
        if it.number == 1:
            clock.advance(105)  # a 10 s loop whose iteration took 105 s: 10 slots skipped

    async def body() -> None:
        await drive(clock, 5, step=5)
        await until(lambda: hook.received("loop iterations skipped"), what="the webhook call")

    with Engine(sqlite_url, clock=clock) as engine:
        loop = Loop("slow", slow, every=10)
        asyncio.run(
            run_worker(
                Worker(
                    engine,
                    [loop],
                    grace=1.0,
                    alerts=Alerts([webhook_sink(hook.url)], background=True),
                ),
                body,
            )
        )

    (body,) = hook.received("loop iterations skipped")
    assert (body["level"], body["subject"]) == ("warning", "slow")
    assert body["message"].startswith("10 slots skipped")
    assert body["hint"] == "flowloop loops slow"


def test_alert__worker_that_lost_a_lease(sqlite_url: str, hook: Hook) -> None:
    hold = threading.Event()

    class Ctx(BaseModel):
        pass

    wf = Workflow("held", context=Ctx)

    @wf.step(initial=True, next="done")
    def wait(ctx: Ctx) -> None:
        hold.wait(WAIT_S)

    wf.final("done")

    with Engine(sqlite_url, clock=FakeClock(T0), poll_seconds=0.05) as engine:
        run_id = engine.start(wf, {}).id

        async def body() -> None:
            await until(lambda: engine.get(run_id).status == "running", what="the step")
            engine.store.expire_leases([engine.worker_id])
            assert engine.store.claim_interrupted(worker="thief", limit=1, lease_seconds=30)
            hold.set()
            await until(lambda: hook.received("lease lost"), what="the webhook call")

        asyncio.run(
            run_worker(
                Worker(engine, grace=1.0, alerts=Alerts([webhook_sink(hook.url)], background=True)),
                body,
            )
        )
        worker_id = engine.worker_id

    (body,) = hook.received("lease lost")
    assert (body["level"], body["subject"]) == ("warning", run_id)
    assert body["message"].startswith(f"worker {worker_id} ")
    assert body["hint"] == f"flowloop status {run_id}"
    assert body["data"] == {"kind": "run", "worker": worker_id}


# -- the sinks -------------------------------------------------------------------------------


def test_command_sink__alert_on_stdin_and_in_the_environment(tmp_path: Path) -> None:
    out = tmp_path / "alert.json"
    env_out = tmp_path / "alert.env"
    sink = command_sink(
        f'cat > {out} && printf "%s|%s|%s" "$FLOWLOOP_ALERT_LEVEL" "$FLOWLOOP_ALERT_SUBJECT" '
        f'"$FLOWLOOP_ALERT_HINT" > {env_out}'
    )
    sink(alert())
    body = json.loads(out.read_text())
    assert (body["what"], body["subject"], body["error"]) == ("run failed", "r1", "ValueError: bad")
    assert env_out.read_text() == "critical|r1|flowloop history r1"


def test_command_sink__failure_and_timeout_raise_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(AlertSinkError) as raised:
        command_sink([sys.executable, "-c", "import sys; sys.exit('pager down')"])(alert())
    assert "exited 1: pager down" in str(raised.value)
    with pytest.raises(AlertSinkError) as raised:
        command_sink("sleep 5", timeout=0.2)(alert())
    assert "took longer than 0.2s" in str(raised.value)


def test_webhook_sink__error_status_raises(hook: Hook) -> None:
    hook.status = 500
    with pytest.raises(AlertSinkError) as raised:
        webhook_sink(hook.url)(alert())
    assert "500" in str(raised.value)
    with pytest.raises(ConfigError):
        webhook_sink("ftp://example.com/x")


def test_alerts__python_callable_and_level_filter(hook: Hook) -> None:
    got: list[Alert] = []
    alerts = Alerts([got.append, at_least("critical", webhook_sink(hook.url))])
    alerts(alert(level="warning", what="lease lost"))
    alerts(alert())
    assert [a.what for a in got] == ["lease lost", "run failed"]
    assert [b["what"] for b in hook.bodies] == ["run failed"]
    assert import_sink("flowloop.alerts:log_sink").__name__ == "log_sink"
    with pytest.raises(ConfigError):
        import_sink("flowloop.alerts:nope")


def test_alerts__failing_sink_is_logged_and_the_others_still_get_it(
    hook: Hook, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(_: Alert) -> None:
        raise RuntimeError("sink bug")

    alerts = Alerts([broken, webhook_sink(hook.url)], background=True)
    alerts(alert())
    assert alerts.flush(WAIT_S)
    alerts.close()
    assert [b["subject"] for b in hook.bodies] == ["r1"]
    assert (alerts.sent, alerts.failed) == (1, 1)
    assert "alert sink" in caplog.text and "sink bug" in caplog.text


def test_alerts__background_delivery_keeps_order(hook: Hook) -> None:
    alerts = Alerts([webhook_sink(hook.url)], background=True)
    for n in range(5):
        alerts(alert(subject=f"r{n}"))
    wait_for(lambda: len(hook.bodies) == 5, what="five webhook calls")
    alerts.close()
    assert [b["subject"] for b in hook.bodies] == [f"r{n}" for n in range(5)]
