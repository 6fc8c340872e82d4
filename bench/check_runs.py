"""``flowloop check`` on many live runs: how long judging every live run takes.

One database per backend with ``--runs`` live runs of ``order`` v1 (tests/deploykit.py),
a third each queued in ``reserve``, sleeping in ``charge`` and waiting in ``confirm``
(states set in bulk after ``start_many``). Then ``checking.check_runs`` (what the CLI
command runs) is timed for four new definitions:

* ``same``: v1 itself (every run continues as is: no context is read);
* ``removed state``: ``confirm`` gone (a third would be parked; contexts trusted, the
  model is unchanged);
* ``added field + upcaster``: every context is upcast and validated (continues after
  migration): the expensive case;
* ``added field, no upcaster``: every run would fail (each verdict listed up to 1,000).

    python bench/check_runs.py               # 100,000 runs, SQLite and PostgreSQL
    python bench/check_runs.py --quick       # 5,000 runs, SQLite only
"""

from __future__ import annotations

import sys
from pathlib import Path

import common
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from deploykit import OrderV1, added_field, order, removed_state


def populate(url: str, runs: int) -> None:
    from flowloop import Engine
    from flowloop.store.schema import runs as table

    with Engine(url, workflows=[order()]) as engine:
        wf = engine.workflow("order")
        batch = 10_000
        for start in range(0, runs, batch):
            contexts = [OrderV1(order_id=f"o{n}") for n in range(start, min(runs, start + batch))]
            engine.start_many(wf, contexts)
        store = engine.store
        with store.engine.begin() as conn:  # type: ignore[attr-defined]
            ids = [row.id for row in conn.execute(sa.select(table.c.id).order_by(table.c.id))]
            third = len(ids) // 3
            for state, chunk in (("charge", ids[:third]), ("confirm", ids[third : 2 * third])):
                for at in range(0, len(chunk), 5_000):
                    part = chunk[at : at + 5_000]
                    conn.execute(sa.update(table).where(table.c.id.in_(part)).values(state=state))


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None)
    args = p.parse_args()
    runs = args.runs or (5_000 if args.quick else 100_000)
    pg = None if args.pg == "none" or (args.quick and "--pg" not in sys.argv) else args.pg
    from flowloop.checking import check_runs

    definitions = {
        "same": order(),
        "removed state": removed_state(),
        "added field + upcaster": added_field(migrated=True),
        "added field, no upcaster": added_field(migrated=False),
    }
    print(f"flowloop check on {runs:,} live runs ({common.cpu_model()})")
    with common.data_dir(args.dir) as directory:
        for backend in ["sqlite", *(["postgresql"] if pg else [])]:
            with common.fresh_url(backend, directory, pg, "check") as url:
                with common.Timer() as t:
                    populate(url, runs)
                print(f"\n{backend}: {runs:,} runs created in {t.seconds:.1f} s")
                from flowloop.store.sql import SQLStore

                store = SQLStore(url)
                try:
                    for label, workflow in definitions.items():
                        times = []
                        for _ in range(common.rounds_for(args, default=3, quick=1)):
                            report = check_runs(store, workflow)
                            times.append(report.seconds)
                        best = min(times)
                        counts = {k: v for k, v in report.counts.items() if v}
                        print(
                            f"  {label:26s} {best:6.2f} s (best of {len(times)}; "
                            f"{runs / best:,.0f} runs/s)  {counts}"
                        )
                finally:
                    store.close()


if __name__ == "__main__":
    main()
