"""A folder load as the bodies of five steps: discover, open a file, load a batch, close the
file, report. The workflow (its states, names and transitions) stays in the user's file;
each of its steps calls one method here.

* :meth:`FolderLoader.discover` lists the input folder, skips files already recorded in the
  ``loaded_files`` table (same name and sha256; same name, size and mtime when
  ``trust_mtime``), inspects each new file as a whole (empty, not UTF-8 and a wrong header
  make it *malformed*: one reject, the run goes on) and plans the run to fit a batch budget.
* :meth:`FolderLoader.load_batch` reads ``batch_size`` records from the byte offset in the
  context, validates them, and upserts rows and rejects in one target transaction. Killed
  mid-file, a run resumes at the last committed offset; the batch that was interrupted is
  read again and rewrites the same keys, so nothing is duplicated.
* A file that changes while it loads (its size before a batch, its sha256 when it ends) is
  left for the next run: what was loaded stays (it is keyed) and the new version is loaded
  from its start next time. Drop files atomically (write ``x.csv.part``, rename it).
"""

from __future__ import annotations

import logging
import math
import stat
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import sqlalchemy as sa
from pydantic import BaseModel

from flowloop.definition import Step
from flowloop.errors import FlowloopError
from flowloop.etl import writers
from flowloop.etl.context import FolderContext
from flowloop.etl.files import FileInfo, inspect_file, sha256_of
from flowloop.etl.formats import (
    CsvFormat,
    FileChanged,
    Format,
    Header,
    Record,
    header_problem,
)
from flowloop.etl.validate import Nulls, Transform, reject_row, validate

log = logging.getLogger("flowloop.etl")

FILE_ROW: Final = 0
"""The ``row_no`` of a reject that concerns the whole file."""
MAX_BATCHES_PER_RUN: Final = 100_000
"""Default batch budget of a run: 100 million rows at the default batch size."""
MAX_FILES_PER_RUN: Final = 1_000


REFUSALS: Final = (sa.exc.DataError, sa.exc.IntegrityError, OverflowError)
"""What a target raises for a value of one row (too long, out of range, a NUL byte, a
constraint): the batch is written again in parts, and the rows refused become rejects."""


def refusal(error: Exception) -> str:
    """The database's own words (its first line), without SQLAlchemy's statement dump."""
    cause = error.orig if isinstance(error, sa.exc.DBAPIError) else error
    return (str(cause).strip().splitlines() or [type(cause).__name__])[0]


class InputMissing(FlowloopError, ValueError):
    """The input folder does not exist (or is no folder): a mistake in the context, failed
    at once (an ``OSError`` was retried as a file system hiccup)."""


def folder_problem(folder: Path) -> str | None:
    """Why ``folder`` is no input folder (``None``: it is one). Only its absence is a
    mistake in the context: another OSError (a permission, a network file system's
    hiccup) is raised and retried — ``Path.is_dir`` says False for those too (Python
    3.13 and later), which failed the run at once as "does not exist"."""
    try:
        mode = folder.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "does not exist"
    return None if stat.S_ISDIR(mode) else "is a file, not a folder"


class BatchBudgetExceeded(FlowloopError, ValueError):
    """One file needs more batches than a run may take: use a larger ``batch_size``."""


