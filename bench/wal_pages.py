"""WAL pages per commit on SQLite: what one step boundary writes to disk.

Automatic checkpoints are turned off on every connection, so the ``-wal`` file only
grows: frames written = (size - 32) / (page size + 24). Commits are counted at the driver
(``common.WireCounter``), so pages/commit is exact, not estimated. Workloads:

* ``core``            the SQLAlchemy Core baseline of ``seq_steps.py`` (UPDATE + INSERT)
* ``flowloop 1KB``    10 trivial steps, a ~1 KB context, one field changed per step
* ``flowloop 100KB``  the same with a ~100 KB context (the same one field changes)
* ``flowloop 1000 states`` a 1,000-state chain: is the per-step cost flat in the number
  of states visited (µs/step against the 10-state chain)?

For the flowloop workloads the ``-wal`` file is also walked frame by frame (a frame whose
header carries the database size ends a commit), so each commit's pages are known: a run
of N steps is N + 1 commits — its creation (with the first ``step_started``), N - 1
boundaries that go on (an outcome and the next start) and its end. The breakdown is shown
only when the commits counted are exactly that (no lease renewal in between).

    python bench/wal_pages.py            # ~30 s
    python bench/wal_pages.py --quick    # smoke run
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

import common
import sqlalchemy as sa
from common import WireCounter
from pydantic import BaseModel


class Small(BaseModel):
    n: int = 0
    blob: str = "x" * 1000


class Large(BaseModel):
    n: int = 0
    blob: str = "x" * 100_000


def _no_autocheckpoint(engine: sa.Engine) -> None:
    def pragma(dbapi: Any, _record: Any) -> None:
        cursor = dbapi.cursor()
        cursor.execute("PRAGMA wal_autocheckpoint=0")
        cursor.close()

    sa.event.listen(engine, "connect", pragma)
    engine.dispose()  # connections opened before the listener are replaced


def _reconnect(store: Any) -> None:
    """The store's held write connection was opened before the listener: drop it (the
    next write opens one with automatic checkpoints off)."""
    writer = getattr(store, "_writer", None)
    if writer is not None:
        writer.close()
        store._writer = None


def _frames(path: str) -> int:
    wal = path + "-wal"
    if not os.path.exists(wal) or os.path.getsize(wal) < 32:
        return 0
    with open(path, "rb") as handle:
        header = handle.read(18)
    page = int.from_bytes(header[16:18], "big")
    page = 65536 if page == 1 else page
    return (os.path.getsize(wal) - 32) // (page + 24)


def _page_size(path: str) -> int:
    with open(path, "rb") as handle:
        header = handle.read(18)
    page = int.from_bytes(header[16:18], "big")
    return 65536 if page == 1 else page


def _commit_frames(path: str, first_frame: int) -> list[list[int]]:
    """The page numbers of each commit in the ``-wal`` file from frame ``first_frame`` on,
    in order: a frame header's bytes 0-4 are its page number, bytes 4-8 (the database size
    after the commit) are non-zero only on the last frame of a commit."""
    page = _page_size(path)
    out: list[list[int]] = []
    pending: list[int] = []
    with open(path + "-wal", "rb") as wal:
        wal.seek(32 + first_frame * (page + 24))
        while True:
            header = wal.read(24)
            if len(header) < 24:
                return out
            wal.seek(page, os.SEEK_CUR)
            pending.append(int.from_bytes(header[0:4], "big"))
            if int.from_bytes(header[4:8], "big") != 0:
                out.append(pending)
                pending = []


def _trees(path: str) -> dict[int, str]:
    """Page number -> the B-tree it belongs to (``name leaf|internal|overflow``), read from
    SQLite's ``dbstat`` table; empty when this SQLite is built without it."""
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT pageno, name, pagetype FROM dbstat").fetchall()
    except sqlite3.OperationalError:
        return {}
    finally:
        conn.close()
    return {pageno: f"{name} {kind}" for pageno, name, kind in rows}


def _by_tree(commits: list[list[int]], trees: dict[int, str], runs: int, steps: int) -> Any:
    """Mean pages per B-tree of a run's creation, a boundary that goes on, and its end:
    ``{"tree <name> <kind>": pages}`` (nothing when the commits are not as expected)."""
    per_run = steps + 1
    if not trees or len(commits) != runs * per_run or steps < 2:
        return {}
    kinds = {
        "creation": [i * per_run for i in range(runs)],
        "goes_on": [i * per_run + j for i in range(runs) for j in range(1, per_run - 1)],
        "end": [i * per_run + per_run - 1 for i in range(runs)],
    }
    out: dict[str, float] = {}
    for kind, picked in kinds.items():
        for index in picked:
            for pageno in commits[index]:
                key = f"tree {trees.get(pageno, 'unknown (freed since)')} {kind}"
                out[key] = out.get(key, 0.0) + 1.0 / len(picked)
    return out


