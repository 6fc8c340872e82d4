"""Events sent at once from several processes to one run, on SQLite and PostgreSQL: every
one journaled once, each sender's in the order it sent them, no lost update of the context;
the same dedupe key from several processes has effect once. And `flowloop send` / `status`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from waitkit import (
    ALL,
    assert_journal_sound,
    collector,
    ctx,
    gatherer,
    inbox_rows,
    items_plan,
    received,
    send_from_processes,
    sender_command,
    wait_until,
    workers,
)

from flowloop import Engine
from flowloop.cli import cli, main
from flowloop.engine import RunInfo
from flowloop.loader import load_target

SENDERS = 3
PER_SENDER = 12
START_IN_S = 1.5
"""Senders start this long after being spawned (imports take ~1 s), all at the same instant."""
ORDER_FILE = str(Path(__file__).resolve().parents[2] / "workflows" / "order.py")


def dup(run_id: str) -> dict[str, Any]:
    """The same event with the same dedupe key, sent by every sender."""
    return {
        "run": run_id,
        "event": "item",
        "payload": {"value": "dup"},
        "dedupe_key": "dup",
        "buffer": True,
    }


def interleave(*plans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for group in zip(*plans, strict=True) for entry in group]


def check_collected(engine: Engine, url: str, run_id: str, prefixes: list[str]) -> list[str]:
    """Every item once; each sender's in its order; each event_received added exactly its
    own item to the context the previous one left (no lost update); inbox all consumed."""
    info = engine.get(run_id)
    items: list[str] = ctx(info).items
    expected = ["dup"] + [f"{p}{i:03d}" for p in prefixes for i in range(PER_SENDER)]
    assert sorted(items) == sorted(expected), "an item is missing or taken twice"
    for prefix in prefixes:
        mine = [value for value in items if value.startswith(prefix)]
        assert mine == sorted(mine), f"sender {prefix} was journaled out of order: {mine}"
    seen: list[str] = []
    taken = received(engine, run_id, "item")
    for event in taken:
        after = json.loads(event.context or "{}")["items"]
        assert after[:-1] == seen, f"seq {event.seq} lost an update"
        seen = after
    assert seen == items and len(taken) == len(expected)
    rows = [row for row in inbox_rows(url, run_id) if row.event == "item"]
    assert sorted(row.consumed_seq for row in rows) == [event.seq for event in taken]
    assert_journal_sound(engine, run_id)
    return items


def test_send__events_from_several_processes_are_all_journaled_in_order_with_no_lost_update(
    store_url: str, tmp_path: Path
) -> None:
    """The same senders race on two runs at once:

    * ``collector``: collect (wait) --item--> take (a step a worker process runs) --> collect,
      items sent with buffer=True (kept while the run is in `take`);
    * ``gatherer``: gather --item--> gather, sent directly: every send a fenced write racing
      the other senders'.

    Each sender also sends one event under a dedupe key all senders share."""
    with Engine(store_url, workflows=ALL) as engine, workers(store_url, tmp_path) as start:
        worker = start()
        bag = engine.start(collector, {}).id
        heap = engine.run(gatherer, {}).id
        wait_until(
            lambda: engine.get(bag).state == "collect",
            timeout=20,
            what="the worker opens the bag",
            diagnose=worker.output,
        )
        prefixes = [f"p{k}-" for k in range(SENDERS)]
        start_at = time.time() + START_IN_S
        results = send_from_processes(
            [
                sender_command(
                    store_url,
                    [
                        dup(bag),
                        dup(heap),
                        *interleave(
                            items_plan(bag, prefix, PER_SENDER, buffer=True),
                            items_plan(heap, prefix, PER_SENDER, buffer=False),
                        ),
                    ],
                    start_at=start_at,
                )
                for prefix in prefixes
            ]
        )
        to_bag = [r for result in results for r in result[:1] + result[2::2]]
        to_heap = [r for result in results for r in result[1:2] + result[3::2]]
        total = SENDERS * PER_SENDER + 1
        assert to_bag.count("duplicate") == SENDERS - 1
        assert set(to_bag) <= {"applied", "buffered", "duplicate"}
        assert to_heap.count("duplicate") == SENDERS - 1
        assert to_heap.count("applied") == total

        def settled() -> RunInfo | None:
            info = engine.get(bag)
            done = ctx(info).taken == total
            return info if done and info.state == "collect" and info.owner is None else None

        wait_until(
            settled, timeout=60, what=f"the worker takes all {total} items", diagnose=worker.output
        )
        for run_id in (bag, heap):
            items = check_collected(engine, store_url, run_id, prefixes)
            assert items.count("dup") == 1
            assert engine.send(run_id, "finish").run.state == "done"
            assert_journal_sound(engine, run_id)
        print(
            f"\n{SENDERS} processes x {2 * total} events: to the looping run "
            f"{to_bag.count('applied')} applied at once, {to_bag.count('buffered')} kept; "
            f"to the self-looping wait {to_heap.count('applied')} applied"
        )


# -- the command line --------------------------------------------------------------------------


@pytest.fixture
def orders(store_url: str) -> dict[str, str]:
    """Two large orders (A1, A2) waiting for approval: key → run id."""
    order, _ = load_target(ORDER_FILE)
    with Engine(store_url) as engine:
        ids = {}
        for key in ("A1", "A2"):
            info = engine.run(order, {"order_id": key, "items": [{"sku": "chair", "qty": 3}]})
            assert (info.state, info.key) == ("awaiting_approval", key)
            ids[key] = info.id
    return ids


def flowloop(*args: str) -> Any:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output) if "--json" in args else result.output


def test_cli__send_by_run_id_and_by_business_key_then_status_by_key(
    store_url: str, orders: dict[str, str]
) -> None:
    db = ["--db", store_url]
    sent = flowloop(
        "send",
        orders["A2"],
        "reject",
        "--data",
        '{"by": "bob", "note": "too dear"}',
        "-w",
        ORDER_FILE,
        *db,
        "--json",
    )
    assert sent["result"] == "applied"
    assert (sent["run"]["status"], sent["run"]["state"]) == ("succeeded", "cancelled")
    assert sent["run"]["context"]["cancel_reason"] == "rejected by bob: too dear"

    approve_by_key = (
        "send", "A1", "approve", "--workflow", "order", "--data", '{"by": "ann"}',
        "--dedupe-key", "mail-1", "-w", ORDER_FILE, *db, "--json",
    )  # fmt: skip
    sent = flowloop(*approve_by_key)
    assert sent["result"] == "applied"
    assert (sent["run"]["id"], sent["run"]["state"]) == (orders["A1"], "charge")
    assert sent["run"]["context"]["approved_by"] == "ann"
    again = flowloop(*approve_by_key)  # the same send again: deduplicated
    assert again["result"] == "duplicate"

    [listed] = flowloop("status", "--key", "A1", *db, "--json")["runs"]
    assert (listed["id"], listed["key"], listed["state"]) == (orders["A1"], "A1", "charge")
    table = flowloop("status", "--key", "A1", *db)
    assert orders["A1"] in table and orders["A2"] not in table
    text = flowloop(
        "send", orders["A1"], "approve", "--data", '{"by": "x"}', "--buffer", "-w", ORDER_FILE, *db
    )
    assert "approve: buffered" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["paid"],
            "state 'awaiting_approval' does not accept event 'paid' (it accepts: approve, reject)",
        ),
        (
            ["approve", "--data", '{"note": "hi"}'],
            "payload of event 'approve' is invalid: by: Field required",
        ),
        (["approve", "--data", "{oops"], "--data is not valid JSON"),
    ],
)
def test_cli__send_refused_prints_one_line_and_exits_2(
    store_url: str,
    orders: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "send",
                "A1",
                *args[:1],
                "--workflow",
                "order",
                *args[1:],
                "-w",
                ORDER_FILE,
                "--db",
                store_url,
            ]
        )
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err
