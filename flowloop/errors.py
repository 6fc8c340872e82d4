"""One error tree for flowloop.

Every error a user can cause derives from :class:`FlowloopError`. The CLI prints a
``FlowloopError`` as one line and exits with its ``exit_code`` (2: the input was wrong,
1: something failed); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")

EXIT_USAGE = 2
EXIT_FAILURE = 1


class FlowloopError(Exception):
    """Base of every flowloop error."""

    exit_code = EXIT_USAGE


class DefinitionError(FlowloopError):
    """A workflow or loop definition cannot work; fix the definition named in the message."""

    def __init__(self, workflow: str, message: str) -> None:
        super().__init__(f"workflow {workflow!r}: {message}")
        self.workflow = workflow


class LoopDefinitionError(DefinitionError):
    """A loop definition cannot work; fix the argument named in the message."""

    def __init__(self, loop: str, message: str) -> None:
        FlowloopError.__init__(self, f"loop {loop!r}: {message}")
        self.workflow = loop
        self.loop = loop


class UnknownWorkflow(FlowloopError):
    """No workflow of that name is known; register it or load the file that defines it."""

    def __init__(self, name: str, known: Iterable[str] = ()) -> None:
        known_list = ", ".join(sorted(known)) or "none"
        super().__init__(f"unknown workflow {name!r} (known: {known_list})")
        self.name = name


class UnknownRun(FlowloopError):
    """No run with that id exists in this database; check the id with `flowloop status`."""

    def __init__(self, run_id: str, hint: str | None = None) -> None:
        hint = hint or "list runs with `flowloop status`"
        super().__init__(f"no run {run_id!r} in this database ({hint})")
        self.run_id = run_id


class UnknownLoop(FlowloopError):
    """No loop of that name is registered in this database; list them with `flowloop loops`."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no loop {name!r} in this database (list loops with `flowloop loops`)")
        self.name = name


class InvalidContext(FlowloopError):
    """A context does not validate against the workflow's model; the fields are listed."""

    def __init__(self, workflow: str, problems: str, *, position: int | None = None) -> None:
        which = "context" if position is None else f"context #{position}"
        super().__init__(f"{which} for workflow {workflow!r} is invalid: {problems}")
        self.workflow = workflow
        self.problems = problems
        self.position = position


class ContextNotSerializable(FlowloopError):
    """A step left a value in its context that JSON cannot hold (a lock, a connection …):
    the journal cannot keep it, so retrying cannot help. Keep such objects out of the
    context (in a module-level or per-process resource) and store only plain data."""

    exit_code = EXIT_FAILURE

    def __init__(
        self,
        workflow: str,
        state: str,
        field: str,
        problem: str,
        *,
        advice: str = "keep only plain data in the context",
    ) -> None:
        super().__init__(
            f"workflow {workflow!r} step {state!r} left context field {field!r} holding a "
            f"value the journal cannot store ({problem}); {advice}"
        )
        self.workflow = workflow
        self.state = state
        self.field = field


class InvalidEvent(FlowloopError):
    """A step returned (or a caller sent) an event its state does not declare."""

    def __init__(
        self, state: str, event: object, accepted: Iterable[str], *, message: str | None = None
    ) -> None:
        # ``message``: what a step returned that is no event at all (flowloop/returns.py).
        accepted_list = ", ".join(sorted(accepted)) or "none"
        super().__init__(
            message
            or f"state {state!r} does not accept event {event!r} (it accepts: {accepted_list})"
        )
        self.state = state
        self.event = event


class InvalidTransition(FlowloopError):
    """An operation is not allowed in the run's current lifecycle status."""

    def __init__(self, run_id: str, status: str, action: str, *, what: str = "run") -> None:
        # A stopped or failed run goes on only by a retry: say so where one is refused.
        hint = (
            "; a retry runs it again (engine.retry, `flowloop retry`)"
            if what == "run" and action == "unpause" and status in ("stopped", "failed")
            else _retry_hint(run_id, status)
            if what == "run" and action == "retry"
            else ""
        )
        super().__init__(f"{what} {run_id!r} is {status}: cannot {action} it{hint}")
        self.run_id = run_id
        self.status = status


