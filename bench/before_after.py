"""Two versions of flowloop side by side: the same bench script, alternated.

Runs ``seq_steps.py`` (and ``wal_pages.py``) once per round in each version's tree (a copy
of these scripts is put in ``TREE/bench``) — before, after, before, after … — and prints,
per database and program, the median of each version's ratio to the baselines measured
*in the same invocation* (the SQLAlchemy Core loop, the stdlib floor). Ratios taken within one
invocation cancel most of the load other processes put on a shared machine; the
before/after comparison is then a ratio of ratios.

    git worktree add /tmp/flowloop-before <commit>        # or any copy of the package
    python bench/before_after.py --before /tmp/flowloop-before --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _bench_of(tree: str) -> Path:
    """The tree's own copy of these scripts: ``common.py`` puts the repository root of the
    script first on ``sys.path``, so a script measures the tree it sits in."""
    bench = Path(tree) / "bench"
    if bench.resolve() != HERE:
        bench.mkdir(exist_ok=True)
        for script in ("common.py", "seq_steps.py", "wal_pages.py"):
            shutil.copyfile(HERE / script, bench / script)
    return bench


def _run(script: str, tree: str, extra: list[str]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    env = {**os.environ, "PYTHONPATH": tree}
    done = subprocess.run(
        [sys.executable, str(_bench_of(tree) / script), "--rounds", "1", "--json", out, *extra],
        env=env,
        cwd=tempfile.gettempdir(),  # not the checkout: its package must not shadow `tree`
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{script} with {tree} failed:\n{done.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(Path(out).read_text())
    Path(out).unlink()
    return data


def _value(results: dict[str, Any], program: str, metric: str) -> float | None:
    found = results.get(program, {}).get(metric)
    return None if found is None else float(found["median"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="a directory holding the old `flowloop/`")
    p.add_argument("--after", default=str(HERE.parent), help="the new one (this checkout)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pg", default=None, help="PostgreSQL URL for seq_steps ('none' skips)")
    p.add_argument("--runs", type=int, default=None, help="seq_steps --runs")
    p.add_argument("--runs-pg", type=int, default=None, help="seq_steps --runs-pg")
    args = p.parse_args()
    seq_extra = ["--no-full"] + (["--pg", args.pg] if args.pg else [])
    seq_extra += ["--runs", str(args.runs)] if args.runs else []
    seq_extra += ["--runs-pg", str(args.runs_pg)] if args.runs_pg else []
    trees = {"before": args.before, "after": args.after}
    ratios: dict[tuple[str, str, str, str], list[float]] = {}
    absolute: dict[tuple[str, str, str, str], list[float]] = {}
    pages: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for version, tree in trees.items():
            data = _run("seq_steps.py", tree, seq_extra)
            for database, results in data["results"].items():
                core = _value(results, "core", "steps_per_s")
                core_cpu = _value(results, "core", "cpu_us_per_step")
                # SQLite: the Core loop given flowloop's WAL checkpoints on a thread too.
                apart = _value(results, "core_apart", "steps_per_s")
                for program in ("async", "sync"):
                    speed = _value(results, program, "steps_per_s")
                    cpu = _value(results, program, "cpu_us_per_step")
                    if speed is None or core is None or cpu is None or core_cpu is None:
                        continue
                    ratios.setdefault((database, program, version, "vs core"), []).append(
                        speed / core
                    )
                    ratios.setdefault((database, program, version, "cpu vs core"), []).append(
                        core_cpu / cpu
                    )
                    if apart is not None:
                        key = (database, program, version, "vs apart")
                        ratios.setdefault(key, []).append(speed / apart)
                    for metric in ("cpu_us_per_step", "round_trips", "statements"):
                        value = _value(results, program, metric)
                        if value is not None:
                            absolute.setdefault((database, program, version, metric), []).append(
                                value
                            )
            wal = _run("wal_pages.py", tree, ["--runs", "60"])
            for program, metrics in wal["results"].items():
                pages.setdefault((program, version), []).append(
                    float(metrics["pages_per_commit"]["median"])
                )
            print(f"  round {r + 1}/{args.rounds}: {version} done", file=sys.stderr, flush=True)
    print("\nsteps/s as a ratio to the Core baseline of the same invocation (median); vs apart:")
    print("to the Core loop with its WAL checkpoints on a thread (SQLite)")
    print("  database           program  before  after  after/before")
    for database, program in sorted({(k[0], k[1]) for k in ratios}):
        for kind in ("vs core", "cpu vs core", "vs apart"):
            if (database, program, "before", kind) not in ratios:
                continue
            b = statistics.median(ratios[(database, program, "before", kind)])
            a = statistics.median(ratios[(database, program, "after", kind)])
            print(f"  {database:<18} {program:<8} {kind:<11} {b:6.2f}x {a:6.2f}x {a / b:6.2f}x")
    print("\nabsolute (median): CPU µs/step, PostgreSQL round trips/step, statements/step")
    for key in sorted({(k[0], k[1], k[3]) for k in absolute}):
        database, program, metric = key
        b = statistics.median(absolute.get((database, program, "before", metric), [0.0]))
        a = statistics.median(absolute.get((database, program, "after", metric), [0.0]))
        print(f"  {database:<18} {program:<6} {metric:<16} before {b:8.2f}  after {a:8.2f}")
    print("\nWAL pages per commit (wal_pages.py, median)")
    for program in sorted({k[0] for k in pages}):
        b = statistics.median(pages.get((program, "before"), [float("nan")]))
        a = statistics.median(pages.get((program, "after"), [float("nan")]))
        print(f"  {program:<24} before {b:6.2f}  after {a:6.2f}")


if __name__ == "__main__":
    main()
