"""Run ids grow with time (flowloop/runids.py): B-tree locality for the journal's key,
while a short prefix still tells apart runs created a moment apart."""

from __future__ import annotations

import re

import pytest

from flowloop import runids
from flowloop.runids import EPOCH_MS, new_run_id


def at(monkeypatch: pytest.MonkeyPatch, unix_ms: int) -> None:
    monkeypatch.setattr(runids.time, "time_ns", lambda: unix_ms * 1_000_000)


def test_ids_are_32_hex_digits_led_by_the_milliseconds_since_2026(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    at(monkeypatch, EPOCH_MS + 0x1234)
    run_id = new_run_id()
    assert re.fullmatch(r"[0-9a-f]{32}", run_id), run_id
    assert run_id[:10] == "0000001234"


def test_ids_sort_by_creation_time_and_are_unique_within_a_millisecond(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = []
    for step in range(200):
        at(monkeypatch, EPOCH_MS + 1_000_000_000 + step // 50)  # 50 ids per millisecond
        made.append(new_run_id())
    assert len(set(made)) == len(made)
    by_time = [run_id[:10] for run_id in made]
    assert by_time == sorted(by_time)
    assert sorted(made)[0][:10] == by_time[0] and sorted(made)[-1][:10] == by_time[-1]


def test_eight_digits_tell_apart_runs_created_256_ms_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    at(monkeypatch, EPOCH_MS + 5_000_000_000)
    first = new_run_id()
    at(monkeypatch, EPOCH_MS + 5_000_000_256)
    assert new_run_id()[:8] != first[:8]


def test_the_clock_wraps_after_40_bits_instead_of_growing_the_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    at(monkeypatch, EPOCH_MS + (1 << 40) + 7)
    run_id = new_run_id()
    assert len(run_id) == 32 and run_id[:10] == "0000000007"


def test_the_random_part_is_the_88_bits_secrets_randbits_drew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The id writes os.urandom's 11 bytes as hex; secrets.randbits(88), which it wrote
    # before, reads the same bytes big-endian: the same digits, leading zeros kept.
    drawn = bytes([0, 0, 7, *range(250, 255), 1, 2, 3])
    monkeypatch.setattr(runids.os, "urandom", lambda n: drawn[:n])
    at(monkeypatch, EPOCH_MS + 0xABC)
    run_id = new_run_id()
    assert run_id == f"{0xABC:010x}{int.from_bytes(drawn, 'big'):022x}"
    assert len(run_id) == 32 and run_id[10:13] == "000"
