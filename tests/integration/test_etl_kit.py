"""flowloop.etl on real files and databases: byte offsets that resume exactly (quoted fields
spanning lines, BOM, CRLF), dialects given or sniffed, JSON lines, "NA" as None, a file that
changes while it loads, and idempotent upserts on SQLite and PostgreSQL."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, Field, StringConstraints

from flowloop import Step
from flowloop import etl as kit
from flowloop.errors import FlowloopError
from flowloop.etl import writers
from flowloop.etl.formats import Header, header_problem


def step(state: str = "load_batch") -> Step:
    return Step(run_id="kit", workflow="kit", state=state, attempt=1, visit=1, seq=0, worker="t")


def header_of(fmt: kit.Format, path: Path) -> Header:
    header, problem = fmt.header(path)
    assert header is not None, problem
    return header


def read_all(fmt: kit.Format, path: Path, limit: int) -> tuple[list[kit.Record], list[int]]:
    """Every record, reading ``limit`` at a time from each returned offset (as resumed
    batches do), and the offsets each read ended at."""
    header = header_of(fmt, path)
    size = path.stat().st_size
    offset, line, records, ends = header.data_offset, header.data_line, [], []
    while offset < size:
        batch = fmt.read(path, header=header, offset=offset, end=size, line=line, limit=limit)
        assert batch.offset > offset
        records += batch.records
        offset, line = batch.offset, batch.line
        ends.append(offset)
    return records, ends


# -- CSV: offsets, BOM, CRLF, dialects ----------------------------------------------------

TRICKY = [
    ["1", "plain", "a"],
    ["2", "two\nlines", "b"],
    ["3", 'quote "inside", and comma', "c"],
    ["4", "three\nlines\nhere", "d"],
    ["5", "", "e"],
    ["6", "café ☕", "f"],
]


def write(path: Path, rows: list[list[str]], *, bom: bool = False, **dialect: Any) -> Path:
    with path.open("w", encoding="utf-8-sig" if bom else "utf-8", newline="") as handle:
        writer = csv.writer(handle, **dialect)
        writer.writerow(["id", "text", "tag"])
        writer.writerows(rows)
    return path


@pytest.mark.parametrize("terminator", ["\n", "\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("bom", [False, True], ids=["no-bom", "bom"])
@pytest.mark.parametrize("limit", [1, 2, 100])
def test_csv__offsets_resume_exactly_across_quoted_lines_bom_and_crlf(
    tmp_path: Path, terminator: str, bom: bool, limit: int
) -> None:
    path = write(tmp_path / "t.csv", TRICKY, bom=bom, lineterminator=terminator)
    data = path.read_bytes()
    fmt = kit.CsvFormat()
    header = header_of(fmt, path)
    assert header.columns == ["id", "text", "tag"]
    assert data[header.data_offset :].startswith(b"1,plain,a")
    records, ends = read_all(fmt, path, limit)
    assert [r.fields for r in records] == TRICKY  # a newline inside quotes is kept as written
    assert all(not r.fields[-1].endswith("\r") for r in records if isinstance(r.fields, list))
    assert [r.line for r in records] == [2, 3, 5, 6, 9, 10]  # where each record starts
    # Each batch ends where a record starts: the raw bytes of the records tile the file.
    assert b"".join(r.raw for r in records) == data[header.data_offset :]
    assert ends[-1] == len(data)
    for end in ends[:-1]:
        assert any(data[end:].startswith(r.raw) for r in records)


def test_csv__record_count_at_inspection_counts_records_not_lines(tmp_path: Path) -> None:
    path = write(tmp_path / "t.csv", TRICKY, lineterminator="\r\n")
    loader = kit.FolderLoader(Text, "texts", key="id")
    info = loader.inspect(path)
    assert (info.rows, info.problem, info.size) == (6, None, path.stat().st_size)
    assert info.sha256 == kit.sha256_of(path)


@pytest.mark.parametrize(
    ("dialect", "written"),
    [
        pytest.param({"delimiter": ";"}, {"delimiter": ";"}, id="mapping"),
        pytest.param("excel-tab", {"delimiter": "\t"}, id="excel-tab"),
        pytest.param("sniff", {"delimiter": ";"}, id="sniff-semicolon"),
        pytest.param("sniff", {"delimiter": "\t", "lineterminator": "\r\n"}, id="sniff-tab-crlf"),
        pytest.param("sniff", {"delimiter": "|", "quotechar": "'"}, id="sniff-pipe-quote"),
        pytest.param("sniff", {}, id="sniff-comma"),
    ],
)
def test_csv__explicit_and_sniffed_dialects(
    tmp_path: Path, dialect: Any, written: dict[str, str]
) -> None:
    rows = [[str(n), f"text; {n}, with\tall | separators", "x"] for n in range(1, 30)]
    rows.append(["30", "a 'quoted' \"word\"\nover two lines", "y"])
    path = write(tmp_path / "t.csv", rows, **written)
    fmt = kit.CsvFormat(dialect)
    header = header_of(fmt, path)
    assert header.dialect["delimiter"] == written.get("delimiter", ",")
    records, _ = read_all(fmt, path, 7)
    assert [r.fields for r in records] == rows


def test_csv__unknown_dialect__says_what_to_use() -> None:
    with pytest.raises(FlowloopError, match=r"unknown CSV dialect 'excel2'.*excel-tab.*sniff"):
        kit.CsvFormat("excel2")
    with pytest.raises(FlowloopError, match=r"unknown CSV dialect setting.*delim"):
        kit.CsvFormat({"delim": ";"})


def test_header__normalised_names_and_problems_in_words() -> None:
    assert kit.normalize_column(" Temperature (C) ") == "temperature_c"
    assert kit.normalize_column("Wind km/h") == "wind_km_h"
    expected = ["id", "text", "tag"]
    assert header_problem(["id", "text", "tag", "extra"], expected) is None
    assert header_problem(["id", "tag", "extra"], expected, reject_extra=True) == (
        "wrong header: missing text; unexpected extra (expected id,text,tag)"
    )
    assert header_problem(["id", "text", "tag", "id"], expected) == (
        "wrong header: repeated id (expected id,text,tag)"
    )
    assert header_problem(["id", "tag"], expected, required=["id"]) is None


# -- JSON lines ---------------------------------------------------------------------------


def test_json_lines__objects_rejects_blank_lines_and_offsets(tmp_path: Path) -> None:
    lines = [
        json.dumps({"id": "1", "text": "a\nb", "tag": "x"}),
        "",
        json.dumps({"id": "2", "text": "é", "tag": None}),
        "{not json",
        "[1, 2]",
        json.dumps({"id": "3", "text": "c", "tag": "z"}),
    ]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    fmt = kit.JsonLinesFormat()
    records, ends = read_all(fmt, path, 1)
    assert [r.line for r in records] == [1, 3, 4, 5, 6]
    assert records[0].fields == {"id": "1", "text": "a\nb", "tag": "x"}
    assert records[2].fields is None and (records[2].error or "").startswith("not JSON: ")
    assert records[3].error == "not a JSON object (a list)"
    assert ends[-1] == path.stat().st_size
    assert b"".join(r.raw for r in records).startswith(b'{"id": "1"')


# -- validation: NA and rejects -----------------------------------------------------------


class Text(BaseModel):
    id: Annotated[str, StringConstraints(pattern=r"^\d+$")]
    text: str | None
    tag: str | None = Field(max_length=1)


class Measure(BaseModel):
    name: str
    value: float | None
    note: str | None


def test_nulls__global_per_field_and_none() -> None:
    records = [
        kit.Record(2, ["a", "NA", "NA"], b"a,NA,NA\n"),
        kit.Record(3, ["b", " ", ""], b"b, ,\n"),
        kit.Record(4, ["c", "1.5", " n/a "], b"c,1.5, n/a \n"),
    ]
    columns = ["name", "value", "note"]

    def run(nulls: kit.Nulls | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        return kit.validate(
            records,
            columns,
            model=Measure,
            transform=lambda row, file, line: {**row.model_dump(), "line": line},
            file="m.csv",
            sha256="0" * 64,
            nulls=nulls,
        )

    good, bad = run(None)
    assert [r["line"] for r in good] == [4] and [b["row_no"] for b in bad] == [2, 3]
    assert bad[0]["reason"].startswith("value: Input should be a valid number")
    good, bad = run(kit.Nulls(("NA", "")))
    assert bad == []
    assert [(r["value"], r["note"]) for r in good] == [(None, None), (None, None), (1.5, " n/a ")]
    # Per field: "n/a" is missing in note only, and note keeps "NA" as text.
    good, bad = run(kit.Nulls(("NA", ""), fields={"note": ("n/a",)}))
    assert [(r["value"], r["note"]) for r in good] == [(None, "NA"), (None, ""), (1.5, None)]


# -- a file changed while it loads --------------------------------------------------------


class Row(BaseModel):
    id: int
    text: str


@pytest.fixture
def folder_loader() -> Iterator[kit.FolderLoader]:
    yield kit.FolderLoader(Row, "rows", key=None, noun="row")


class Ctx(kit.FolderContext):
    pass


def rows_file(path: Path, n: int, text: str = "x") -> Path:
    path.write_text("id,text\n" + "".join(f"{i},{text}{i}\n" for i in range(1, n + 1)))
    return path


def dump(url: str, table: str) -> list[tuple[Any, ...]]:
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(f"SELECT * FROM {table} ORDER BY 1, 2"))]
    finally:
        engine.dispose()


def opened(loader: kit.FolderLoader, folder: Path, target: str, batch: int) -> Ctx:
    ctx = Ctx(input_dir=str(folder), target_url=target, batch_size=batch)
    assert loader.discover(ctx) == "found"
    assert loader.open_file(ctx, step("open_file")) == "ready"
    return ctx


def test_changed_mid_load__same_size_new_content__found_by_hash_and_left_for_next_run(
    tmp_path: Path, folder_loader: kit.FolderLoader
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    path = rows_file(folder / "a.csv", 10)
    target = f"sqlite:///{tmp_path / 't.db'}"
    ctx = opened(folder_loader, folder, target, 4)
    assert folder_loader.load_batch(ctx, step()) == "more"
    rows_file(path, 10, text="y")  # same size, other bytes: the size check cannot see it
    while folder_loader.load_batch(ctx, step()) == "more":
        pass
    assert folder_loader.close_file(ctx, step("close_file")) == "finished"
    assert ctx.changed == ["a.csv"] and ctx.loaded == []
    assert dump(target, "loaded_files") == []
    # The next run loads the new version; its rows replace the old version's (position key).
    later = Ctx(input_dir=str(folder), target_url=target)
    kit.run_plain(kit.folder_workflow("rows", folder_loader, context=Ctx), later)
    got = dump(target, "rows")
    assert [(r[0], r[1]) for r in got] == [(i, f"y{i}") for i in range(1, 11)]
    assert {r[4] for r in got} == {kit.sha256_of(path)}


def test_changed_mid_load__grown__stops_at_the_size_check(
    tmp_path: Path, folder_loader: kit.FolderLoader
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    path = rows_file(folder / "a.csv", 10)
    target = f"sqlite:///{tmp_path / 't.db'}"
    ctx = opened(folder_loader, folder, target, 4)
    assert folder_loader.load_batch(ctx, step()) == "more"
    with path.open("a") as handle:
        handle.write("11,x11\n")
    assert folder_loader.load_batch(ctx, step()) == "eof"
    assert ctx.file_status == "changed" and ctx.rows_done == 4


def test_source_position_key__a_batch_run_twice_duplicates_nothing(
    tmp_path: Path, folder_loader: kit.FolderLoader
) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    rows_file(folder / "a.csv", 9)
    target = f"sqlite:///{tmp_path / 't.db'}"
    ctx = opened(folder_loader, folder, target, 5)
    before = ctx.model_copy(deep=True)
    assert folder_loader.load_batch(ctx, step()) == "more"
    once = dump(target, "rows")
    assert folder_loader.load_batch(before, step()) == "more"  # the same batch again
    assert dump(target, "rows") == once and len(once) == 5
    assert [(r[2], r[3]) for r in once] == [("a.csv", line) for line in range(2, 7)]


# -- writers on SQLite and PostgreSQL ------------------------------------------------------


def test_upsert__idempotent_last_wins_on_sqlite_and_postgresql(store_url: str) -> None:
    metadata = sa.MetaData()
    table = kit.table_from_model("measures", metadata, Measure, key="name")
    assert [c.name for c in table.primary_key.columns] == ["name"]
    assert table.c.value.nullable and not table.c.name.nullable
    assert {"source_file", "source_row", "source_sha256"} <= set(table.c.keys())
    engine = writers.target_engine(store_url, metadata)
    lineage = {"source_file": "f", "source_row": 1, "source_sha256": "0" * 64}
    rows = [
        {"name": "a", "value": 1.0, "note": None, **lineage},
        {"name": "b", "value": None, "note": "x", **lineage},
        {"name": "a", "value": 2.0, "note": "again", **lineage},  # same key: the last wins
    ]
    try:
        for _ in range(2):
            with engine.begin() as conn:
                kit.upsert(conn, table, rows)
            with engine.connect() as conn:
                got = conn.execute(
                    sa.select(table.c.name, table.c.value, table.c.note).order_by(table.c.name)
                ).all()
            assert [tuple(r) for r in got] == [("a", 2.0, "again"), ("b", None, "x")]
        with engine.begin() as conn:
            kit.upsert(conn, table, [{**rows[1], "value": 3.5}])
            assert conn.execute(sa.select(table.c.value).where(table.c.name == "b")).scalar() == 3.5
    finally:
        writers.close_engine(store_url)


def test_table_from_model__names_a_bad_key_and_an_unmappable_type() -> None:
    with pytest.raises(FlowloopError, match="key nope is not a field of Measure"):
        kit.table_from_model("m", sa.MetaData(), Measure, key="nope")

    class Odd(BaseModel):
        items: list[int]

    with pytest.raises(FlowloopError, match=r"Odd\.items: no column type"):
        kit.table_from_model("o", sa.MetaData(), Odd, key=None)
    table = kit.table_from_model("m", sa.MetaData(), Measure, key=None)
    assert [c.name for c in table.primary_key.columns] == ["source_file", "source_row"]


def test_loader__a_key_that_is_not_the_tables_primary_key_is_refused() -> None:
    table = sa.Table("t", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    with pytest.raises(FlowloopError, match="not the primary key of table 't'"):
        kit.FolderLoader(Row, table, key="text")


def test_json_lines__through_the_loader__natural_key_upsert_and_rejects(tmp_path: Path) -> None:
    folder = tmp_path / "in"
    folder.mkdir()
    lines = [{"id": 1, "text": "a"}, {"id": 2, "text": "NA"}, {"id": "x", "text": "b"}]
    (folder / "a.jsonl").write_text("\n".join(json.dumps(v) for v in lines) + "\n[]\n")
    (folder / "b.jsonl").write_text(json.dumps({"id": 1, "text": "again"}) + "\n")
    loader = kit.FolderLoader(
        Row, "rows", key="id", fmt=kit.JsonLinesFormat(), nulls=kit.Nulls(("NA",))
    )
    target = f"sqlite:///{tmp_path / 't.db'}"
    ctx = kit.run_plain(
        kit.folder_workflow("jsonl", loader, context=Ctx),
        {"input_dir": str(folder), "target_url": target, "pattern": "*.jsonl", "batch_size": 2},
    )
    assert ctx.loaded == ["a.jsonl", "b.jsonl"] and (ctx.rows_done, ctx.rejects) == (5, 3)
    assert [(r[0], r[1]) for r in dump(target, "rows")] == [(1, "again")]
    reasons = {r[1]: r[2] for r in dump(target, "rejects")}
    assert reasons[2].startswith("text: Input should be a valid string")  # NA became None
    assert reasons[3].startswith("id: Input should be a valid integer")
    assert reasons[4] == "not a JSON object (a list)"
