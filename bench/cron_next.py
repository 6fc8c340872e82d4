"""Cron next-fire speed: cronsim (what flowloop uses) against croniter (what it used).

Two figures per expression, each the median (min-max) of alternating rounds:

* **next fire**: microseconds per "first slot after t" from a fresh parser (what the
  scheduler does once per iteration), over 20,000 start times 37 s apart;
* **missed slots**: milliseconds for ``Loop.missed_slots`` over 30 days of a ``* * * * *``
  loop (43,200 slots counted one by one, as after a worker's downtime), flowloop's own
  code with cronsim; croniter's figure is the same walk with croniter.

croniter is not a dependency any more: ``pip install croniter`` to compare (else only
cronsim is measured). Usage: ``python bench/cron_next.py [--rounds N] [--quick]``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import common  # puts the repository root first on sys.path
from cronsim import CronSim

EXPRESSIONS = ("*/5 * * * *", "0 3 * * *", "15,45 9-17 * * mon-fri", "0 0 1 * *", "0 12 L * *")
T0 = 1_800_000_000.0
STARTS = 20_000
QUICK_STARTS = 2_000
MISSED_DAYS = 30


def per_call_us(fn: Callable[[float], float], starts: int) -> float:
    began = time.perf_counter()
    for i in range(starts):
        fn(T0 + i * 37.0)
    return (time.perf_counter() - began) / starts * 1e6


def cronsim_next(expression: str) -> Callable[[float], float]:
    return lambda m: next(CronSim(expression, datetime.fromtimestamp(m, UTC))).timestamp()


def croniter_next(expression: str) -> Callable[[float], float] | None:
    try:
        from croniter import croniter
    except ImportError:
        return None
    return lambda m: float(croniter(expression, datetime.fromtimestamp(m, UTC)).get_next(float))


def missed_cronsim() -> float:
    from flowloop.loops import Loop

    loop = Loop("bench", lambda _: None, cron="* * * * *")
    began = time.perf_counter()
    count = loop.missed_slots(T0, T0 + MISSED_DAYS * 86400)
    assert count > 40_000, count
    return (time.perf_counter() - began) * 1e3


def missed_croniter() -> float | None:
    step = croniter_next("* * * * *")
    if step is None:
        return None
    began = time.perf_counter()
    slot, count, end = T0, 0, T0 + MISSED_DAYS * 86400
    while (slot := step(slot)) < end:
        count += 1
    return (time.perf_counter() - began) * 1e3


def main() -> None:
    args = common.parser(__doc__ or "").parse_args()
    rounds = common.rounds_for(args)
    starts = QUICK_STARTS if args.quick else STARTS
    common.header(
        "cron next fire: cronsim vs croniter",
        {k: v for k, v in common.machine(None, ".").items() if k not in ("sqlite files",)},
        {"rounds": rounds, "start times": starts, "missed-slot window": f"{MISSED_DAYS} days"},
    )
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for expression in EXPRESSIONS:
            for name, make in (("cronsim", cronsim_next), ("croniter", croniter_next)):
                fn = make(expression)
                if fn is not None:
                    samples.setdefault((expression, name), []).append(per_call_us(fn, starts))
        samples.setdefault(("missed", "cronsim"), []).append(missed_cronsim())
        other = missed_croniter()
        if other is not None:
            samples.setdefault(("missed", "croniter"), []).append(other)

    def spread(key: tuple[str, str]) -> str:
        values = sorted(samples.get(key, []))
        if not values:
            return "-"
        return f"{values[len(values) // 2]:.1f} ({values[0]:.1f}-{values[-1]:.1f})"

    def ratio(what: str) -> str:
        a, b = samples.get((what, "croniter")), samples.get((what, "cronsim"))
        if not a or not b:
            return "-"
        return f"{sorted(a)[len(a) // 2] / sorted(b)[len(b) // 2]:.2f}x"

    rows = [[e, spread((e, "cronsim")), spread((e, "croniter")), ratio(e)] for e in EXPRESSIONS]
    common.table(["next fire (us/call)", "cronsim", "croniter", "croniter/cronsim"], rows)
    common.table(
        ["missed slots, 30 days of * * * * * (ms)", "cronsim", "croniter", "croniter/cronsim"],
        [
            [
                "Loop.missed_slots",
                spread(("missed", "cronsim")),
                spread(("missed", "croniter")),
                ratio("missed"),
            ]
        ],
    )
    common.footer()


if __name__ == "__main__":
    main()
