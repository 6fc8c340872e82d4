"""flowloop.etl on the data real exports hold: a misspelt context field, a value the target
database refuses (NUL byte, out of range, too long), a field over the ``csv`` module's size
limit. Each is a reject with its file and line, or a one-line refusal; never a silent
default or a failed run with no row named."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import etlkit
import pytest
import sqlalchemy as sa
from pydantic import BaseModel, Field

from flowloop import Engine
from flowloop import etl as kit
from flowloop.errors import InvalidContext
from flowloop.etl import writers
from flowloop.etl.formats import header_problem


class Item(BaseModel):
    id: int
    name: str = Field(max_length=100)
    amount: int


class Ctx(kit.FolderContext):
    pass


def items_table(metadata: sa.MetaData) -> sa.Table:
    """A hand-made target narrower than the model: ``name`` holds 8 characters (PostgreSQL
    enforces it, SQLite does not)."""
    return sa.Table(
        "items",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(8), nullable=False),
        sa.Column("amount", sa.BigInteger, nullable=False),
        sa.Column("source_file", sa.String(255), nullable=False),
        sa.Column("source_row", sa.Integer, nullable=False),
    )


def rows_of(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


# -- the context ----------------------------------------------------------------------------


def test_context__a_misspelt_field_is_refused_not_dropped(
    tmp_path: Path, sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ETL_BATCH_SIZE", raising=False)
    loader = kit.FolderLoader(Item, "items", key="id")
    workflow = kit.folder_workflow("items", loader, context=Ctx)
    given = {"input_dir": str(tmp_path), "batchsize": 5}
    with Engine(sqlite_url) as engine, pytest.raises(InvalidContext, match="batchsize"):
        engine.start(workflow, given)  # was: started with batch_size 1000
    with pytest.raises(InvalidContext, match="batchsize"):
        workflow.parse_new_context(json.dumps(given))
    # A stored context still loads (it holds the model's fields only).
    stored = Ctx(input_dir=str(tmp_path), batch_size=5)
    assert workflow.load_context(stored.model_dump_json()).batch_size == 5  # type: ignore[attr-defined]


def test_context__the_example_refuses_a_misspelt_input_dir_instead_of_loading_the_sample(
    tmp_path: Path,
) -> None:
    db = tmp_path / "runs.db"
    context = json.dumps({"inputdir": str(tmp_path)})
    result = etlkit.cli(
        ["run", str(etlkit.ETL_FILE), "--db", str(db), "--context", context],
        env={"XDG_DATA_HOME": str(tmp_path / "data-home")},  # (where the sample loaded)
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "inputdir" in result.stderr
    assert not db.exists()  # nothing written


def test_input_folder_missing__fails_at_once_saying_what_to_do(
    tmp_path: Path, sqlite_url: str
) -> None:
    # A typo is no file system hiccup: it was retried 4 times over 7.5 s first.
    workflow = kit.folder_workflow("items", kit.FolderLoader(Item, "items"), context=Ctx)
    with Engine(sqlite_url) as engine:
        info = engine.run(workflow, {"input_dir": str(tmp_path / "nope")})
        failures = [e for e in engine.history(info.id) if e.kind == "step_failed"]
    assert info.status == "failed" and len(failures) == 1
    assert info.error is not None and f"input folder {tmp_path / 'nope'} does not exist" in (
        info.error
    )


# -- values the target refuses --------------------------------------------------------------


def test_target_refuses_a_row__it_becomes_a_reject_with_file_and_line(
    tmp_path: Path, store_url: str
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    rows = [
        ["1", "ok", "10"],
        ["2", "nul\x00byte", "20"],  # PostgreSQL text takes no NUL; SQLite would keep it
        ["3", "ok", str(10**20)],  # a valid Python int, out of the column's range
        ["4", "too long here", "40"],  # over String(8) (PostgreSQL refuses it)
        ["5", "ok", "50"],
    ]
    with (folder / "a.csv").open("w", newline="") as handle:
        csv.writer(handle, lineterminator="\n").writerows([["id", "name", "amount"], *rows])
    loader = kit.FolderLoader(Item, items_table(sa.MetaData()))
    workflow = kit.folder_workflow("items", loader, context=Ctx)
    try:
        ctx = kit.run_plain(
            workflow, {"input_dir": str(folder), "target_url": store_url, "batch_size": 10}
        )
        loaded = rows_of(store_url, "SELECT id FROM items ORDER BY id")
        rejects = dict(rows_of(store_url, "SELECT row_no, reason FROM rejects ORDER BY row_no"))
    finally:
        writers.close_engine(store_url)
    postgres = store_url.startswith("postgresql")
    refused = {2, 3, 4} if postgres else {2, 3}
    assert {row[0] for row in loaded} == {1, 2, 3, 4, 5} - refused
    assert set(rejects) == {n + 1 for n in refused}  # their lines (the header is line 1)
    assert rejects.pop(3).startswith("a NUL byte (0x00) in the record")  # on both targets
    assert all(reason.startswith("the target refused it: ") for reason in rejects.values())
    assert "range" in rejects[4] or "too large" in rejects[4]
    assert (ctx.rows_done, ctx.rows_loaded, ctx.rejects) == (5, 5 - len(refused), len(refused))
    assert ctx.loaded == ["a.csv"]


def test_target_refuses_every_row__the_batch_fails_with_the_targets_error(
    tmp_path: Path,
) -> None:
    # A table the rows cannot fit at all (a column the transform never fills) is no bad
    # data: the load stops and says why, rather than rejecting every row.
    metadata = sa.MetaData()
    table = items_table(metadata)
    table.append_column(sa.Column("region", sa.String(8), nullable=False))
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.csv").write_text("id,name,amount\n1,a,1\n2,b,2\n")
    workflow = kit.folder_workflow("items", kit.FolderLoader(Item, table), context=Ctx)
    target = f"sqlite:///{tmp_path / 't.db'}"
    try:
        with pytest.raises(sa.exc.IntegrityError, match="NOT NULL"):
            kit.run_plain(workflow, {"input_dir": str(folder), "target_url": target})
    finally:
        writers.close_engine(target)


# -- CSV fields over the csv module's limit -------------------------------------------------


def test_csv__a_field_over_the_size_limit__one_reject_and_the_next_record_intact(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.csv"
    huge = "x" * (csv.field_size_limit() + 10) + "\n" + "1,2,3"  # a line that looks like a row
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerows(
            [["id", "text", "tag"], ["1", "a", "t"], ["2", huge, "t"], ["3", "c", "t"]]
        )
    fmt = kit.CsvFormat()
    header, problem = fmt.header(path)
    assert header is not None, problem
    size = path.stat().st_size
    batch = fmt.read(path, header=header, offset=header.data_offset, end=size, line=2, limit=10)
    assert [(r.line, r.fields is None) for r in batch.records] == [
        (2, False),
        (3, True),
        (5, False),
    ]
    assert batch.records[1].error is not None and "field larger than field limit" in (
        batch.records[1].error
    )
    assert batch.records[2].fields == ["3", "c", "t"] and batch.offset == size
    # Read one record at a time, as resumed batches do: the same records.
    offset, line, lines = header.data_offset, 2, []
    while offset < size:
        one = fmt.read(path, header=header, offset=offset, end=size, line=line, limit=1)
        lines += [r.line for r in one.records]
        offset, line = one.offset, one.line
    assert lines == [2, 3, 5]


# -- headers that say what is wrong -----------------------------------------------------------


def test_header__an_unnamed_column_is_named_by_its_position(tmp_path: Path) -> None:
    # A trailing delimiter (common in exports) was "unexpected " followed by nothing.
    assert header_problem(["id", "text", "tag", ""], ["id", "text", "tag"], reject_extra=True) == (
        "wrong header: unexpected (unnamed column 4) (expected id,text,tag)"
    )
    # Two of them are no repeated name: ignored with the other extra columns (the file was
    # malformed: "repeated " and nothing).
    assert header_problem(["id", "text", "tag", "", ""], ["id", "text", "tag"]) is None


def test_header__another_delimiter_or_cr_line_ends__says_so(tmp_path: Path) -> None:
    loader = kit.FolderLoader(Item, "items", key="id")
    semicolons = tmp_path / "semi.csv"
    semicolons.write_text("id;name;amount\n1;a;2\n")
    _, problem = loader.read_header(semicolons)
    assert problem is not None and problem.endswith(
        "; the header has no ',' but ';': pass fmt=CsvFormat({'delimiter': ';'}) or "
        "CsvFormat('sniff')"
    )
    old_mac = tmp_path / "mac.csv"
    old_mac.write_bytes(b"id,name,amount\r1,a,2\r")
    _, problem = loader.read_header(old_mac)
    assert problem == (
        "unreadable header: its lines end in a lone CR (old Mac line ends); "
        "convert them to LF or CRLF"
    )


# -- a PostgreSQL target: sessions a lost client leaves behind ----------------------------------


def test_postgres_target__sessions_end_when_left_idle_in_a_transaction(pg_url: str) -> None:
    # A client lost in the middle of a batch (a partition: the server sees a silent
    # session) held the batch's row locks; the retried batch waited for them for good.
    loader = kit.FolderLoader(Item, "items", key="id")
    try:
        with loader.engine(pg_url).connect() as conn:
            shown = {
                name: conn.exec_driver_sql(f"SHOW {name}").scalar_one()
                for name in ("idle_in_transaction_session_timeout", "tcp_keepalives_idle")
            }
            keepalives = conn.connection.driver_connection.info.get_parameters()  # type: ignore[union-attr]
    finally:
        writers.close_engine(pg_url)
    assert shown == {"idle_in_transaction_session_timeout": "10s", "tcp_keepalives_idle": "10"}
    assert keepalives.get("keepalives") == "1" and keepalives.get("connect_timeout") == "5"


def test_input_folder__only_its_absence_is_a_mistake_another_os_error_is_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Path.is_dir says False for any OSError from Python 3.13 on: a permission or a network
    # file system's hiccup would have failed the run at once as "does not exist" instead
    # of being raised (and retried as an OSError). stat tells them apart.
    from flowloop.etl.loader import folder_problem

    (tmp_path / "a.csv").write_text("x\n")
    assert folder_problem(tmp_path) is None
    assert folder_problem(tmp_path / "nope") == "does not exist"
    assert folder_problem(tmp_path / "a.csv" / "under") == "does not exist"
    assert folder_problem(tmp_path / "a.csv") == "is a file, not a folder"
    real_stat = Path.stat

    def refused(self: Path, **kwargs: Any) -> Any:
        if self == tmp_path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, **kwargs)

    monkeypatch.setattr(Path, "stat", refused)
    with pytest.raises(PermissionError):
        folder_problem(tmp_path)
