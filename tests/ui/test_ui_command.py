"""``flowloop ui`` as a user starts it: a real process that prints its URL and serves on
127.0.0.1; ``--host`` other than loopback warns; ``--allow-actions`` prints a token that
the actions accept; a database without flowloop's schema is one line, exit 2 or 1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from polling import poll
from uikit import free_port, parcels

from flowloop.cli.ui import is_loopback

UIKIT = str(Path(__file__).resolve().parents[1] / "uikit.py")


@contextmanager
def flowloop_ui(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    environ = {k: v for k, v in os.environ.items() if k != "FLOWLOOP_UI_TOKEN"}
    process = subprocess.Popen(
        [sys.executable, "-m", "flowloop.cli", "ui", *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    lines: list[str] = []
    try:
        yield process, lines
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def read_until(process: subprocess.Popen[str], lines: list[str], words: str) -> str:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if words in line:
            return line
    raise AssertionError(f"flowloop ui exited ({process.wait()}) without {words!r}: {lines}")


def test_ui__prints_its_url_and_serves_read_only(sqlite_url: str, tmp_path: Path) -> None:
    parcels(sqlite_url, 2)
    port = free_port()
    with flowloop_ui("--db", sqlite_url, "-w", UIKIT, "--port", str(port), cwd=tmp_path) as (
        process,
        lines,
    ):
        line = read_until(process, lines, "http://")
        assert f"http://127.0.0.1:{port}/" in line
        base = f"http://127.0.0.1:{port}"
        runs = poll(lambda: _get(base + "/api/runs"), timeout=20, every=0.05, what="the dashboard")
        assert len(runs.json()["runs"]) == 2
        assert "read-only" in httpx.get(base + "/runs").text
        assert httpx.post(f"{base}/api/runs/{runs.json()['runs'][0]['id']}/stop").status_code in (
            404,
            405,
        )


def test_ui__allow_actions_prints_a_token_the_api_accepts(sqlite_url: str, tmp_path: Path) -> None:
    from uikit import Parcel, parcel

    from flowloop import Engine

    with Engine(sqlite_url, workflows=[parcel]) as engine:
        run_id = engine.start(parcel, Parcel(parcel_id="Q")).id
    port = free_port()
    args = ("--db", sqlite_url, "-w", UIKIT, "--port", str(port), "--allow-actions")
    with flowloop_ui(*args, cwd=tmp_path) as (process, lines):
        read_until(process, lines, "http://")
        token = read_until(process, lines, "token:").split("token:")[1].strip()
        base = f"http://127.0.0.1:{port}"
        poll(lambda: _get(base + "/api/runs"), timeout=20, every=0.05, what="the dashboard")
        headers = {"Authorization": f"Bearer {token}"}
        paused = httpx.post(f"{base}/api/runs/{run_id}/pause", headers=headers)
        assert paused.status_code == 200 and paused.json()["status"] == "paused"


def test_ui__allow_actions_without_workflows_warns_and_send_says_pass_w(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The audit's session: `FLOWLOOP_UI_TOKEN=… flowloop ui --allow-actions` (no -w, no
    ./workflows), then a send: 400 `unknown workflow … (known: none)`, no word of -w at
    start-up nor in the error. With -w (the other tests here) nothing is said."""
    from waitkit import review

    from flowloop import Engine

    with Engine(sqlite_url, workflows=[review]) as engine:
        run_id = engine.run(review, {"doc_id": "D1"}).id
    port = free_port()
    args = ("--db", sqlite_url, "--port", str(port), "--allow-actions")
    with flowloop_ui(*args, cwd=tmp_path, env={"FLOWLOOP_UI_TOKEN": "tok123"}) as (
        process,
        lines,
    ):
        read_until(process, lines, "http://")
        warned = [line for line in lines if line.startswith("warning: ")]
        assert warned == [
            "warning: no workflow loaded (no -w given and no ./workflows here): retry and send "
            "will be refused; pass -w FILE_OR_DIR that defines the runs' workflows\n"
        ]
        base = f"http://127.0.0.1:{port}"
        poll(lambda: _get(base + "/api/runs"), timeout=20, every=0.05, what="the dashboard")
        sent = httpx.post(
            f"{base}/api/runs/{run_id}/send",
            headers={"Authorization": "Bearer tok123"},
            content='{"event":"approve","data":{"by":"x"}}',
        )
        assert sent.status_code == 400
        assert "start flowloop ui with -w FILE_OR_DIR" in sent.json()["error"]


def test_ui__allow_actions_with_workflows_does_not_warn(sqlite_url: str, tmp_path: Path) -> None:
    parcels(sqlite_url, 1)
    port = free_port()
    args = ("--db", sqlite_url, "-w", UIKIT, "--port", str(port), "--allow-actions")
    with flowloop_ui(*args, cwd=tmp_path) as (process, lines):
        read_until(process, lines, "token:")
    assert not [line for line in lines if "warning" in line], lines


