"""A real dashboard server for tests: uvicorn on 127.0.0.1 and a free port, in a thread,
waited on by polling the port; and a headless Chromium (Debian's) driven by Playwright."""

from __future__ import annotations

import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, Retry, Step, Workflow
from flowloop.engine import RunInfo

HOST = "127.0.0.1"
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
