"""ETL: load a folder of order CSV files into a database table, one batch per step.

    discover --found--> open_file --ready--> load_batch --more--> load_batch (one batch
       |                  |    ^                 |                 per step, to itself)
       | nothing  rejected|    | next            | eof
       |                  v    |                 |
       |                close_file <-------------+
       |                  | finished
       v                  |
     report <-------------+
       | next
       v
     done

* ``discover`` (extract): lists the input folder, skips files already recorded in the target's
  ``loaded_files`` table (same name and sha256), and checks each new file as a whole: empty,
  not UTF-8 and wrong header make it *malformed* (one reject, the run goes on).
* ``load_batch`` reads ``batch_size`` records from the byte offset committed in the context,
  validates each with pydantic (a bad row becomes a reject with its reason), transforms the
  good ones and upserts them, rejects included, in one target transaction. Each batch is a
  step boundary: killed mid-file, the run resumes at the last committed offset, and re-running
  the interrupted batch rewrites the same keys (orders by ``order_id``, rejects by file and
  row), so nothing is duplicated. An order id seen again (a later file, a correction) is
  overwritten: the file loaded last wins; files load in name order.
* ``close_file`` records the file in ``loaded_files``; ``report`` writes a summary.

Run it (the default context loads the sample data in ``workflows/data``)::

    flowloop run workflows/etl.py --context '{}'
    flowloop run workflows/etl.py --context '{"input_dir": "inbox", "batch_size": 10000}'

As a loop that picks up new files every ``ETL_EVERY`` seconds (default 10)::

    ETL_INPUT=inbox flowloop worker workflows/etl.py

Drop files atomically (write ``x.csv.part``, then rename it to ``x.csv``): a file is read
up to the size it had when it was discovered, and one that changes meanwhile is left for the
next run. The target is ``etl_target.db`` inside the input folder unless ``target_url``
(any SQLAlchemy URL, or ``$ETL_TARGET``) says otherwise; for the bundled sample folder it is
``$XDG_DATA_HOME/flowloop/etl_target.db`` (``~/.local/share/…``), never the source tree.
The loop does nothing unless ``ETL_INPUT`` is set, and an iteration that finds no new file
creates no run (its context function returns ``None``: journaled ``iteration_skipped_idle``).
The context, target URL included, is journaled: keep passwords out of the URL (use
``~/.pgpass`` or ``PGPASSWORD`` for PostgreSQL).
"""

from __future__ import annotations

import codecs
import csv
import hashlib
import logging
import math
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import IO, Annotated, Any, Final, Literal

import sqlalchemy as sa
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite

from flowloop import Retry, Step, Workflow
from flowloop.loops import Loop

log = logging.getLogger("workflows.etl")

HERE: Final = Path(__file__).resolve().parent
SAMPLE_DIR: Final = HERE / "data"
TARGET_FILE: Final = "etl_target.db"
DEFAULT_BATCH_SIZE: Final = 1_000
DEFAULT_EVERY_SECONDS: Final = 10.0
MAX_BATCHES_PER_RUN: Final = 100_000
"""``max_visits`` of ``load_batch``: 100 million rows per run at the default batch size.
``discover`` plans each run to fit (a file's batch count is known from its line count), so
the guard only fires on a bug that stops making progress; the files past the budget are left
for the next run, in order."""
MAX_FILES_PER_RUN: Final = 1_000
"""``max_visits`` of ``open_file`` and ``close_file``; later files wait for the next run."""
CHUNK_BYTES: Final = 1 << 20
RAW_KEPT_CHARS: Final = 500
"""How much of a rejected record's text the rejects table keeps."""
FILE_ROW: Final = 0
"""The ``row_no`` of a reject that concerns the whole file."""

COLUMNS: Final = (
    "order_id",
    "ordered_at",
    "customer_id",
    "email",
    "country",
    "sku",
    "product",
    "quantity",
    "unit_price",
    "currency",
    "status",
)
EUR_PER: Final = {"EUR": Decimal("1"), "USD": Decimal("0.92"), "GBP": Decimal("1.17")}
"""Fixed rates keep the example deterministic; a real job joins a rates table by date."""


# -- the target database ---------------------------------------------------------------------

target_metadata = sa.MetaData()

