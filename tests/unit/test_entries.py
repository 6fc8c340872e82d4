"""Contexts journaled as splices (flowloop/store/entries.py): exact to the character."""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from flowloop import journal as j
from flowloop.journal import JournalEvent, RunRecord
from flowloop.store import entries
from flowloop.store.base import StoredRun
from flowloop.store.entries import (
    JOURNAL_FIELDS,
    SNAPSHOT_EVERY,
    SPLICE_KEY,
    SPLICE_MIN,
    ContextCache,
    Decoder,
    context_after,
    decode,
    encode,
    splice,
    stored_from_row,
    unsplice,
)
from flowloop.store.schema import journal, metadata, runs


def _edit(rand: random.Random, text: str) -> str:
    """A few random edits: replace, insert or delete a short span (unicode included)."""
    for _ in range(rand.randint(1, 3)):
        at = rand.randint(0, len(text))
        cut = rand.randint(0, 5)
        new = "".join(
            rand.choice('ab\u00e9\u4e2d\U0001f600"\\{}') for _ in range(rand.randint(0, 5))
        )
        text = text[:at] + new + text[at + cut :]
    return text


@pytest.mark.parametrize("seed", range(200))
def test_splice__undone_gives_back_the_very_text(seed: int) -> None:
    rand = random.Random(seed)
    old = "".join(rand.choice("xyz\u00e9") for _ in range(rand.randint(0, 3 * SPLICE_MIN)))
    new = _edit(rand, old)
    cut = splice(old, new)
    if cut is None:
        return  # stored whole
    prefix, suffix, middle = cut
    assert unsplice(old, prefix, suffix, middle) == new
    assert len(middle) * 2 <= len(new)


def test_splice__small_or_rewritten_contexts_are_stored_whole() -> None:
    assert splice("a" * 10, "b" * 10) is None  # shorter than SPLICE_MIN
    big = "x" * (2 * SPLICE_MIN)
    assert splice(big, "y" * (2 * SPLICE_MIN)) is None  # nothing in common
    assert splice(big, big[:5] + "Z" + big[6:]) == (5, len(big) - 6, "Z")


def _row(event: JournalEvent, stored: dict[str, Any]) -> Any:
    return SimpleNamespace(**stored)


def test_encode_decode__a_run_of_changes_folds_back_exactly() -> None:
    """Rows as the store writes them (a splice where it saves, a whole context every
    SNAPSHOT_EVERY) decode to the events given, in seq order from seq 1."""
    rand = random.Random(7)
    context = json.dumps({"n": 0, "blob": "q" * 3000})
    events = []
    for seq in range(1, 2 * SNAPSHOT_EVERY + 5):
        if seq % 3 == 0:
            events.append(JournalEvent(run_id="r", seq=seq, kind=j.STEP_STARTED, at=1.0))
            continue
        context = _edit(rand, context)
        events.append(
            JournalEvent(
                run_id="r", seq=seq, kind=j.STEP_SUCCEEDED, at=1.0, context=context, data={"a": 1}
            )
        )
    cache = ContextCache()
    rows = [_row(e, r) for e, r in zip(events, encode(events, cache), strict=True)]
    spliced = [r for r in rows if r.data and SPLICE_KEY in r.data]
    assert len(spliced) > len(rows) // 2  # most contexts travel as splices
    assert len(rows) - len(spliced) - sum(1 for e in events if e.context is None) >= 2
    assert decode(rows) == events
    # A reader of raw rows undoes the splices one by one the same way.
    text = None
    for row, event in zip(rows, events, strict=True):
        if row.context is not None:
            text = context_after(text, row.context, row.data)
            assert text == event.context


def test_encode__a_gap_in_seq_or_a_forgotten_run_is_stored_whole() -> None:
    big = "w" * (4 * SPLICE_MIN)
    cache = ContextCache()
    first = JournalEvent(run_id="r", seq=1, kind=j.RUN_CREATED, at=1.0, context=big)
    later = JournalEvent(run_id="r", seq=3, kind=j.STEP_SUCCEEDED, at=1.0, context=big + "!")
    rows = encode([first], cache) + encode([later], cache)  # seq 2 was not written here
    assert [r["context"] for r in rows] == [big, big + "!"]
    cache.forget("r")
    again = JournalEvent(run_id="r", seq=4, kind=j.STEP_SUCCEEDED, at=1.0, context=big + "?")
    assert encode([again], cache)[0]["context"] == big + "?"


def test_decode__a_splice_without_its_base_is_a_fold_error() -> None:
    big = "v" * (4 * SPLICE_MIN)
    events = [
        JournalEvent(run_id="r", seq=1, kind=j.RUN_CREATED, at=1.0, context=big),
        JournalEvent(run_id="r", seq=2, kind=j.STEP_SUCCEEDED, at=1.0, context=big + "."),
    ]
    rows = [SimpleNamespace(**r) for r in encode(events, ContextCache())]
    with pytest.raises(j.FoldError, match="seq 2"):
        decode(rows[1:])


