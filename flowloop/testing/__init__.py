"""flowloop.testing: test your own workflows — fast, on the real engine.

* :class:`TestEngine` — the real engine on a temporary SQLite file (WAL, the production
  store) and a :class:`FakeClock`: ``run_until_idle()`` jumps the clock to each next due
  timer (wait timeouts, ``step.sleep``, retry backoff) instead of sleeping, ``advance(…)``
  moves it by a given amount; ``run_loops(loops, timedelta)`` drives ``@loop`` schedules
  slot by slot on the same clock.
* Crash injection: ``engine.crash_at("ship", "inside")`` or ``crash_at_commit(k)`` makes the
  engine die at that journal point as SIGKILL would (the database keeps what was committed,
  nothing else is written); ``engine.resume()`` goes on with a fresh engine.
  :func:`assert_crash_safe` does that at every journal point of a run and checks each
  ends as the uninterrupted run does.
* Assertions: :func:`assert_path`, :func:`assert_events`, :func:`attempts`,
  :func:`context_at`, with readable (diffed) failure messages.
* ``engine.override(workflow, "charge", fake)`` swaps one step's function for a test.
* A pytest plugin (installed with flowloop) with the fixtures ``flowloop_engine`` and
  ``fake_clock``.
"""

from __future__ import annotations

from flowloop.clock import FakeClock
from flowloop.testing.assertions import (
    Attempt,
    PathMismatch,
    assert_events,
    assert_path,
    attempts,
    context_at,
    kinds,
    path,
    same_context,
)
from flowloop.testing.crash import Commit, SimulatedCrash
from flowloop.testing.engine import MAX_JUMPS, TestEngine
from flowloop.testing.sweep import (
    CrashOutcome,
    CrashSweep,
    Ending,
    assert_crash_safe,
    check_crash_points,
    describe,
)

__all__ = [
    "MAX_JUMPS",
    "Attempt",
    "Commit",
    "CrashOutcome",
    "CrashSweep",
    "Ending",
    "FakeClock",
    "PathMismatch",
    "SimulatedCrash",
    "TestEngine",
    "assert_crash_safe",
    "assert_events",
    "assert_path",
    "attempts",
    "check_crash_points",
    "context_at",
    "describe",
    "kinds",
    "path",
    "same_context",
]
