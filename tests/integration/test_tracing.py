"""OpenTelemetry spans of runs on a real SQLite file, collected by the SDK's in-memory
exporter: the run span and its attempt spans, their attributes and events, the caller's
context as the run's parent, and nothing at all (not even an import) while tracing is off."""

from __future__ import annotations

import http.client
import subprocess
import sys
import threading
import wsgiref.headers
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from polling import poll
from pydantic import BaseModel

from flowloop import Engine, FakeClock, Retry, Step, Workflow, tracing
from flowloop.tracecontext import InvalidTraceContext, derived_run_trace, run_trace


class Ctx(BaseModel):
    n: int = 0


def flaky_job() -> Workflow:
    """``a`` fails once (retried), ``b`` sleeps durably before ``c``, which leads to a wait
    for ``go``, then the end;
    ``bad`` fails for good."""
    wf = Workflow("job", context=Ctx, version=3)

    @wf.step(
        initial=True,
        on={"ok": "b", "break": "bad"},
        retry=Retry(attempts=3, backoff="fixed", base=1, on=(ConnectionError,)),
    )
    def a(ctx: Ctx, step: Step) -> str:
        if step.attempt == 1:
            raise ConnectionError("refused")
        return "break" if ctx.n < 0 else "ok"

    @wf.step(next="c")
    def b(ctx: Ctx, step: Step) -> object:
        return step.sleep(timedelta(minutes=5))  # c starts 5 minutes later

    @wf.step(next="gate")
    def c(ctx: Ctx) -> None:
        ctx.n += 1

    wf.wait("gate", on={"go": "done"})

    @wf.step(next="done", retry=Retry(attempts=1))
    def bad(ctx: Ctx) -> None:
        raise ValueError("cannot")

    wf.final("done")
    return wf


