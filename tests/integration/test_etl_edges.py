"""flowloop.etl on the data real exports hold: a misspelt context field, a value the target
database refuses (NUL byte, out of range, too long), a field over the ``csv`` module's size
limit. Each is a reject with its file and line, or a one-line refusal; never a silent
default or a failed run with no row named."""

from __future__ import annotations

import json
from pathlib import Path

import etlkit
import pytest
import sqlalchemy as sa
from pydantic import BaseModel, Field

from flowloop import Engine
from flowloop import etl as kit
from flowloop.errors import InvalidContext


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
