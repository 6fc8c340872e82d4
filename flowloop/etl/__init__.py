"""flowloop.etl: load a folder of files into a SQLAlchemy table in checkpointed batches.

The parts, one module each:

* :mod:`~flowloop.etl.formats`  resumable readers over a byte range: CSV in any dialect
  (stdlib ``csv``: quoted fields spanning lines, BOM, CRLF), JSON lines;
* :mod:`~flowloop.etl.files`    a file as a whole: size, sha256, record count, malformed?;
* :mod:`~flowloop.etl.validate` pydantic row models per batch, rejects with reasons,
  ``"NA"``/empty as None (:class:`Nulls`);
* :mod:`~flowloop.etl.writers`  idempotent upserts (SQLite, PostgreSQL, MySQL, others by
  delete+insert), the rejects and loaded-files tables, a table derived from a row model;
* :mod:`~flowloop.etl.context`  the context of a load: resume point and progress counters;
* :mod:`~flowloop.etl.loader`   the bodies of the five steps (:class:`FolderLoader`);
* :mod:`~flowloop.etl.workflow` the standard five-step workflow in one call;
* :mod:`~flowloop.etl.loop`     a loop that loads new files as they arrive;
* :mod:`~flowloop.etl.plain`    the same steps without flowloop (benchmarks, references).

A load is a workflow of five steps in the user's file: spelled out in ``workflows/etl.py``,
built by :func:`folder_workflow` in ``workflows/etl_readings.py``::

    loader = FolderLoader(Reading, "readings", key=None, nulls=Nulls(("NA", "")))
    readings = folder_workflow("readings", loader, context=ReadingsContext)
"""

from __future__ import annotations

from flowloop.etl.context import FolderContext, sample_target_dir
from flowloop.etl.files import FileInfo, inspect_file, sha256_of
from flowloop.etl.formats import (
    Batch,
    CsvFormat,
    FileChanged,
    Format,
    Header,
    JsonLinesFormat,
    Record,
    normalize_column,
)
from flowloop.etl.loader import (
    FILE_ROW,
    MAX_BATCHES_PER_RUN,
    MAX_FILES_PER_RUN,
    BatchBudgetExceeded,
    FolderLoader,
    InputMissing,
)
from flowloop.etl.loop import inbox_loop
from flowloop.etl.plain import run_plain
from flowloop.etl.validate import Nulls, validate, why_invalid
from flowloop.etl.workflow import RETRY_TRANSIENT, folder_workflow
from flowloop.etl.writers import source_columns, table_from_model, target_engine, upsert

__all__ = [
    "FILE_ROW",
    "MAX_BATCHES_PER_RUN",
    "MAX_FILES_PER_RUN",
    "RETRY_TRANSIENT",
    "Batch",
    "BatchBudgetExceeded",
    "CsvFormat",
    "FileChanged",
    "FileInfo",
    "FolderContext",
    "FolderLoader",
    "Format",
    "Header",
    "InputMissing",
    "JsonLinesFormat",
    "Nulls",
    "Record",
    "folder_workflow",
    "inbox_loop",
    "inspect_file",
    "normalize_column",
    "run_plain",
    "sample_target_dir",
    "sha256_of",
    "source_columns",
    "table_from_model",
    "target_engine",
    "upsert",
    "validate",
    "why_invalid",
]
