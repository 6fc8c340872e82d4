"""workflows/etl.py on real databases: sample data, rejects, malformed files, upserts,
resuming at the committed byte offset, the inbox loop and the progress display."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import etlkit
import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from etlkit import order, write_csv

from flowloop import Engine, RunInfo, Step
from flowloop.cli import cli
from flowloop.worker import Worker

WAIT_S = 20.0
"""Upper bound of every wait on the loop test (it normally takes well under a second)."""


@pytest.fixture(scope="module")
def etl() -> ModuleType:
    return etlkit.load_etl()


@pytest.fixture
def inbox(tmp_path: Path) -> Path:
    folder = tmp_path / "inbox"
    folder.mkdir()
    return folder


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    """A copy of workflows/data (a test must not write a target next to the repo's data)."""
    folder = tmp_path / "sample"
    shutil.copytree(etlkit.SAMPLE_DIR, folder, ignore=shutil.ignore_patterns("*.db*"))
    return folder


def step(etl: ModuleType, state: str) -> Step:
    return Step(
        run_id="test", workflow="etl", state=state, attempt=1, visit=1, seq=0, worker="test"
    )


def call(etl: ModuleType, ctx: Any, state: str) -> Any:
    return etl.etl.steps[state].fn(ctx, step(etl, state))


def ctx_of(info: RunInfo) -> Any:
    """A run's context (an ``EtlContext``; typed ``Any`` as the module is loaded from a file)."""
    return info.context


def reasons(url: str, file: str) -> dict[int, str]:
    return {row[1]: row[2] for row in etlkit.dump(url)["rejects"] if row[0] == file}


# -- the sample data ----------------------------------------------------------------------


def test_etl__sample_data__loads_orders_and_rejects_bad_rows_and_the_malformed_file(
    etl: ModuleType, sample: Path, sqlite_url: str
) -> None:
    with Engine(sqlite_url) as engine:
        info = engine.run(etl.etl, {"input_dir": str(sample)})
    assert info.status == "succeeded", info.error
    ctx = ctx_of(info)
    assert ctx.loaded == [f"orders_2024-03-0{d}.csv" for d in (1, 2, 3)]
    assert ctx.rejected == ["customers_2024-03-03.csv"]
    assert (ctx.rows_done, ctx.rows_loaded, ctx.rejects) == (46, 40, 7)
    url = ctx.target
    assert url == f"sqlite:///{sample / 'etl_target.db'}"
    target = etlkit.dump(url)
    assert len(target["orders"]) == 39  # 40 good rows, one of them an update of SO-10004
    assert reasons(url, "customers_2024-03-03.csv")[0].startswith(
        "wrong header: missing order_id, ordered_at, sku"
    )
    assert reasons(url, "orders_2024-03-01.csv") == {
        11: "quantity: Input should be greater than 0 (got '-2')",
        14: "email: not an email address (got 'olga.petrova(at)example.ru')",
    }
    day2 = reasons(url, "orders_2024-03-02.csv")
    assert day2[8].startswith("ordered_at: Input should be a valid datetime")
    assert day2[11] == "currency: not one of EUR, USD, GBP (got 'SEK')"
    assert day2[14] == "expected 11 fields, got 10"
    assert reasons(url, "orders_2024-03-03.csv")[13].startswith(
        "quantity: Input should be a valid integer"
    )
    rows = {row[0]: row for row in target["orders"]}
    assert rows["SO-10004"][12] == "shipped"  # day 2 updated day 1's order (upsert)
    # SO-10010 was rejected on day 1 and fixed on day 3.
    assert rows["SO-10010"][13:] == ("orders_2024-03-03.csv", 4)
    assert rows["SO-10042"][6] == "Notebook A5 dotted\n(gift wrapped)"  # a field spanning lines
    assert rows["SO-10003"][10:12] == (3900, 4563)  # 39.00 GBP in cents, and in EUR
    statuses = {row[0]: row[3] for row in target["loaded_files"]}
    assert statuses == {**{f: "loaded" for f in ctx.loaded}, "customers_2024-03-03.csv": "rejected"}


def test_etl__default_context__reads_workflows_data_and_env(
    etl: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("ETL_INPUT", "ETL_TARGET", "ETL_BATCH_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data-home"))
    ctx = etl.EtlContext()
    assert Path(ctx.input_dir) == etlkit.SAMPLE_DIR
    # The sample folder is in the source tree: its target goes to the user's data dir.
    assert ctx.target == f"sqlite:///{tmp_path / 'data-home' / 'flowloop' / 'etl_target.db'}"
    assert ctx.batch_size == 1000
    monkeypatch.setenv("ETL_INPUT", str(tmp_path))
    monkeypatch.setenv("ETL_TARGET", str(tmp_path / "t.db"))
    monkeypatch.setenv("ETL_BATCH_SIZE", "50")
    ctx = etl.EtlContext()
    assert (ctx.input_dir, ctx.target, ctx.batch_size) == (
        str(tmp_path),
        f"sqlite:///{tmp_path / 't.db'}",
        50,
    )
    assert etl.etl.steps["load_batch"].max_visits == etl.MAX_BATCHES_PER_RUN
    assert etl.etl.steps["load_batch"].on == {"more": "load_batch", "eof": "close_file"}


# -- files already loaded -------------------------------------------------------------------


def test_etl__second_run__skips_loaded_files_and_loads_a_changed_one_again(
    etl: ModuleType, inbox: Path, tmp_path: Path
) -> None:
    target = etlkit.sqlite_target(tmp_path)
    context = {"input_dir": str(inbox), "target_url": target, "batch_size": 2}
    write_csv(inbox / "a.csv", [order(n) for n in range(1, 6)])
    write_csv(inbox / "b.csv", [order(n) for n in range(6, 9)])
    etl.run_plain(context)
    first = etlkit.dump(target)

    again = etl.run_plain(context)
    assert (again.skipped, again.files_total, again.rows_done) == (2, 0, 0)
    assert etlkit.dump(target) == first

    os.utime(inbox / "a.csv", ns=(1, 1))  # same bytes, new mtime: recognised by its hash
    touched = etl.run_plain({**context, "trust_mtime": False})
    assert (touched.skipped, touched.files_total) == (2, 0)

    write_csv(inbox / "b.csv", [order(n, status="shipped") for n in range(6, 10)])
    changed = etl.run_plain(context)
    assert changed.loaded == ["b.csv"]
    after = etlkit.dump(target)
    assert len(after["orders"]) == 9
    assert {row[0]: row[12] for row in after["orders"]}["SO-00006"] == "shipped"
    assert [row[0] for row in after["loaded_files"]] == ["a.csv", "b.csv", "b.csv"]


# -- malformed files and bad rows -------------------------------------------------------------

HEADER = ",".join(etlkit.load_generator().HEADER)
GOOD_ROW = ",".join(order(1))


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        pytest.param(b"", r"^empty file \(0 bytes\): nothing to load$", id="empty"),
        pytest.param(b"\n \n", r"^empty file \(only blank lines\)", id="blank"),
        pytest.param(
            f"{HEADER}\n{GOOD_ROW}\n".encode()
            + "SO-00002,2024-03-01T10:00:00Z,C1002,"
            "zoë@example.com,DE,BK-1001,Café,1,1.00,EUR,paid\n".encode("latin-1"),
            r"^not UTF-8: byte 0xEB on line 3 \(byte offset \d+\) is invalid .*re-export",
            id="latin-1",
        ),
        pytest.param(
            f"{HEADER.replace('quantity', 'qty')}\n{GOOD_ROW}\n".encode(),
            r"^wrong header: missing quantity; unexpected qty \(expected order_id,",
            id="wrong-header",
        ),
        pytest.param(
            f"{HEADER},{HEADER.split(',')[0]}\n".encode(),
            r"^wrong header: repeated order_id",
            id="repeated-column",
        ),
    ],
)
def test_etl__malformed_file__one_reject_with_a_clear_reason_and_the_run_goes_on(
    etl: ModuleType, inbox: Path, tmp_path: Path, sqlite_url: str, content: bytes, reason: str
) -> None:
    (inbox / "a_bad.csv").write_bytes(content)
    write_csv(inbox / "b_good.csv", [order(n) for n in range(10, 13)])
    target = etlkit.sqlite_target(tmp_path)
    with Engine(sqlite_url) as engine:
        info = engine.run(etl.etl, {"input_dir": str(inbox), "target_url": target})
    assert info.status == "succeeded", info.error
    assert (ctx_of(info).rejected, ctx_of(info).loaded) == (["a_bad.csv"], ["b_good.csv"])
    rejected = reasons(target, "a_bad.csv")
    assert list(rejected) == [0], rejected
    assert re.search(reason, rejected[0]), rejected[0]
    dumped = etlkit.dump(target)
    assert [row[0] for row in dumped["orders"]] == ["SO-00010", "SO-00011", "SO-00012"]
    assert [(row[0], row[3]) for row in dumped["loaded_files"]] == [
        ("a_bad.csv", "rejected"),
        ("b_good.csv", "loaded"),
    ]


