"""Idle loops: what 10,000 registered loops cost a worker while none of them is due.

A child process runs a real :class:`~flowloop.worker.Worker` (executor and scheduler on one
event loop, SQLite file) with N loops of ``every=3600 s`` whose first slot is an hour away,
so that once registered nothing is due. The parent measures:

* **registration**: Loop objects built (definition-time validation), then worker start to
  "every loop registered and armed" (``Scheduler.ready``) — on a fresh database (rows and
  journal entries created) and again on a restart (rows found);
* **idle CPU**: user + system CPU time of the child over the idle window (``/proc/PID/stat``,
  read by the parent, 10 ms ticks; the child's own ``resource.getrusage`` is the fallback),
  as % of one CPU, plus its resident memory — and the same for a worker with one loop, so
  the cost of the loops themselves shows apart from the worker's own polling.

Usage: ``python bench/idle_loops.py [--loops N] [--seconds S] [--quick]``
(``--quick``: 500 loops, 3 s, under 10 s in all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common  # puts the repository root first on sys.path

EVERY_S = 3600.0
FIRST_SLOT_AHEAD_S = 3600.0
DEFAULT_LOOPS = 10_000
DEFAULT_SECONDS = 30.0
QUICK_LOOPS = 500
QUICK_SECONDS = 3.0
RESTART_WINDOW_S = 0.5
"""The restart run measures registration only; a short idle window suffices."""
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# -- the child: a worker with N idle loops --------------------------------------------------


def child(db: str, count: int) -> None:
    from flowloop import Engine
    from flowloop.loops import Iteration, Loop
    from flowloop.worker import Worker

    def work(it: Iteration) -> None:
        return None

    built = time.perf_counter()
    start_at = time.time() + FIRST_SLOT_AHEAD_S
    loops = [Loop(f"idle-{i:05d}", work, every=EVERY_S, start_at=start_at) for i in range(count)]
    built = time.perf_counter() - built
    engine = Engine(db)
    worker = Worker(engine, loops)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        began = time.perf_counter()
        running = asyncio.create_task(worker.run(stop))
        while worker.scheduler is None or not worker.scheduler.ready.is_set():
            if running.done():
                running.result()
            await asyncio.sleep(0.01)
        registered = time.perf_counter() - began
        ready_cpu = time.process_time()
        print(
            json.dumps(
                {"ready": True, "build_s": built, "register_s": registered, "cpu_s": ready_cpu}
            ),
            flush=True,
        )
        await running
        usage = resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({"cpu_s": time.process_time(), "maxrss_kb": usage.ru_maxrss}), flush=True)

    asyncio.run(main())
    engine.close()


# -- the parent: start, wait for ready, measure, stop ----------------------------------------


def proc_cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def proc_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def measure(db: str, count: int, seconds: float) -> dict[str, Any]:
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", db, "--loops", str(count)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    try:
        line = process.stdout.readline()
        if not line:
            raise SystemExit(f"the worker exited before it was ready (code {process.wait()})")
        ready = json.loads(line)
        cpu_before, wall_before = proc_cpu_seconds(process.pid), time.monotonic()
        time.sleep(seconds)  # a benchmark, not a test: the idle window is the measurement
        cpu_after, wall = proc_cpu_seconds(process.pid), time.monotonic() - wall_before
        rss = proc_rss_mb(process.pid)
        process.send_signal(signal.SIGTERM)
        final = json.loads(process.stdout.readline() or "{}")
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if cpu_before is not None and cpu_after is not None:
        idle_cpu, how = cpu_after - cpu_before, "/proc/PID/stat utime+stime, read by the parent"
    else:  # no /proc: the child's own figure (includes its shutdown, a few ms)
        idle_cpu, how = final["cpu_s"] - ready["cpu_s"], "child's getrusage (incl. shutdown)"
    return {
        "loops": count,
        "build_s": ready["build_s"],
        "register_s": ready["register_s"],
        "idle_window_s": wall,
        "idle_cpu_s": idle_cpu,
        "idle_cpu_pct": 100.0 * idle_cpu / wall,
        "rss_mb": rss if rss is not None else final.get("maxrss_kb", 0) / 1024,
        "how": how,
    }


def main(argv: list[str] | None = None) -> int:
    p = common.parser("CPU of an idle worker with many registered loops")
    p.add_argument("--loops", type=int, default=None, help=f"loops (default {DEFAULT_LOOPS})")
    p.add_argument(
        "--seconds", type=float, default=None, help=f"idle window (default {DEFAULT_SECONDS:g} s)"
    )
    p.add_argument("--child", metavar="DB", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    count = args.loops or (QUICK_LOOPS if args.quick else DEFAULT_LOOPS)
    if args.child:
        child(args.child, count)
        return 0
    seconds = args.seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS)
    with common.data_dir(args.dir) as directory, common.sqlite_file(directory, "idle") as db:
        common.header(
            "idle loops: CPU of a worker whose loops are all waiting",
            common.machine(None, directory),
            {
                "loops": f"{count} x every={EVERY_S:g}s, first slot {FIRST_SLOT_AHEAD_S:g}s ahead",
                "idle window": f"{seconds:g} s",
                "database": "SQLite file (WAL, synchronous=NORMAL)",
            },
        )
        fresh = measure(db, count, seconds)
        again = measure(db, count, RESTART_WINDOW_S)
    baseline = None
    if not args.quick and count > 1:
        # The same worker with one loop: what the worker's own polling costs.
        with common.data_dir(args.dir) as directory, common.sqlite_file(directory, "one") as db:
            baseline = measure(db, 1, seconds)
    print(
        f"Loop objects built:        {fresh['build_s'] * 1000:8.1f} ms "
        f"({fresh['build_s'] / count * 1e6:.1f} µs per loop)"
    )
    print(
        f"registration, fresh db:    {fresh['register_s'] * 1000:8.1f} ms "
        f"({fresh['register_s'] / count * 1e6:.1f} µs per loop)"
    )
    print(f"registration, restart:     {again['register_s'] * 1000:8.1f} ms")
    print(
        f"idle CPU over {fresh['idle_window_s']:.1f} s:     {fresh['idle_cpu_s'] * 1000:8.1f} ms "
        f"= {fresh['idle_cpu_pct']:.2f} % of one CPU  ({fresh['how']})"
    )
    if baseline is not None:
        print(
            f"  the same with 1 loop:    {baseline['idle_cpu_s'] * 1000:8.1f} ms "
            f"= {baseline['idle_cpu_pct']:.2f} % (the worker's own polling of the database)"
        )
        extra = fresh["idle_cpu_pct"] - baseline["idle_cpu_pct"]
        print(f"  cost of {count - 1} idle loops: {extra:+.2f} % of one CPU")
    print(f"resident memory:           {fresh['rss_mb']:8.1f} MB")
    common.footer()
    if args.json:
        results = {"fresh": fresh, "restart": again, "one_loop": baseline}
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
