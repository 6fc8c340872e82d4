"""What a step returned that is no event its state takes: the one-line error that names the
mistake (a ``next=`` step returning a value, an async helper called without ``await``, a
bool or number for an event), built only when a step got it wrong — never on the hot path.
"""

from __future__ import annotations

import inspect
import reprlib

from flowloop.errors import InvalidEvent
from flowloop.specs import NEXT_EVENT, Sleep, StepSpec

_short = reprlib.Repr()
_short.maxstring = 60
_short.maxother = 60


def bad_return(spec: StepSpec, returned: object) -> InvalidEvent:
    """The error for a step ``spec`` whose return value ``returned`` (a :class:`Sleep`
    stands for its event) is not an event it may take. A coroutine it returned is closed
    (no "never awaited" warning)."""
    state = spec.name
    event = returned.event if isinstance(returned, Sleep) else returned
    if inspect.iscoroutine(event):
        event.close()
    if inspect.isawaitable(event):
        what = "await it" if spec.is_async else "make the step `async def` and await it"
        name = getattr(event, "__qualname__", None)
        called = f"{name}() called" if name else f"a {type(event).__name__}"
        message = f"step {state!r} returned a coroutine ({called} without await): {what}"
    elif not spec.returns_event:
        target = spec.on[NEXT_EVENT]
        if isinstance(returned, Sleep):
            message = (
                f"step {state!r} has next={target!r} and slept into event {event!r}: "
                f"sleep with no event (step.sleep(delay)), or declare on={{{event!r}: ...}}"
            )
        else:
            message = (
                f"step {state!r} has next={target!r} and returned {_short.repr(returned)}: "
                f"return None, or declare on={{...}}"
            )
    else:
        keys = ", ".join(repr(key) for key in sorted(spec.on))
        if event is None and isinstance(returned, Sleep):
            got = "slept with no event"
        else:
            got = f"returned {_short.repr(event)}"
        message = f"step {state!r} {got}: return an event, the name of one of its on= keys ({keys})"
    return InvalidEvent(state, event, spec.on, message=message)
