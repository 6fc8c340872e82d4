"""The pure parts of the CLI's helpers: JSON times, how two contexts differ, the SQLite modes."""

from __future__ import annotations

from pathlib import Path

from flowloop.cli.support import iso8601, with_times

T = 1_764_580_568.974123  # 2025-12-01 09:16:08.974123 UTC


def test_with_times__iso_8601_utc_and_the_epoch_beside_it() -> None:
    out = with_times({"at": T, "due": None, "n": 1}, "at", "due", "missing")
    assert out == {
        "at": "2025-12-01T09:16:08.974123+00:00",
        "at_epoch": T,
        "due": None,
        "due_epoch": None,
        "n": 1,
    }
    assert iso8601(None) is None


def test_synchronous_modes__the_cli_option_offers_what_the_store_accepts() -> None:
    # Spelled twice so the option needs no SQLAlchemy at `flowloop --help`.
    from flowloop.cli.common import SYNCHRONOUS_MODES
    from flowloop.store.dialect import SYNCHRONOUS_MODES as STORE_MODES

    assert SYNCHRONOUS_MODES == STORE_MODES


def test_not_ended_line__says_what_the_run_waits_for_and_what_continues_it() -> None:
    """What `flowloop run`/`retry` print (exit 0) for a run they hand back unended."""
    import dataclasses

    from flowloop.cli.support import not_ended_line
    from flowloop.runinfo import RunInfo

    fields = {f.name: None for f in dataclasses.fields(RunInfo)}
    base = RunInfo(**{**fields, "id": "r1", "state": "s", "visits": {}, "attempt": 0})  # type: ignore[arg-type]
    run = lambda **changes: dataclasses.replace(base, **changes)  # noqa: E731
    assert (
        not_ended_line(run(status="running", owner="w1")) == "run r1 is running in s, driven by w1"
    )
    assert not_ended_line(run(status="paused", reason="paused")) == (
        "run r1 is paused in s (paused); `flowloop unpause r1` lets it go on"
    )
    assert not_ended_line(run(status="paused", reason="definition_mismatch: gone")) == (
        "run r1 is paused in s (definition_mismatch: gone); deploy a definition that can "
        "take it (`flowloop check FILE`), then `flowloop unpause r1` lets it go on"
    )
    sleeping = not_ended_line(run(status="scheduled", next_run_at=T))
    assert sleeping.startswith("run r1 sleeps in s until 2025-12-01 09:16:08.974Z; a worker")
    assert not_ended_line(run(status="retrying", next_run_at=T)).startswith(
        "run r1 retries s at 2025-12-01 09:16:08.974Z; "
    )
    assert not_ended_line(run(status="scheduled")).startswith(
        "run r1 waits in s for its children; "
    )


def test_loop_request__a_stop_cancels_the_running_iteration_a_pause_lets_it_finish() -> None:
    """`flowloop stop LOOP` during an iteration said "after the running iteration", as a
    pause does; a stop cancels it (README: "stop cancels it")."""
    from flowloop.cli.operators import loop_request

    assert loop_request("stop") == " (stop requested; its worker cancels the running iteration)"
    assert loop_request("pause") == " (pause requested; after the running iteration)"
    assert loop_request(None) == ""


def test_a_taken_key_of_a_root_model_context_is_compared_whole(tmp_path: Path) -> None:
    """`run`/`start` with a taken key of a root-model context: a KeyError traceback from
    comparing its fields (review). Compared whole."""
    from pydantic import RootModel

    from flowloop import Engine, Workflow
    from flowloop.cli.support import existing_for_key

    class Counts(RootModel[dict[str, int]]):
        pass

    wf = Workflow("counts", context=Counts, key=lambda ctx: "k1")
    wf.step(name="count", initial=True, next="done")(lambda ctx: None)
    wf.final("done")
    with Engine(f"sqlite:///{tmp_path / 'c.db'}") as engine:
        engine.start(wf, {"a": 1})
        found = existing_for_key(engine, wf, {"a": 1}, None)
        assert found is not None and found[1] == []
        found = existing_for_key(engine, wf, {"a": 2}, None)
        assert found is not None and found[1] == ["(the whole context)"]
