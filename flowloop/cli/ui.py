"""``flowloop ui``: serve the dashboard. This module imports only click; starlette and
uvicorn load when the command runs, so ``flowloop --help`` never imports them."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Final

import click

if TYPE_CHECKING:
    import socket

LOOPBACK: Final = "127.0.0.1"
DEFAULT_PORT: Final = 8050


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.command(name="ui")
@click.option("--db", envvar="FLOWLOOP_DB", default=None, help="Database URL or SQLite file.")
@click.option(
    "-w",
    "--workflows",
    "workflow_paths",
    multiple=True,
    help="Files or directories that define the workflows [default: ./workflows]; a workflow "
    "not given is drawn from the definition stored in the database.",
)
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--host",
    default=LOOPBACK,
    show_default=True,
    help="Address to listen on; anything but loopback exposes the dashboard to the network.",
)
@click.option(
    "--allow-actions",
    is_flag=True,
    help="Enable pause, unpause, stop, retry and send (retry and send need the run's workflow "
    "given with -w; each needs the token: $FLOWLOOP_UI_TOKEN, else ui_token in flowloop.toml, "
    "else a new one printed at start-up).",
)
@click.option("--token", envvar="FLOWLOOP_UI_TOKEN", default=None, hidden=True)
def ui_command(
    db: str | None,
    workflow_paths: tuple[str, ...],
    port: int,
    host: str,
    allow_actions: bool,
    token: str | None,
) -> None:
    """Serve the web dashboard: runs, live run diagrams, workflows, loops, workers.

    Read-only unless --allow-actions; listens on 127.0.0.1 unless --host is given."""
    from flowloop.cli.common import (
        database,
        err,
        load_workflow_paths,
        looked_in,
        out,
        settings,
    )
    from flowloop.cli.support import require_database
    from flowloop.errors import MissingExtra

    try:
        import uvicorn

        from flowloop.ui.app import create_app
    except ModuleNotFoundError as error:
        raise MissingExtra("the dashboard needs its extra", error.name, "ui") from error
    from flowloop.store.sql import SQLStore

    loaded = load_workflow_paths(workflow_paths)
    url = database(db)
    require_database(url)
    # Opened without creating anything: a dashboard never writes a schema.
    store = SQLStore(url, create=False)
    sock = _bind(host, port)
    app = create_app(
        store,
        workflows=loaded.workflows,
        loops=loaded.loops,
        allow_actions=allow_actions,
        # $FLOWLOOP_UI_TOKEN (the option's envvar) wins over the configuration file.
        token=token or settings().ui_token,
        allowed_hosts=_allowed_hosts(host),
    )
    if allow_actions and not loaded.workflows:
        # Pause, unpause and stop need no definition; retry and send do (refused per run).
        where = looked_in(workflow_paths).replace("not defined in", "none defined in")
        err.print(
            f"warning: no workflow loaded ({where}): retry and send will be refused; "
            "pass -w FILE_OR_DIR that defines the runs' workflows",
            markup=False,
        )
    if not is_loopback(host):
        err.print(
            f"warning: listening on {host}: anyone who can reach this address can read every "
            "run and its context",
            markup=False,
        )
    bound_port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    out.print(f"flowloop dashboard on http://{shown}:{bound_port}/ (Ctrl-C stops it)", markup=False)
    if allow_actions:
        # A token given is a secret someone keeps: not written to a log of this output.
        given = "$FLOWLOOP_UI_TOKEN or --token" if token else "ui_token in flowloop.toml"
        shown_token = app.state.dash.token if not (token or settings().ui_token) else None
        out.print(
            f"actions enabled; token: {shown_token or f'the one in {given} (not shown)'}",
            markup=False,
        )
    try:
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        try:
            with _terminated_as_stopped():
                server.run(sockets=[sock])
        except (KeyboardInterrupt, _Terminated):
            # uvicorn shuts down on Ctrl-C or SIGTERM, then raises the signal again: the
            # way to stop a dashboard, not a run cut off (the CLI said "interrupted …",
            # exit 130; a SIGTERM killed the process, exit 143 to a service manager).
            err.print("dashboard stopped", markup=False)
    finally:
        sock.close()
        store.close()


class _Terminated(Exception):
    """A SIGTERM, the way a service manager stops the dashboard."""


@contextmanager
def _terminated_as_stopped() -> Iterator[None]:
    """SIGTERM raised as :class:`_Terminated` while the server runs (uvicorn puts back
    this handler when it has shut down, then raises the signal it caught again)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # (signals reach the main thread only: a caller's thread is left as it is)
        return

    def terminated(_signum: int, _frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything is printed: a port in use or a host
    that does not resolve is one line (exit 2), and ``--port 0`` shows the port it got."""
    import socket

    from flowloop.errors import FlowloopError

    try:
        return socket.create_server((host, port), family=_family(host))
    except OSError as error:
        raise FlowloopError(
            f"cannot listen on {host}:{port}: {error.strerror or error}; choose another "
            "--port (or --host)"
        ) from error


def _family(host: str) -> socket.AddressFamily:
    import socket

    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _allowed_hosts(host: str) -> list[str]:
    """Host headers to answer: the loopback names, plus the one given with --host; every
    name when bound to all interfaces (the warning above says what that means)."""
    from flowloop.ui.app import LOOPBACK_HOSTS

    if host in ("0.0.0.0", "::", ""):
        return ["*"]
    return [*LOOPBACK_HOSTS, host]
