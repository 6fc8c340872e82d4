"""Reading runs whose context is long (kept in the journal only since migration 0015).

A context longer than ``ROW_CONTEXT_MAX`` characters is not in the run row: every read
takes it from the run's latest whole context in the journal and the splices after it.
This prints what that costs against a 1 KB context (kept in the row), on SQLite WAL NORMAL
and PostgreSQL, for the same 10-step workflow (one field changed per step):

* ``get finished``  ``store.get_run`` of a finished run, µs per call
* ``get running``   the same for a run interrupted in its first step (its worker gone)
* ``claim``         ``claim_interrupted`` of ``--claim`` runs interrupted that way, µs per
  claimed run (recovery after a crash)

Run it from an older tree (copy the script there) to compare: ``python bench/long_contexts.py``
measures the flowloop it sits beside. ~1 min; ``--quick`` < 10 s.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import common
from pydantic import BaseModel
from wal_pages import Large, Small  # the same ~1 KB and ~100 KB contexts


def program(
    backend: str, directory: str, pg: str | None, size: str, calls: int, claim: int
) -> common.Program:
    from flowloop import Engine, Workflow

    context = Small if size == "1KB" else Large
    workflow = Workflow(f"long_{size.lower()}", context=context)
    for i in range(10):

        async def fn(ctx: Any) -> None:
            ctx.n += 1

        workflow.step(name=f"s{i}", initial=i == 0, next=f"s{i + 1}" if i < 9 else "done")(fn)
    workflow.final("done")

    def run(_round: int) -> Mapping[str, float]:
        with common.fresh_url(backend, directory, pg, "long") as url:
            engine = Engine(url, workflows=[workflow])
            try:
                store = engine.store
                done = engine.run(workflow, context())
                running = _cut(engine, workflow, context, 1)[0]
                out: dict[str, float] = {}
                for name, run_id in (("get finished", done.id), ("get running", running)):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        store.get_run(run_id)
                    out[name] = (time.perf_counter() - t0) / calls * 1e6
                _cut(engine, workflow, context, claim)
                t0 = time.perf_counter()
                claimed = store.claim_interrupted(worker="bench", limit=claim + 1, lease_seconds=60)
                seconds = time.perf_counter() - t0
                if len(claimed) != claim + 1:
                    raise RuntimeError(f"claimed {len(claimed)} of {claim + 1}")
                out["claim"] = seconds / len(claimed) * 1e6
                return out
            finally:
                engine.close()

    return run


def _cut(engine: Any, workflow: Any, context: type[BaseModel], count: int) -> list[str]:
    """``count`` runs whose worker started their first step and was gone: claimed, their
    ``step_started`` committed, the lease then expired (what a SIGKILL leaves)."""
    from flowloop import journal as j
    from flowloop.store.base import Boundary, Fence

    store = engine.store
    ids = [engine.start(workflow, context()).id for _ in range(count)]
    claimed = store.claim(worker="gone", now=time.time(), limit=count, lease_seconds=60)
    boundaries = []
    for stored in claimed:
        record = stored.record
        started = j.JournalEvent(
            run_id=record.id,
            seq=record.last_seq + 1,
            kind=j.STEP_STARTED,
            at=time.time(),
            state=record.state,
            attempt=record.attempt + 1,
            worker="gone",
        )
        boundaries.append(
            Boundary(
                events=[started],
                record=j.apply(record, started),
                fence=Fence("gone", stored.lease_epoch),
            )
        )
    if sorted(store.write(boundaries)) != [True] * count:
        raise RuntimeError("a start was refused")
    store.expire_leases(["gone"])
    return ids


def main() -> None:
    parser = common.parser(__doc__ or "")
    parser.add_argument("--calls", type=int, default=None, help="get_run calls per sample (200)")
    parser.add_argument("--claim", type=int, default=None, help="runs per claim (200)")
    args = parser.parse_args()
    calls = args.calls or (20 if args.quick else 200)
    claim = args.claim or (10 if args.quick else 200)
    rounds = common.rounds_for(args, default=3)
    pg = common.pg_for(args)
    with common.data_dir(args.dir) as directory:
        info = common.machine(pg, directory)
        common.header("Reading long contexts", info, {"calls": calls, "claim": claim})
        backends = ["sqlite"] + (["postgres"] if pg else [])
        programs = [
            (f"{backend} {size}", program(backend, directory, pg, size, calls, claim))
            for backend in backends
            for size in ("1KB", "100KB")
        ]
        results = common.alternate(programs, rounds, show="get finished")
        metrics = ("get finished", "get running", "claim")
        rows = [
            [name, *[common.fmt_spread(results, name, m, 0) for m in metrics]]
            for name, _ in programs
            if results.has(name, "claim")
        ]
        common.table(["program", "get finished µs", "get running µs", "claim µs/run"], rows)
        for name, note in results.notes.items():
            print(f"  {name}: {note}")
        common.write_json(args.json, {"info": info, "results": results.to_json()})
        common.footer()


if __name__ == "__main__":
    main()
