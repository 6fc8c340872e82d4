"""flowloop: explicit state-machine workflows, every step journaled, resumable after a crash."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from flowloop.clock import Clock, FakeClock, SystemClock
    from flowloop.compose import ChildResult, StepError
    from flowloop.definition import Step, Workflow
    from flowloop.engine import Engine, Replay, RunInfo, Stranded
    from flowloop.errors import FlowloopError
    from flowloop.journal import JournalEvent
    from flowloop.loops import Iteration, Loop, loop
    from flowloop.retry import Retry

# Each public name and the module that defines it. Imported on first use (PEP 562), so
# `import flowloop.cli` (`flowloop --help`) does not load the engine, SQLAlchemy and Alembic.
_SOURCES: Final = {
    "Clock": "flowloop.clock",
    "FakeClock": "flowloop.clock",
    "SystemClock": "flowloop.clock",
    "ChildResult": "flowloop.compose",
    "StepError": "flowloop.compose",
    "Step": "flowloop.definition",
    "Workflow": "flowloop.definition",
    "Engine": "flowloop.engine",
    "Replay": "flowloop.engine",
    "RunInfo": "flowloop.engine",
    "Stranded": "flowloop.engine",
    "FlowloopError": "flowloop.errors",
    "JournalEvent": "flowloop.journal",
    "Iteration": "flowloop.loops",
    "Loop": "flowloop.loops",
    "loop": "flowloop.loops",
    "Retry": "flowloop.retry",
}

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


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'flowloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # looked up once; later uses are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
