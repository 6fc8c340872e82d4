"""Generate order CSV files for workflows/etl.py, deterministically (same seed, same bytes).

About one row in ``--bad-every`` is wrong on purpose, in one of several ways (a negative
quantity, an e-mail without @, an unparseable date, an unknown currency, a missing field,
a price with three decimals); some product names need CSV quoting (commas, quotes) and a
few span two lines.

    python bench/gen_etl_data.py /tmp/etl-in                    # 1,000,000 rows, one file
    python bench/gen_etl_data.py /tmp/etl-in --rows 200000 --files 4 --seed 7
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

HEADER = (
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
PRODUCTS = (
    ("BK-1001", "The Pragmatic Programmer, 20th ed.", "42.90"),
    ("BK-1002", "Designing Data-Intensive Applications", "44.50"),
    ("PN-0042", "Fountain pen (blue)", "12.50"),
    ("LM-0200", "Desk lamp", "39.00"),
    ("KB-0777", "Mechanical keyboard, 87 keys", "119.00"),
    ("NB-0100", "Notebook A5 dotted", "6.40"),
    ("MU-0300", 'Mug "I love CSV"', "9.90"),
    ("CH-0500", "Office chair", "289.00"),
    ("CB-0010", "USB-C cable\n(2 m)", "8.99"),
)
COUNTRIES = (
    ("DE", "EUR"),
    ("FR", "EUR"),
    ("IT", "EUR"),
    ("GB", "GBP"),
    ("US", "USD"),
    ("IE", "EUR"),
    ("SE", "EUR"),
    ("JP", "USD"),
)
STATUSES = ("placed", "paid", "paid", "paid", "shipped", "cancelled", "refunded")
FIRST = ("anna", "tom", "liu", "sara", "julien", "olga", "marco", "hana", "piet", "dara")
LAST = ("keller", "baker", "wei", "nyberg", "martin", "petrova", "rossi", "yamada", "novak")
START = datetime(2024, 1, 1, tzinfo=UTC)
BAD_KINDS = ("quantity", "email", "date", "currency", "fields", "price")

DEFAULT_ROWS = 1_000_000
DEFAULT_SEED = 42
DEFAULT_BAD_EVERY = 1_000


def rows(
    count: int, *, seed: int = DEFAULT_SEED, bad_every: int = DEFAULT_BAD_EVERY, first_id: int = 1
) -> Iterator[list[str]]:
    """``count`` data rows (lists of fields), order ids from ``first_id`` on."""
    rand = random.Random(seed).random  # random() * n: much cheaper than randrange(n)
    customers = 50_000
    start = int(START.timestamp())
    day_text: dict[int, str] = {}
    for n in range(first_id, first_id + count):
        cust = int(rand() * customers)
        country, currency = COUNTRIES[cust % len(COUNTRIES)]
        sku, product, price = PRODUCTS[int(rand() * len(PRODUCTS))]
        ts = start + n * 7 + int(rand() * 7)
        day, second = divmod(ts, 86_400)
        date = day_text.get(day)
        if date is None:
            date = day_text[day] = datetime.fromtimestamp(day * 86_400, UTC).strftime("%Y-%m-%d")
        hh, rest = divmod(second, 3600)
        at = f"{date}T{hh:02d}:{rest // 60:02d}:{rest % 60:02d}Z"
        email = f"{FIRST[cust % len(FIRST)]}.{LAST[cust % len(LAST)]}{cust}@example.com"
        row = [
            f"ORD-{n:08d}",
            at,
            f"C{cust:06d}",
            email,
            country,
            sku,
            product,
            str(1 + int(rand() * 5)),
            price,
            currency,
            STATUSES[int(rand() * len(STATUSES))],
        ]
        if bad_every and int(rand() * bad_every) == 0:
            kind = BAD_KINDS[int(rand() * len(BAD_KINDS))]
            if kind == "quantity":
                row[7] = "-" + row[7]
            elif kind == "email":
                row[3] = row[3].replace("@", " at ")
            elif kind == "date":
                row[1] = f"{date[8:10]}/{date[5:7]}/{date[:4]} {hh:02d}:{rest // 60:02d}"
            elif kind == "currency":
                row[9] = "SEK"
            elif kind == "fields":
                row.pop()
            else:
                row[8] = row[8] + "5"
        yield row


def write(
    path: Path,
    count: int,
    *,
    seed: int = DEFAULT_SEED,
    bad_every: int = DEFAULT_BAD_EVERY,
    first_id: int = 1,
) -> int:
    """Write one file of ``count`` rows atomically (``.part`` then rename); its size."""
    part = path.with_name(path.name + ".part")
    with part.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(HEADER)
        writer.writerows(rows(count, seed=seed, bad_every=bad_every, first_id=first_id))
    part.replace(path)
    return path.stat().st_size


def generate(
    folder: Path,
    total: int,
    *,
    files: int = 1,
    seed: int = DEFAULT_SEED,
    bad_every: int = DEFAULT_BAD_EVERY,
    prefix: str = "orders_gen",
) -> list[Path]:
    """``total`` rows split over ``files`` files named ``{prefix}_0001.csv`` …"""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    per, extra = divmod(total, files)
    first = 1
    for i in range(files):
        count = per + (1 if i < extra else 0)
        path = folder / f"{prefix}_{i + 1:04d}.csv"
        write(path, count, seed=seed + i, bad_every=bad_every, first_id=first)
        paths.append(path)
        first += count
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--rows", type=int, default=DEFAULT_ROWS)
    p.add_argument("--files", type=int, default=1)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument(
        "--bad-every", type=int, default=DEFAULT_BAD_EVERY, help="about one bad row in N (0: none)"
    )
    p.add_argument("--prefix", default="orders_gen")
    args = p.parse_args(argv)
    if args.rows < 0 or args.files < 1:
        p.error("--rows must be >= 0 and --files >= 1")
    t0 = time.perf_counter()
    paths = generate(
        args.folder,
        args.rows,
        files=args.files,
        seed=args.seed,
        bad_every=args.bad_every,
        prefix=args.prefix,
    )
    size = sum(path.stat().st_size for path in paths)
    print(
        f"wrote {args.rows:,} rows in {len(paths)} file(s), {size / 1e6:.1f} MB, to "
        f"{args.folder} in {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
