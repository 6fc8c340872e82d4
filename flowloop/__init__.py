"""flowloop: explicit state-machine workflows, every step journaled, resumable after a crash."""

from flowloop.clock import Clock, FakeClock, SystemClock
from flowloop.compose import ChildResult, StepError
from flowloop.definition import Step, Workflow
from flowloop.engine import Engine, Replay, RunInfo, Stranded
from flowloop.errors import FlowloopError
from flowloop.journal import JournalEvent
from flowloop.loops import Iteration, Loop, loop
from flowloop.retry import Retry

__all__ = [
    "ChildResult",
    "Clock",
    "Engine",
    "FakeClock",
    "FlowloopError",
    "Iteration",
    "JournalEvent",
    "Loop",
    "Replay",
    "Retry",
    "RunInfo",
    "Step",
    "StepError",
    "Stranded",
    "SystemClock",
    "Workflow",
    "loop",
]
__version__ = "0.1.0"
