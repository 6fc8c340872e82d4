"""Durations are finite, positive where they must be, and validated with one line naming
the value (issue 20, item 9): NaN and infinity (``lease = inf`` in flowloop.toml, a
400-digit --lease or --grace, ``timeout=nan``, ``Retry(base=nan)``) and NaN/Infinity in a
context."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterable
from datetime import timedelta
from decimal import Decimal
from enum import Enum
from pathlib import Path

import pytest
from pydantic import BaseModel

from flowloop import Engine, Retry, Workflow, limits
from flowloop.config import parse_duration
from flowloop.errors import FlowloopError
from flowloop.limits import check_finite, non_finite

HUGE = "1" * 400


class Ctx(BaseModel):
    x: float = 0.0


@pytest.mark.parametrize("value", [float("inf"), float("nan"), HUGE, f"{HUGE}s", 1e300])
def test_config_durations_must_be_finite(value: object) -> None:
    with pytest.raises(ValueError, match="not a finite duration"):
        parse_duration(value)
    assert parse_duration("30s") == 30.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), timedelta(days=10_000)])
def test_definitions_refuse_non_finite_durations(bad: float | timedelta) -> None:
    with pytest.raises(FlowloopError, match=re.escape("Retry(base=...)")):
        Retry(base=bad)
    with pytest.raises(FlowloopError, match=re.escape("Retry(cap=...)")):
        Retry(cap=bad)
    wf = Workflow("durations", context=Ctx)
    with pytest.raises(FlowloopError, match="state 'a' timeout"):
        wf.step(name="a", initial=True, next="done", timeout=bad)(lambda ctx: None)


def test_engine_refuses_non_finite_leases_and_contexts(sqlite_url: str) -> None:
    for lease in (float("inf"), float("nan"), 0.0):
        with pytest.raises(FlowloopError, match="lease_seconds"):
            Engine(sqlite_url, lease_seconds=lease)
    wf = Workflow("durations", context=Ctx)
    wf.step(name="a", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    with Engine(sqlite_url, workflows=[wf]) as engine:
        for bad in ("NaN", "Infinity", "-Infinity", "1e999"):
            with pytest.raises(FlowloopError, match="field x is NaN or infinite"):
                engine.start(wf, f'{{"x": {bad}}}')
        assert engine.runs() == []


FLOW = """
from pydantic import BaseModel
from flowloop import Workflow

class Ctx(BaseModel):
    x: float = 0.0

wf = Workflow("durations", context=Ctx)
wf.step(name="a", initial=True, next="done")(lambda ctx: None)
wf.final("done")
"""


def flowloop(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # A real process: an accepted --lease would start a worker that never ends (the
    # timeout fails the test instead).
    return subprocess.run(
        [sys.executable, "-m", "flowloop.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(cwd),
    )


def test_cli_refuses_non_finite_durations_in_one_line(tmp_path: Path) -> None:
    flow = tmp_path / "flow.py"
    flow.write_text(FLOW)
    db = ["--db", f"sqlite:///{tmp_path / 'flowloop.db'}"]
    for option in ("--lease", "--grace"):
        done = flowloop("worker", str(flow), option, HUGE, *db, cwd=tmp_path)
        assert done.returncode == 2, (option, done.stdout, done.stderr)
        assert "not a finite duration" in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    (tmp_path / "flowloop.toml").write_text("lease = inf\n")
    done = flowloop("worker", str(flow), *db, cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "inf" in done.stderr and "Traceback" not in done.stderr
    (tmp_path / "flowloop.toml").unlink()
    done = flowloop("start", str(flow), "--context", '{"x": NaN}', *db, cwd=tmp_path)
    assert done.returncode == 2 and "field x is NaN or infinite" in done.stderr, done.stderr


def test_non_finite_names_the_first_bad_number_under_any_nesting() -> None:
    nan, inf = float("nan"), float("inf")
    assert non_finite({"a": "x", "b": [1, 2.0, {"c": nan}], "d": inf}) == "b[2].c"
    assert non_finite([True, None, "s", (0, -inf)]) == "[3][1]"
    assert non_finite({"outer": {"inner": [{"x": 1.5}, {"y": inf}]}}) == "outer.inner[1].y"
    assert non_finite(nan) == "(the value)"
    # Values that hold no number to check, and finite floats, pass.
    assert non_finite({"a": True, "b": None, "c": 3, "d": "NaN", "e": [0.5, {"f": -1e308}]}) is None


class Ratio(float):
    pass


class Half(float, Enum):
    NAN = float("nan")


def _nested(depth: int, leaf: object) -> object:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"a": 1.0, "b": [1, {"c": float("-inf")}]}, "b[1].c"),
        ({"text": "NaN and Infinity are words here", "x": 2.5}, None),  # the walk decides
        ({(1, 2): float("nan")}, "(1, 2)"),  # under a tuple key (written "1,2")
        ({"opaque": object(), "n": float("inf")}, "n"),  # a value JSON has no type for
        ({"opaque": object()}, None),
        ({"many": [{"price": 1.5, "qty": i} for i in range(1000)]}, None),
        ({"sub": [Ratio("nan")]}, "sub[0]"),  # a float subclass
        ({"enum": [Half.NAN]}, "enum[0]"),  # a float-valued enum
        ({"deep": _nested(300, float("inf"))}, "deep" + "[0]" * 300),  # too deep to encode
        # What the walk does not look into, the check does not refuse either:
        ({"set": {float("nan")}, "decimal": Decimal("NaN"), "text": "Infinity"}, None),
    ],
)
@pytest.mark.parametrize("encode_first", [True, False], ids=["encoded", "walked"])
def test_check_finite_refuses_exactly_what_non_finite_names(
    value: object, named: str | None, encode_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with the Rust encoding first and with the walk alone (a pydantic_core that
    does not write NaN as such: limits._ENCODE_FIRST off)."""
    if encode_first and not limits._ENCODE_FIRST:
        pytest.skip("this pydantic_core does not write NaN as such: the walk alone runs")
    monkeypatch.setattr(limits, "_ENCODE_FIRST", encode_first)
    assert non_finite(value) == named
    if named is None:
        check_finite("context", value)
    else:
        with pytest.raises(FlowloopError, match=re.escape(f"context field {named} is NaN")):
            check_finite("context", value)


class Lazy(BaseModel):
    items: Iterable[int]


def test_a_context_s_iterator_is_stored_whole_before_it_is_checked(sqlite_url: str) -> None:
    """The check encodes a dump of the context, which exhausts an iterator field: the
    context's text is made first, so the run stores what it was given."""
    wf = Workflow("lazy", context=Lazy)
    wf.step(name="a", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    with Engine(sqlite_url, workflows=[wf]) as engine:
        run_id = engine.start(wf, Lazy(items=iter([1, 2, 3]))).id
        stored = engine.store.get_run(run_id)
        assert stored is not None and json.loads(stored.record.context) == {"items": [1, 2, 3]}
