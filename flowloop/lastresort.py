"""The CLI's last line of defence: an error no command turned into a FlowloopError still
becomes one line (and an exit code), never a traceback, when it is a storage or encoding
error — a full disk, a read-only file system, a database refusing a value, bytes that are
not UTF-8. Anything else is a bug and keeps its traceback."""

from __future__ import annotations

import errno
import re
from typing import Final

from pydantic_core import PydanticSerializationError
from sqlalchemy.exc import SQLAlchemyError

from flowloop.errors import EXIT_FAILURE, EXIT_USAGE
from flowloop.store import outage

STORAGE_ERRNOS: Final = frozenset(
    {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EIO}
)

_SURROGATE: Final = re.compile(r"\\udc([89a-f][0-9a-f])")


def _bad_byte(error: UnicodeError) -> str:
    if isinstance(error, UnicodeEncodeError) and error.start < len(error.object):
        char = ord(error.object[error.start])
        if 0xDC80 <= char <= 0xDCFF:  # a byte smuggled in by surrogateescape
            return f" (byte 0x{char - 0xDC00:02x})"
    if isinstance(error, UnicodeDecodeError) and error.start < len(error.object):
        return f" (byte 0x{error.object[error.start]:02x})"
    return ""


def last_resort(error: BaseException) -> tuple[str | None, int]:
    """The line to print for ``error`` and the exit code; ``(None, …)``: not ours to hide."""
    if isinstance(error, SQLAlchemyError):
        return outage.describe(error, outage.last_opened() or "(not opened)"), EXIT_FAILURE
    if isinstance(error, UnicodeError) or (
        isinstance(error, PydanticSerializationError) and "UnicodeEncodeError" in str(error)
    ):
        found = _SURROGATE.search(str(error))
        byte = _bad_byte(error) if isinstance(error, UnicodeError) else ""
        if not byte and found is not None:
            byte = f" (byte 0x{found.group(1)})"
        return (
            f"an argument, option or file is not valid UTF-8 text{byte}: "
            "flowloop takes names, keys and JSON as UTF-8",
            EXIT_USAGE,
        )
    if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{error.strerror or error}", EXIT_FAILURE
    if isinstance(error, ValueError) and "NUL (0x00)" in str(error):
        return "text for PostgreSQL cannot contain NUL (\\0) characters", EXIT_USAGE
    return None, EXIT_FAILURE
