"""Batch validation with pydantic: each record becomes a target row or a reject with a reason.

A bad record never stops the batch. Missing values are configurable: :class:`Nulls` says
which texts mean "no value" (``"NA"``, ``""`` …), for every field or per field; such a
value reaches the row model as ``None`` (so the field must allow it, ``float | None``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from pydantic import BaseModel, ValidationError

from flowloop.etl.formats import Record

RAW_KEPT_CHARS: Final = 500
"""How much of a rejected record's text the rejects table keeps."""

NUL: Final = b"\x00"
NUL_REASON: Final = (
    "a NUL byte (0x00) in the record (PostgreSQL text refuses it): remove it at the source"
)

M = TypeVar("M", bound=BaseModel)
Transform = Callable[[Any, str, int], dict[str, Any]]
"""``(row, file, line) -> target row``: the validated model to the target table's columns."""


@dataclass(frozen=True)
class Nulls:
    """Which texts are a missing value: ``values`` for every field, ``fields`` per field
    (replacing ``values`` for that field; an empty set keeps the field's text as it is).

    ``Nulls()`` changes nothing; ``Nulls(("NA", ""))`` makes ``NA`` and empty fields None.
    Matching is exact, after stripping spaces.
    """

    values: Collection[str] = ()
    fields: Mapping[str, Collection[str]] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.values) or any(self.fields.values())

    def apply(self, data: dict[str, Any]) -> dict[str, Any]:
        """``data`` with its missing values as None (in place; returned for chaining)."""
        default = frozenset(self.values)
        special = {name: frozenset(values) for name, values in self.fields.items()}
        for name, value in data.items():
            if isinstance(value, str):
                nulls = special.get(name, default)
                if nulls and value.strip() in nulls:
                    data[name] = None
        return data


def why_invalid(error: ValidationError, explain: Mapping[str, str] | None = None) -> str:
    """``field: problem (got 'value')`` for each failed field, on one line; ``explain``
    words a pattern mismatch per field (``{"sku": "not a SKU like BK-1001"}``)."""
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "row"
        message = item["msg"]
        if item["type"] == "string_pattern_mismatch" and explain:
            message = explain.get(where, message)
        got = item.get("input")
        shown = f" (got {got!r})" if isinstance(got, str) else ""
        parts.append(f"{where}: {message}{shown}")
    return "; ".join(parts)


def reject_row(record: Record, reason: str, *, file: str, sha256: str) -> dict[str, Any]:
    """A row of the rejects table: file, row number, reason and the record's text."""
    # (A NUL stays visible, and out of the text column: PostgreSQL refuses it there.)
    raw = record.raw.decode("utf-8", "replace").rstrip("\r\n").replace("\x00", "\\x00")
    return {
        "file": file,
        "row_no": record.line,
        "reason": reason,
        "raw": raw[:RAW_KEPT_CHARS],
        "file_sha256": sha256,
    }


def validate(
    records: Sequence[Record],
    columns: Sequence[str],
    *,
    model: type[BaseModel],
    transform: Transform,
    file: str,
    sha256: str,
    nulls: Nulls | None = None,
    explain: Mapping[str, str] | None = None,
    sources: list[Record] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Target rows and reject rows for ``records``. A CSV record is matched to ``columns``
    by position (a record of another width, or one holding a NUL byte, is a reject); a JSON
    object by its keys. ``sources`` gets the record of each target row, in order."""
    good: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    width = len(columns)
    use_nulls = nulls is not None and nulls.active
    for record in records:
        fields = record.fields
        if fields is None:
            bad.append(reject_row(record, record.error or "unreadable", file=file, sha256=sha256))
            continue
        if isinstance(fields, list):
            if NUL in record.raw:  # corruption, not text: refused by PostgreSQL, kept by SQLite
                bad.append(reject_row(record, NUL_REASON, file=file, sha256=sha256))
                continue
            if len(fields) != width:
                reason = f"expected {width} fields, got {len(fields)}"
                bad.append(reject_row(record, reason, file=file, sha256=sha256))
                continue
            data = dict(zip(columns, fields, strict=True))
        else:
            data = fields
        if use_nulls:
            assert nulls is not None
            nulls.apply(data)
        try:
            row = model.model_validate(data)
        except ValidationError as error:
            bad.append(reject_row(record, why_invalid(error, explain), file=file, sha256=sha256))
            continue
        good.append(transform(row, file, record.line))
        if sources is not None:
            sources.append(record)
    return good, bad
