"""A run whose ``visits`` column cannot be read keeps that text through an operator's
pause, unpause and stop (and the sweep's invalid_row failure): the write of the row puts
back what was there, not ``{}``. On SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from waitkit import ALL, Chain, chain, kinds

from flowloop import FakeClock
from flowloop.store.schema import runs
from flowloop.testing import TestEngine

CORRUPT = '{"first": 1, oops'


@pytest.fixture
def engine(store_url: str) -> Iterator[TestEngine]:
    with TestEngine(store_url, clock=FakeClock(auto_advance=False), workflows=ALL) as engine:
        yield engine


def _stored_visits(engine: TestEngine, run_id: str) -> str:
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        return str(conn.execute(sa.select(runs.c.visits).where(runs.c.id == run_id)).scalar_one())


def _corrupt(engine: TestEngine) -> str:
    run_id = engine.start(chain, Chain()).id
    engine.run_until_idle()
    assert engine.get(run_id).state == "first"
    with engine.store.engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(sa.update(runs).where(runs.c.id == run_id).values(visits=CORRUPT))
    return run_id


def test_an_operators_pause_and_unpause_keep_unreadable_visits(engine: TestEngine) -> None:
    # Review: a pause wrote the row back as read, its unreadable visits as {} (the visit
    # counts lost; an unpause then went on without them, the run no longer unreadable).
    run_id = _corrupt(engine)
    engine.pause(run_id)
    assert engine.get(run_id).status == "paused"
    assert _stored_visits(engine, run_id) == CORRUPT
    engine.unpause(run_id)
    assert _stored_visits(engine, run_id) == CORRUPT
    assert kinds(engine, run_id)[-2:] == ["run_paused", "run_unpaused"]


def test_an_operators_stop_keeps_unreadable_visits(engine: TestEngine) -> None:
    run_id = _corrupt(engine)
    engine.stop(run_id)
    assert engine.get(run_id).status == "stopped"
    assert _stored_visits(engine, run_id) == CORRUPT
