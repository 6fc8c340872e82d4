"""Contexts journaled as splices (flowloop/store/entries.py): exact to the character."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import pytest

from flowloop import journal as j
from flowloop.journal import JournalEvent
from flowloop.store.entries import (
    SNAPSHOT_EVERY,
    SPLICE_KEY,
    SPLICE_MIN,
    ContextCache,
    context_after,
    decode,
    encode,
    splice,
    unsplice,
)


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