def test_etl__bad_rows__rejected_with_row_and_reason_without_stopping_the_batch(
    etl: ModuleType, inbox: Path, tmp_path: Path
) -> None:
    lines = [
        HEADER,
        ",".join(order(1)),
        ",".join(order(2, quantity="0")),
        ",".join(order(3)[:-1]),  # a field short
        "",  # a blank line is skipped, not rejected
        ",".join(order(4, email="nobody")),
        ",".join(order(5, ordered_at="yesterday", currency="XXX")),
        ",".join(order(6, product='"27"" monitor, matte"')),
        ",".join(order(7, order_id="7")),
        ",".join(order(8, unit_price="9.999")),
        ",".join(order(9, country="de", currency="eur", status="PAID")),  # normalised, fine
        ",".join(order(10)) + ',"unterminated',
    ]
    (inbox / "rows.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    target = etlkit.sqlite_target(tmp_path)
    ctx = etl.run_plain({"input_dir": str(inbox), "target_url": target, "batch_size": 3})
    assert ctx.batches_done == 4 and ctx.rows_done == 10
    got = reasons(target, "rows.csv")
    assert got == {
        3: "quantity: Input should be greater than 0 (got '0')",
        4: "expected 11 fields, got 10",
        6: "email: not an email address (got 'nobody')",
        7: "ordered_at: Input should be a valid datetime or date, input is too short "
        "(got 'yesterday'); currency: not one of EUR, USD, GBP (got 'XXX')",
        9: "order_id: not an order id like SO-10001 (got '7')",
        10: "unit_price: Decimal input should have no more than 2 decimal places (got '9.999')",
        12: "expected 11 fields, got 12",
    }
    rows = {row[0]: row for row in etlkit.dump(target)["orders"]}
    assert sorted(rows) == ["SO-00001", "SO-00006", "SO-00009"]
    assert rows["SO-00006"][6] == '27" monitor, matte'
    assert (rows["SO-00009"][4], rows["SO-00009"][9], rows["SO-00009"][12]) == ("DE", "EUR", "paid")
    raw = {row[1]: row[3] for row in etlkit.dump(target)["rejects"]}
    assert raw[4] == lines[3]


# -- batches: idempotent, resumable at the byte offset --------------------------------------


def _opened(etl: ModuleType, inbox: Path, target: str, batch_size: int) -> Any:
    ctx = etl.EtlContext(input_dir=str(inbox), target_url=target, batch_size=batch_size)
    assert call(etl, ctx, "discover") == "found"
    assert call(etl, ctx, "open_file") == "ready"
    return ctx


def test_etl__rerunning_a_batch__rewrites_the_same_rows_and_rejects(
    etl: ModuleType, inbox: Path, tmp_path: Path
) -> None:
    rows = [order(n, quantity="-1" if n % 4 == 0 else "2") for n in range(1, 21)]
    write_csv(inbox / "a.csv", rows)
    target = etlkit.sqlite_target(tmp_path)
    ctx = _opened(etl, inbox, target, batch_size=8)
    committed = ctx.model_copy(deep=True)
    assert call(etl, ctx, "load_batch") == "more"
    once = etlkit.dump(target)
    assert (len(once["orders"]), len(once["rejects"])) == (6, 2)
    # A crash after the target commit, before the journal's: the batch runs again.
    again = committed.model_copy(deep=True)
    assert call(etl, again, "load_batch") == "more"
    assert etlkit.dump(target) == once
    assert again.offset == ctx.offset and again.line == ctx.line


def test_etl__resume__reads_from_the_committed_byte_offset_not_the_start(
    etl: ModuleType, inbox: Path, tmp_path: Path
) -> None:
    path = write_csv(inbox / "a.csv", [order(n) for n in range(1, 11)])
    target = etlkit.sqlite_target(tmp_path)
    ctx = _opened(etl, inbox, target, batch_size=4)
    assert call(etl, ctx, "load_batch") == "more"
    assert ctx.batch_from == ctx.file_start and ctx.offset > ctx.file_start
    # Scribble over the rows already loaded (same length, so the file size holds): a batch
    # that re-read them would reject them.
    data = path.read_bytes()
    garbage = bytes(b if b == ord("\n") else ord("#") for b in data[ctx.file_start : ctx.offset])
    path.write_bytes(data[: ctx.file_start] + garbage + data[ctx.offset :])
    resumed = etl.EtlContext.model_validate_json(ctx.model_dump_json())  # as the journal has it
    while call(etl, resumed, "load_batch") == "more":
        pass
    assert resumed.file_status == "loaded"
    dumped = etlkit.dump(target)
    assert len(dumped["orders"]) == 10 and dumped["rejects"] == []
    assert resumed.rows_done == 10 and resumed.batches_done == 3


def test_etl__file_changed_while_loading__is_left_for_the_next_run(
    etl: ModuleType, inbox: Path, tmp_path: Path
) -> None:
    write_csv(inbox / "a.csv", [order(n) for n in range(1, 11)])
    target = etlkit.sqlite_target(tmp_path)
    ctx = _opened(etl, inbox, target, batch_size=4)
    assert call(etl, ctx, "load_batch") == "more"
    write_csv(inbox / "a.csv", [order(n, status="shipped") for n in range(1, 13)])
    assert call(etl, ctx, "load_batch") == "eof"
    assert call(etl, ctx, "close_file") == "finished"
    assert ctx.changed == ["a.csv"] and etlkit.dump(target)["loaded_files"] == []
    later = etl.run_plain({"input_dir": str(inbox), "target_url": target})
    assert later.loaded == ["a.csv"]
    dumped = etlkit.dump(target)
    assert len(dumped["orders"]) == 12 and {row[12] for row in dumped["orders"]} == {"shipped"}


def test_etl__batch_budget__later_files_wait_for_the_next_run_in_order(
    etl: ModuleType, inbox: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i, name in enumerate(["a.csv", "b.csv", "c.csv"]):
        write_csv(inbox / name, [order(10 * i + n) for n in range(1, 6)])
    target = etlkit.sqlite_target(tmp_path)
    context = {"input_dir": str(inbox), "target_url": target, "batch_size": 2}
    monkeypatch.setattr(etl, "MAX_BATCHES_PER_RUN", 6)  # 3 batches a file: two fit
    first = etl.run_plain(context)
    assert (first.loaded, first.deferred) == (["a.csv", "b.csv"], 1)
    assert "1 left for the next run" in (first.summary or "")
    second = etl.run_plain(context)
    assert (second.loaded, second.skipped, second.deferred) == (["c.csv"], 2, 0)
    monkeypatch.setattr(etl, "MAX_BATCHES_PER_RUN", 2)
    write_csv(inbox / "d.csv", [order(100 + n) for n in range(1, 6)])
    too_big = r"d.csv: 5 rows need 3 batches of 2; a run takes at most 2"
    with pytest.raises(ValueError, match=too_big):
        etl.run_plain(context)


# -- flowloop and the plain loop; other targets ----------------------------------------------


def test_etl__flowloop_run__gives_the_plain_loops_target(
    etl: ModuleType, inbox: Path, tmp_path: Path, sqlite_url: str
) -> None:
    etlkit.load_generator().generate(inbox, 3_000, files=2, seed=3, bad_every=50)
    context = {"input_dir": str(inbox), "batch_size": 128}
    plain_url, flow_url = etlkit.sqlite_target(tmp_path, "plain.db"), etlkit.sqlite_target(tmp_path)
    plain = etl.run_plain({**context, "target_url": plain_url})
    with Engine(sqlite_url) as engine:
        info = engine.run(etl.etl, {**context, "target_url": flow_url})
    assert info.status == "succeeded", info.error
    assert etlkit.dump(flow_url) == etlkit.dump(plain_url)
    assert ctx_of(info).batches_done == plain.batches_done == info.visits["load_batch"]
    assert ctx_of(info).batches_total == plain.batches_done


def test_etl__target_url__postgresql_and_sqlite_upsert_alike(
    etl: ModuleType, sample: Path, sqlite_url: str, store_url: str
) -> None:
    with Engine(sqlite_url) as engine:
        info = engine.run(etl.etl, {"input_dir": str(sample), "target_url": store_url})
        assert info.status == "succeeded", info.error
        first = etlkit.dump(store_url)
        # Forget the loaded files: the second run loads everything again, over itself.
        dialect_engine = sa.create_engine(store_url, poolclass=sa.NullPool)
        with dialect_engine.begin() as conn:
            conn.execute(etl.loader.loaded_files.delete())
        dialect_engine.dispose()
        again = engine.run(etl.etl, {"input_dir": str(sample), "target_url": store_url})
    assert ctx_of(again).loaded == ctx_of(info).loaded
    assert etlkit.dump(store_url) == first
    assert len(first["orders"]) == 39 and len(first["rejects"]) == 7


# -- as a loop ----------------------------------------------------------------------------


async def _until(what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_S}s waiting for {what}")
        await asyncio.sleep(0.01)


def _files(url: str) -> list[str]:
    try:
        return [row[0] for row in etlkit.dump(url)["loaded_files"]]
    except sa.exc.OperationalError:  # the first run has not created the tables yet
        return []


def test_etl__loop__loads_a_file_dropped_after_start_exactly_once(
    etl: ModuleType, inbox: Path, tmp_path: Path, sqlite_url: str
) -> None:
    write_csv(inbox / "a.csv", [order(n) for n in range(1, 6)])
    target = etlkit.sqlite_target(tmp_path)
    loop = etl.inbox_loop(
        "etl_test_inbox", every=0.05, context={"input_dir": str(inbox), "target_url": target}
    )
    assert loop.mode == "fixed_delay"

    async def scenario(engine: Engine) -> None:
        stop = asyncio.Event()
        worker = asyncio.create_task(Worker(engine, [loop], grace=10).run(stop))

        try:
            await _until("a.csv to load", lambda: _files(target) == ["a.csv"])
            write_csv(inbox / "b.csv", [order(n) for n in range(6, 9)])  # dropped while running
            await _until("b.csv to load", lambda: _files(target) == ["a.csv", "b.csv"])
            await _until(
                "two more iterations that found nothing new",
                lambda: (
                    sum(
                        event.kind == "iteration_skipped_idle"
                        for event in engine.loop_history("etl_test_inbox")
                    )
                    >= 2
                ),
            )
        finally:
            stop.set()
            await asyncio.wait_for(worker, WAIT_S)

    with Engine(sqlite_url, poll_seconds=0.02) as engine:
        asyncio.run(scenario(engine))
        runs = engine.runs(workflow="etl", limit=1000)
    assert all(run.status == "succeeded" for run in runs), [(r.status, r.error) for r in runs]
    loads = [name for run in runs for name in ctx_of(run).loaded]
    assert sorted(loads) == ["a.csv", "b.csv"]  # each file by exactly one run
    # An iteration with nothing new creates no run: every run loaded something.
    assert all(ctx_of(run).loaded for run in runs), [ctx_of(run).summary for run in runs]
    assert [row[0] for row in etlkit.dump(target)["orders"]] == [f"SO-{n:05d}" for n in range(1, 9)]


# -- the command line ---------------------------------------------------------------------


def test_etl__flowloop_run__shows_rows_batches_rejects_and_rate(
    sample: Path, tmp_path: Path
) -> None:
    context = json.dumps({"input_dir": str(sample), "batch_size": 4})
    result = CliRunner().invoke(
        cli, ["run", str(etlkit.ETL_FILE), "--context", context, "--db", str(tmp_path / "f.db")]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    progress = [line for line in lines if line.startswith("progress")]
    assert progress, result.output
    # After the first file's last batch (more may come, at most one a second, if it is slow).
    assert any(
        "orders_2024-03-01.csv  rows 18/" in line and "batches 5/" in line for line in progress
    ), progress
    assert progress[-1].startswith("progress  done")
    assert "rows 46/46 (100.0%)" in progress[-1] and "batches 12/12" in progress[-1]
    assert "rejects 7" in progress[-1] and "files 4/4" in progress[-1]
    assert progress[-1].endswith(" rows/s")
    # Batches that loop back to load_batch are summarised, not printed one by one.
    assert not any("load_batch --more--> load_batch" in line for line in lines)
    assert any("load_batch --eof--> close_file" in line for line in lines)
    # Every number says what it counts, and they add up.
    assert (
        "files: 3 loaded, 1 malformed (customers_2024-03-03.csv); rows read: 46 = 40 valid "
        "+ 6 rejected; the valid rows upserted 39 order(s) (1 order id(s) seen again: the row "
        "read last wins); target sqlite:///"
    ) in result.output
    assert "now holds 39 order(s) and 7 reject(s) (6 row(s), 1 malformed file(s))." in (
        result.output
    )
    # Rows are counted as records (a quoted field may span lines): the total never shrinks.
    assert {line.split("rows ")[1].split()[0].split("/")[1] for line in progress} == {"46"}
    assert lines[-1].endswith("succeeded in state done")
    # A second run says the four files were seen before: one of them was rejected, not
    # loaded ("4 already loaded" said otherwise).
    again = CliRunner().invoke(
        cli, ["run", str(etlkit.ETL_FILE), "--context", context, "--db", str(tmp_path / "f.db")]
    )
    assert again.exit_code == 0, again.output
    assert "files: 4 seen before (loaded or rejected)" in again.output


def test_etl__history_shows_each_batch_byte_range_unbroken(sample: Path, tmp_path: Path) -> None:
    db = str(tmp_path / "h.db")
    context = json.dumps({"input_dir": str(sample), "batch_size": 4})
    ran = CliRunner().invoke(cli, ["run", str(etlkit.ETL_FILE), "--context", context, "--db", db])
    assert ran.exit_code == 0, ran.output
    with Engine(db) as engine:
        (run,) = engine.runs()
        notes = [
            (event.state, event.data.get("note", ""))
            for event in engine.history(run.id)
            if event.kind == "step_succeeded" and event.state in ("open_file", "load_batch")
        ]
    shown = CliRunner().invoke(cli, ["history", run.id, "--db", db])
    assert shown.exit_code == 0, shown.output
    assert "load_batch --more--> load_batch: bytes " in shown.output
    # Per file: the batches' byte ranges follow on from the header to the end of the file.
    sizes = {p.name: p.stat().st_size for p in sample.glob("orders_*.csv")}
    file, end = None, 0
    for state, note in notes:
        if state == "open_file":
            if file is not None:
                assert end == sizes[file], (file, end)
            name, _, rest = note.partition(": ")
            file = None if rest == "malformed" else name  # a malformed file has no batches
            end = int(rest.rsplit(" ", 1)[1]) if file is not None else 0
            continue
        start, stop = note.split(",")[0].removeprefix("bytes ").split("-")
        assert int(start) == end, (file, note)
        end = int(stop)
    assert file is not None and end == sizes[file]