orders = sa.Table(
    "orders",
    target_metadata,
    sa.Column("order_id", sa.String(32), primary_key=True),
    sa.Column("ordered_at", sa.String(32), nullable=False),  # ISO-8601, UTC
    sa.Column("customer_id", sa.String(32), nullable=False),
    sa.Column("email", sa.String(254), nullable=False),
    sa.Column("country", sa.String(2), nullable=False),
    sa.Column("sku", sa.String(32), nullable=False),
    sa.Column("product", sa.String(200), nullable=False),
    sa.Column("quantity", sa.Integer, nullable=False),
    sa.Column("unit_price_cents", sa.BigInteger, nullable=False),
    sa.Column("currency", sa.String(3), nullable=False),
    sa.Column("total_cents", sa.BigInteger, nullable=False),
    sa.Column("total_eur_cents", sa.BigInteger, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("source_file", sa.String(255), nullable=False),
    sa.Column("source_row", sa.Integer, nullable=False),
)

rejects = sa.Table(
    "rejects",
    target_metadata,
    sa.Column("file", sa.String(255), primary_key=True),
    sa.Column("row_no", sa.Integer, primary_key=True),  # the record's first line; 0: the file
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("raw", sa.Text),
    sa.Column("file_sha256", sa.String(64), nullable=False),
)

loaded_files = sa.Table(
    "loaded_files",
    target_metadata,
    sa.Column("file", sa.String(255), primary_key=True),
    sa.Column("sha256", sa.String(64), primary_key=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("mtime_ns", sa.BigInteger, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),  # loaded | rejected
    sa.Column("rows_loaded", sa.Integer, nullable=False),
    sa.Column("rows_rejected", sa.Integer, nullable=False),
    sa.Column("loaded_at", sa.String(32), nullable=False),
    sa.Column("run_id", sa.String(64), nullable=False),
)

_engines: dict[str, tuple[int, sa.Engine]] = {}
_engines_lock = threading.Lock()


def target_engine(url: str) -> sa.Engine:
    """One engine per target URL and process (steps run in threads; a forked child must not
    share its parent's connections), tables created on first use."""
    with _engines_lock:
        cached = _engines.get(url)
        if cached is not None and cached[0] == os.getpid():
            return cached[1]
        if cached is not None:
            cached[1].dispose(close=False)
        sqlite_target = sa.make_url(url).get_backend_name() == "sqlite"
        # A loop worker holds its pool for days: check server connections before use.
        engine = sa.create_engine(
            url, connect_args=_connect_args(url), pool_pre_ping=not sqlite_target
        )
        if engine.dialect.name == "sqlite":
            sa.event.listen(engine, "connect", _sqlite_pragmas)
        target_metadata.create_all(engine)
        _engines[url] = (os.getpid(), engine)
        return engine


def _connect_args(url: str) -> dict[str, Any]:
    return {"timeout": 30} if sa.make_url(url).get_backend_name() == "sqlite" else {}


def _sqlite_pragmas(dbapi: Any, _record: Any) -> None:
    # WAL + NORMAL: a committed batch survives the process being killed.
    cursor = dbapi.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def upsert(conn: sa.Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``rows`` or overwrite the rows with the same primary key: running it twice
    leaves the table as running it once."""
    keys = [column.name for column in table.primary_key.columns]
    # One row per key (the last wins, as it would row by row): PostgreSQL refuses to update
    # one row twice in a statement.
    unique = list({tuple(row[k] for k in keys): row for row in rows}.values())
    if not unique:
        return
    others = [c.name for c in table.columns if c.name not in keys]
    dialect = conn.dialect.name
    if dialect in ("sqlite", "postgresql"):
        insert = sqlite.insert(table) if dialect == "sqlite" else postgresql.insert(table)
        conn.execute(
            insert.on_conflict_do_update(
                index_elements=keys, set_={name: insert.excluded[name] for name in others}
            ),
            unique,
        )
    elif dialect in ("mysql", "mariadb"):
        my_insert = mysql.insert(table)
        conn.execute(
            my_insert.on_duplicate_key_update({name: my_insert.inserted[name] for name in others}),
            unique,
        )
    else:  # any other database: delete the keys, then insert, in the caller's transaction
        where = sa.and_(*(table.c[k] == sa.bindparam(f"key_{k}") for k in keys))
        old = [{f"key_{k}": row[k] for k in keys} for row in unique]
        conn.execute(table.delete().where(where), old)
        conn.execute(table.insert(), unique)


# -- rows: validate and transform ------------------------------------------------------------


# Checks run inside pydantic-core (patterns, case folding): a Python validator per field
# would cost more than the rest of the row. PATTERN_MEANS turns a pattern failure into words.
CURRENCIES: Final = ("EUR", "USD", "GBP")
STATUSES: Final = ("placed", "paid", "shipped", "cancelled", "refunded")
PATTERN_MEANS: Final = {
    "order_id": "not an order id like SO-10001",
    "customer_id": "not a customer id like C1042",
    "email": "not an email address",
    "country": "not a two-letter country code",
    "sku": "not a SKU like BK-1001",
    "currency": f"not one of {', '.join(CURRENCIES)}",
    "status": f"not one of {', '.join(STATUSES)}",
}


def _one_of(values: Sequence[str]) -> str:
    return "(?i)^(" + "|".join(values) + ")$"  # any case: the pattern sees the raw text


class OrderRow(BaseModel):
    """One CSV record, as text in, typed out. A failure is the reject's reason."""

    model_config = ConfigDict(str_strip_whitespace=True, frozen=True)

    order_id: Annotated[str, StringConstraints(pattern=r"^[A-Z]{2,5}-\d{3,12}$")]
    ordered_at: datetime
    customer_id: Annotated[str, StringConstraints(pattern=r"^C\d{3,12}$")]
    email: Annotated[
        str,
        StringConstraints(
            to_lower=True, max_length=254, pattern=r"(?i)^[^@\s,;]+@[^@\s,;]+\.[a-z]{2,}$"
        ),
    ]
    country: Annotated[str, StringConstraints(to_upper=True, pattern=r"(?i)^[A-Z]{2}$")]
    sku: Annotated[str, StringConstraints(pattern=r"^[A-Z0-9][A-Z0-9-]{1,31}$")]
    product: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    quantity: int = Field(gt=0, le=10_000)
    unit_price: Decimal = Field(ge=0, le=1_000_000, decimal_places=2)
    currency: Annotated[str, StringConstraints(to_upper=True, pattern=_one_of(CURRENCIES))]
    status: Annotated[str, StringConstraints(to_lower=True, pattern=_one_of(STATUSES))]


def why_invalid(error: ValidationError) -> str:
    """``field: problem (got 'value')`` for each failed field, on one line."""
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "row"
        message = item["msg"]
        if item["type"] == "string_pattern_mismatch":
            message = PATTERN_MEANS.get(where, message)
        got = item.get("input")
        shown = f" (got {got!r})" if isinstance(got, str) else ""
        parts.append(f"{where}: {message}{shown}")
    return "; ".join(parts)


def transform(row: OrderRow, *, file: str, line: int) -> dict[str, Any]:
    """The target row: UTC time, amounts in cents (and in EUR), lineage."""
    at = row.ordered_at if row.ordered_at.tzinfo else row.ordered_at.replace(tzinfo=UTC)
    unit_cents = int(row.unit_price * 100)
    total_cents = unit_cents * row.quantity
    total_eur = (Decimal(total_cents) * EUR_PER[row.currency]).quantize(
        Decimal(1), rounding=ROUND_HALF_EVEN
    )
    return {
        "order_id": row.order_id,
        "ordered_at": at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "customer_id": row.customer_id,
        "email": row.email,
        "country": row.country,
        "sku": row.sku,
        "product": row.product,
        "quantity": row.quantity,
        "unit_price_cents": unit_cents,
        "currency": row.currency,
        "total_cents": total_cents,
        "total_eur_cents": int(total_eur),
        "status": row.status,
        "source_file": file,
        "source_row": line,
    }


# -- files: inspect, read records ------------------------------------------------------------


class FileInfo(BaseModel):
    """A new file found by ``discover``."""

    name: str
    size: int
    mtime_ns: int
    sha256: str
    rows: int
    """Data lines (an upper bound on records: quoted fields may span lines)."""
    problem: str | None = None
    """Why the whole file is rejected (empty, not UTF-8, wrong header), or None."""


@dataclass(frozen=True)
class Header:
    columns: list[str]
    data_offset: int


class FileChanged(Exception):
    """The file is not what ``discover`` saw: it is left for the next run."""


def read_header(path: Path) -> tuple[Header | None, str | None]:
    """The columns (in file order) and where the data starts, or why the header is wrong."""
    with path.open("rb") as handle:
        first = handle.readline(1 << 16)
    bom = len(codecs.BOM_UTF8) if first.startswith(codecs.BOM_UTF8) else 0
    try:
        text = first[bom:].decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8: the header line is not valid UTF-8"
    if not text.strip():
        return None, "no header: the first line is blank"
    names = [name.strip().lower() for name in next(csv.reader([text]))]
    missing = [c for c in COLUMNS if c not in names]
    unexpected = [n for n in names if n not in COLUMNS]
    doubled = sorted({n for n in names if names.count(n) > 1})
    if missing or unexpected or doubled:
        problems = []
        if missing:
            problems.append("missing " + ", ".join(missing))
        if unexpected:
            problems.append("unexpected " + ", ".join(unexpected))
        if doubled:
            problems.append("repeated " + ", ".join(doubled))
        return None, f"wrong header: {'; '.join(problems)} (expected {','.join(COLUMNS)})"
    return Header(names, len(first)), None


def first_bad_utf8(path: Path) -> str:
    """Where the first invalid UTF-8 byte is, in words (only for a file known to be bad)."""
    offset = 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                byte = line[error.start]
                return (
                    f"not UTF-8: byte 0x{byte:02X} on line {number} (byte offset "
                    f"{offset + error.start}) is invalid ({error.reason}); re-export it as UTF-8"
                )
            offset += len(line)
    return "not UTF-8: the file ends inside a multi-byte character"


def record_ends(chunk: bytes, quoted: bool) -> tuple[int, bool]:
    """Newlines in ``chunk`` that end a CSV record (outside double quotes: a quoted field
    may hold a newline), and whether the chunk ends inside quotes."""
    if b'"' not in chunk:
        return (0 if quoted else chunk.count(b"\n")), quoted
    parts = chunk.split(b'"')  # an escaped "" flips twice: an empty part in between
    ends = sum(part.count(b"\n") for part in parts[1 if quoted else 0 :: 2])
    return ends, quoted != (len(parts) % 2 == 0)


def inspect_file(path: Path) -> FileInfo:
    """Size, sha256 and record count in one pass, and whether the file can be loaded at all."""
    stat = path.stat()
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    newlines, utf8, last, blank, quoted = 0, True, b"", True, False
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            ends, quoted = record_ends(chunk, quoted)
            newlines += ends
            blank = blank and not chunk.strip()
            last = chunk[-1:]
            if utf8:
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError:
                    utf8 = False
    if utf8:
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            utf8 = False
    lines = newlines + (1 if last and last != b"\n" else 0)
    problem: str | None = None
    if stat.st_size == 0:
        problem = "empty file (0 bytes): nothing to load"
    elif blank:
        problem = "empty file (only blank lines): nothing to load"
    elif not utf8:
        problem = first_bad_utf8(path)
    else:
        problem = read_header(path)[1]
    return FileInfo(
        name=path.name,
        size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        sha256=digest.hexdigest(),
        rows=max(0, lines - 1),
        problem=problem,
    )


@dataclass(frozen=True)
class Record:
    line: int
    """The line the record starts on (the header is line 1)."""
    fields: list[str] | None
    raw: bytes
    error: str | None = None


class _Lines:
    """Decoded lines of a binary file from ``offset`` up to ``end``. csv.reader pulls exactly
    the lines of one record (quoted fields may span lines), so after each record ``offset`` is
    where the next one starts: the resume point a batch commits."""

    def __init__(self, handle: IO[bytes], offset: int, end: int) -> None:
        self.handle = handle
        self.offset = offset
        self.end = end
        self.count = 0
        self.taken: list[bytes] = []

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self.offset >= self.end:
            raise StopIteration
        raw = self.handle.readline(self.end - self.offset)
        if not raw:
            raise StopIteration
        self.offset += len(raw)
        self.count += 1
        self.taken.append(raw)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise FileChanged("is no longer valid UTF-8") from None

    def take(self) -> bytes:
        raw = b"".join(self.taken)
        self.taken.clear()
        return raw


@dataclass(frozen=True)
class Extracted:
    records: list[Record]
    offset: int
    """Byte offset after the last record read."""
    line: int
    """Line number of the next record."""


def extract(path: Path, *, offset: int, end: int, line: int, limit: int) -> Extracted:
    """Up to ``limit`` records from byte ``offset`` (never past ``end``); blank lines skipped."""
    records: list[Record] = []
    with path.open("rb") as handle:
        handle.seek(offset)
        lines = _Lines(handle, offset, end)
        reader = csv.reader(lines)
        while len(records) < limit:
            start = line + lines.count
            try:
                fields = next(reader)
            except StopIteration:
                break
            except csv.Error as error:
                records.append(Record(start, None, lines.take(), f"unreadable CSV: {error}"))
                continue
            raw = lines.take()
            if fields:
                records.append(Record(start, fields, raw))
        return Extracted(records, lines.offset, line + lines.count)


def validate(
    records: Sequence[Record], columns: Sequence[str], *, file: str, sha256: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Target rows and reject rows for ``records``: a bad record never stops the batch."""
    good: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    width = len(columns)

    def reject(record: Record, reason: str) -> None:
        raw = record.raw.decode("utf-8", "replace").rstrip("\r\n")
        bad.append(
            {
                "file": file,
                "row_no": record.line,
                "reason": reason,
                "raw": raw[:RAW_KEPT_CHARS],
                "file_sha256": sha256,
            }
        )

    for record in records:
        if record.fields is None:
            reject(record, record.error or "unreadable CSV")
            continue
        if len(record.fields) != width:
            reject(record, f"expected {width} fields, got {len(record.fields)}")
            continue
        try:
            row = OrderRow.model_validate(dict(zip(columns, record.fields, strict=True)))
        except ValidationError as error:
            reject(record, why_invalid(error))
            continue
        good.append(transform(row, file=file, line=record.line))
    return good, bad


def load(url: str, rows: Sequence[Mapping[str, Any]], bad: Sequence[Mapping[str, Any]]) -> None:
    """Upsert one batch's rows and rejects in one transaction."""
    with target_engine(url).begin() as conn:
        upsert(conn, orders, rows)
        upsert(conn, rejects, bad)


# -- the workflow ----------------------------------------------------------------------------


def sample_target_dir() -> Path:
    """Where the sample data's target goes: ``$XDG_DATA_HOME/flowloop`` (default
    ``~/.local/share/flowloop``), outside the source tree."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "flowloop"


def default_input_dir() -> str:
    return os.environ.get("ETL_INPUT") or str(SAMPLE_DIR)


def default_batch_size() -> int:
    return int(os.environ.get("ETL_BATCH_SIZE") or DEFAULT_BATCH_SIZE)


class EtlContext(BaseModel):
    """Where to read and write, where a run is, and what it has done so far."""

    input_dir: str = Field(default_factory=default_input_dir, validate_default=True)
    target_url: str | None = Field(
        default_factory=lambda: os.environ.get("ETL_TARGET") or None, validate_default=True
    )
    """Any SQLAlchemy URL (or a file path, as SQLite); default ``<input_dir>/etl_target.db``."""
    pattern: str = "*.csv"
    batch_size: int = Field(default_factory=default_batch_size, ge=1, le=1_000_000)
    trust_mtime: bool = True
    """Skip a file whose name, size and mtime match a loaded one without hashing it again."""

    # the plan: files to load in this run, in name order (the first is the current one)
    pending: list[FileInfo] = Field(default_factory=list)
    skipped: int = 0
    deferred: int = 0

    # the current file and the resume point
    file: str | None = None
    file_status: Literal["", "loading", "loaded", "rejected", "changed"] = ""
    columns: list[str] = Field(default_factory=list)
    offset: int = 0
    """Byte offset of the next record to read: where a resumed run continues."""
    line: int = 1
    batch_from: int = 0
    """Byte offset where the last committed batch started (the journal shows the chain)."""
    file_start: int = 0
    """Byte offset of the current file's first record (after the header)."""
    file_rows: int = 0
    file_rejects: int = 0
    file_batches: int = 0
    file_estimate: tuple[int, int] = (0, 0)
    """Rows and batches the current file is expected to have (its share of the totals)."""

    # progress (`flowloop run` prints these with a rate)
    files_total: int = 0
    files_done: int = 0
    rows_total: int = 0
    rows_done: int = 0
    rows_loaded: int = 0
    rejects: int = 0
    batches_total: int = 0
    batches_done: int = 0

    loaded: list[str] = Field(default_factory=list)
    rejected: list[str] = Field(default_factory=list)
    changed: list[str] = Field(default_factory=list)
    summary: str | None = None

    @field_validator("input_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        # Stored absolute: a run resumed from another directory reads the same folder.
        return str(Path(value).expanduser().resolve())

    @field_validator("pattern")
    @classmethod
    def _names_only(cls, value: str) -> str:
        if "/" in value or os.sep in value or value.startswith("."):
            raise ValueError("pattern matches file names inside input_dir (no '/', no leading '.')")
        return value

    @field_validator("target_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None or "://" in value:
            return value
        return f"sqlite:///{Path(value).expanduser().resolve()}"

    def estimate(self, rows: int, batches: int) -> None:
        """Replace the current file's share of ``rows_total`` and ``batches_total``."""
        old_rows, old_batches = self.file_estimate
        self.rows_total += rows - old_rows
        self.batches_total += batches - old_batches
        self.file_estimate = (rows, batches)

    @property
    def target(self) -> str:
        if self.target_url:
            return self.target_url
        # Next to the input, except for the bundled sample folder: never into the checkout.
        folder = Path(self.input_dir)
        if folder == SAMPLE_DIR:
            folder = sample_target_dir()
            folder.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{folder / TARGET_FILE}"

    @property
    def current(self) -> FileInfo:
        return self.pending[0]

    def path(self, info: FileInfo) -> Path:
        return Path(self.input_dir) / info.name


def batches_for(rows: int, batch_size: int) -> int:
    return max(1, math.ceil(rows / batch_size))


def _now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


TRANSIENT: Final = (sa.exc.OperationalError, sa.exc.InterfaceError, OSError)
retry_transient = Retry(attempts=5, backoff="exponential", base=0.5, cap=30, on=TRANSIENT)

etl = Workflow(
    "etl",
    context=EtlContext,
    version=1,
    description="CSV files of orders -> validated, transformed, upserted into a table",
)


@etl.step(initial=True, on={"found": "open_file", "nothing": "report"}, retry=retry_transient)
def discover(ctx: EtlContext, step: Step) -> str:
    """Extract: the new files of the input folder, planned to fit this run's batch budget."""
    folder = Path(ctx.input_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"input folder {folder} does not exist")
    paths = sorted(
        p for p in folder.glob(ctx.pattern) if p.is_file() and not p.name.startswith(".")
    )
    engine = target_engine(ctx.target)
    with engine.connect() as conn:
        known = conn.execute(
            sa.select(
                loaded_files.c.file,
                loaded_files.c.sha256,
                loaded_files.c.size,
                loaded_files.c.mtime_ns,
            )
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
        info = inspect_file(path)
        if (info.name, info.sha256) in by_hash:
            skipped += 1
            touched.append(info)
            continue
        need = 0 if info.problem else batches_for(info.rows, ctx.batch_size)
        if len(pending) >= MAX_FILES_PER_RUN or (pending and planned + need > MAX_BATCHES_PER_RUN):
            deferred += 1
            continue
        if need > MAX_BATCHES_PER_RUN:
            raise ValueError(
                f"{info.name}: {info.rows:,} rows need {need:,} batches of {ctx.batch_size:,}; "
                f"a run takes at most {MAX_BATCHES_PER_RUN:,}: use a larger batch_size"
            )
        planned += need
        pending.append(info)
    if touched:  # same content, new mtime (copied again): remember the new mtime
        with engine.begin() as conn:
            for info in touched:
                conn.execute(
                    loaded_files.update()
                    .where(loaded_files.c.file == info.name, loaded_files.c.sha256 == info.sha256)
                    .values(mtime_ns=info.mtime_ns)
                )
    ctx.pending, ctx.skipped, ctx.deferred = pending, skipped, deferred
    ctx.files_total = len(pending)
    ctx.rows_total = sum(info.rows for info in pending if info.problem is None)
    ctx.batches_total = planned
    log.info("etl: %d new file(s), %d already loaded, %d deferred", len(pending), skipped, deferred)
    return "found" if pending else "nothing"


@etl.step(
    on={"ready": "load_batch", "rejected": "close_file"},
    retry=retry_transient,
    max_visits=MAX_FILES_PER_RUN,
)
def open_file(ctx: EtlContext, step: Step) -> str:
    """Validate the file as a whole; a malformed one becomes one reject (row 0)."""
    info = ctx.current
    ctx.file, ctx.columns, ctx.offset, ctx.line, ctx.batch_from = info.name, [], 0, 1, 0
    ctx.file_rows = ctx.file_rejects = ctx.file_batches = ctx.file_start = 0
    ctx.file_estimate = (
        (0, 0) if info.problem else (info.rows, batches_for(info.rows, ctx.batch_size))
    )
    engine = target_engine(ctx.target)
    with engine.begin() as conn:
        # Rejects of an earlier version of this file name no longer apply.
        stale = sa.and_(rejects.c.file == info.name, rejects.c.file_sha256 != info.sha256)
        conn.execute(rejects.delete().where(stale))
    problem = info.problem
    header: Header | None = None
    if problem is None:
        path = ctx.path(info)
        if not path.exists() or path.stat().st_size != info.size:
            ctx.file_status = "changed"
            return "rejected"
        header, problem = read_header(path)
    if problem is not None or header is None:
        reason = problem or "unreadable header"
        load(
            ctx.target,
            [],
            [
                {
                    "file": info.name,
                    "row_no": FILE_ROW,
                    "reason": reason,
                    "raw": None,
                    "file_sha256": info.sha256,
                }
            ],
        )
        ctx.file_status, ctx.file_rejects = "rejected", 1
        ctx.rejects += 1
        step.note(f"{info.name}: malformed")
        log.info("etl: %s rejected: %s", info.name, reason)
        return "rejected"
    ctx.columns, ctx.offset, ctx.line = header.columns, header.data_offset, 2
    ctx.file_start = header.data_offset
    ctx.file_status = "loading"
    step.note(f"{info.name}: {info.rows} rows, from byte {header.data_offset}")
    return "ready"


@etl.step(
    on={"more": "load_batch", "eof": "close_file"},
    retry=retry_transient,
    max_visits=MAX_BATCHES_PER_RUN,
)
def load_batch(ctx: EtlContext, step: Step) -> str:
    """One batch: extract ``batch_size`` records from the committed offset, validate,
    transform, load (rows and rejects in one transaction), and move the offset on."""
    info = ctx.current
    path = ctx.path(info)
    try:
        if path.stat().st_size != info.size:
            raise FileChanged(f"size {path.stat().st_size} != {info.size}")
        batch = extract(path, offset=ctx.offset, end=info.size, line=ctx.line, limit=ctx.batch_size)
    except (FileChanged, FileNotFoundError) as error:
        # Replaced or removed while loading: what was loaded stays (it is keyed); the new
        # version is loaded from its start by the next run.
        log.warning("etl: %s changed while loading (%s); left for the next run", info.name, error)
        ctx.file_status = "changed"
        return "eof"
    good, bad = validate(batch.records, ctx.columns, file=info.name, sha256=info.sha256)
    load(ctx.target, good, bad)
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


@etl.step(
    on={"next": "open_file", "finished": "report"},
    retry=retry_transient,
    max_visits=MAX_FILES_PER_RUN,
)
def close_file(ctx: EtlContext, step: Step) -> str:
    """Record the file in ``loaded_files`` (loaded or rejected), so no run takes it again."""
    info = ctx.pending.pop(0)
    if ctx.file_status != "rejected":
        ctx.estimate(ctx.file_rows, ctx.file_batches)  # what the file turned out to hold
    if ctx.file_status in ("loaded", "rejected"):
        row = {
            "file": info.name,
            "sha256": info.sha256,
            "size": info.size,
            "mtime_ns": info.mtime_ns,
            "status": ctx.file_status,
            "rows_loaded": ctx.file_rows - ctx.file_rejects if ctx.file_status == "loaded" else 0,
            "rows_rejected": ctx.file_rejects,
            "loaded_at": _now_iso(),
            "run_id": step.run_id,
        }
        with target_engine(ctx.target).begin() as conn:
            upsert(conn, loaded_files, [row])
    if ctx.file_status == "loaded":
        ctx.loaded.append(info.name)
    elif ctx.file_status == "rejected":
        ctx.rejected.append(info.name)
    else:
        ctx.changed.append(info.name)
    ctx.files_done += 1
    ctx.file, ctx.file_status, ctx.columns, ctx.offset, ctx.line = None, "", [], 0, 1
    return "next" if ctx.pending else "finished"


@etl.step(next="done", retry=retry_transient)
def report(ctx: EtlContext, step: Step) -> None:
    """Summarise the run and the target."""
    count = sa.select(sa.func.count())
    with target_engine(ctx.target).connect() as conn:
        total = conn.execute(count.select_from(orders)).scalar_one()
        mine = conn.execute(
            count.select_from(orders).where(orders.c.source_file.in_(ctx.loaded))
        ).scalar_one()
        row_rejects = conn.execute(
            count.select_from(rejects).where(rejects.c.row_no != FILE_ROW)
        ).scalar_one()
        file_rejects = conn.execute(
            count.select_from(rejects).where(rejects.c.row_no == FILE_ROW)
        ).scalar_one()
    # Each number says what it counts: files, rows read (valid + rejected), orders (one per
    # order id: a row whose id was seen before overwrites it), rejects (rows + files).
    files = [f"{len(ctx.loaded)} loaded"] if ctx.loaded else []
    if ctx.rejected:
        files.append(f"{len(ctx.rejected)} malformed ({', '.join(ctx.rejected)})")
    if ctx.changed:
        files.append(f"{len(ctx.changed)} changed while loading, left for the next run")
    if ctx.skipped:
        files.append(f"{ctx.skipped} already loaded")
    if ctx.deferred:
        files.append(f"{ctx.deferred} left for the next run")
    parts = [f"files: {', '.join(files)}" if files else "files: nothing new"]
    if ctx.loaded or ctx.rows_done:
        bad_rows = ctx.rejects - len(ctx.rejected)
        repeated = ctx.rows_loaded - mine
        again = (
            f" ({repeated:,} order id(s) seen again: the row read last wins)" if repeated else ""
        )
        parts.append(
            f"rows read: {ctx.rows_done:,} = {ctx.rows_loaded:,} valid + {bad_rows:,} rejected; "
            f"the valid rows upserted {mine:,} order(s){again}"
        )
    target = sa.make_url(ctx.target).render_as_string(hide_password=True)
    parts.append(
        f"target {target} now holds {total:,} order(s) and {row_rejects + file_rejects:,} "
        f"reject(s) ({row_rejects:,} row(s), {file_rejects:,} malformed file(s))"
    )
    ctx.summary = "; ".join(parts) + "."
    log.info("etl: %s", ctx.summary)


etl.final("done")


# -- as a loop -------------------------------------------------------------------------------


def inbox_loop(
    name: str = "etl_inbox",
    *,
    every: float | None = None,
    context: Mapping[str, Any] | None = None,
) -> Loop:
    """A loop that runs :data:`etl` over the input folder every ``every`` seconds after the
    previous run ended (``fixed_delay``); files already loaded are skipped."""
    interval = (
        every if every is not None else float(os.environ.get("ETL_EVERY") or DEFAULT_EVERY_SECONDS)
    )
    fixed = dict(context or {})

    def when_new_files(_iteration: Any) -> EtlContext | None:
        # None: nothing to do, no run (journaled iteration_skipped_idle). Without ETL_INPUT
        # (or an input_dir here) the loop stays idle: `flowloop worker workflows/` must not
        # load the bundled sample folder unasked.
        if "input_dir" not in fixed and not os.environ.get("ETL_INPUT"):
            return None
        ctx = EtlContext.model_validate(fixed)
        return ctx if has_new_files(ctx) else None

    return Loop(
        name,
        workflow=etl,
        context=when_new_files,
        every=interval,
        mode="fixed_delay",
        max_failures=5,
    )


def has_new_files(ctx: EtlContext) -> bool:
    """Whether the input folder may hold a file to load: one whose name, size and mtime
    match no loaded file (``discover`` then checks its content). A missing folder or target
    is ``True``: the run says what is wrong."""
    folder = Path(ctx.input_dir)
    if not ctx.trust_mtime or not folder.is_dir():
        return True
    seen = {
        (p.name, p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.glob(ctx.pattern)
        if p.is_file() and not p.name.startswith(".")
    }
    if not seen:
        return False
    try:
        with target_engine(ctx.target).connect() as conn:
            known = conn.execute(
                sa.select(loaded_files.c.file, loaded_files.c.size, loaded_files.c.mtime_ns)
            ).all()
    except sa.exc.SQLAlchemyError:
        return True
    return bool(seen - {(r.file, r.size, r.mtime_ns) for r in known})


etl_inbox = inbox_loop()


# -- without flowloop ------------------------------------------------------------------------


def run_plain(context: Mapping[str, Any] | EtlContext, *, run_id: str = "plain") -> EtlContext:
    """The same steps in a plain loop, with no journal: nothing survives a crash. For
    benchmarks (the cost of checkpointing) and as a reference in tests."""
    ctx = etl.parse_context(context)
    assert isinstance(ctx, EtlContext)
    state, visits = etl.initial, {etl.initial: 1}
    while not etl.is_final(state):
        spec = etl.steps[state]
        step = Step(
            run_id=run_id,
            workflow=etl.name,
            state=state,
            attempt=1,
            visit=visits[state],
            seq=0,
            worker="plain",
        )
        returned = spec.fn(ctx, step)
        state = etl.next_state(state, etl.event_for(state, returned))
        visits[state] = visits.get(state, 0) + 1
    return ctx