def _retry_hint(run_id: str, status: str) -> str:
    """What to do instead of retrying a run that has not failed or been stopped (the
    refusal alone said "cannot retry it")."""
    if status == "paused":
        return (
            f"; only a failed or stopped run is retried: `flowloop unpause {run_id}` lets it go on"
        )
    if status == "succeeded":
        return "; only a failed or stopped run is retried: start a new run to do it again"
    waiting = (
        ", or, waiting for an event, `flowloop send` or its timeout"
        if status == "scheduled"
        else ""
    )
    return (
        "; only a failed or stopped run is retried: this one has not ended (a worker or "
        f"`flowloop resume` continues it{waiting}; `flowloop stop` ends it)"
    )


class DefinitionMismatch(FlowloopError):
    """A run cannot continue under the workflow's current definition; it is parked, not lost."""

    exit_code = EXIT_FAILURE

    def __init__(self, run_id: str, reason: str) -> None:
        # A reason that says which mismatch (``context_mismatch: …``) is shown as it is.
        known = reason.startswith(("definition_mismatch", "context_mismatch"))
        shown = reason if known else f"definition_mismatch: {reason}"
        super().__init__(
            f"run {run_id!r}: {shown} "
            "(nothing is lost: fix and deploy, or flowloop migrate, then unpause)"
        )
        self.run_id = run_id
        self.reason = reason


class MissingExtra(FlowloopError, ImportError):
    """An optional part of flowloop is used without the packages its extra installs; the
    message names what is missing and the ``pip install`` that adds it (an ImportError
    too, for code that tries an import)."""

    def __init__(self, what: str, missing: str | None, extra: str) -> None:
        FlowloopError.__init__(
            self, f"{what} ({missing or 'a package'} is missing): pip install 'flowloop[{extra}]'"
        )
        self.name = missing


class StoreError(FlowloopError):
    """The database cannot be used as a flowloop store; the message says why and what to do."""

    exit_code = EXIT_FAILURE


class WrongDatabase(StoreError):
    """``--db`` names something that is not a usable flowloop database (a file that is not
    SQLite, another application's tables, an unsupported URL); point it at the right one.
    A mistake in the input: exit code 2."""

    exit_code = EXIT_USAGE


class MissingDatabase(WrongDatabase):
    """A command that only reads was pointed at a database that does not exist (a typo in
    ``--db``?); it creates nothing. The message names close file names."""


class SchemaMismatch(StoreError):
    """The database schema is older or newer than this flowloop; upgrade one of them.
    Exit code 2: nothing failed, the command must be run differently."""

    exit_code = EXIT_USAGE


class LeaseLost(FlowloopError):
    """This worker no longer owns the run (its lease expired and another worker took it)."""

    exit_code = EXIT_FAILURE

    def __init__(self, run_id: str) -> None:
        super().__init__(f"lost the lease on run {run_id!r}; another worker owns it now")
        self.run_id = run_id


class HeldBack(FlowloopError):
    """A step would wait for a run that its own run's limit slot (or its callers') holds
    back: refused at once (flowloop/holding.py) — a new run before it is written, one
    with a key once made or found, queued (``queued``: its id). A step that lets the
    refusal of a new run out fails at once, not retried: its retry, holding the same
    slots, would be refused too. One naming a queued run is retried as any error (the
    run goes once the step has ended; the retry finds it)."""

    def __init__(self, message: str, *, queued: str | None = None) -> None:
        super().__init__(message)
        self.queued = queued


def retry_cannot_help(error: BaseException) -> bool:
    """Whether a step that failed with ``error`` fails at once, whatever its ``retry``:
    a :class:`HeldBack` refusing a new run (its retry would be refused the same way)."""
    return isinstance(error, HeldBack) and error.queued is None


class NoFreeSlot(FlowloopError):
    """A retry of a map's child whose map already runs ``max_parallel`` children: it would
    run past the bound. Retry it once one of them has ended."""

    def __init__(self, run_id: str, parent_id: str, max_parallel: int) -> None:
        super().__init__(
            f"run {run_id} is a child of run {parent_id}, which runs {max_parallel} children "
            f"(its max_parallel) now: retry it once one of them has ended"
        )
        self.run_id = run_id
        self.parent_id = parent_id