def _breakdown(commits: list[int], runs: int, steps: int) -> dict[str, float]:
    """Mean pages of a run's creation, of a boundary that goes on, of its end."""
    nan = float("nan")
    per_run = steps + 1
    if len(commits) != runs * per_run or steps < 2:
        return {"create_pages": nan, "goes_on_pages": nan, "end_pages": nan}
    runs_of = [commits[i * per_run : (i + 1) * per_run] for i in range(runs)]
    going = [pages for one in runs_of for pages in one[1:-1]]
    return {
        "create_pages": sum(one[0] for one in runs_of) / runs,
        "goes_on_pages": sum(going) / len(going),
        "end_pages": sum(one[-1] for one in runs_of) / runs,
    }


def _chain(name: str, steps: int, context: type[BaseModel]) -> Any:
    from flowloop import Workflow

    workflow = Workflow(name, context=context)
    for i in range(steps):
        nxt = f"s{i + 1}" if i < steps - 1 else "done"

        async def fn(ctx: Any) -> None:
            ctx.n += 1

        workflow.step(name=f"s{i}", initial=i == 0, next=nxt)(fn)
    workflow.final("done")
    return workflow


def flowloop_pages(directory: str, runs: int, steps: int, context: type[BaseModel]) -> Any:
    from flowloop import Engine

    workflow = _chain(f"pages_{context.__name__.lower()}_{steps}", steps, context)

    def run(_round: int) -> Mapping[str, float]:
        with common.sqlite_file(directory) as path, WireCounter() as wire:
            engine = Engine(f"sqlite:///{path}", workflows=[workflow])
            try:
                store: Any = engine.store
                # The store's checkpoint thread (flowloop/store/checkpointer.py; absent in
                # older trees) would copy and reset the WAL this script counts frames of.
                checkpointer = getattr(store, "checkpointer", None)
                if checkpointer is not None:
                    checkpointer.close()
                _no_autocheckpoint(store.engine)
                _reconnect(store)
                engine.run(workflow, context())
                before = _frames(path)
                wire.start()
                t0 = time.perf_counter()
                for _ in range(runs):
                    info = engine.run(workflow, context())
                seconds = time.perf_counter() - t0
                wire.stop()
                if info.status != "succeeded":
                    raise RuntimeError(f"run ended {info.status}: {info.error}")
                frames = _frames(path) - before
                if frames <= 0:  # the WAL was reset (a checkpoint): no page count
                    frames = float("nan")
                    frames_of: list[list[int]] = []
                else:
                    frames_of = _commit_frames(path, before)
            finally:
                engine.close()
            walked = [len(one) for one in frames_of]
            trees = _by_tree(frames_of, _trees(path), runs, steps)
        commits = wire.counts()["commits"]
        return {
            "pages_per_commit": frames / max(commits, 1),
            "commits_per_step": commits / (runs * steps),
            "us_per_step": seconds / (runs * steps) * 1e6,
            **_breakdown(walked, runs, steps),
            **trees,
        }

    return run


def core_pages(directory: str, runs: int, steps: int) -> Any:
    def run(_round: int) -> Mapping[str, float]:
        with common.sqlite_file(directory) as path, WireCounter() as wire:
            engine = sa.create_engine(f"sqlite:///{path}")

            def pragmas(dbapi: Any, _record: Any) -> None:
                cursor = dbapi.cursor()
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA synchronous=NORMAL")
                cursor.execute("PRAGMA wal_autocheckpoint=0")
                cursor.close()

            sa.event.listen(engine, "connect", pragmas)
            with engine.connect() as conn:
                conn.exec_driver_sql(
                    "CREATE TABLE runs (id VARCHAR(40) PRIMARY KEY, status VARCHAR(16), "
                    "state VARCHAR(200), context TEXT, last_seq INTEGER, updated_at FLOAT)"
                )
                conn.exec_driver_sql(
                    "CREATE TABLE journal (run_id VARCHAR(40), seq INTEGER, kind VARCHAR(32), "
                    "at FLOAT, state VARCHAR(200), context TEXT, worker VARCHAR(200), "
                    "PRIMARY KEY (run_id, seq))"
                )
                conn.commit()
                before = _frames(path)
                wire.start()
                for _ in range(runs):
                    rid = uuid.uuid4().hex
                    with conn.begin():
                        conn.exec_driver_sql(
                            "INSERT INTO runs VALUES (?, 'running', 's0', '{}', 1, ?)",
                            (rid, time.time()),
                        )
                        conn.exec_driver_sql(
                            "INSERT INTO journal VALUES (?, 1, 'run_created', ?, 's0', '{}', 'w')",
                            (rid, time.time()),
                        )
                    for i in range(steps):
                        ctx = f'{{"n":{i + 1}}}'
                        with conn.begin():
                            conn.exec_driver_sql(
                                "UPDATE runs SET status='running', state=?, context=?, "
                                "last_seq=?, updated_at=? WHERE id=?",
                                (f"s{i + 1}", ctx, i + 2, time.time(), rid),
                            )
                            conn.exec_driver_sql(
                                "INSERT INTO journal VALUES (?, ?, 'step', ?, ?, ?, 'w')",
                                (rid, i + 2, time.time(), f"s{i}", ctx),
                            )
                wire.stop()
                frames = _frames(path) - before
            engine.dispose()
        commits = wire.counts()["commits"]
        return {"pages_per_commit": frames / max(commits, 1), "commits_per_step": 1.1}

    return run