@pytest.mark.parametrize("from_env", [False, True], ids=["file", "env_wins"])
def test_ui__the_action_token_comes_from_flowloop_toml_and_the_env_wins(
    sqlite_url: str, tmp_path: Path, from_env: bool
) -> None:
    from uikit import Parcel, parcel

    from flowloop import Engine

    with Engine(sqlite_url, workflows=[parcel]) as engine:
        run_id = engine.start(parcel, Parcel(parcel_id="T")).id
    (tmp_path / "flowloop.toml").write_text('ui_token = "token-from-the-file"\n')
    env = {"FLOWLOOP_UI_TOKEN": "token-from-the-env"} if from_env else {}
    expected = "token-from-the-env" if from_env else "token-from-the-file"
    port = free_port()
    args = ("--db", sqlite_url, "-w", UIKIT, "--port", str(port), "--allow-actions")
    with flowloop_ui(*args, cwd=tmp_path, env=env) as (process, lines):
        read_until(process, lines, "http://")
        # A token given is not printed (the output may go to a log): where it is, is.
        where = "$FLOWLOOP_UI_TOKEN or --token" if from_env else "ui_token in flowloop.toml"
        told = read_until(process, lines, "token:").split("token:")[1].strip()
        assert told == f"the one in {where} (not shown)"
        base = f"http://127.0.0.1:{port}"
        poll(lambda: _get(base + "/api/runs"), timeout=20, every=0.05, what="the dashboard")
        other = "token-from-the-file" if from_env else "token-from-the-env"
        refused = httpx.post(
            f"{base}/api/runs/{run_id}/pause", headers={"Authorization": f"Bearer {other}"}
        )
        assert refused.status_code in (401, 403)
        paused = httpx.post(
            f"{base}/api/runs/{run_id}/pause", headers={"Authorization": f"Bearer {expected}"}
        )
        assert paused.status_code == 200 and paused.json()["status"] == "paused"


def test_ui__which_hosts_warn() -> None:
    # Only loopback is quiet; anything else prints the warning line before serving (not
    # started here: a test listens on loopback only).
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.1")
    assert not is_loopback("example.org")


def test_ui__a_missing_or_foreign_database_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "new.db"
    port = str(free_port())
    with flowloop_ui("--db", str(missing), "--port", port, cwd=tmp_path) as (process, _):
        assert process.wait(timeout=60) == 2
        assert process.stdout is not None
        output = process.stdout.read()
    assert output.startswith("error: ") and "no database" in output and "Traceback" not in output
    assert not missing.exists()  # a dashboard creates nothing
    foreign = tmp_path / "foreign.db"
    foreign.write_text("not sqlite")
    with flowloop_ui("--db", str(foreign), "--port", port, cwd=tmp_path) as (process, _):
        assert process.wait(timeout=60) != 0
        assert process.stdout is not None
        output = process.stdout.read()
    assert output.startswith("error: ") and "Traceback" not in output


def _get(url: str) -> httpx.Response | None:
    try:
        response = httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None
    return response if response.status_code == 200 else None


def test_ui__a_port_in_use_is_one_line_exit_2(sqlite_url: str, tmp_path: Path) -> None:
    parcels(sqlite_url, 1)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        with flowloop_ui("--db", sqlite_url, "--port", port, cwd=tmp_path) as (process, _):
            assert process.wait(timeout=60) == 2
            assert process.stdout is not None
            output = process.stdout.read()
    assert output.startswith("error: cannot listen on 127.0.0.1:") and "--port" in output
    assert "Traceback" not in output and "http://" not in output  # no URL that never served


def test_ui__port_0_prints_the_port_it_got(sqlite_url: str, tmp_path: Path) -> None:
    parcels(sqlite_url, 1)
    with flowloop_ui("--db", sqlite_url, "--port", "0", cwd=tmp_path) as (process, lines):
        line = read_until(process, lines, "http://")
        port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        assert port > 0
        runs = poll(
            lambda: _get(f"http://127.0.0.1:{port}/api/runs"), timeout=20, every=0.05, what="ui"
        )
        assert len(runs.json()["runs"]) == 1


def test_ui__another_host_header_is_refused(sqlite_url: str, tmp_path: Path) -> None:
    # DNS rebinding: a page on attacker.example whose name now resolves to 127.0.0.1 sends
    # Host: attacker.example; reads need no token, so the dashboard must refuse the host.
    parcels(sqlite_url, 1)
    port = free_port()
    with flowloop_ui("--db", sqlite_url, "--port", str(port), cwd=tmp_path) as (process, lines):
        read_until(process, lines, "http://")
        base = f"http://127.0.0.1:{port}"
        poll(lambda: _get(base + "/api/runs"), timeout=20, every=0.05, what="the dashboard")
        foreign = httpx.get(base + "/api/runs", headers={"Host": f"attacker.example:{port}"})
        assert foreign.status_code == 400 and "order" not in foreign.text
        assert httpx.get(base + "/api/runs", headers={"Host": f"localhost:{port}"}).is_success


def test_ui__ctrl_c_stops_it_with_one_line_exit_0(sqlite_url: str, tmp_path: Path) -> None:
    # "(Ctrl-C stops it)": uvicorn re-raised the SIGINT it had caught, and the CLI's
    # catch-all said "interrupted before anything was started; nothing to continue", exit
    # 130, as if a run had been cut off.
    parcels(sqlite_url, 1)
    port = free_port()
    with flowloop_ui("--db", sqlite_url, "--port", str(port), cwd=tmp_path) as (process, lines):
        read_until(process, lines, "http://")
        poll(lambda: _get(f"http://127.0.0.1:{port}/api/runs"), timeout=20, every=0.05, what="ui")
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert process.stdout is not None
        rest = process.stdout.read()
    assert rest.strip() == "dashboard stopped", rest


def test_ui__sigterm_stops_it_as_ctrl_c_does(sqlite_url: str, tmp_path: Path) -> None:
    # A service manager stops it with SIGTERM: uvicorn shut down, then raised the SIGTERM
    # again with Python's default handler, and the process died of it (exit 143 in a shell,
    # "failed" to systemd), nothing said.
    parcels(sqlite_url, 1)
    port = free_port()
    with flowloop_ui("--db", sqlite_url, "--port", str(port), cwd=tmp_path) as (process, lines):
        read_until(process, lines, "http://")
        poll(lambda: _get(f"http://127.0.0.1:{port}/api/runs"), timeout=20, every=0.05, what="ui")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert process.stdout is not None
        rest = process.stdout.read()
    assert rest.strip() == "dashboard stopped", rest
