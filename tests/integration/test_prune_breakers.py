"""`prune` deletes old breaker journal entries (``opened``, ``half_opened``, ``closed``) on
SQLite and PostgreSQL, keeping each breaker's latest ``opened`` entry and every entry after
it (its current or last episode), whatever their age; the breakers go on as they were (their
state is their row in ``flowloop_breakers``, never the journal) and the next entry's seq
follows the last one written. Before, nothing ever pruned this journal: a flapping breaker
on a long-lived fleet added two entries per cool-down for ever."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa

from flowloop import Engine
from flowloop.flowcontrol import Breaker
from flowloop.prune import prune
from flowloop.store import SQLStore
from flowloop.store.schema import breaker_journal, breakers

DAY = 86400.0
CYCLES = 12
"""The flapping breaker's old (opened, half_opened) pairs before its current episode."""


@pytest.fixture
def engine(store_url: str) -> Iterator[Engine]:
    with Engine(store_url) as e:
        yield e


def db_of(engine: Engine) -> sa.Engine:
    assert isinstance(engine.store, SQLStore)
    return engine.store.engine


def journaled(engine: Engine, name: str, kinds: list[str], ages: list[float]) -> None:
    """A breaker's journal (``kinds`` ``ages`` seconds ago, by the database's clock) and
    its row as the last entry left it."""
    now = engine.store.db_now()
    rows = [
        {"name": name, "seq": seq, "kind": kind, "at": now - age, "worker": "w0", "data": "{}"}
        for seq, (kind, age) in enumerate(zip(kinds, ages, strict=True), start=1)
    ]
    status = {"opened": "open", "half_opened": "half_open", "closed": "closed"}[kinds[-1]]
    with db_of(engine).begin() as conn:
        conn.execute(sa.insert(breaker_journal), rows)
        conn.execute(
            sa.insert(breakers),
            [
                {
                    "name": name,
                    "status": status,
                    "failures": "[]",
                    "until": None if status == "closed" else now + 30.0,
                    "trial": "trialrun:2" if status == "half_open" else None,
                    "opened": kinds.count("opened"),
                    "last_seq": len(kinds),
                    "updated_at": now - ages[-1],
                }
            ],
        )


def seqs(engine: Engine) -> dict[str, list[int]]:
    with db_of(engine).connect() as conn:
        rows = conn.execute(
            sa.select(breaker_journal.c.name, breaker_journal.c.seq).order_by(
                breaker_journal.c.name, breaker_journal.c.seq
            )
        )
        found: dict[str, list[int]] = {}
        for name, seq in rows:
            found.setdefault(name, []).append(int(seq))
        return found


def fleet(engine: Engine) -> None:
    old, new = 3 * DAY, 60.0
    flapping = ["opened", "half_opened"] * (CYCLES + 1)  # half open now, its trial running
    journaled(engine, "flapping", flapping, [old - i for i in range(len(flapping))])
    # Reopened long ago, closed recently: the episode from that opening on stays whole.
    recovered = ["opened", "half_opened", "closed", "opened", "half_opened", "closed"]
    journaled(engine, "recovered", recovered, [old, old, old, old, new, new])
    # Closed long ago: its last episode tells when and why it last opened.
    journaled(engine, "quiet", ["opened", "half_opened", "closed"], [old, old - 1, old - 2])
    journaled(engine, "recent", ["opened", "half_opened", "closed"], [new, new - 1, new - 2])


@pytest.mark.parametrize("batch", [500, 1])
def test_prune__old_breaker_journal_entries_go_each_breakers_latest_episode_stays(
    engine: Engine, batch: int
) -> None:
    fleet(engine)
    cutoff = engine.store.db_now() - DAY
    planned = prune(db_of(engine), cutoff=cutoff, dry_run=True)
    states = engine.store.breakers()  # type: ignore[attr-defined]

    result = prune(db_of(engine), cutoff=cutoff, batch=batch)

    last = 2 * (CYCLES + 1)
    assert seqs(engine) == {
        "flapping": [last - 1, last],  # its current opening and the trial after it
        "recovered": [4, 5, 6],
        "quiet": [1, 2, 3],
        "recent": [1, 2, 3],
    }
    assert result.breaker_journal == planned.breaker_journal == 2 * CYCLES + 3
    assert result.as_dict()["breaker_journal"] == 2 * CYCLES + 3
    if batch == 1:  # ten seqs per transaction: the flapping breaker's 24 in three
        assert result.batches == 4
    assert prune(db_of(engine), cutoff=cutoff).breaker_journal == 0  # nothing left to do
    # The breakers are as they were, and go on from their last seq.
    assert engine.store.breakers() == states  # type: ignore[attr-defined]
    flapping = Breaker("flapping", failures=1, within=timedelta(minutes=1), cool_down=30)
    assert engine.store.breaker_failed(flapping, "w1", "down", "trialrun:2") == "opened"  # type: ignore[attr-defined]
    journal = engine.store.breaker_journal("flapping")  # type: ignore[attr-defined]
    assert [(e.seq, e.kind) for e in journal] == [
        (last - 1, "opened"),
        (last, "half_opened"),
        (last + 1, "opened"),
    ]
    assert journal[-1].data["from"] == "half_open"  # the trial failed
    # Reopened, the breaker's episode is the new one: the next prune takes the old one.
    assert prune(db_of(engine), cutoff=cutoff).breaker_journal == 2
    assert seqs(engine)["flapping"] == [last + 1]


def test_prune__the_cli_line_counts_breaker_journal_entries(
    engine: Engine, store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from flowloop.cli import main

    fleet(engine)
    try:
        main(["prune", "--older-than", "1d", "--dry-run", "--db", store_url])
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr().err
    assert f"{2 * CYCLES + 3} breaker journal entries" in capsys.readouterr().out


def test_only_old_entries_are_walked__no_transaction_for_recent_ones(engine: Engine) -> None:
    # Two old entries, then 60 recent ones before the latest opened: the deletes walk the
    # two old seqs, not every seq up to the keep point (review: 60 empty transactions,
    # each counted in "in N batch(es)"); a breaker with nothing old costs none.
    kinds = ["opened", "half_opened"] * 31 + ["opened"]
    ages = [5 * DAY, 4 * DAY] + [600.0 - i for i in range(61)]
    journaled(engine, "mostly-recent", kinds, ages)
    journaled(engine, "all-recent", ["opened", "half_opened"], [60.0, 30.0])
    result = prune(db_of(engine), cutoff=engine.store.db_now() - DAY, batch=1)
    assert result.breaker_journal == 2
    assert result.batches == 1  # (10 seqs a transaction at batch 1; no runs to prune)
    assert seqs(engine)["mostly-recent"] == list(range(3, 64))
