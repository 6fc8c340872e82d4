"""Cold start of the `flowloop` command: a fresh process per call, as a user types it.

Times `flowloop --help`, `status` (the list and one run), `history` and `replay` on a small
SQLite database, each in a new interpreter (``python -m flowloop``) started from an empty
directory with no ``FLOWLOOP_*`` variable (no configuration to read), and beside them what
no command can go below: the interpreter alone and ``import sqlalchemy``. With ``--before
DIR`` the same commands run from another tree too (its package first on ``PYTHONPATH``),
alternated call by call, and the table shows after/before. ``--callgrind`` also counts each
command's instructions once per tree (``valgrind --tool=callgrind``: the same to a fraction
of a percent whatever else the machine does; ~1 minute per tree).

    python bench/cold_start.py
    git worktree add /tmp/flowloop-before <commit>
    python bench/cold_start.py --before /tmp/flowloop-before --callgrind

Both trees must read the database at the same schema revision (it is made by this one).
Each tree's package is compiled to bytecode first, as an installed package is: with
``PYTHONDONTWRITEBYTECODE=1`` in the environment a checkout is otherwise compiled from
source on every call (the eighth pass's figures in bench/README.md include it).
Issue 13's targets: ``--help`` < 150 ms, ``status`` < 300 ms.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common

HERE = Path(__file__).resolve().parent
RUNS = 20


def _database(directory: str) -> tuple[str, str]:
    """A SQLite file with ``RUNS`` finished 3-step runs: (its path, the newest run's id)."""
    from flowloop import Engine

    path = str(Path(directory) / "cold.db")
    workflow = common.chain("cold_start", 3)
    with Engine(path, workflows=[workflow]) as engine:
        infos = [engine.run(workflow, common.Ctx()) for _ in range(RUNS)]
    return path, infos[-1].id


def _commands(db: str, run_id: str) -> list[tuple[str, list[str]]]:
    flowloop = ["-m", "flowloop"]
    return [
        ("python alone", ["-c", "pass"]),
        ("import sqlalchemy", ["-c", "import sqlalchemy"]),
        ("flowloop --help", [*flowloop, "--help"]),
        ("flowloop status", [*flowloop, "status", "--db", db]),
        ("flowloop status RUN", [*flowloop, "status", run_id, "--db", db]),
        ("flowloop history RUN", [*flowloop, "history", run_id, "--db", db]),
        ("flowloop replay RUN", [*flowloop, "replay", run_id, "--db", db]),
    ]


def _env(tree: Path) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("FLOWLOOP_")}
    return {**clean, "PYTHONPATH": str(tree)}


def _compile(tree: Path) -> None:
    """Compile the tree's package to bytecode, as ``pip install`` does: an environment with
    ``PYTHONDONTWRITEBYTECODE=1`` (as this project's VMs have) never writes a checkout's
    ``__pycache__``, and every call would compile flowloop's sources again (~170 M
    instructions of a cold ``status``), which an installed package never does."""
    done = subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(tree / "flowloop")],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"compiling {tree / 'flowloop'} failed:\n{done.stdout}{done.stderr}")


def _wall(tree: Path, args: list[str], cwd: str) -> float:
    """Seconds from spawning the interpreter to its exit (a failure stops the script)."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=_env(tree), capture_output=True, text=True
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed in {tree}:\n{done.stderr[-2000:]}")
    return elapsed


def _instructions(tree: Path, args: list[str], cwd: str) -> int:
    return common.callgrind(
        [sys.executable, *args],
        options=["--callgrind-out-file=/dev/null"],
        env=_env(tree),
        cwd=cwd,
        what=" ".join(args),
    )


def main() -> int:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--before", default=None, metavar="DIR", help="another tree to compare")
    p.add_argument("--callgrind", action="store_true", help="also count instructions")
    args = p.parse_args()
    rounds = common.rounds_for(args, default=15, quick=2)
    trees = {"after": HERE.parent}
    if args.before:
        trees = {"before": Path(args.before).resolve(), **trees}
    if args.callgrind and shutil.which("valgrind") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    with common.data_dir(args.dir) as directory, tempfile.TemporaryDirectory() as empty:
        common.header(
            "cold start: a new `python -m flowloop` process per call, wall time",
            common.machine(None, directory),
            {
                "trees": ", ".join(f"{name} = {tree}" for name, tree in trees.items()),
                "calls": f"{rounds} per command and tree, alternated",
                "database": f"SQLite, {RUNS} finished 3-step runs; no configuration to read",
                "bytecode": "each tree's package compiled beforehand (as pip installs it)",
            },
        )
        for tree in trees.values():
            _compile(tree)
        db, run_id = _database(directory)
        commands = _commands(db, run_id)
        walls: dict[tuple[str, str], list[float]] = {}
        for r in range(rounds):
            for label, command in commands:
                for name, tree in trees.items():
                    walls.setdefault((label, name), []).append(_wall(tree, command, empty))
            print(f"  round {r + 1}/{rounds}", file=sys.stderr, flush=True)
        counts: dict[tuple[str, str], int] = {}
        if args.callgrind:
            for label, command in commands:
                for name, tree in trees.items():
                    print(f"  callgrind: {label} ({name})", file=sys.stderr, flush=True)
                    counts[label, name] = _instructions(tree, command, empty)
        rows = []
        for label, _ in commands:
            row = [label]
            for name in trees:
                ms = [w * 1000 for w in walls[label, name]]
                shown = f"{statistics.median(ms):,.0f} (min {min(ms):,.0f})"
                if counts:
                    shown += f", {counts[label, name] / 1e6:,.0f} M instr"
                row.append(shown)
            if "before" in trees:
                ratio = statistics.median(walls[label, "after"]) / statistics.median(
                    walls[label, "before"]
                )
                row.append(f"{ratio:.2f}")
                if counts:
                    row[-1] += f" ({counts[label, 'after'] / counts[label, 'before']:.2f})"
            rows.append(row)
        headers = ["command", *(f"{name}: ms median (min)" for name in trees)]
        if "before" in trees:
            headers.append("after/before" + (" (instr)" if counts else ""))
        common.table(headers, rows)
        common.footer()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
