"""A real dashboard server for tests: uvicorn on 127.0.0.1 and a free port, in a thread,
waited on by polling the port; and a headless Chromium (Debian's) driven by Playwright."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

import pytest
import storekit
import uvicorn
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Retry, Step, Workflow
from flowloop import journal as j
from flowloop.engine import RunInfo
from flowloop.store import Boundary, Fence
from flowloop.store.sql import SQLStore

HOST = "127.0.0.1"
T = TypeVar("T")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Serve ``app`` until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"uvicorn:{port}", daemon=True)
    thread.start()
    try:
        poll(lambda: _listening(port), timeout=20, every=0.02, what=f"uvicorn on port {port}")
        yield f"http://{HOST}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


WAIT_MS = 15_000
"""How long a page condition may take before a browser test fails."""


@contextmanager
def chromium() -> Iterator[Any]:
    """Debian's chromium, headless, driven by Playwright: the test skips without it, or
    fails in CI (where `make test` installed it)."""
    executable = chromium_path()
    if executable is None:
        message = "Debian's chromium is not installed (make system installs it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


def new_page(browser: Any) -> Any:
    """A desktop-sized page whose conditions wait up to :data:`WAIT_MS`."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(WAIT_MS)
    return page


# -- workflows the dashboard tests run -------------------------------------------------------

HOSTILE = '<script>alert(1)</script>"]; [label="x'
"""A name that breaks HTML, DOT and SVG unless each escapes it."""


class Parcel(BaseModel):
    parcel_id: str = "P1"
    weight: int = 1
    note: str = ""
    packed: bool = False
    fail_at: str = ""


parcel = Workflow("parcel", context=Parcel, key="parcel_id")


@parcel.step(initial=True, next="pack")
def weigh(ctx: Parcel, step: Step) -> None:
    ctx.weight += 1


@parcel.step(next="send", retry=Retry(attempts=1))
def pack(ctx: Parcel, step: Step) -> None:
    if ctx.fail_at == "pack":
        raise ValueError("the box is torn")
    ctx.packed = True


@parcel.step(next="sent")
def send(ctx: Parcel, step: Step) -> None:
    ctx.note = "on its way"


parcel.final("sent")


def parcels(url: str, n: int, *, failing: int = 0) -> list[RunInfo]:
    """Start and finish ``n`` parcel runs (the first ``failing`` fail in ``pack``)."""
    with Engine(url, workflows=[parcel]) as engine:
        started = [
            engine.start(parcel, Parcel(parcel_id=f"P{i}", fail_at="pack" if i < failing else ""))
            for i in range(n)
        ]
        engine.run_until_idle()
        return [engine.get(run.id) for run in started]


# -- a workflow the test moves one step at a time --------------------------------------------

GATES: dict[str, threading.Event] = {}
"""One event per state of ``gated``: its step returns once the test sets it."""
GATE_WAIT_S = 60.0


class Ticket(BaseModel):
    ticket_id: str = "T1"
    passed: list[str] = []


def _through(state: str, ctx: Ticket) -> None:
    if not GATES.setdefault(state, threading.Event()).wait(GATE_WAIT_S):
        raise TimeoutError(f"the test never opened the gate of {state}")
    ctx.passed.append(state)


gated = Workflow("gated", context=Ticket, key="ticket_id")


@gated.step(initial=True, next="second", retry=Retry(attempts=1))
def first(ctx: Ticket, step: Step) -> None:
    _through("first", ctx)


@gated.step(next="third", retry=Retry(attempts=1))
def second(ctx: Ticket, step: Step) -> None:
    _through("second", ctx)


@gated.step(next="done", retry=Retry(attempts=1))
def third(ctx: Ticket, step: Step) -> None:
    _through("third", ctx)


gated.final("done")


def open_gates() -> None:
    for state in ("first", "second", "third"):
        GATES.setdefault(state, threading.Event()).set()


def start_gated(url: str, key: str) -> tuple[Engine, threading.Thread, RunInfo]:
    """A ``gated`` run, and an engine driving it to the end in a thread, one gate at a
    time (stop it: open_gates, then join the thread)."""
    GATES.clear()
    engine = Engine(url, workflows=[gated])
    run = engine.start(gated, Ticket(ticket_id=key))
    thread = threading.Thread(target=engine.run_until_idle, name="gated-worker", daemon=True)
    thread.start()
    return engine, thread, run


