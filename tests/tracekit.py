"""Tracing test kit: a span exporter that appends JSON lines to a file (so spans from several
processes — one of them SIGKILLed — can be collected), and the worker process of the
tracing crash test (``python tracekit.py run|resume DB SPANS``)."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from pydantic import BaseModel

from flowloop import Engine, Retry, Step, Workflow, tracing


class JsonLinesSpanExporter(SpanExporter):
    """Each finished span as one JSON object per line, written and flushed at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock, self.path.open("a") as out:
            for span in spans:
                out.write(json.dumps(span_dict(span)) + "\n")
            out.flush()
            os.fsync(out.fileno())  # the process may be SIGKILLed right after
        return SpanExportResult.SUCCESS


def span_dict(span: ReadableSpan) -> dict[str, Any]:
    assert span.context is not None
    return {
        "name": span.name,
        "trace_id": format(span.context.trace_id, "032x"),
        "span_id": format(span.context.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
        "start": span.start_time,
        "end": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "events": [event.name for event in span.events],
        "pid": span.resource.attributes.get("process.pid"),
    }


def read_spans(*paths: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in paths
        if path.exists()
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def provider_to(path: Path) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"process.pid": os.getpid()}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    return provider


class Ctx(BaseModel):
    n: int = 0


def traced(marker: Path | None = None) -> Workflow:
    """``fetch → load → publish → done``; ``load``'s first attempt writes ``marker`` and
    hangs (the test SIGKILLs its process there); its next attempt succeeds."""
    wf = Workflow("traced", context=Ctx)

    @wf.step(initial=True, next="load")
    def fetch(ctx: Ctx) -> None:
        ctx.n += 1

    @wf.step(next="publish", retry=Retry(attempts=3, backoff="fixed", base=0))
    async def load(ctx: Ctx, step: Step) -> None:
        if step.attempt == 1 and marker is not None:
            marker.write_text(str(os.getpid()))
            await asyncio_forever()

    @wf.step(next="done")
    def publish(ctx: Ctx) -> None:
        ctx.n += 1

    wf.final("done")
    return wf


async def asyncio_forever() -> None:
    import asyncio

    await asyncio.Event().wait()


def main(argv: list[str]) -> int:
    command, db, spans = argv[0], argv[1], Path(argv[2])
    provider = provider_to(spans)
    with Engine(db) as engine:
        if command == "run":
            marker = Path(argv[3])
            workflow = traced(marker)
            tracing.instrument(engine, tracer_provider=provider)
            with provider.get_tracer("app").start_as_current_span("request") as request:
                context = request.get_span_context()
                print(
                    json.dumps(
                        {
                            "trace_id": format(context.trace_id, "032x"),
                            "span_id": format(context.span_id, "016x"),
                        }
                    ),
                    flush=True,
                )
                engine.run(workflow, {})  # never returns: SIGKILLed in `load`
            return 1
        if command == "resume":
            engine.register(traced())
            tracing.instrument(engine, tracer_provider=provider)
            engine.resume()
            provider.shutdown()
            return 0
    raise SystemExit(f"usage: tracekit.py run DB SPANS MARKER | resume DB SPANS (got {argv})")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