def batches_for(rows: int, batch_size: int) -> int:
    return max(1, math.ceil(rows / batch_size))


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class FolderLoader:
    """Loads the files of a folder into one table of a SQLAlchemy target.

    ``model``      the row model (pydantic): one field per column, its checks the row's;
    ``table``      the target table (``sa.Table``), or a name: a table derived from
                   ``model`` (:func:`~flowloop.etl.writers.table_from_model`);
    ``key``        the natural key (a field name or several) with a table name; ``None``:
                   the source position (file, line). A given ``sa.Table``'s primary key is
                   its key;
    ``transform``  ``(row, file, line) -> dict`` of target columns (default: the fields);
                   ``source_file``/``source_row``/``source_sha256`` columns are filled in;
    ``fmt``        :class:`~flowloop.etl.formats.CsvFormat` (default) or ``JsonLinesFormat``;
    ``nulls``      which texts are missing values (:class:`~flowloop.etl.validate.Nulls`);
    ``explain``    words for a field's pattern mismatch in reject reasons;
    ``extra_columns``  ``"reject"`` a file with columns the model does not name, or ignore;
    ``noun``       what a row is, in the report (``"order"``).
    """

    def __init__(
        self,
        model: type[BaseModel],
        table: sa.Table | str,
        *,
        key: str | Sequence[str] | None = None,
        transform: Transform | None = None,
        fmt: Format | None = None,
        nulls: Nulls | None = None,
        explain: Mapping[str, str] | None = None,
        extra_columns: str = "ignore",
        noun: str = "row",
        metadata: sa.MetaData | None = None,
    ) -> None:
        if isinstance(table, str):
            table = writers.table_from_model(table, metadata or sa.MetaData(), model, key=key)
        elif key is not None:
            keys = [key] if isinstance(key, str) else list(key)
            if keys != [c.name for c in table.primary_key.columns]:
                raise FlowloopError(
                    f"key {keys} is not the primary key of table {table.name!r}; "
                    "the upsert needs the key to be the primary key"
                )
        if extra_columns not in ("ignore", "reject"):
            raise FlowloopError(f"extra_columns={extra_columns!r}: use 'ignore' or 'reject'")
        self.model = model
        self.table = table
        self.metadata = table.metadata
        self.rejects = writers.rejects_table(self.metadata)
        self.loaded_files = writers.loaded_files_table(self.metadata)
        self.fmt: Format = fmt or CsvFormat()
        self.nulls = nulls
        self.explain = dict(explain or {})
        self.reject_extra = extra_columns == "reject"
        self.noun = noun
        self.columns = [info.alias or name for name, info in model.model_fields.items()]
        self.required = [
            info.alias or name for name, info in model.model_fields.items() if info.is_required()
        ]
        self.transform: Transform = transform or _fields
        names = set(table.c.keys())
        self.lineage = [c for c in writers.LINEAGE if c in names]
        self.by_position = {writers.SOURCE_FILE, writers.SOURCE_ROW} <= {
            c.name for c in table.primary_key.columns
        }

    # -- the target ---------------------------------------------------------------------

    def engine(self, url: str) -> sa.Engine:
        return writers.target_engine(url, self.metadata)

    def write(
        self, url: str, rows: Sequence[Mapping[str, Any]], bad: Sequence[Mapping[str, Any]]
    ) -> None:
        """Upsert one batch's rows and rejects in one transaction."""
        with self.engine(url).begin() as conn:
            writers.upsert(conn, self.table, rows)
            writers.upsert(conn, self.rejects, bad)

    def write_apart(
        self, url: str, rows: Sequence[Mapping[str, Any]], error: Exception
    ) -> dict[int, str]:
        """Write ``rows`` in ever smaller parts, each in its own transaction, after the
        target refused the batch (``error``): the rows it refuses alone, by index, with its
        reason. Every part is an upsert, so a crash in between leaves nothing a re-run of the
        batch does not overwrite. All rows refused is the table's fault, not theirs:
        ``error`` is raised."""
        refused: dict[int, str] = {}
        parts = [(0, len(rows))]
        while parts:
            start, stop = parts.pop()
            try:
                with self.engine(url).begin() as conn:
                    writers.upsert(conn, self.table, rows[start:stop])
            except REFUSALS as part_error:
                if stop - start == 1:
                    refused[start] = f"the target refused it: {refusal(part_error)}"
                    continue
                middle = (start + stop) // 2
                parts += [(middle, stop), (start, middle)]  # the first half first: last wins
        if len(refused) == len(rows) > 1:
            raise error
        if refused:
            log.warning("etl: the target refused %d row(s) of %d", len(refused), len(rows))
        return refused

    def read_header(self, path: Path) -> tuple[Header | None, str | None]:
        """The file's header, or why it cannot be loaded (its columns do not fit the model)."""
        header, problem = self.fmt.header(path)
        if header is None or problem is not None:
            return None, problem or "unreadable header"
        if self.fmt.header_lines:
            problem = header_problem(
                header.columns, self.columns, required=self.required, reject_extra=self.reject_extra
            )
            if problem:
                return None, f"{problem}; {header.hint}" if header.hint else problem
        return header, None

    def inspect(self, path: Path) -> FileInfo:
        return inspect_file(path, self.fmt, lambda p: self.read_header(p)[1])

    # -- the steps ------------------------------------------------------------------------

    def discover(
        self,
        ctx: FolderContext,
        *,
        max_batches: int = MAX_BATCHES_PER_RUN,
        max_files: int = MAX_FILES_PER_RUN,
    ) -> str:
        """The new files of the input folder, planned to fit ``max_batches`` and
        ``max_files`` (later files wait for the next run, in name order): ``"found"`` or
        ``"nothing"``."""
        folder = Path(ctx.input_dir)
        what = folder_problem(folder)
        if what is not None:
            raise InputMissing(
                f"input folder {folder} {what}; pass input_dir (or ${ctx.env_prefix}INPUT)"
            )
        paths = sorted(
            p for p in folder.glob(ctx.pattern) if p.is_file() and not p.name.startswith(".")
        )
        files = self.loaded_files
        with self.engine(ctx.target).connect() as conn:
            known = conn.execute(
                sa.select(files.c.file, files.c.sha256, files.c.size, files.c.mtime_ns)
            ).all()
        by_stat = {(r.file, r.size, r.mtime_ns) for r in known}
        by_hash = {(r.file, r.sha256) for r in known}
        pending: list[FileInfo] = []
        skipped, deferred, planned, touched = 0, 0, 0, []
        for path in paths:
            stat = path.stat()
            if ctx.trust_mtime and (path.name, stat.st_size, stat.st_mtime_ns) in by_stat:
                skipped += 1
                continue
            if deferred:  # keep file order: nothing after a deferred file loads before it
                deferred += 1
                continue
            info = self.inspect(path)
            if (info.name, info.sha256) in by_hash:
                skipped += 1
                touched.append(info)
                continue
            need = 0 if info.problem else batches_for(info.rows, ctx.batch_size)
            if len(pending) >= max_files or (pending and planned + need > max_batches):
                deferred += 1
                continue
            if need > max_batches:
                raise BatchBudgetExceeded(
                    f"{info.name}: {info.rows:,} rows need {need:,} batches of "
                    f"{ctx.batch_size:,}; a run takes at most {max_batches:,}: use a larger "
                    "batch_size"
                )
            planned += need
            pending.append(info)
        if touched:  # same content, new mtime (copied again): remember the new mtime
            with self.engine(ctx.target).begin() as conn:
                for info in touched:
                    conn.execute(
                        files.update()
                        .where(files.c.file == info.name, files.c.sha256 == info.sha256)
                        .values(mtime_ns=info.mtime_ns)
                    )
        ctx.pending, ctx.skipped, ctx.deferred = pending, skipped, deferred
        ctx.files_total = len(pending)
        ctx.rows_total = sum(info.rows for info in pending if info.problem is None)
        ctx.batches_total = planned
        log.info(
            "etl: %d new file(s), %d seen before, %d deferred", len(pending), skipped, deferred
        )
        return "found" if pending else "nothing"

    def open_file(self, ctx: FolderContext, step: Step) -> str:
        """Start the current file: ``"ready"``, or ``"rejected"`` (malformed: one reject,
        row 0; or changed since discovery)."""
        info = ctx.current
        ctx.file, ctx.columns, ctx.dialect, ctx.offset, ctx.line = info.name, [], {}, 0, 1
        ctx.batch_from = ctx.file_rows = ctx.file_rejects = ctx.file_batches = ctx.file_start = 0
        ctx.file_estimate = (
            (0, 0) if info.problem else (info.rows, batches_for(info.rows, ctx.batch_size))
        )
        with self.engine(ctx.target).begin() as conn:
            # Rejects (and position-keyed rows) of an earlier version of this file no longer
            # apply.
            rejects = self.rejects
            stale = sa.and_(rejects.c.file == info.name, rejects.c.file_sha256 != info.sha256)
            conn.execute(rejects.delete().where(stale))
            if self.by_position and writers.SOURCE_SHA256 in self.table.c:
                table = self.table
                conn.execute(
                    table.delete().where(
                        table.c[writers.SOURCE_FILE] == info.name,
                        table.c[writers.SOURCE_SHA256] != info.sha256,
                    )
                )
        problem = info.problem
        header: Header | None = None
        if problem is None:
            path = ctx.path(info)
            if not path.exists() or path.stat().st_size != info.size:
                ctx.file_status = "changed"
                return "rejected"
            header, problem = self.read_header(path)
        if problem is not None or header is None:
            reason = problem or "unreadable header"
            whole = {"file": info.name, "row_no": FILE_ROW, "reason": reason, "raw": None}
            self.write(ctx.target, [], [{**whole, "file_sha256": info.sha256}])
            ctx.file_status, ctx.file_rejects = "rejected", 1
            ctx.rejects += 1
            step.note(f"{info.name}: malformed")
            log.info("etl: %s rejected: %s", info.name, reason)
            return "rejected"
        ctx.columns, ctx.dialect = header.columns, header.dialect
        ctx.offset = ctx.file_start = header.data_offset
        ctx.line = header.data_line
        ctx.file_status = "loading"
        step.note(f"{info.name}: {info.rows} rows, from byte {header.data_offset}")
        return "ready"

    def load_batch(self, ctx: FolderContext, step: Step) -> str:
        """One batch from the committed offset: read, validate, write (rows and rejects in
        one transaction), move the offset on: ``"more"`` or ``"eof"``."""
        info = ctx.current
        path = ctx.path(info)
        header = Header(ctx.columns, ctx.file_start, ctx.line, ctx.dialect)
        try:
            if path.stat().st_size != info.size:
                raise FileChanged(f"size {path.stat().st_size} != {info.size}")
            batch = self.fmt.read(
                path,
                header=header,
                offset=ctx.offset,
                end=info.size,
                line=ctx.line,
                limit=ctx.batch_size,
            )
        except (FileChanged, FileNotFoundError) as error:
            # Replaced or removed while loading: what was loaded stays (it is keyed); the new
            # version is loaded from its start by the next run.
            log.warning(
                "etl: %s changed while loading (%s); left for the next run", info.name, error
            )
            ctx.file_status = "changed"
            return "eof"
        sources: list[Record] = []
        good, bad = validate(
            batch.records,
            ctx.columns,
            model=self.model,
            transform=self._with_lineage(info.sha256),
            file=info.name,
            sha256=info.sha256,
            nulls=self.nulls,
            explain=self.explain,
            sources=sources,
        )
        try:
            self.write(ctx.target, good, bad)
        except REFUSALS as error:
            refused = self.write_apart(ctx.target, good, error)
            good = [row for i, row in enumerate(good) if i not in refused]
            bad += [
                reject_row(sources[i], reason, file=info.name, sha256=info.sha256)
                for i, reason in refused.items()
            ]
            self.write(ctx.target, [], bad)
        if batch.offset <= ctx.offset and batch.offset < info.size:
            raise RuntimeError(f"{info.name}: no progress at byte {ctx.offset}")  # a bug: stop
        rejected = f", {len(bad)} rejected" if bad else ""
        step.note(f"bytes {ctx.offset}-{batch.offset}, lines {ctx.line}-{batch.line - 1}{rejected}")
        ctx.batch_from, ctx.offset, ctx.line = ctx.offset, batch.offset, batch.line
        ctx.file_rows += len(batch.records)
        ctx.file_rejects += len(bad)
        ctx.rows_done += len(batch.records)
        ctx.rows_loaded += len(good)
        ctx.rejects += len(bad)
        ctx.batches_done += 1
        ctx.file_batches += 1
        if batch.offset >= info.size:
            ctx.file_status = "loaded"
            ctx.estimate(ctx.file_rows, ctx.file_batches)
            return "eof"
        return "more"

    def close_file(self, ctx: FolderContext, step: Step) -> str:
        """Record the file in ``loaded_files`` (loaded or rejected) so no run takes it again,
        unless its content changed meanwhile: ``"next"`` or ``"finished"``."""
        info = ctx.pending.pop(0)
        if ctx.file_status != "rejected":
            ctx.estimate(ctx.file_rows, ctx.file_batches)  # what the file turned out to hold
        if ctx.file_status == "loaded":
            path = ctx.path(info)
            if not path.exists() or sha256_of(path) != info.sha256:
                log.warning("etl: %s changed while loading; left for the next run", info.name)
                ctx.file_status = "changed"
        if ctx.file_status in ("loaded", "rejected"):
            row = {
                "file": info.name,
                "sha256": info.sha256,
                "size": info.size,
                "mtime_ns": info.mtime_ns,
                "status": ctx.file_status,
                "rows_loaded": ctx.file_rows - ctx.file_rejects
                if ctx.file_status == "loaded"
                else 0,
                "rows_rejected": ctx.file_rejects,
                "loaded_at": _now_iso(),
                "run_id": step.run_id,
            }
            with self.engine(ctx.target).begin() as conn:
                writers.upsert(conn, self.loaded_files, [row])
        {"loaded": ctx.loaded, "rejected": ctx.rejected}.get(ctx.file_status, ctx.changed).append(
            info.name
        )
        ctx.files_done += 1
        ctx.file, ctx.file_status, ctx.columns, ctx.offset, ctx.line = None, "", [], 0, 1
        return "next" if ctx.pending else "finished"

    def report(self, ctx: FolderContext) -> str:
        """A summary of the run and the target, each number saying what it counts: files,
        rows read (valid + rejected), target rows (one per key: a row whose key was seen
        before overwrites it), rejects (rows + files). Also set as ``ctx.summary``."""
        count = sa.select(sa.func.count())
        table, rejects, noun = self.table, self.rejects, self.noun
        with self.engine(ctx.target).connect() as conn:
            total = conn.execute(count.select_from(table)).scalar_one()
            mine = (
                conn.execute(
                    count.select_from(table).where(table.c[writers.SOURCE_FILE].in_(ctx.loaded))
                ).scalar_one()
                if writers.SOURCE_FILE in table.c
                else None
            )
            row_rejects = conn.execute(
                count.select_from(rejects).where(rejects.c.row_no != FILE_ROW)
            ).scalar_one()
            file_rejects = conn.execute(
                count.select_from(rejects).where(rejects.c.row_no == FILE_ROW)
            ).scalar_one()
        files = [f"{len(ctx.loaded)} loaded"] if ctx.loaded else []
        if ctx.rejected:
            files.append(f"{len(ctx.rejected)} malformed ({', '.join(ctx.rejected)})")
        if ctx.changed:
            files.append(f"{len(ctx.changed)} changed while loading, left for the next run")
        if ctx.skipped:
            files.append(f"{ctx.skipped} seen before (loaded or rejected)")
        if ctx.deferred:
            files.append(f"{ctx.deferred} left for the next run")
        parts = [f"files: {', '.join(files)}" if files else "files: nothing new"]
        if ctx.loaded or ctx.rows_done:
            bad_rows = ctx.rejects - len(ctx.rejected)
            read = (
                f"rows read: {ctx.rows_done:,} = {ctx.rows_loaded:,} valid + {bad_rows:,} rejected"
            )
            if mine is not None:
                repeated = ctx.rows_loaded - mine
                key = "/".join(c.name.replace("_", " ") for c in table.primary_key.columns)
                again = (
                    f" ({repeated:,} {key}(s) seen again: the row read last wins)"
                    if repeated
                    else ""
                )
                read += f"; the valid rows upserted {mine:,} {noun}(s){again}"
            parts.append(read)
        target = sa.make_url(ctx.target).render_as_string(hide_password=True)
        parts.append(
            f"target {target} now holds {total:,} {noun}(s) and {row_rejects + file_rejects:,} "
            f"reject(s) ({row_rejects:,} row(s), {file_rejects:,} malformed file(s))"
        )
        ctx.summary = "; ".join(parts) + "."
        log.info("etl: %s", ctx.summary)
        return ctx.summary

    def _with_lineage(self, sha256: str) -> Callable[[Any, str, int], dict[str, Any]]:
        transform, lineage = self.transform, self.lineage
        if not lineage:
            return transform

        def to_row(row: Any, file: str, line: int) -> dict[str, Any]:
            out = transform(row, file, line)
            values = {
                writers.SOURCE_FILE: file,
                writers.SOURCE_ROW: line,
                writers.SOURCE_SHA256: sha256,
            }
            for name in lineage:
                out.setdefault(name, values[name])
            return out

        return to_row


def _fields(row: BaseModel, file: str, line: int) -> dict[str, Any]:
    return row.model_dump()
