"""ETL fan-out: one child run per CSV file, at most 4 at a time, joined into one report.

    discover --next--> load_files (map: one `load_file` run per file) --done/failed--> report

``load_file`` counts a file's records and checks its header; a file that cannot be read
fails its own run. ``load_files`` waits (no worker, no thread) until every child has
ended, then ``summarize`` folds their results into the report; more than a quarter of
the files failing takes ``failed`` (the report says which).

Run it on the sample data in ``workflows/data``::

    flowloop run workflows/etl_fanout.py --context '{}'
"""

from __future__ import annotations

import csv
import stat
from pathlib import Path

from pydantic import BaseModel

from flowloop import Step, Workflow
from flowloop.compose import ChildResult

DATA = Path(__file__).resolve().parent / "data"


class FileJob(BaseModel):
    path: str
    records: int = 0
    columns: int = 0


class Batch(BaseModel):
    # Empty: the sample files next to this example (defaults are not in the fingerprint,
    # so an absolute path would not change it either; "" reads the same in every checkout).
    input_dir: str = ""
    files: list[str] = []
    records: int = 0
    failed_files: list[str] = []
    report: str = ""


load_file = Workflow("load_file", context=FileJob)


@load_file.step(initial=True, next="loaded")
def load(ctx: FileJob, step: Step) -> None:
    # Records, not lines: a quoted field may span lines. (utf-8-sig: a BOM is no header text.)
    with open(ctx.path, encoding="utf-8-sig", newline="") as handle:
        rows = csv.reader(handle)
        header = next(rows, [])
        if not any(name.strip() for name in header):
            raise ValueError(f"{Path(ctx.path).name}: empty file or no header")
        ctx.columns = len(header)
        ctx.records = sum(1 for row in rows if row)


load_file.final("loaded")

etl_fanout = Workflow("etl_fanout", context=Batch)


@etl_fanout.step(initial=True, next="load_files")
def discover(ctx: Batch) -> None:
    folder = Path(ctx.input_dir).resolve() if ctx.input_dir else DATA  # (children: absolute)
    # A typo looked like a day without files. (stat, not is_dir: a permission or network
    # hiccup raises and is retried; is_dir said "no folder".)
    try:
        mode = folder.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        raise ValueError(f"input folder {folder} does not exist") from None
    if not stat.S_ISDIR(mode):
        raise ValueError(f"input folder {folder} is a file, not a folder")
    ctx.files = sorted(str(p) for p in folder.glob("*.csv"))


def summarize(ctx: Batch, results: list[ChildResult[FileJob]]) -> None:
    ctx.records = sum(r.context.records for r in results if r.ok)
    ctx.failed_files = [Path(ctx.files[r.index]).name for r in results if not r.ok]


etl_fanout.map(
    "load_files",
    child=load_file,
    items=lambda ctx: ctx.files,
    context=lambda ctx, path: FileJob(path=path),
    max_parallel=4,
    tolerate_failures=0.25,
    on={"done": "report", "failed": "report"},
    reduce=summarize,
)


@etl_fanout.step(next="done")
def report(ctx: Batch) -> None:
    ctx.report = f"{len(ctx.files)} file(s), {ctx.records} record(s) loaded"
    if ctx.failed_files:
        ctx.report += f"; failed: {', '.join(ctx.failed_files)}"


etl_fanout.final("done")