BREAKDOWN = ("create_pages", "goes_on_pages", "end_pages")


def _print_trees(results: Any, program: str) -> None:
    """Which B-tree each page of a commit belongs to (the pages by kind, taken apart):
    means over the rounds that were taken apart (a B-tree a round's commits did not touch
    counts 0 there; a round whose commits were not as expected has no breakdown)."""
    metrics: dict[str, list[float]] = results.samples.get(program, {})
    rounds = sum(1 for value in metrics.get("create_pages", []) if value == value)  # not NaN
    names = sorted({key.rsplit(" ", 1)[0] for key in metrics if key.startswith("tree ")})
    if not names or not rounds:
        return
    rows = [
        [
            name.removeprefix("tree "),
            *[
                common.fmt(sum(metrics.get(f"{name} {kind}", [])) / rounds, 2)
                for kind in ("creation", "goes_on", "end")
            ],
        ]
        for name in names
    ]
    print(f"\nPages per commit by B-tree, {program} (SQLite's dbstat; means over rounds;")
    print("sqlite_schema's root is page 1, the file header: written when the file grows)")
    common.table(["B-tree page", "creation", "a boundary that goes on", "end"], rows)


def main() -> None:
    parser = common.parser(__doc__ or "")
    parser.add_argument("--runs", type=int, default=None, help="runs per sample (100)")
    args = parser.parse_args()
    runs = args.runs or (10 if args.quick else 100)
    rounds = common.rounds_for(args, default=3)
    with common.data_dir(args.dir) as directory:
        info = common.machine(None, directory)
        common.header("WAL pages per commit (SQLite WAL NORMAL)", info, {"runs": runs})
        programs = [
            ("core", core_pages(directory, runs, 10)),
            ("flowloop 1KB", flowloop_pages(directory, runs, 10, Small)),
            ("flowloop 100KB", flowloop_pages(directory, max(runs // 5, 2), 10, Large)),
            (
                "flowloop 1000 states",
                flowloop_pages(directory, 1 if args.quick else 2, 1000, Small),
            ),
        ]
        results = common.alternate(programs, rounds, show="pages_per_commit")
        rows = []
        for name, _ in programs:
            rows.append(
                [
                    name,
                    common.fmt_spread(results, name, "pages_per_commit", 2),
                    common.fmt(results.median(name, "commits_per_step"), 2),
                    common.fmt(results.median(name, "us_per_step"), 0)
                    if results.has(name, "us_per_step")
                    else "",
                ]
            )
        common.table(["program", "WAL pages/commit", "commits/step", "µs/step"], rows)
        split = [
            [name, *[common.fmt(results.median(name, key), 2) for key in BREAKDOWN]]
            for name, _ in programs[1:]
        ]
        print("\nPages per commit by kind (WAL frame walk; nan: commits not as expected)")
        common.table(["program", "creation", "a boundary that goes on", "end"], split)
        _print_trees(results, "flowloop 1KB")
        small = results.median("flowloop 1KB", "pages_per_commit")
        large = results.median("flowloop 100KB", "pages_per_commit")
        ratio = large / small
        print(f"\n100 KB context / 1 KB context, pages per commit: {ratio:.2f}x (target <= 2x)")
        going = results.median("flowloop 100KB", "goes_on_pages") / results.median(
            "flowloop 1KB", "goes_on_pages"
        )
        print(f"the same, a boundary that goes on: {going:.2f}x")
        flat = results.median("flowloop 1000 states", "us_per_step") / results.median(
            "flowloop 1KB", "us_per_step"
        )
        print(f"1,000-state chain / 10-state chain, µs per step: {flat:.2f}x (target: flat)")
        common.write_json(args.json, {"info": info, "results": results.to_json()})
        common.footer()


if __name__ == "__main__":
    main()
