"""The cost of a claim with and without cluster-wide limits, in µs per claimed run.

Programs (alternated, one fresh database per sample): ``plain`` — a workflow without
limits (the one-statement SKIP LOCKED claim); ``capped`` — ``max_concurrency`` set high
enough never to refuse (the counted claim: advisory lock on PostgreSQL, the CTE that
counts the slots held); ``keyed`` — ``concurrency_key`` with ``key_limit=1`` over as many
keys as runs (round-robin ranking and per-key counts). Each sample queues ``--queued`` runs,
then claims 8 at a time and hands them back (so the queue stays full) ``--claims`` times.
PostgreSQL's statistics are refreshed (ANALYZE) after queueing, as autovacuum would.

    python bench/limits.py [--quick] [--queued N] [--claims N] [--pg URL|none]
"""

from __future__ import annotations

import time
from typing import Any

import common

from flowloop import Engine, Workflow
from flowloop.store import SQLStore

BATCH = 8


def _flow(program: str) -> Workflow:
    limits: dict[str, Any] = {}
    if program == "capped":
        limits = {"max_concurrency": 1_000_000}
    elif program == "keyed":
        limits = {"concurrency_key": lambda c: c.label, "key_limit": 1}
    flow = Workflow(program, context=common.Ctx, **limits)
    flow.step(name="a", initial=True, next="done")(lambda ctx: None)
    flow.final("done")
    return flow


def sample(
    backend: str, directory: str, pg: str | None, program: str, queued: int, claims: int
) -> dict[str, float]:
    flow = _flow(program)
    with (
        common.fresh_url(backend, directory, pg, f"limits_{program}") as url,
        Engine(url, workflows=[flow]) as engine,
    ):
        engine.start_many(flow, [{"n": i, "label": f"k{i}"} for i in range(queued)])
        store = engine.store
        assert isinstance(store, SQLStore)
        if backend == "postgres":  # planner statistics, as autovacuum keeps them
            with store.engine.begin() as conn:
                conn.exec_driver_sql("ANALYZE flowloop_runs")
        now = store.db_now() + 1
        spent = 0.0
        claimed = 0
        for _ in range(claims):
            started = time.perf_counter()
            rows = store.claim(
                worker="bench", now=now, limit=BATCH, lease_seconds=30, workflows=[program]
            )
            spent += time.perf_counter() - started
            claimed += len(rows)
            store.release(worker="bench", run_ids=[row.id for row in rows])
        assert claimed == claims * BATCH, claimed
    return {"us_per_run": spent / claimed * 1e6, "us_per_claim": spent / claims * 1e6}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--queued", type=int, default=None, help="runs queued (default 2000)")
    p.add_argument("--claims", type=int, default=None, help="claims per sample (default 200)")
    args = p.parse_args()
    queued = args.queued or (200 if args.quick else 2000)
    claims = args.claims or (20 if args.quick else 200)
    rounds = common.rounds_for(args)
    pg = common.pg_for(args)
    programs = ["plain", "capped", "keyed"]
    with common.data_dir(args.dir) as directory:
        common.header(
            "claim cost with and without limits",
            common.machine(pg, directory),
            {"queued": queued, "claims": claims, "batch": BATCH, "rounds": rounds},
        )
        payload: dict[str, Any] = {}
        for backend in ["sqlite", *(["postgres"] if pg else [])]:
            results: dict[str, list[dict[str, float]]] = {p: [] for p in programs}
            for _ in range(rounds):
                for program in programs:  # alternated: A B C A B C ...
                    results[program].append(sample(backend, directory, pg, program, queued, claims))
            rows = []
            for program in programs:
                per_run = sorted(r["us_per_run"] for r in results[program])
                per_claim = sorted(r["us_per_claim"] for r in results[program])
                rows.append(
                    [
                        backend,
                        program,
                        f"{per_run[len(per_run) // 2]:.0f} ({per_run[0]:.0f}-{per_run[-1]:.0f})",
                        f"{per_claim[len(per_claim) // 2]:.0f}",
                    ]
                )
            common.table(["backend", "program", "µs/claimed run (min-max)", "µs/claim"], rows)
            payload[backend] = results
        common.footer()
        common.write_json(args.json, payload)


if __name__ == "__main__":
    main()