@pytest.fixture
def traced(tmp_path: Path) -> Iterator[tuple[Engine, InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with Engine(str(tmp_path / "t.db"), clock=FakeClock()) as engine:
        tracing.instrument(engine, tracer_provider=provider)
        yield engine, exporter, provider


def hexid(value: int) -> str:
    return format(value, "016x")


def by_name(spans: tuple[ReadableSpan, ...], prefix: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name.startswith(prefix)]


def test_tracing__run_span_parents_every_attempt_with_attributes_and_events(
    traced: tuple[Engine, InMemorySpanExporter, TracerProvider],
) -> None:
    engine, exporter, provider = traced
    wf = flaky_job()
    with provider.get_tracer("web").start_as_current_span("POST /jobs") as request:
        info = engine.run(wf, {"n": 1})
    assert (info.status, info.state) == ("scheduled", "gate")
    assert not by_name(exporter.get_finished_spans(), "flowloop.run")  # not finished yet
    engine.send(info.id, "go")
    engine.run_until_idle()
    assert engine.get(info.id).status == "succeeded"

    spans = exporter.get_finished_spans()
    [run] = by_name(spans, "flowloop.run job")
    stored = run_trace(info.id, engine.history(info.id)[0].data)
    assert run.context is not None and run.parent is not None
    assert hexid(run.context.span_id) == stored.span_id
    assert run.parent.span_id == request.get_span_context().span_id
    assert run.context.trace_id == request.get_span_context().trace_id
    assert dict(run.attributes or {}) == {
        "flowloop.workflow": "job",
        "flowloop.version": 3,
        "flowloop.run_id": info.id,
        "flowloop.status": "succeeded",
        "flowloop.state": "done",
    }
    assert [event.name for event in run.events] == [
        "flowloop.retry",
        "flowloop.timer",
        "flowloop.wait",
        "flowloop.event",
    ]

    attempts = by_name(spans, "flowloop.step ")
    assert [
        (
            s.attributes["flowloop.state"],
            s.attributes["flowloop.attempt"],
            s.attributes["flowloop.outcome"],
        )  # type: ignore[index]
        for s in attempts
    ] == [("a", 1, "retried"), ("a", 2, "succeeded"), ("b", 1, "succeeded"), ("c", 1, "succeeded")]
    assert all(s.parent is not None and s.parent.span_id == run.context.span_id for s in attempts)
    first = attempts[0]
    assert first.attributes is not None and first.attributes["error.type"] == "ConnectionError"
    assert first.status.status_code.name == "ERROR"
    assert [event.name for event in first.events] == ["exception", "flowloop.retry"]
    assert [event.name for event in attempts[2].events] == ["flowloop.timer"]
    assert [event.name for event in attempts[3].events] == ["flowloop.wait"]
    assert run.start_time is not None and first.start_time is not None
    assert run.start_time <= first.start_time


def test_tracing__each_engine_run_joins_the_span_current_at_its_own_call(
    traced: tuple[Engine, InMemorySpanExporter, TracerProvider],
) -> None:
    """Two ``Engine.run`` calls on one thread, under two requests' spans: each run is a
    child of its own request (the kept loop runs each call in the caller's context, not
    in the context of the thread's first call)."""
    engine, exporter, provider = traced
    wf = Workflow("quick", context=Ctx)

    @wf.step(initial=True, next="done")
    def only(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    tracer = provider.get_tracer("web")
    requests, infos = [], []
    for name in ("GET /first", "GET /second"):
        with tracer.start_as_current_span(name) as request:
            infos.append(engine.run(wf, Ctx()))
            requests.append(request.get_span_context())
    runs = {
        span.attributes["flowloop.run_id"]: span
        for span in by_name(  # type: ignore[index]
            exporter.get_finished_spans(), "flowloop.run"
        )
    }
    for info, request in zip(infos, requests, strict=True):
        run = runs[info.id]
        assert run.context is not None and run.parent is not None
        assert run.context.trace_id == request.trace_id
        assert run.parent.span_id == request.span_id
    assert requests[0].trace_id != requests[1].trace_id


def test_tracing__failed_run_span_is_an_error_and_names_the_error_type(
    traced: tuple[Engine, InMemorySpanExporter, TracerProvider],
) -> None:
    engine, exporter, provider = traced
    assert tracing.instrument(engine, tracer_provider=provider) is engine.listeners[0]
    info = engine.run(flaky_job(), {"n": -1})
    assert info.status == "failed"
    assert len(by_name(exporter.get_finished_spans(), "flowloop.step job.a")) == 2  # not 4
    [run] = by_name(exporter.get_finished_spans(), "flowloop.run")
    assert run.status.status_code.name == "ERROR"
    assert run.attributes is not None and run.attributes["error.type"] == "ValueError"
    assert run.parent is None  # started outside any span: the root of its own trace
    stored = run_trace(info.id, engine.history(info.id)[0].data)
    assert run.context is not None and format(run.context.trace_id, "032x") == stored.trace_id


def test_tracing__explicit_trace_context_is_the_parent_and_a_bad_one_is_refused(
    traced: tuple[Engine, InMemorySpanExporter, TracerProvider],
) -> None:
    engine, exporter, _ = traced
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    wf = flaky_job()
    info = engine.start(wf, {"n": -1}, trace_context={"traceparent": parent})
    engine.run_until_idle()
    [run] = by_name(exporter.get_finished_spans(), "flowloop.run")
    assert run.context is not None and run.parent is not None
    assert format(run.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert hexid(run.parent.span_id) == "b7ad6b7169203331"
    assert run_trace(info.id, engine.history(info.id)[0].data).parent_id == "b7ad6b7169203331"
    before = len(engine.runs())
    with pytest.raises(InvalidTraceContext, match="traceparent"):
        engine.start(wf, {}, trace_context={"traceparent": "not-a-trace"})
    # The header's value instead of the carrier: an AttributeError from inside flowloop.
    with pytest.raises(InvalidTraceContext, match=r"a mapping of headers, not str"):
        engine.start(wf, {}, trace_context=parent)  # type: ignore[arg-type]
    assert len(engine.runs()) == before
    # HTTP header names are case-insensitive: a framework's dict may spell it Traceparent.
    info = engine.start(wf, {"n": 2}, trace_context={"Traceparent": parent})
    assert run_trace(info.id, engine.history(info.id)[0].data).parent_id == "b7ad6b7169203331"


def test_tracing__request_headers_that_are_no_mapping_carry_the_trace(
    traced: tuple[Engine, InMemorySpanExporter, TracerProvider],
) -> None:
    """http.server's headers (an email Message) and wsgiref's are no Mapping, but have the
    case-insensitive get a carrier needs: taken as they are (the review of the pass: the
    check for a mapping refused them)."""
    engine, _, _ = traced
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    message = http.client.HTTPMessage()
    message["Traceparent"] = parent
    message["tracestate"] = "vendor=1"
    wsgi = wsgiref.headers.Headers([("TRACEPARENT", parent)])
    for carrier in (message, wsgi):
        info = engine.start(flaky_job(), {"n": 2}, trace_context=carrier)  # type: ignore[arg-type]
        trace = run_trace(info.id, engine.history(info.id)[0].data)
        assert (trace.trace_id, trace.parent_id) == (
            "0af7651916cd43dd8448eb211c80319c",
            "b7ad6b7169203331",
        )
    assert run_trace(info.id, engine.history(info.id)[0].data).tracestate is None
    with_state = engine.start(flaky_job(), {"n": 2}, trace_context=message)  # type: ignore[arg-type]
    assert run_trace(with_state.id, engine.history(with_state.id)[0].data).tracestate == "vendor=1"
    message["tracestate"] = "other=2"  # a second header: one list, W3C's comma join
    both = engine.start(flaky_job(), {"n": 2}, trace_context=message)  # type: ignore[arg-type]
    assert run_trace(both.id, engine.history(both.id)[0].data).tracestate == "vendor=1,other=2"


def test_tracing__a_run_created_without_tracing_joins_its_derived_trace(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    with Engine(db, clock=FakeClock()) as plain:
        info = plain.start(flaky_job(), {"n": 1})
        assert "trace" not in plain.history(info.id)[0].data
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with Engine(db, clock=FakeClock()) as engine:
        engine.register(flaky_job())
        tracing.instrument(engine, tracer_provider=provider)
        engine.run_until_idle()
    derived = derived_run_trace(info.id)
    spans = exporter.get_finished_spans()
    assert spans and all(
        s.context is not None and format(s.context.trace_id, "032x") == derived.trace_id
        for s in spans
    )
    assert all(s.parent is not None and hexid(s.parent.span_id) == derived.span_id for s in spans)


def test_tracing__off_stores_nothing_and_never_imports_opentelemetry(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from pydantic import BaseModel\n"
        "import flowloop, flowloop.engine, flowloop.cli, flowloop.worker\n"
        "from flowloop import Engine, Workflow\n"
        "class C(BaseModel):\n    n: int = 0\n"
        "wf = Workflow('w', context=C)\n"
        "wf.step(name='go', initial=True, next='end')(lambda ctx: None)\n"
        "wf.final('end')\n"
        "with Engine('off.db') as engine:\n"
        "    info = engine.run(wf, {})\n"
        "    assert info.status == 'succeeded'\n"
        "    assert 'trace' not in engine.history(info.id)[0].data\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr.decode()


def test_tracing__stopped_and_rerun_runs_close_their_spans(
    traced: tuple[Engine, InMemorySpanExporter, TracerProvider],
) -> None:
    engine, exporter, _ = traced
    wf = flaky_job()
    waiting = engine.run(wf, {"n": 1})
    assert waiting.state == "gate"
    engine.stop(waiting.id)  # an operator's write: no executor involved
    failed = engine.run(wf, {"n": -1})
    engine.retry(failed.id)
    engine.run_until_idle()
    assert engine.get(failed.id).status == "failed"

    spans = exporter.get_finished_spans()
    runs = {
        s.attributes["flowloop.run_id"]: s  # type: ignore[index]
        for s in by_name(spans, "flowloop.run job")
    }
    stopped = runs[waiting.id]
    assert stopped.attributes is not None and stopped.attributes["flowloop.status"] == "stopped"
    assert stopped.status.status_code.name == "ERROR"
    assert [e.name for e in stopped.events][-1] == "flowloop.run_stopped"
    # The operator's retry: the run span ended at the first failure; the rerun is its child.
    [rerun] = by_name(spans, "flowloop.rerun job")
    first = runs[failed.id]
    assert first.context is not None and rerun.parent is not None
    assert rerun.parent.span_id == first.context.span_id
    assert rerun.events and rerun.events[0].name == "flowloop.run_retried"
    bad_attempts = [s for s in by_name(spans, "flowloop.step job.bad") if s.attributes is not None]
    assert [s.attributes["flowloop.outcome"] for s in bad_attempts] == ["failed", "failed"]  # type: ignore[index]
    assert all(
        s.parent is not None and s.parent.span_id == first.context.span_id for s in bad_attempts
    )


def test_readme__the_tracing_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Tracing with OpenTelemetry") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    block = block[: block.index("```")]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(block, "README.md (tracing)", "exec"), namespace)
    assert (tmp_path / "traced.db").exists()


def test_tracing__an_executor_made_while_instrumenting_is_traced(tmp_path: Path) -> None:
    """A thread makes its executor (copying the engine's listeners) just as ``instrument``
    runs in another: the executor is traced all the same (before, one made between the
    copy and being kept missed the listener for good, and its runs had no spans)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with Engine(str(tmp_path / "t.db"), clock=FakeClock()) as engine:
        made, go, asked = threading.Event(), threading.Event(), threading.Event()
        new_executor = engine._new_executor

        def paused_after_the_copy(**kwargs: object) -> object:
            executor = new_executor(**kwargs)  # type: ignore[arg-type]
            made.set()
            assert go.wait(30)
            return executor

        class NotedLock:
            """The engine's lock, noting a second thread that asks for it."""

            def __init__(self, lock: threading.Lock) -> None:
                self.lock = lock

            def __enter__(self) -> None:
                if threading.current_thread() is not maker:
                    asked.set()
                self.lock.acquire()

            def __exit__(self, *exc: object) -> None:
                self.lock.release()

        engine._new_executor = paused_after_the_copy  # type: ignore[method-assign,assignment]
        if hasattr(engine, "_listening"):
            engine._listening = NotedLock(engine._listening)  # type: ignore[assignment]
        kept: list[object] = []
        checked = threading.Event()

        def make() -> None:
            kept.append(engine._executor())
            checked.wait(30)  # kept while the thread lives

        maker = threading.Thread(target=make)
        maker.start()
        assert made.wait(30)
        instrumenting = threading.Thread(
            target=lambda: tracing.instrument(engine, tracer_provider=provider)
        )
        instrumenting.start()
        # instrument() has run (it missed the executor), or it waits for it to be kept
        poll(
            lambda: asked.is_set() or not instrumenting.is_alive(),
            timeout=30,
            what="instrument() to end or to wait",
            every=0.01,
        )
        go.set()
        instrumenting.join(30)
        poll(lambda: bool(kept), timeout=30, what="the executor to be kept", every=0.01)
        (executor,) = kept
        traced = [
            listener
            for listener in executor.listeners  # type: ignore[attr-defined]
            if isinstance(listener, tracing.RunTracing)
        ]
        checked.set()
        maker.join(30)
        assert len(traced) == 1, executor.listeners  # type: ignore[attr-defined]


def test_tracing__a_start_that_makes_no_run_keeps_no_trace(
    traced: tuple[Engine, InMemorySpanExporter, TracerProvider],
) -> None:
    """A start whose key finds a run, a debounced start merged into the burst's run, a
    throttled one refused: each made a trace for its would-be run and kept it (until the
    table of 10,000 was cleared, with every live run's)."""
    from flowloop.admission import StartThrottled
    from flowloop.backpressure import QueueFull

    engine, _, _ = traced
    (listener,) = [
        listener for listener in engine.listeners if isinstance(listener, tracing.RunTracing)
    ]
    wf = Workflow("keyed", context=Ctx)
    wf.step(name="a", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    first = engine.start(wf, Ctx(), idempotency_key="req-1")
    for _ in range(3):
        assert engine.start(wf, Ctx(), idempotency_key="req-1").id == first.id
    merged = {engine.start(wf, Ctx(), key="k", debounce=60).id for _ in range(3)}
    assert len(merged) == 1
    throttled = engine.start(wf, Ctx(), key="t", throttle=(1, 60))
    with pytest.raises(StartThrottled):
        engine.start(wf, Ctx(), key="t", throttle=(1, 60))
    bounded = Workflow("bounded", context=Ctx, max_queued=1)
    bounded.step(name="a", initial=True, next="done")(lambda ctx: None)
    bounded.final("done")
    queued = engine.start(bounded, Ctx())
    with pytest.raises(QueueFull):
        engine.start(bounded, Ctx())
    engine.start_many(wf, [Ctx(), Ctx()])
    made = {run.id for run in engine.runs()}
    assert set(listener._runs) <= made, set(listener._runs) - made
    # The runs that were made keep theirs.
    assert {first.id, *merged, throttled.id, queued.id} <= set(listener._runs)
