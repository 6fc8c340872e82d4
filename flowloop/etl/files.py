"""A file as a whole: size, sha256, record estimate and whether it can be loaded at all."""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Final

from pydantic import BaseModel

from flowloop.etl.formats import Format

CHUNK_BYTES: Final = 1 << 20


class FileInfo(BaseModel):
    """A file found by discovery, as it was then (the load reads up to ``size``)."""

    name: str
    size: int
    mtime_ns: int
    sha256: str
    rows: int
    """Records expected: data lines outside quoted fields (exact for CSV unless a record is
    blank or unreadable, counted with ``"`` as the quote when the dialect is sniffed;
    JSON lines: lines). Used for progress and the batch budget; the load counts records."""
    problem: str | None = None
    """Why the whole file is rejected (empty, not UTF-8, wrong header), or None."""


def record_ends(chunk: bytes, quoted: bool, quote: bytes | None = b'"') -> tuple[int, bool]:
    """Newlines in ``chunk`` that end a record (outside quotes: a quoted CSV field may hold a
    newline), and whether the chunk ends inside quotes."""
    if quote is None or quote not in chunk:
        return (0 if quoted else chunk.count(b"\n")), quoted
    parts = chunk.split(quote)  # an escaped "" flips twice: an empty part in between
    ends = sum(part.count(b"\n") for part in parts[1 if quoted else 0 :: 2])
    return ends, quoted != (len(parts) % 2 == 0)


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


def sha256_of(path: Path, size: int | None = None) -> str:
    """The sha256 of the file's first ``size`` bytes (all of it by default)."""
    digest = hashlib.sha256()
    left = size
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES if left is None else min(CHUNK_BYTES, left)):
            digest.update(chunk)
            if left is not None:
                left -= len(chunk)
    return digest.hexdigest()


def inspect_file(path: Path, fmt: Format, check: Callable[[Path], str | None]) -> FileInfo:
    """Size, sha256 and record count in one pass, and whether the file can be loaded at all
    (``check``: why its header cannot be loaded, or None)."""
    stat = path.stat()
    digest = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")()
    newlines, utf8, last, blank, quoted = 0, True, b"", True, False
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            ends, quoted = record_ends(chunk, quoted, fmt.quote)
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
        problem = check(path)
    return FileInfo(
        name=path.name,
        size=stat.st_size,
        mtime_ns=stat.st_mtime_ns,
        sha256=digest.hexdigest(),
        rows=max(0, lines - fmt.header_lines),
        problem=problem,
    )
