"""ETL: load a folder of order CSV files into a database table, one batch per step.

    discover --found--> open_file --ready--> load_batch --more--> load_batch (to itself)
       | nothing          | rejected ^ next     | eof
       v                  v          |          v
     report <--finished-- close_file <----------+        report --next--> done

This file is the user's part, on top of :mod:`flowloop.etl`: the row model (a field per
CSV column, with its checks), the target table and its key (``order_id``: an order seen
again is overwritten, the file loaded last wins; files load in name order), the transform
and the workflow. Each batch is a step boundary: killed mid-file, a run resumes at the
last committed byte offset and re-running a batch rewrites the same keys.

    flowloop run workflows/etl.py --context '{}'          # the sample data in workflows/data
    flowloop run workflows/etl.py --context '{"input_dir": "inbox", "batch_size": 10000}'
    ETL_INPUT=inbox flowloop worker workflows/etl.py      # a loop: new files every ETL_EVERY s

The target is ``etl_target.db`` in the input folder unless ``target_url`` (a SQLAlchemy URL,
or ``$ETL_TARGET``) says otherwise; for the sample folder, ``$XDG_DATA_HOME/flowloop/``. The
context, target URL included, is journaled: keep passwords out of it (``~/.pgpass``).
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path
from typing import Annotated, Any, ClassVar, Final

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from flowloop import Retry, Step, Workflow
from flowloop import etl as kit

SAMPLE_DIR: Final = Path(__file__).resolve().parent / "data"
MAX_BATCHES_PER_RUN: Final = kit.MAX_BATCHES_PER_RUN
"""``max_visits`` of ``load_batch``; ``discover`` plans each run to fit (later files wait)."""
MAX_FILES_PER_RUN: Final = kit.MAX_FILES_PER_RUN
EUR_PER: Final = {"EUR": Decimal("1"), "USD": Decimal("0.92"), "GBP": Decimal("1.17")}
"""Fixed rates keep the example deterministic; a real job joins a rates table by date."""
CURRENCIES: Final = ("EUR", "USD", "GBP")
STATUSES: Final = ("placed", "paid", "shipped", "cancelled", "refunded")


def _one_of(values: tuple[str, ...]) -> str:
    return "(?i)^(" + "|".join(values) + ")$"  # any case: the pattern sees the raw text


# Checks run inside pydantic-core (patterns, case folding): a Python validator per field
# would cost more than the rest of the row. EXPLAIN words a pattern failure.
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


EXPLAIN: Final = {
    "order_id": "not an order id like SO-10001",
    "customer_id": "not a customer id like C1042",
    "email": "not an email address",
    "country": "not a two-letter country code",
    "sku": "not a SKU like BK-1001",
    "currency": f"not one of {', '.join(CURRENCIES)}",
    "status": f"not one of {', '.join(STATUSES)}",
}

target_metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    target_metadata,
    sa.Column("order_id", sa.String(32), primary_key=True),  # the key of the upsert
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
    sa.Column("source_file", sa.String(255), nullable=False),  # lineage, filled by the kit
    sa.Column("source_row", sa.Integer, nullable=False),
)


def transform(row: OrderRow, file: str, line: int) -> dict[str, Any]:
    """The target row: UTC time, amounts in cents (and in EUR)."""
    at = row.ordered_at if row.ordered_at.tzinfo else row.ordered_at.replace(tzinfo=UTC)
    unit_cents = int(row.unit_price * 100)
    total_cents = unit_cents * row.quantity
    total_eur = (Decimal(total_cents) * EUR_PER[row.currency]).quantize(
        Decimal(1), rounding=ROUND_HALF_EVEN
    )
    values = dict(row.__dict__)  # the fields as they are (model_dump costs 10 % more CPU)
    del values["unit_price"]
    return {
        **values,
        "ordered_at": at.astimezone(UTC).isoformat().replace("+00:00", "Z"),
        "unit_price_cents": unit_cents,
        "total_cents": total_cents,
        "total_eur_cents": int(total_eur),
    }


loader = kit.FolderLoader(
    OrderRow,
    orders,
    transform=transform,
    fmt=kit.CsvFormat("excel"),
    explain=EXPLAIN,
    extra_columns="reject",
    noun="order",
)


class EtlContext(kit.FolderContext):
    """Where to read and write (``$ETL_INPUT``, ``$ETL_TARGET``, ``$ETL_BATCH_SIZE``), where
    a run is, and what it has done so far."""

    env_prefix: ClassVar[str] = "ETL_"
    sample_dir: ClassVar[Path | None] = SAMPLE_DIR


TRANSIENT: Final = (sa.exc.OperationalError, sa.exc.InterfaceError, OSError)
retry_transient = Retry(attempts=5, backoff="exponential", base=0.5, cap=30, on=TRANSIENT)
per_file: Final[dict[str, Any]] = {"retry": retry_transient, "max_visits": MAX_FILES_PER_RUN}
per_batch: Final[dict[str, Any]] = {"retry": retry_transient, "max_visits": MAX_BATCHES_PER_RUN}

etl = Workflow(
    "etl",
    context=EtlContext,
    version=1,
    description="CSV files of orders -> validated, transformed, upserted into a table",
)


@etl.step(initial=True, on={"found": "open_file", "nothing": "report"}, retry=retry_transient)
def discover(ctx: EtlContext, step: Step) -> str:
    """Extract: the new files of the input folder, planned to fit this run's batch budget."""
    return loader.discover(ctx, max_batches=MAX_BATCHES_PER_RUN, max_files=MAX_FILES_PER_RUN)


@etl.step(on={"ready": "load_batch", "rejected": "close_file"}, **per_file)
def open_file(ctx: EtlContext, step: Step) -> str:
    """Check the file's header; a malformed file becomes one reject (row 0)."""
    return loader.open_file(ctx, step)


@etl.step(on={"more": "load_batch", "eof": "close_file"}, **per_batch)
def load_batch(ctx: EtlContext, step: Step) -> str:
    """One batch from the committed offset: read, validate, transform, upsert."""
    return loader.load_batch(ctx, step)


@etl.step(on={"next": "open_file", "finished": "report"}, **per_file)
def close_file(ctx: EtlContext, step: Step) -> str:
    """Record the file in ``loaded_files`` (loaded or rejected), so no run takes it again."""
    return loader.close_file(ctx, step)


@etl.step(next="done", retry=retry_transient)
def report(ctx: EtlContext, step: Step) -> None:
    """Summarise the run and the target."""
    loader.report(ctx)


etl.final("done")


inbox_loop = functools.partial(kit.inbox_loop, workflow=etl, loader=loader)
"""``inbox_loop(name="etl_inbox", every=None, context=None)``: runs :data:`etl` every
``every`` seconds (``$ETL_EVERY``, default 10) after the previous run ended; idle unless
``$ETL_INPUT`` (or an ``input_dir`` in ``context``) is given."""
etl_inbox = inbox_loop()
run_plain = functools.partial(kit.run_plain, etl)
"""``run_plain(context)``: the same steps in a plain loop, no journal (benchmarks, tests)."""
