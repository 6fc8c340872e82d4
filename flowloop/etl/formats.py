"""Record readers over a byte range of a file: CSV in any dialect, and JSON lines.

A reader starts at a byte offset and stops after ``limit`` records (or at ``end``, the size
the file had when it was inspected); it returns the records and the byte offset where the
next record starts: the resume point a batch commits. The offset is exact across quoted CSV
fields that span lines (``csv.reader`` pulls exactly one record's lines), CRLF line ends and
a UTF-8 byte-order mark (skipped by the header). Lines end with ``\\n`` (LF or CRLF; a file of
old Mac ``\\r``-only line ends reads as one record).
"""

from __future__ import annotations

import codecs
import csv
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, Protocol

from flowloop.errors import FlowloopError

SNIFF_BYTES: Final = 1 << 16
"""How much of a file :class:`CsvFormat` reads to guess its dialect."""
DIALECT_KEYS: Final = (
    "delimiter",
    "quotechar",
    "escapechar",
    "doublequote",
    "skipinitialspace",
    "quoting",
)
"""The ``csv`` dialect attributes kept in the context (a resumed run reads alike)."""


class FileChanged(FlowloopError):
    """The file is no longer what was inspected (size, content): it is left for the next run."""


@dataclass(frozen=True)
class Record:
    """One record as read: CSV fields (a list of text) or a JSON object, or why neither."""

    line: int
    """The line the record starts on (1 is the file's first line)."""
    fields: list[str] | dict[str, Any] | None
    raw: bytes
    error: str | None = None


@dataclass(frozen=True)
class Batch:
    """What one read returned, and where the next one starts."""

    records: list[Record]
    offset: int
    """Byte offset after the last record read."""
    line: int
    """Line number of the next record."""


@dataclass(frozen=True)
class Header:
    """Where a file's data starts, its columns (CSV) and its dialect (as plain values)."""

    columns: list[str]
    data_offset: int
    data_line: int
    """The line the first record starts on."""
    dialect: dict[str, Any]
    hint: str | None = None
    """What may be wrong when the columns do not fit (another delimiter), or None."""


class Format(Protocol):
    """A file format the kit can read in resumable batches."""

    quote: bytes | None
    """The byte that opens a field where a newline does not end the record, or None."""
    header_lines: int
    """Lines before the first record (counted out of the record estimate)."""

    def header(self, path: Path) -> tuple[Header | None, str | None]:
        """The header (columns, data offset, dialect), or why the file cannot be read."""
        ...

    def read(
        self, path: Path, *, header: Header, offset: int, end: int, line: int, limit: int
    ) -> Batch:
        """Up to ``limit`` records from byte ``offset``, never past ``end``."""
        ...


def bom_length(first: bytes) -> int:
    return len(codecs.BOM_UTF8) if first.startswith(codecs.BOM_UTF8) else 0


def normalize_column(name: str) -> str:
    """``" Sensor ID"`` → ``sensor_id``: header names as Python field names."""
    return re.sub(r"[^0-9a-z]+", "_", name.strip().lower()).strip("_")


class _Lines:
    """Decoded lines of a binary file from ``offset`` up to ``end``. ``csv.reader`` pulls
    exactly the lines of one record, so after each record ``offset`` is where the next one
    starts."""

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


