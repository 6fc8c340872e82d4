"""What ``engine.run`` costs at different depths of its caller's stack (CPython gh-142183).

CPython 3.11 and 3.12 map a new 16 KiB data-stack chunk when a call does not fit in the
current one, and unmap it when that call returns: a loop that goes back and forth across
the end of a chunk faults a page in at every crossing. flowloop/freshstack.py starts a
thread's runs on a fresh chunk once they keep faulting. This script shows both sides:

1. **Scan** (untimed): from each caller depth (0 to 278 frames of a small recursive
   function, in a thread of its own), a few 10-step runs with flowloop's rule off, then
   on: page faults per run (the thread's own, ``getrusage(RUSAGE_THREAD)``). Picks the
   depth with the most faults (the worst) and the first with the fewest (a quiet one);
   when no depth faults (a CPython that keeps a freed chunk), says so and stops.
2. **Timed**, alternated per round, a fresh SQLite file per sample: 10-step runs from the
   quiet and the worst depth, rule off and on — steps/s, the thread's CPU µs per step and
   page faults per run.

    python bench/stack_depth.py            # ~1 minute
    python bench/stack_depth.py --quick    # smoke run, < 10 s

Linux and CPython only (a thread's page faults).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TypeVar

import common
from common import Ctx, Results

from flowloop import Engine, Workflow, freshstack

STEPS = 10
T = TypeVar("T")

COUNTER = freshstack.thread_faults or (lambda: 0)
"""The thread's page faults, read even while the rule is off (which hides it)."""


def at_depth(depth: int, fn: Callable[..., T], args: tuple[object, ...]) -> T:
    """``fn(*args)`` called ``depth`` frames down (a small frame each)."""
    if depth == 0:
        return fn(*args)
    return at_depth(depth - 1, fn, args)


def in_thread_at(depth: int, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a new thread, ``depth`` frames down: each depth starts from the
    same place of a fresh data stack, and the rule's per-thread state starts empty. The
    scan and the timed programs call :func:`drive` this way, from the same place."""
    result: list[T] = []
    failed: list[BaseException] = []

    def bottom() -> None:
        try:
            result.append(at_depth(depth, fn, args))
        except BaseException as error:  # raised again in the caller's thread
            failed.append(error)

    thread = threading.Thread(target=bottom)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return result[0]


@contextmanager
def rule(on: bool) -> Iterator[None]:
    """flowloop's rule on (as shipped) or off (``steady_call`` then calls plainly)."""
    shipped = freshstack.thread_faults
    if not on:
        freshstack.thread_faults = None
    try:
        yield
    finally:
        freshstack.thread_faults = shipped


class Driven:
    """What :func:`drive` saw of its timed runs."""

    def __init__(self) -> None:
        self.faults: list[int] = []
        self.cpu = 0.0
        self.wall = 0.0


def drive(engine: Engine, workflow: Workflow, warm: int, runs: int) -> Driven:
    """``warm`` runs (the loop made, the rule's decision), then ``runs`` timed ones."""
    counter = COUNTER
    for _ in range(warm):
        engine.run(workflow, Ctx())
    driven = Driven()
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(runs):
        before = counter()
        engine.run(workflow, Ctx())
        driven.faults.append(counter() - before)
    driven.wall, driven.cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return driven


def scan(url: str, workflow: Workflow, depths: range, warm: int) -> dict[bool, dict[int, float]]:
    """Per rule (off, on) and depth: the median page faults of 4 runs after ``warm``
    others (in which the rule decides)."""
    found: dict[bool, dict[int, float]] = {False: {}, True: {}}
    with Engine(url, workflows=[workflow]) as engine:
        engine.run(workflow, Ctx())
        for on in (False, True):
            for depth in depths:
                with rule(on):
                    driven = in_thread_at(depth, drive, engine, workflow, warm, 4)
                found[on][depth] = statistics.median(driven.faults)
    return found


def program(directory: str, workflow: Workflow, depth: int, on: bool, runs: int) -> common.Program:
    def run(_round: int) -> Mapping[str, float]:
        with (
            common.sqlite_file(directory, "depth") as url,
            Engine(url, workflows=[workflow]) as engine,
        ):
            engine.run(workflow, Ctx())  # the store's statements prepared
            with rule(on):
                driven = in_thread_at(depth, drive, engine, workflow, 20, runs)
        steps = runs * STEPS
        return {
            "steps_per_s": steps / driven.wall,
            "cpu_us_per_step": driven.cpu / steps * 1e6,
            "faults_per_run": statistics.mean(driven.faults),
        }

    return run


def main() -> int:
    args = common.parser(__doc__ or "").parse_args()
    if freshstack.thread_faults is None:
        print("a thread's page faults cannot be read here (Linux and CPython only)")
        return 2
    rounds = common.rounds_for(args)
    runs = 20 if args.quick else 300
    depths = range(0, 280, 6 if args.quick else 2)
    warm = freshstack.STRIKES + 1  # the rule decides within STRIKES runs
    workflow = common.chain("depth", STEPS)
    with common.data_dir(args.dir) as directory:
        common.header(
            "engine.run at different caller depths (CPython data-stack chunks, gh-142183)",
            common.machine(None, directory),
            {
                "workflow": f"{STEPS} trivial async steps per run, sequential runs",
                "database": "SQLite WAL, synchronous=NORMAL",
                "scan": f"caller depths {depths.start}-{depths[-1]} step {depths.step}, "
                f"{warm} + 4 runs per depth and rule setting, each in a thread of its own",
                "timed": f"{runs} runs per sample, {rounds} rounds",
            },
        )
        with common.sqlite_file(directory, "scan") as url:
            found = scan(url, workflow, depths, warm)
        off, on = found[False], found[True]
        worst = max(depths, key=lambda d: off[d])
        quiet = min(depths, key=lambda d: (off[d], d))
        faulting = [d for d in depths if off[d] >= freshstack.THRASH_FAULTS]
        print(
            f"scan, rule off: {len(faulting)} of {len(depths)} depths fault "
            f"{freshstack.THRASH_FAULTS}+ times per run; the most: {off[worst]:g} at "
            f"depth {worst}"
        )
        print(f"scan, rule on: the most faults per run at any depth: {max(on.values()):g}")
        if not faulting:
            print("no caller depth makes runs fault here: nothing to time")
            return 0
        programs = [
            (
                f"depth {depth}, rule {'on' if rule_on else 'off'}",
                program(directory, workflow, depth, rule_on, runs),
            )
            for depth in (quiet, worst)
            for rule_on in (False, True)
        ]
        results = common.alternate(programs, rounds, Results())
    rows = [
        [
            name,
            common.fmt_spread(results, name, "steps_per_s"),
            common.fmt_spread(results, name, "cpu_us_per_step"),
            common.fmt_spread(results, name, "faults_per_run"),
            results.notes.get(name, ""),
        ]
        for name, _ in programs
    ]
    common.table(["program", "steps/s", "thread CPU µs/step", "page faults/run", "note"], rows)
    for depth in (quiet, worst):
        plain, ruled = f"depth {depth}, rule off", f"depth {depth}, rule on"
        if results.has(plain, "steps_per_s") and results.has(ruled, "steps_per_s"):
            ratio = results.median(ruled, "steps_per_s") / results.median(plain, "steps_per_s")
            print(f"depth {depth}: rule on / rule off, steps/s: {ratio:.2f}x")
    common.write_json(args.json, results.to_json())
    common.footer()
    return 0


if __name__ == "__main__":
    sys.exit(main())
