"""flowloop/store/recordsets.py: on PostgreSQL a batch of boundaries (concurrent runs
sharing a commit) goes as one statement per kind of write, its rows one JSON array; what
it stores is what the statements of a single boundary store, every character included."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import BaseModel
from storekit import batch_sizes, event, new_run, start_step

from flowloop import Engine, Workflow
from flowloop import journal as j
from flowloop.store import Boundary, recordsets
from flowloop.store.recordsets import rows_json, rows_json_parts
from flowloop.store.sql import SQLStore

TRICKY = 'quote " backslash \\ text \\u0000, NUL \x00, tab \t, é, 🎉, \u2028'
"""Characters JSON escapes (the NUL inside a context is escaped by the context's own JSON)."""


class Text(BaseModel):
    n: int = 0
    s: str = ""
    x: float = 0.0


def _tricky() -> Workflow:
    workflow = Workflow("tricky", context=Text)

    @workflow.step(initial=True, next="b")
    async def a(ctx: Text) -> None:
        ctx.n += 1
        ctx.s = TRICKY
        ctx.x = 0.1 + 0.2

    @workflow.step(next="done")
    async def b(ctx: Text) -> None:
        ctx.n += 1
        ctx.x = 1e-300 * ctx.n

    workflow.final("done")
    return workflow


def test_rows_json__none_for_what_postgresql_json_refuses() -> None:
    assert rows_json([{"a": "x\x00y"}]) is None  # NUL: no text column holds it
    assert rows_json([{"a": "\\\x00"}]) is None  # a backslash, then NUL
    assert rows_json([{"a": float("nan")}]) is None
    assert rows_json([{"a": b"bytes"}]) is None  # no JSON type: the driver adapts it
    text = rows_json([{"a": "\\u0000", "b": None, "c": 1.5}])  # the text \u0000 is text
    assert text is not None and json.loads(text) == [{"a": "\\u0000", "b": None, "c": 1.5}]


def test_rows_json_parts__each_at_most_the_limit_and_together_the_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = [{"i": i, "s": "é" * (i % 7) * 40} for i in range(50)]
    assert rows_json_parts(rows) == [(rows_json(rows), 50)]  # short: one part
    monkeypatch.setattr(recordsets, "PART_CHARS", 600)
    parts = rows_json_parts([*rows, {"i": 50, "s": "x" * 2000}])  # the last alone, longer
    assert parts is not None and len(parts) > 5
    assert all(len(text) <= 600 for text, _ in parts[:-1]) and len(parts[-1][0]) > 2000
    decoded = [row for text, count in parts for row in json.loads(text)]
    assert [count for _, count in parts] == [len(json.loads(text)) for text, _ in parts]
    assert decoded == [*rows, {"i": 50, "s": "x" * 2000}]
    assert rows_json_parts([{"a": "x\x00"}]) is None


@pytest.mark.parametrize("over", [0, 1])
def test_rows_json_parts__a_part_exactly_at_the_limit(
    monkeypatch: pytest.MonkeyPatch, over: int
) -> None:
    """Rows whose array is exactly the limit go as one part; one character more, in two."""
    rows = [{"s": "x" * 40}, {"s": "y" * 40}, {"s": "z" * 40}]
    whole = rows_json(rows)
    assert whole is not None
    monkeypatch.setattr(recordsets, "PART_CHARS", len(whole) - over)
    parts = rows_json_parts([*rows, {"s": "w"}])  # longer than the limit: in parts
    assert parts is not None
    assert parts[0] == ((whole, 3) if not over else (rows_json(rows[:2]), 2))
    assert all(len(text) <= recordsets.PART_CHARS for text, _ in parts)


def test_a_batch_of_long_contexts__in_parts_on_postgresql(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight concurrent runs whose steps store long contexts, the parts' limit made small:
    each batch's rows go in several statements (one array was cancelled by the worker's
    statement_timeout when the batch was long enough), and every run ends with exactly its
    context."""
    monkeypatch.setattr(recordsets, "PART_CHARS", 3_000)
    counts: list[int] = []
    in_parts = recordsets.rows_json_parts

    def counted(params: object) -> object:
        parts = in_parts(params)  # type: ignore[arg-type]
        counts.append(0 if parts is None else len(parts))
        return parts

    monkeypatch.setattr(recordsets, "rows_json_parts", counted)
    one_by_one: list[int] = []
    apply = SQLStore._apply

    def noted_apply(
        self: SQLStore, conn: object, boundaries: list[object], *rest: object
    ) -> object:
        one_by_one.append(len(boundaries))
        return apply(self, conn, boundaries, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(SQLStore, "_apply", noted_apply)
    workflow = Workflow("long", context=Text)

    @workflow.step(initial=True, next="b")
    async def a(ctx: Text) -> None:
        ctx.s = f"{ctx.n:04d}" * 250  # 1,000 characters

    @workflow.step(next="done")
    async def b(ctx: Text) -> None:
        ctx.n += 1
        ctx.s = ctx.s[::-1]

    workflow.final("done")
    with Engine(store_url, workflows=[workflow], max_concurrency=8) as engine:
        ids = [engine.start(workflow, Text(n=n)).id for n in range(8)]
        engine.run_until_idle()
        for n, run_id in enumerate(ids):
            info = engine.get(run_id)
            assert info.status == "succeeded", info
            assert info.context == Text(n=n + 1, s=(f"{n:04d}" * 250)[::-1]), info.context
            assert engine.replay(run_id).matches
        assert isinstance(engine.store, SQLStore)
        postgres = engine.store._postgres
    if postgres:
        assert max(counts) > 1, counts
        assert one_by_one == []  # each batch applied in its parts, none written again alone
    else:
        assert counts == []  # SQLite keeps its executemany


def test_a_batch__one_statement_per_kind_and_every_character_kept(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight concurrent runs of two steps whose context holds characters JSON escapes: on
    PostgreSQL their batches never go by executemany, and on both databases every run ends
    with exactly its context (the journal's folded too)."""
    sent, as_json = batch_sizes(monkeypatch)
    workflow = _tricky()
    with Engine(store_url, workflows=[workflow], max_concurrency=8) as engine:
        ids = [engine.start(workflow, Text()).id for _ in range(8)]
        engine.run_until_idle()
        for run_id in ids:
            info = engine.get(run_id)
            assert info.status == "succeeded", info
            assert info.context == Text(n=2, s=TRICKY, x=2e-300), info.context
            assert engine.replay(run_id).matches
        assert isinstance(engine.store, SQLStore)
        postgres = engine.store._postgres
    if postgres:
        assert sent == [] and max(as_json) > 1, (sent, as_json)
    else:
        assert max(sent) > 1  # SQLite keeps its executemany: the batches were batches


def test_a_batch__keeps_every_value_and_clears_the_requests_it_honours(
    store: SQLStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six claimed runs start their step in one batch (their rows written with a lease),
    then, asked to pause, pause in one batch (rows released, requests cleared): every
    entry's times are stored exactly as written, on PostgreSQL by one statement per kind."""
    created = [store.create_run(new_run())[0] for _ in range(6)]
    claimed = store.claim(
        worker="a", now=time.time(), limit=6, lease_seconds=30, run_ids=[c.id for c in created]
    )
    assert len(claimed) == 6
    by_executemany, as_json = batch_sizes(monkeypatch)
    starts = [start_step(c, "a") for c in claimed]
    assert store.write(starts) == [True] * 6
    for run in claimed:
        assert store.request_control(run.id, "pause")
    pauses = []
    for n, start in enumerate(starts):
        record = start.record
        paused = event(record, j.RUN_PAUSED, state=record.state, duration=n / 3 + 1e-9)
        pauses.append(
            Boundary(
                events=[paused],
                record=j.apply(record, paused),
                fence=start.fence,
                release=True,
                clear_control=True,
                seen_control="pause",
            )
        )
    assert store.write(pauses) == [True] * 6
    for start, pause in zip(starts, pauses, strict=True):
        stored = {e.seq: e for e in store.journal(start.run_id)}
        for written in (*start.events, *pause.events):
            entry = stored[written.seq]
            assert (entry.kind, entry.at, entry.duration) == (
                written.kind,
                written.at,
                written.duration,
            )
        row = store.get_run(start.run_id)
        assert row is not None
        assert (row.record.status, row.control, row.owner) == ("paused", None, None)
    if store._postgres:
        assert by_executemany == [] and as_json == [6, 6, 6, 6], (by_executemany, as_json)
    else:
        assert as_json == [] and max(by_executemany) == 6
