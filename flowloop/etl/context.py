"""The context of a folder load: where to read and write, the resume point, the counters.

Subclass :class:`FolderContext` to give a load its defaults: ``env_prefix`` names the
environment variables read when a field is not given (``<prefix>INPUT``, ``<prefix>TARGET``,
``<prefix>BATCH_SIZE``), ``sample_dir`` is the input folder when none is given (its target
goes to ``$XDG_DATA_HOME/flowloop/``, never into a source tree), ``target_file`` the SQLite
file next to the input otherwise. A run's context is journaled at each batch: the byte
offset it holds is where a resumed run continues. The ``*_done``/``*_total`` counters,
``rejects`` and ``file`` are what ``flowloop run`` shows as progress lines.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flowloop.etl.files import FileInfo

DEFAULT_BATCH_SIZE: Final = 1_000


def sample_target_dir() -> Path:
    """Where a sample folder's target goes: ``$XDG_DATA_HOME/flowloop`` (default
    ``~/.local/share/flowloop``), outside the source tree."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "flowloop"


class FolderContext(BaseModel):
    """Where to read and write, where a run is, and what it has done so far."""

    # The environment defaults below read the raw input (a "before" validator), so flowloop
    # cannot tell a misspelt key from one the model takes: pydantic refuses it instead (it
    # was dropped, and {"inputdir": ...} loaded the sample folder).
    model_config = ConfigDict(extra="forbid")

    env_prefix: ClassVar[str] = "ETL_"
    sample_dir: ClassVar[Path | None] = None
    target_file: ClassVar[str] = "etl_target.db"

    input_dir: str
    target_url: str | None = None
    """Any SQLAlchemy URL (or a file path, as SQLite); default ``<input_dir>/<target_file>``."""
    pattern: str = "*.csv"
    batch_size: int = Field(default=DEFAULT_BATCH_SIZE, ge=1, le=1_000_000)
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
    dialect: dict[str, Any] = Field(default_factory=dict)
    """The CSV dialect the current file is read with (sniffed once, at open)."""
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

    @model_validator(mode="before")
    @classmethod
    def _from_environment(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        env = {
            "input_dir": os.environ.get(f"{cls.env_prefix}INPUT"),
            "target_url": os.environ.get(f"{cls.env_prefix}TARGET"),
            "batch_size": os.environ.get(f"{cls.env_prefix}BATCH_SIZE"),
        }
        if env["input_dir"] is None and cls.sample_dir is not None:
            env["input_dir"] = str(cls.sample_dir)
        for name, value in env.items():
            if name not in data and value:
                data[name] = value
        return data

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
        """The target's SQLAlchemy URL."""
        if self.target_url:
            return self.target_url
        folder = Path(self.input_dir)
        if self.sample_dir is not None and folder == Path(self.sample_dir).resolve():
            folder = sample_target_dir()
            folder.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{folder / self.target_file}"

    @property
    def current(self) -> FileInfo:
        return self.pending[0]

    def path(self, info: FileInfo) -> Path:
        return Path(self.input_dir) / info.name
