"""The pytest plugin of flowloop.testing (registered through the ``pytest11`` entry point,
so installing flowloop makes these fixtures available in every test suite). A top-level
module, so that loading it imports pytest only — not flowloop:

* ``fake_clock`` — a :class:`~flowloop.FakeClock` (starts 2027-01-15 08:00 UTC);
* ``flowloop_engine`` — a :class:`~flowloop.testing.TestEngine` on a SQLite file in the
  test's ``tmp_path``, driven by ``fake_clock``; closed after the test.

Both are plain (sync) fixtures, so they serve sync tests and async ones alike (with
pytest-asyncio, call the engine's ``a…`` methods: ``await flowloop_engine.arun_until_idle()``).
flowloop is imported only when a test asks for a fixture.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from flowloop.clock import FakeClock
    from flowloop.testing.engine import TestEngine


@pytest.fixture
def fake_clock() -> FakeClock:
    """A fake clock that moves only when told to (or when the engine skips time)."""
    from flowloop.clock import FakeClock

    return FakeClock()


@pytest.fixture
def flowloop_engine(tmp_path: Path, fake_clock: FakeClock) -> Iterator[TestEngine]:
    """A TestEngine on ``tmp_path/flowloop.db`` with ``fake_clock``; register workflows with
    ``flowloop_engine.register(...)`` or just start them."""
    from flowloop.testing.engine import TestEngine

    with TestEngine(tmp_path / "flowloop.db", clock=fake_clock) as engine:
        yield engine