class CsvFormat:
    """CSV through the standard library's ``csv`` module, in any dialect.

    ``dialect`` is a ``csv`` dialect name (``"excel"``, ``"excel-tab"``, ``"unix"``), a
    ``csv.Dialect``, a mapping of its attributes (``{"delimiter": ";"}``), or ``"sniff"``:
    the delimiter, quote character and initial spaces guessed per file from its first
    64 KiB (``csv.Sniffer``, delimiters ``, ; \\t |``; the rest as ``"excel"``, and
    ``"excel"`` when the sniffer cannot tell). The
    dialect used is kept in the context, so a resumed run reads the rest alike. The first
    record is the header; its names are normalised (:func:`normalize_column`).
    ``extra_columns="reject"`` rejects a file with columns the row model does not name.
    """

    header_lines = 1

    def __init__(
        self,
        dialect: str | type[csv.Dialect] | csv.Dialect | Mapping[str, Any] = "excel",
        *,
        sniff_delimiters: str = ",;\t|",
    ) -> None:
        self.sniff = dialect == "sniff"
        self.sniff_delimiters = sniff_delimiters
        self.fixed: dict[str, Any] = {} if self.sniff else dialect_values(dialect)
        self.quote = (self.fixed.get("quotechar") or '"').encode() if not self.sniff else b'"'

    def dialect_for(self, path: Path) -> dict[str, Any]:
        if not self.sniff:
            return self.fixed
        with path.open("rb") as handle:
            sample = handle.read(SNIFF_BYTES)
        if len(sample) == SNIFF_BYTES and b"\n" in sample:
            sample = sample[: sample.rindex(b"\n") + 1]  # whole lines only
        # The sniffer cannot tell the delimiter of CRLF lines: it sees them as LF.
        text = sample[bom_length(sample) :].decode("utf-8", "ignore").replace("\r\n", "\n")
        try:
            found = csv.Sniffer().sniff(text, delimiters=self.sniff_delimiters)
        except csv.Error:
            return dialect_values("excel")
        # Only what a sample shows reliably; a doubled quote may first come later.
        guessed = ("delimiter", "quotechar", "skipinitialspace")
        return dialect_values({key: getattr(found, key) for key in guessed})

    def header(self, path: Path) -> tuple[Header | None, str | None]:
        dialect = self.dialect_for(path)
        with path.open("rb") as handle:
            start = bom_length(handle.read(3))
            handle.seek(start)
            lines = _Lines(handle, start, 1 << 62)
            try:
                names = next(csv.reader(lines, **dialect))
            except StopIteration:
                return None, "no header: the file has no first line"
            except FileChanged:
                return None, "not UTF-8: the header line is not valid UTF-8"
            except csv.Error as error:
                if "new-line character" in str(error):  # (csv's words suggest an open mode)
                    return None, (
                        "unreadable header: its lines end in a lone CR (old Mac line ends); "
                        "convert them to LF or CRLF"
                    )
                return None, f"unreadable header: {error}"
        if not any(name.strip() for name in names):
            return None, "no header: the first line is blank"
        columns = [normalize_column(name) for name in names]
        hint = self.delimiter_hint(names, dialect)
        return Header(columns, lines.offset, 1 + lines.count, dialect, hint), None

    def delimiter_hint(self, names: Sequence[str], dialect: Mapping[str, Any]) -> str | None:
        """A header read as one column that holds another usual delimiter: the words that
        say which, and how to read it (a European ``;`` export read as ``,``)."""
        if self.sniff or len(names) != 1:
            return None
        ours = dialect.get("delimiter")
        other = next((d for d in self.sniff_delimiters if d != ours and d in names[0]), None)
        if other is None:
            return None
        return (
            f"the header has no {ours!r} but {other!r}: pass "
            f"fmt=CsvFormat({{'delimiter': {other!r}}}) or CsvFormat('sniff')"
        )

    def read(
        self, path: Path, *, header: Header, offset: int, end: int, line: int, limit: int
    ) -> Batch:
        """Up to ``limit`` records from byte ``offset``; blank lines skipped."""
        records: list[Record] = []
        with path.open("rb") as handle:
            handle.seek(offset)
            lines = _Lines(handle, offset, end)
            reader = csv.reader(lines, **header.dialect)
            while len(records) < limit:
                start = line + lines.count
                try:
                    fields = next(reader)
                except StopIteration:
                    break
                except csv.Error as error:
                    raw = _rest_of_record(lines, quote_of(header.dialect))
                    records.append(Record(start, None, raw, f"unreadable CSV: {error}"))
                    continue
                raw = lines.take()
                if fields:
                    records.append(Record(start, fields, raw))
            return Batch(records, lines.offset, line + lines.count)