class KeyTaken(FlowloopError):
    """An idempotency key is held by a run of another workflow: a start with it cannot
    return that run as a run of the workflow asked for; start with another key."""

    def __init__(self, key: str, run_id: str, held_by: str, asked: str) -> None:
        super().__init__(
            f"idempotency key {key!r} is taken by run {run_id} of workflow {held_by!r}, "
            f"not {asked!r}: start with another key"
        )
        self.key = key
        self.run_id = run_id


class StepTimeout(TimeoutError):
    """A step ran longer than its ``timeout``. Subclasses TimeoutError so ``Retry(on=...)``
    can name either."""


class StepExited(Exception):
    """A step, a compensation or a loop's function called ``sys.exit()`` (raised
    ``SystemExit``): it fails like any error (retried under its policy, routed by
    ``on_error``), instead of ending the worker and every run it holds."""

    def __init__(self, what: str, code: object) -> None:
        super().__init__(
            f"{what} called sys.exit({code!r}): return, or raise an error (an exit would end "
            "the worker)"
        )
        self.code = code

    @classmethod
    def instead_of(cls, error: BaseException, what: str) -> Exception:
        """``error`` as the step's error: a ``SystemExit`` becomes a StepExited."""
        if isinstance(error, Exception):
            return error
        return cls(what, error.code if isinstance(error, SystemExit) else None)


async def exits_as_errors(call: Awaitable[T], kind: str, name: str) -> T:
    """Await ``call`` in a task of its own with ``SystemExit`` turned into StepExited (of
    the ``kind`` named ``name``; the text is made only then: a step pays nothing for it):
    asyncio lets a task's ``SystemExit`` out of the event loop, ending the process."""
    try:
        return await call
    except SystemExit as exited:
        raise StepExited(f"{kind} {name!r}", exited.code) from None


class RaisedBaseException(Exception):
    """A loop's function raised a ``BaseException`` that is no ``Exception`` (a
    ``KeyboardInterrupt`` of its own, a class deriving from ``BaseException``): the
    iteration fails with this error like with any other (retried under its policy),
    instead of ending the worker (``KeyboardInterrupt``) or leaving the loop running with
    its outcome never recorded. The original is its ``__cause__``."""

    def __init__(self, what: str, error: BaseException) -> None:
        said = error_line(error) if str(error).strip() else ""
        super().__init__(
            f"{what} raised {type(error).__name__}{': ' + said if said else ''}, a "
            "BaseException that would end the worker: raise an Exception"
        )


class Interrupted(FlowloopError):
    """A step was cut off (its worker died or was killed) and is not idempotent, or has no
    attempts left. Name it in ``on_error={Interrupted: state}`` to route such a step
    somewhere instead of failing the run for an operator ("*" matches it only for an
    idempotent step, whose effect may be repeated)."""

    exit_code = EXIT_FAILURE


class MaxVisitsExceeded(FlowloopError):
    """A run entered a state more often than the state's ``max_visits`` allows."""

    exit_code = EXIT_FAILURE


class RenderError(FlowloopError):
    """A diagram could not be rendered (usually: the `dot` program is missing)."""

    exit_code = EXIT_FAILURE


class ConfigError(FlowloopError):
    """The configuration is invalid; the message names the key and the problem."""


def storable(text: str) -> str:
    """``text`` as the journal can keep it on both databases: a NUL character written
    ``\\x00`` (PostgreSQL's text holds none: a step's error whose message held one failed
    the write of its run's boundary), a lone surrogate (text decoded with
    ``surrogateescape``) as its escape (neither driver encodes it)."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii():
        try:
            text.encode()
        except UnicodeEncodeError:
            text = text.encode("utf-8", "backslashreplace").decode()
    return text


def error_line(error: BaseException) -> str:
    """The first line of an error's message (its class name when it has none): for logs
    and the journal (:func:`storable`)."""
    text = str(error).strip()
    return storable(text.splitlines()[0]) if text else type(error).__name__


def error_trace(error: BaseException) -> str:
    """The error's traceback as the journal keeps it (:func:`storable`): its last 8,000
    characters."""
    return storable("".join(traceback.format_exception(error)))[-8000:]