def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a fresh thread: Playwright's sync API keeps an asyncio
    loop running in the test's thread, where the engine's ``asyncio.run`` cannot start."""
    box: list[Any] = []

    def call() -> None:
        try:
            box.append((True, fn(*args, **kwargs)))
        except BaseException as error:
            box.append((False, error))

    thread = threading.Thread(target=call, name="off-loop")
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    result: T = value
    return result


# -- hostile names ---------------------------------------------------------------------------

SCRIPT_STATE = "</svg><script>alert(3)</script>"
HOSTILE_WORKFLOW = 'wf"><script>alert(5)</script>'
HOSTILE_NOTE = "<img src=x onerror=alert(2)>"
HOSTILE_ERROR = "<script>alert(4)</script>"


def hostile_run(url: str) -> str:
    """A failed run whose workflow, states, event, key, context and error are hostile
    text. Definitions refuse such state names, so it is written straight through the store,
    as a database written by another tool (or an older flowloop) could hold it; the
    dashboard draws it from the stored definition."""
    fingerprint = "h" * 16
    structure = {
        "name": HOSTILE_WORKFLOW,
        "initial": HOSTILE,
        "finals": ["end"],
        "states": {
            HOSTILE: {"kind": "step", "on": {HOSTILE: SCRIPT_STATE}},
            SCRIPT_STATE: {"kind": "step", "on": {"next": "end"}},
        },
    }
    store = SQLStore(url)
    try:
        store.save_definition(fingerprint, HOSTILE_WORKFLOW, 1, json.dumps(structure))
        created = storekit.new_run(
            workflow=HOSTILE_WORKFLOW,
            key=HOSTILE,
            state=HOSTILE,
            context=json.dumps({"note": HOSTILE_NOTE}),
            owner="w1",
        )
        created = replace(
            created,
            events=[
                replace(e, data={**e.data, "fingerprint": fingerprint}) for e in created.events
            ],
        )
        created = replace(created, record=replace(created.record, fingerprint=fingerprint))
        stored, _ = store.create_run(created)
        record = stored.record
        events = []
        for kind, fields in (
            (
                j.STEP_SUCCEEDED,
                {
                    "state": HOSTILE,
                    "attempt": 1,
                    "event": HOSTILE,
                    "next_state": SCRIPT_STATE,
                    "context": json.dumps({"note": HOSTILE_NOTE + " &amp; <b>bold</b>"}),
                    "duration": 0.01,
                },
            ),
            (j.STEP_STARTED, {"state": SCRIPT_STATE, "attempt": 1}),
            (
                j.STEP_FAILED,
                {
                    "state": SCRIPT_STATE,
                    "attempt": 1,
                    "error_type": "RuntimeError",
                    "error_message": HOSTILE_ERROR,
                    "traceback": f"Traceback\n  RuntimeError: {HOSTILE_ERROR}",
                    "retryable": False,
                    "duration": 0.02,
                },
            ),
        ):
            entry = storekit.event(record, kind, **fields)
            events.append(entry)
            record = j.apply(record, entry)
        boundary = Boundary(
            events=events, record=record, fence=Fence("w1", stored.lease_epoch), release=True
        )
        assert store.write([boundary]) == [True]
        return record.id
    finally:
        store.close()


# -- big runs --------------------------------------------------------------------------------


def written_run(url: str, key: str, contexts: list[str], *, first: str = '{"n":0}') -> str:
    """A running ``parcel`` run whose journal holds one step per context of ``contexts``
    (a ``step_succeeded`` with it and the next ``step_started``), written straight through
    the store in few commits: 10,000 entries in a second."""
    store = SQLStore(url)
    try:
        stored, _ = store.create_run(
            storekit.new_run(workflow="parcel", key=key, state="weigh", owner="w1", context=first)
        )
        record, fence = stored.record, Fence("w1", stored.lease_epoch)
        events: list[j.JournalEvent] = []
        for context in contexts:
            done = storekit.event(
                record,
                j.STEP_SUCCEEDED,
                state=record.state,
                event="next",
                next_state=record.state,
                context=context,
                attempt=record.attempt,
                worker="w1",
            )
            record = j.apply(record, done)
            started = storekit.event(record, j.STEP_STARTED, state=record.state, attempt=1)
            record = j.apply(record, started)
            events += [done, started]
            if len(events) >= 1000 or context is contexts[-1]:
                assert store.write([Boundary(events=events, record=record, fence=fence)]) == [True]
                events = []
        return record.id
    finally:
        store.close()