def quote_of(dialect: Mapping[str, Any]) -> bytes | None:
    """The byte whose count in a record's text tells whether it ends inside a quoted field
    (odd), or None: the dialect does not quote, or escapes a quote otherwise than doubling it."""
    quote = dialect.get("quotechar")
    if not quote or dialect.get("quoting") == csv.QUOTE_NONE or not dialect.get("doublequote"):
        return None
    return str(quote).encode()


def _rest_of_record(lines: _Lines, quote: bytes | None) -> bytes:
    """The text of a record ``csv`` gave up on (a field over ``csv.field_size_limit()``),
    through its last line: cut off inside a quoted field, its remaining lines are its own,
    not records to read (they read as rows of their own, or swallowed the rest of the file)."""
    raw = lines.take()
    quotes = raw.count(quote) if quote else 0
    while quotes % 2 and next(lines, None) is not None:
        quotes += lines.taken[-1].count(quote or b"")
    return raw + lines.take()


class JsonLinesFormat:
    """JSON lines: one JSON object per line (https://jsonlines.org), no header. A line that
    is not JSON, or not an object, is a reject with the parser's reason."""

    quote = None
    header_lines = 0

    def header(self, path: Path) -> tuple[Header | None, str | None]:
        with path.open("rb") as handle:
            start = bom_length(handle.read(3))
        return Header([], start, 1, {}), None

    def read(
        self, path: Path, *, header: Header, offset: int, end: int, line: int, limit: int
    ) -> Batch:
        records: list[Record] = []
        with path.open("rb") as handle:
            handle.seek(offset)
            lines = _Lines(handle, offset, end)
            for text in lines:
                start = line + lines.count - 1
                raw = lines.take()
                if not text.strip():
                    continue
                try:
                    value = json.loads(text)
                except ValueError as error:
                    records.append(Record(start, None, raw, f"not JSON: {error}"))
                else:
                    if isinstance(value, dict):
                        records.append(Record(start, value, raw))
                    else:
                        got = type(value).__name__
                        records.append(Record(start, None, raw, f"not a JSON object (a {got})"))
                if len(records) >= limit:
                    break
            return Batch(records, lines.offset, line + lines.count)


def dialect_values(
    dialect: str | type[csv.Dialect] | csv.Dialect | Mapping[str, Any],
) -> dict[str, Any]:
    """A dialect as the plain values ``csv.reader`` takes (kept in the context as JSON)."""
    if isinstance(dialect, Mapping):
        base = dialect_values("excel")
        unknown = sorted(set(dialect) - set(DIALECT_KEYS))
        if unknown:
            raise FlowloopError(
                f"unknown CSV dialect setting(s) {', '.join(unknown)}; "
                f"use {', '.join(DIALECT_KEYS)}"
            )
        return {**base, **dialect}
    found: Any = dialect
    if isinstance(dialect, str):
        try:
            found = csv.get_dialect(dialect)
        except csv.Error:
            known = ", ".join(sorted(csv.list_dialects()))
            raise FlowloopError(
                f"unknown CSV dialect {dialect!r}; use one of {known}, 'sniff' or a mapping"
            ) from None
    return {key: getattr(found, key) for key in DIALECT_KEYS}


def header_problem(
    columns: Sequence[str],
    expected: Sequence[str],
    *,
    required: Sequence[str] | None = None,
    reject_extra: bool = False,
) -> str | None:
    """Why a header does not fit the expected columns (in words), or None: a ``required``
    column (default: all ``expected``) missing, a repeated one, or (``reject_extra``) one
    not expected."""
    missing = [c for c in (expected if required is None else required) if c not in columns]
    unexpected = (
        [n or f"(unnamed column {i})" for i, n in enumerate(columns, 1) if n not in expected]
        if reject_extra
        else []
    )
    doubled = sorted({n for n in columns if n and columns.count(n) > 1})  # ("": unnamed)
    if not (missing or unexpected or doubled):
        return None
    problems = []
    if missing:
        problems.append("missing " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected " + ", ".join(unexpected))
    if doubled:
        problems.append("repeated " + ", ".join(doubled))
    return f"wrong header: {'; '.join(problems)} (expected {','.join(expected)})"