def test_decoder_values__rows_by_position_decode_as_rows_by_name() -> None:
    """Decoder.values (a select(journal) row's values, as the tail folds read them) gives
    the events Decoder.events gives; a splice without its base names the entry either way."""
    assert tuple(column.name for column in journal.columns) == JOURNAL_FIELDS
    rand = random.Random(3)
    context = json.dumps({"n": 0, "blob": "z" * 2000})
    events = [JournalEvent(run_id="r", seq=1, kind=j.RUN_CREATED, at=1.5, context=context)]
    for seq in range(2, 12):
        context = _edit(rand, context)
        events.append(
            JournalEvent(
                run_id="r",
                seq=seq,
                kind=j.STEP_SUCCEEDED,
                at=seq + 0.25,
                context=context,
                retryable=seq % 2 == 0,
                data={"k": seq},
            )
        )
    rows = encode(events, ContextCache())
    assert any(SPLICE_KEY in (r["data"] or "") for r in rows)
    by_position = Decoder()
    values = [tuple(r[f] for f in JOURNAL_FIELDS) for r in rows]
    assert [e for v in values for e in by_position.values(v)] == events
    assert decode(SimpleNamespace(**r) for r in rows) == events
    with pytest.raises(j.FoldError, match="run r seq 3 "):
        Decoder().values(tuple(rows[2][f] for f in JOURNAL_FIELDS))


def test_stored_from_row__every_field_of_a_real_row() -> None:
    """A run row read back (SQLite) becomes the StoredRun its constructors would make:
    every field of both dataclasses filled, a corrupt visits column a problem."""
    engine = sa.create_engine("sqlite://")
    metadata.create_all(engine, tables=[runs])
    row = {
        "id": "r1",
        "workflow": "w",
        "version": 2,
        "fingerprint": "f",
        "key": "k",
        "idempotency_key": "i",
        "status": "running",
        "state": "s1",
        "context": "{}",
        "context_version": 3,
        "attempt": 4,
        "visits": '{"s0":1,"s1":2}',
        "next_run_at": 5.5,
        "last_seq": 6,
        "reason": "why",
        "error": "E: x",
        "priority": 7,
        "owner": "o",
        "lease_expires_at": 8.5,
        "lease_epoch": 9,
        "control": "pause",
        "created_at": 1.25,
        "updated_at": 2.25,
        "deadline_at": 10.5,
        "join_id": "jn",
    }
    with engine.begin() as conn:
        conn.execute(
            sa.insert(runs),
            [row, {**row, "id": "r2", "key": None, "idempotency_key": None, "visits": "[1]"}],
        )
        found = conn.execute(sa.select(runs).order_by(runs.c.id)).all()
    record = RunRecord(
        id="r1",
        workflow="w",
        version=2,
        fingerprint="f",
        key="k",
        status="running",
        state="s1",
        context="{}",
        attempt=4,
        visits={"s0": 1, "s1": 2},
        next_run_at=5.5,
        last_seq=6,
        reason="why",
        error="E: x",
        context_version=3,
        deadline=10.5,
        join="jn",
    )
    expected = StoredRun(
        record=record,
        idempotency_key="i",
        priority=7,
        owner="o",
        lease_expires_at=8.5,
        lease_epoch=9,
        control="pause",
        created_at=1.25,
        updated_at=2.25,
    )
    first, second = (stored_from_row(r) for r in found)
    assert first == expected
    for value in (first, first.record):
        assert set(vars(value)) == {f.name for f in dataclasses.fields(value)}
    assert second.record.visits == {} and second.problem == "stored visits are not a JSON object"


def test_entries__a_joined_start_s_data_is_the_json_the_encoder_writes() -> None:
    """The usual row's ``data`` (a joined start alone) is formatted directly; any other
    data goes through the encoder: both give the same text, and it reads back."""
    rand = random.Random(13)
    values: list[Any] = [1796285892.2361407, 1.0, 1e22, 1.5e-07, 0.1, float("inf"), 7, True]
    values += [rand.random() * 10 ** rand.randint(-12, 22) for _ in range(2000)]
    for at in values:
        for attempt in (0, 1, 12, True):
            data = {"~then": [at, attempt]}
            text = entries._data_text(data)
            assert text == entries.dumps_sorted(data)
            assert json.loads(text) == data
    for other in ({"~then": [1.5, 2, {"granted_at": 1.0}]}, {"~then": [1.5, 2], "cv": 2}):
        assert entries._data_text(other) == json.dumps(other, sort_keys=True, separators=(",", ":"))
