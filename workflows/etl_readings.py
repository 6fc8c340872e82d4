"""ETL of another shape: weather readings, semicolon-separated, "NA" for a missing value,
and no natural key — each record is a row, keyed by where it came from (file, line).

The whole adaptation to this data is the row model, the key (``None``: the source
position), and what differs from the defaults: the dialect (``"sniff"``: guessed per file,
here ``;``), the missing-value texts and the file pattern. The workflow is the kit's
standard one (:func:`flowloop.etl.folder_workflow`; ``workflows/etl.py`` spells it out):

    discover -> open_file -> load_batch (to itself) -> close_file -> report -> done

    flowloop run workflows/etl_readings.py --context '{}'    # workflows/data/sensors
    flowloop run workflows/etl_readings.py --context '{"input_dir": "inbox"}'

A file loaded again in a new version (another sha256) replaces the rows of the old one.
"""

from __future__ import annotations

import functools
from datetime import datetime
from pathlib import Path
from typing import Annotated, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from flowloop import etl as kit

SAMPLE_DIR: Final = Path(__file__).resolve().parent / "data" / "sensors"


class Reading(BaseModel):
    """One record: the header names, normalised (``Temperature (C)`` → ``temperature_c``)."""

    model_config = ConfigDict(str_strip_whitespace=True, frozen=True)

    station: Annotated[str, StringConstraints(pattern=r"^[A-Z]{3}-\d{2}$")]
    measured_at: datetime
    temperature_c: float | None = Field(ge=-90, le=60)
    humidity_pct: float | None = Field(ge=0, le=100)
    wind_kmh: float | None = Field(ge=0, le=500)
    note: str | None = Field(max_length=500)


loader = kit.FolderLoader(
    Reading,
    "readings",  # a table derived from the model, plus source_file/_row/_sha256
    key=None,  # no natural key: the source position (file, line) is the key
    fmt=kit.CsvFormat("sniff"),
    nulls=kit.Nulls(("NA", "")),  # for every field; per field: Nulls(fields={"note": ()})
    explain={"station": "not a station id like BER-01"},
    noun="reading",
)


class ReadingsContext(kit.FolderContext):
    """``$READINGS_INPUT``, ``$READINGS_TARGET``, ``$READINGS_BATCH_SIZE``; the sample
    folder by default (its target: ``$XDG_DATA_HOME/flowloop/readings_target.db``)."""

    env_prefix: ClassVar[str] = "READINGS_"
    sample_dir: ClassVar[Path | None] = SAMPLE_DIR
    target_file: ClassVar[str] = "readings_target.db"
    pattern: str = "readings_*.csv"


readings = kit.folder_workflow(
    "readings",
    loader,
    context=ReadingsContext,
    description="weather readings (CSV, NA, no key) -> validated, appended by source position",
)
run_plain = functools.partial(kit.run_plain, readings)
