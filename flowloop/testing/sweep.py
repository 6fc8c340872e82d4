"""A crash at every journal point: run a workflow once uninterrupted, then once per crash
point (before and after each of its journal commits — fan-outs of calls and maps and
admissions of starts included; only after a claim under a workflow's limits — found in the
crashed run by the journal entries it carried, a claim by the runs it took: group commit
bundles boundaries by timing, so a commit's number may not name the same point in two
runs), resume after the crash, and check that every run ends as the uninterrupted one did —
the check flowloop's own crash suite makes with real processes and SIGKILL, in-process and
in milliseconds.

Besides the final status, state and context, each crashed run is checked for the journal
protocol's promises: the database held exactly what was committed at the crash (the dead
engine wrote nothing more, and every run row was the fold of its journal); no step ran
before its ``step_started`` was committed nor twice for one ``step_started``; no visit of a
state succeeded twice; the journal folds to the stored row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel

from flowloop import journal as j
from flowloop.clock import FakeClock
from flowloop.definition import Step, StepSpec, Workflow
from flowloop.journal import JournalEvent
from flowloop.store import RunFilter, SQLStore
from flowloop.testing.crash import Commit, SimulatedCrash, like_commit
from flowloop.testing.engine import TestEngine

Action = Callable[[TestEngine, str], object]
"""A step of the test script after the run is started: ``action(engine, run_id)``."""
SWEEP_KEY: Final = "flowloop-testing-crash-sweep"
"""The idempotency key the sweep starts its run with (a start repeated after a crash
returns the same run)."""
CLOCK_START: Final = 1_800_000_000.0
AROUND: Final[tuple[Literal["before", "after"], ...]] = ("before", "after")
"""The crash points of each journal commit (a claim's: only after it)."""


@dataclass(frozen=True, kw_only=True)
class Ending:
    """How a run ended: status, state, reason and context (as JSON data)."""

    status: str
    state: str
    reason: str | None
    context: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class CrashOutcome:
    """One crash point of the sweep and what came of it."""

    commit: Commit
    """The uninterrupted run's commit the crash was placed around."""
    when: str
    """``before`` or ``after`` that commit."""
    end: Ending | None
    operator_retried: bool
    """The crash interrupted a step declared ``idempotent=False``: the run failed as
    ``interrupted`` (as it must) and the sweep retried it, as an operator would."""
    problems: tuple[str, ...]

    @property
    def label(self) -> str:
        return f"{self.when} {self.commit.describe()}"


@dataclass(frozen=True, kw_only=True)
class CrashSweep:
    """The uninterrupted run, its journal commits, and one outcome per crash point."""

    baseline: Ending
    commits: tuple[Commit, ...]
    outcomes: tuple[CrashOutcome, ...]

    @property
    def failures(self) -> list[CrashOutcome]:
        return [outcome for outcome in self.outcomes if outcome.problems]

    def assert_ok(self) -> None:
        """Raise AssertionError listing every crash point that did not end as the
        uninterrupted run did (or broke a journal promise)."""
        failures = self.failures
        if not failures:
            return
        lines = [
            f"{len(failures)} of {len(self.outcomes)} crash points went wrong "
            f"(uninterrupted run: {self.baseline.status} in {self.baseline.state}):"
        ]
        for outcome in failures:
            lines.append(f"  crash {outcome.label}:")
            lines.extend(f"    - {problem}" for problem in outcome.problems)
        raise AssertionError("\n".join(lines))


def check_crash_points(
    workflow: Workflow,
    context: BaseModel | Mapping[str, Any],
    *,
    actions: Sequence[Action] = (),
    workflows: Sequence[Workflow] = (),
    directory: str | Path | None = None,
    operator_retry: bool = True,
    clock_start: float = CLOCK_START,
) -> CrashSweep:
    """Crash ``workflow``'s run at each of its journal points and check that it ends as
    the uninterrupted run does. Raises nothing itself: call ``.assert_ok()`` on the result
    (or use :func:`assert_crash_safe`).

    The script of one run: start it, call each of ``actions`` (``action(engine, run_id)``,
    e.g. sending an event), then ``run_until_idle()``; after a crash the engine resumes
    and the interrupted part of the script is done again — so make actions repeatable
    (send events with a ``dedupe_key``). ``workflows`` are further workflows the engine
    needs (children). Each run gets its own SQLite file under ``directory`` (a temporary
    one by default) and a fresh FakeClock starting at ``clock_start``, so the runs are
    identical up to their crash.
    """
    root = Path(tempfile.mkdtemp(prefix="flowloop-sweep-", dir=directory))
    all_workflows = _family([workflow, *workflows])
    try:
        ledger: list[tuple[str, str, int]] = []
        with _recording(all_workflows, ledger):
            baseline, commits = _uninterrupted(
                root, all_workflows, workflow, context, actions, clock_start=clock_start
            )
            outcomes = []
            for commit in commits:
                for when in AROUND[1:] if commit.claimed else AROUND:
                    ledger.clear()
                    outcomes.append(
                        _crashed(
                            root,
                            all_workflows,
                            workflow,
                            context,
                            actions,
                            commits=commits,
                            commit=commit,
                            when=when,
                            baseline=baseline,
                            ledger=ledger,
                            operator_retry=operator_retry,
                            clock_start=clock_start,
                        )
                    )
        return CrashSweep(baseline=baseline, commits=tuple(commits), outcomes=tuple(outcomes))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def assert_crash_safe(
    workflow: Workflow,
    context: BaseModel | Mapping[str, Any],
    **options: Any,
) -> CrashSweep:
    """:func:`check_crash_points`, then ``assert_ok()``; returns the sweep."""
    sweep = check_crash_points(workflow, context, **options)
    sweep.assert_ok()
    return sweep


def _family(workflows: Sequence[Workflow]) -> list[Workflow]:
    """The workflows and, where a definition has child runs (``children``), theirs."""
    found: dict[str, Workflow] = {}
    todo = list(workflows)
    while todo:
        wf = todo.pop(0)
        if wf.name not in found:
            found[wf.name] = wf
            todo.extend(getattr(wf, "children", ()))
    return list(found.values())


def _end(engine: TestEngine, run_id: str) -> Ending:
    info = engine.get(run_id)
    ctx = info.context
    data = ctx.model_dump(mode="json") if isinstance(ctx, BaseModel) else dict(ctx)
    return Ending(status=info.status, state=info.state, reason=info.reason, context=data)


Part = tuple[str, Callable[[TestEngine, list[str]], None]]
"""One part of the test script: what it is called in a report, and what it does."""


def _script(
    workflow: Workflow,
    context: BaseModel | Mapping[str, Any],
    actions: Sequence[Action],
    called: set[str] | None = None,
) -> list[Part]:
    """The parts of the test script; ``called`` collects the names of the actions called
    (a crash in the ``run_until_idle`` before one is not in it: it has not run yet)."""

    def start(engine: TestEngine, run: list[str]) -> None:
        info = engine.start(workflow, context, idempotency_key=SWEEP_KEY)
        run[:] = [info.id]

    def act(name: str, action: Action) -> Callable[[TestEngine, list[str]], None]:
        def part(engine: TestEngine, run: list[str]) -> None:
            engine.run_until_idle(skip_time=False)  # what is due now comes first
            if called is not None:
                called.add(name)
            action(engine, run[0])

        return part

    def finish(engine: TestEngine, run: list[str]) -> None:
        engine.run_until_idle()

    labels = [repr(getattr(action, "__name__", action)) for action in actions]
    # One name per action (two lambdas are both '<lambda>': ``called`` told them apart by
    # name, and blamed the second for being done again once the first had run).
    names = [
        f"action {index} {label}" if labels.count(label) > 1 else f"action {label}"
        for index, label in enumerate(labels, start=1)
    ]
    acts = [(name, act(name, action)) for name, action in zip(names, actions, strict=True)]
    return [("the start", start), *acts, ("run_until_idle", finish)]


def _uninterrupted(
    root: Path,
    workflows: Sequence[Workflow],
    workflow: Workflow,
    context: BaseModel | Mapping[str, Any],
    actions: Sequence[Action],
    *,
    clock_start: float,
) -> tuple[Ending, list[Commit]]:
    run: list[str] = []
    clock = FakeClock(clock_start)
    with TestEngine(root / "uninterrupted.db", workflows=workflows, clock=clock) as engine:
        for _, part in _script(workflow, context, actions):
            part(engine, run)
        return _end(engine, run[0]), engine.commits


def _crashed(
    root: Path,
    workflows: Sequence[Workflow],
    workflow: Workflow,
    context: BaseModel | Mapping[str, Any],
    actions: Sequence[Action],
    *,
    commits: Sequence[Commit],
    commit: Commit,
    when: Literal["before", "after"],
    baseline: Ending,
    ledger: list[tuple[str, str, int]],
    operator_retry: bool,
    clock_start: float,
) -> CrashOutcome:
    db = root / f"crash-{commit.number}-{when}.db"
    problems: list[str] = []
    run: list[str] = []
    retried = False
    crashes = 0
    with TestEngine(db, workflows=workflows, clock=FakeClock(clock_start)) as engine:
        # Named by what it carries, not by number: this run may group its commits otherwise.
        engine._arm(like_commit(commits, commit.number, when))
        called: set[str] = set()
        parts = _script(workflow, context, actions, called)
        index = 0
        repeated: str | None = None  # the part the crash cut off after its action ran
        while index < len(parts):
            name, part = parts[index]
            try:
                part(engine, run)
                index += 1
            except SimulatedCrash:
                crashes += 1
                repeated = name if name in called else None
                if crashes > 1:
                    problems.append("crashed more than once (one crash was armed)")
                    break
                problems.extend(engine.writes_after_crash())
                problems.extend(_rows_fold(engine.url))
                engine.resume(skip_time=False)  # time moves as the script says
                if operator_retry:
                    retried = _retry_interrupted(engine, workflows)
            except Exception as error:  # the script broke here only: this point's problem
                broke: Broke = "again" if repeated == name else "after" if crashes else "before"
                problems.append(_script_broke(name, error, broke, engine, run))
                break
        if crashes == 0:
            problems.append(
                "the crash point was never reached: the run made other journal entries than "
                "the uninterrupted one (is the workflow deterministic?)"
            )
        end = _end(engine, run[0]) if run else None
        if end is not None:
            problems.extend(_compare(baseline, end))
            for run_id in sorted({rid for rid, _, _ in ledger} | {run[0]}):
                problems.extend(_protocol(engine, run_id, ledger))  # children too
    return CrashOutcome(
        commit=commit, when=when, end=end, operator_retried=retried, problems=tuple(problems)
    )


Broke = Literal["before", "after", "again"]
"""When a script's part raised: before the crash, after it, or called again after it."""


def _script_broke(
    name: str,
    error: Exception,
    when: Broke,
    engine: TestEngine,
    run: list[str],
) -> str:
    """The problem of a crash point whose script raised (the uninterrupted one did not):
    ``before`` the crash; ``again``, the part's action called a second time after the crash
    cut off its first call; ``after``, a part that had not run yet when the crash came."""
    raised = f"{name} raised {type(error).__name__}: {error}"
    if when == "before":
        return f"{raised} (before the crash; the uninterrupted run's script did not)"
    if when == "again":
        return (
            f"{raised} when done again after the crash: actions must be repeatable "
            "(send events with a dedupe_key)"
        )
    return f"{raised} after the crash, which changed what it found ({_run_now(engine, run)})"


def _run_now(engine: TestEngine, run: list[str]) -> str:
    """Where the sweep's run is, for a message."""
    if not run:
        return "no run was started"
    info = engine.get(run[0])
    reason = f", reason {info.reason}" if info.reason else ""
    return f"the run is {info.status} in state {info.state}{reason}"


def _retry_interrupted(engine: TestEngine, workflows: Sequence[Workflow]) -> bool:
    """Retry, as an operator would after checking, every run (the sweep's run or a child)
    that failed because a crash interrupted one of its non-idempotent steps."""
    retried = False
    for info in engine.runs(status="failed", limit=1_000_000):
        if info.reason != "interrupted":
            continue
        spec = next((wf.steps[info.state] for wf in workflows if info.state in wf.steps), None)
        if spec is None or spec.idempotent:
            continue  # an idempotent step out of attempts: not the operator's case
        engine.retry(info.id, by="flowloop.testing")
        retried = True
    if retried:
        engine.run_until_idle(skip_time=False)
    return retried


def _compare(baseline: Ending, end: Ending) -> list[str]:
    problems = []
    if (end.status, end.state) != (baseline.status, baseline.state):
        problems.append(
            f"ended {end.status} in {end.state} (reason {end.reason}); "
            f"uninterrupted: {baseline.status} in {baseline.state}"
        )
    for name in sorted(baseline.context.keys() | end.context.keys()):
        want, got = baseline.context.get(name), end.context.get(name)
        if want != got:
            problems.append(f"context {name}: {got!r}, uninterrupted {want!r}")
    return problems


def _rows_fold(url: str) -> list[str]:
    """At the crash, every run row is the fold of its journal (the row and its journal
    entries are one transaction, whatever instant the process died at)."""
    store = SQLStore(url, create=False, check_schema=False)  # read only
    problems: list[str] = []
    try:
        for stored in store.find_runs(RunFilter(limit=1_000_000)):
            differences = j.compare(j.fold(store.journal(stored.id)), stored.record)
            problems.extend(f"after the crash, run {stored.id} row {d}" for d in differences)
    finally:
        store.close()
    return problems


def _protocol(engine: TestEngine, run_id: str, ledger: Sequence[tuple[str, str, int]]) -> list[str]:
    problems: list[str] = []
    events = engine.history(run_id)
    started = {event.seq: event.state for event in events if event.kind == j.STEP_STARTED}
    calls = [(state, seq) for rid, state, seq in ledger if rid == run_id]
    for state, seq in calls:
        if started.get(seq) != state:
            problems.append(f"step {state} ran with no step_started committed at seq {seq}")
    seen: set[int] = set()
    for _, seq in calls:
        if seq in seen:
            problems.append(f"the step started at seq {seq} ran twice")
        seen.add(seq)
    problems.extend(_succeeded_twice(events))
    replay = engine.replay(run_id)
    problems.extend(f"replay: {difference}" for difference in replay.differences)
    return problems


def _succeeded_twice(events: Sequence[JournalEvent]) -> list[str]:
    record = j.create(events[0])
    done: set[tuple[str, int]] = set()
    problems = []
    for event in events[1:]:
        if event.kind == j.STEP_SUCCEEDED and event.state is not None:
            key = (event.state, record.visit(event.state))
            if key in done:
                problems.append(f"visit {key[1]} of {key[0]} succeeded twice")
            done.add(key)
        record = j.apply(record, event)
    return problems


@contextlib.contextmanager
def _recording(workflows: Sequence[Workflow], ledger: list[tuple[str, str, int]]) -> Iterator[None]:
    """Wrap every step function so each execution is noted as (run, state, step seq)."""
    originals: list[tuple[dict[str, StepSpec], str, StepSpec]] = []
    try:
        for wf in workflows:
            steps = wf._draft.steps
            for state, spec in list(steps.items()):
                originals.append((steps, state, spec))
                steps[state] = dataclasses.replace(
                    spec, fn=_recorded(spec, ledger), wants_step=True
                )
        yield
    finally:
        for steps, state, spec in reversed(originals):
            steps[state] = spec


def _recorded(spec: StepSpec, ledger: list[tuple[str, str, int]]) -> Callable[..., Any]:
    function = spec.fn
    wants_step = spec.wants_step
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def async_step(ctx: BaseModel, step: Step) -> Any:
            ledger.append((step.run_id, step.state, step.seq))
            return await (function(ctx, step) if wants_step else function(ctx))

        return async_step

    @functools.wraps(function)
    def sync_step(ctx: BaseModel, step: Step) -> Any:
        ledger.append((step.run_id, step.state, step.seq))
        return function(ctx, step) if wants_step else function(ctx)

    return sync_step


def describe(sweep: CrashSweep) -> str:
    """A short report of a sweep, one line per crash point."""
    lines = [f"uninterrupted: {sweep.baseline.status} in {sweep.baseline.state}"]
    for outcome in sweep.outcomes:
        end = outcome.end
        how = "-" if end is None else f"{end.status} in {end.state}"
        note = " (operator retry)" if outcome.operator_retried else ""
        verdict = "ok" if not outcome.problems else "; ".join(outcome.problems)
        lines.append(f"crash {outcome.label}: {how}{note}: {verdict}")
    return "\n".join(lines)
