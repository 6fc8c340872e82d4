"""Versions of one small workflow for the deploy tests (issue 16).

``order`` v1: ``reserve -> charge -> confirm (wait, timeout) -> ship -> done``; the context
is ``OrderV1(order_id)``. The later versions change exactly one thing each:

- ``added_field(migrated=True)``: ``OrderV2`` adds a required ``currency``; the upcaster
  1->2 fills it in (``context_version=2``);
- ``added_field(migrated=False)``: the same field, no upcaster (contexts do not validate);
- ``renamed_state()``: ``charge`` is called ``bill`` in v2 (``migrates_from={1: {"charge":
  "bill"}}``);
- ``removed_state()``: ``confirm`` is gone (``charge`` goes straight to ``ship``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from flowloop import Retry, Step, Workflow

KILL_ENV = "DEPLOYKIT_KILL"
KILL_ORDER = "killed-in-charge"
WAIT_TIMEOUT_S = 3600.0
SLEEP_S = 600.0


class OrderV1(BaseModel):
    order_id: str
    trail: list[str] = []
    sleep: bool = False
    """The first step sleeps SLEEP_S before ``charge`` (a sleeping run)."""
    fail_reserve: int = 0
    """How many attempts of ``reserve`` fail with a long backoff (a retrying run)."""


class OrderV2(OrderV1):
    currency: str


def v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    """Pure: a version-1 context as a version-2 one (orders were all in euros)."""
    return {**data, "currency": "EUR"}


def order(
    *,
    version: int = 1,
    context: type[BaseModel] = OrderV1,
    context_version: int = 1,
    migrate: dict[int, Any] | None = None,
    charge_name: str = "charge",
    with_confirm: bool = True,
    migrates_from: dict[int, dict[str, str]] | None = None,
) -> Workflow:
    wf = Workflow(
        "order",
        context=context,
        version=version,
        context_version=context_version,
        migrate=migrate,
        migrates_from=migrates_from,
    )

    @wf.step(
        initial=True,
        next=charge_name,
        retry=Retry(attempts=3, backoff="fixed", base=500, cap=500),
    )
    def reserve(ctx: Any, step: Step) -> Any:
        if step.attempt <= ctx.fail_reserve:
            raise ConnectionError("stock service busy")
        ctx.trail.append(f"reserve@v{version}")
        return step.sleep(SLEEP_S) if ctx.sleep else None

    @wf.step(name=charge_name, next="confirm" if with_confirm else "ship")
    def charge(ctx: Any) -> None:
        if ctx.order_id == KILL_ORDER and os.environ.get(KILL_ENV) == "1":
            os.kill(os.getpid(), signal.SIGKILL)  # the worker dies inside the step
        ctx.trail.append(f"{charge_name}@v{version}")

    if with_confirm:
        wf.wait("confirm", on={"confirmed": "ship"}, timeout=WAIT_TIMEOUT_S, on_timeout="ship")

    @wf.step(next="done")
    def ship(ctx: Any) -> None:
        ctx.trail.append(f"ship@v{version}")

    wf.final("done")
    return wf


def added_field(*, migrated: bool) -> Workflow:
    return order(
        version=2,
        context=OrderV2,
        context_version=2,
        migrate={1: v1_to_v2} if migrated else None,
    )


def renamed_state() -> Workflow:
    return order(version=2, charge_name="bill", migrates_from={1: {"charge": "bill"}})


def removed_state() -> Workflow:
    return order(version=2, with_confirm=False)


def run_killed_in_charge(url: str) -> str:
    """A real worker process (v1) that is SIGKILLed inside ``charge``: the run it leaves is
    ``running`` with a dead owner (interrupted). Returns its id."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[2]);"
        "from deploykit import OrderV1, KILL_ORDER, order;"
        "from flowloop import Engine;"
        "e = Engine(sys.argv[1], workflows=[order()]);"
        "run = e.start(e.workflow('order'), OrderV1(order_id=KILL_ORDER));"
        "print(run.id, flush=True);"
        "e.run_until_idle()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, url, str(Path(__file__).resolve().parent)],
        env={**os.environ, KILL_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    return done.stdout.split()[0]
