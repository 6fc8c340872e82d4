"""The ``flowloop`` command. A FlowloopError becomes one line on stderr and an exit code
(2: bad input, 1: a failure); only a bug shows a traceback.

One module per command group: :mod:`~flowloop.cli.runs` (run, start, resume, retry, send),
:mod:`~flowloop.cli.runs_view` (status, history, replay), :mod:`~flowloop.cli.operators`
(pause, unpause, stop, worker, check, migrate), :mod:`~flowloop.cli.loops` (loops,
trigger, backfill), :mod:`~flowloop.cli.diagrams` (diagram), :mod:`~flowloop.cli.database`
(db, stats, prune) and :mod:`~flowloop.cli.ui` (ui); what they share is in
:mod:`~flowloop.cli.common`, :mod:`~flowloop.cli.support` and :mod:`~flowloop.cli.views`.
The command modules import click and the standard library only; the engine, SQLAlchemy
and rich load when a command runs, so ``flowloop --help`` starts fast.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import re
import sys
from collections.abc import Sequence
from typing import Any, Final

import click

from flowloop.cli.common import (
    CONFIG_PATH,
    GLOBAL_FLAGS,
    NO_ARGS_IS_HELP,
    NOTHING_TO_READ,
    TRACE,
    HelpGroup,
    err,
    guard_pipes,
)
from flowloop.errors import FlowloopError
from flowloop.logs import FORMATS, LEVELS

BRIEF: Final = frozenset({"status", "history", "replay"})
"""Commands that read and end. Run as the program (``flowloop status``, not ``main([...])``
or click's runner inside another process), they do without the cyclic garbage collector:
its passes over the ~100,000 objects that loading SQLAlchemy, pydantic and rich makes are
~8% of their time, and they leave ~1,600 objects in cycles a run, as many for 500 runs
listed as for one (issue 13)."""
AS_PROGRAM: Final = "flowloop, run as the program"
"""The group's ``ctx.obj`` (until it becomes the settings) when :func:`main` takes its
arguments from the command line."""


COMMANDS: Final = {
    "run": "flowloop.cli.runs:run",
    "start": "flowloop.cli.runs:start",
    "resume": "flowloop.cli.runs:resume",
    "retry": "flowloop.cli.runs:retry",
    "send": "flowloop.cli.runs:send",
    "status": "flowloop.cli.runs_view:status",
    "history": "flowloop.cli.runs_view:history",
    "replay": "flowloop.cli.runs_view:replay",
    "pause": "flowloop.cli.operators:pause",
    "unpause": "flowloop.cli.operators:unpause",
    "stop": "flowloop.cli.operators:stop",
    "worker": "flowloop.cli.operators:worker",
    "check": "flowloop.cli.operators:check",
    "migrate": "flowloop.cli.operators:migrate",
    "loops": "flowloop.cli.loops:loops_command",
    "trigger": "flowloop.cli.loops:trigger_command",
    "backfill": "flowloop.cli.loops:backfill_command",
    "diagram": "flowloop.cli.diagrams:diagram",
    "db": "flowloop.cli.database:db",
    "stats": "flowloop.cli.database:stats_command",
    "prune": "flowloop.cli.database:prune_command",
    "ui": "flowloop.cli.ui:ui_command",
}
"""Each command and where it is defined (``module:attribute``): a command's module is
imported when the command runs or help lists it, so ``flowloop status`` loads only the
module of ``status`` (issue 13, cold start; click's lazily loaded subcommands)."""


class LazyGroup(HelpGroup):
    """A group whose commands (:data:`COMMANDS`) are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            module, _, attribute = COMMANDS[cmd_name].partition(":")
            command = getattr(importlib.import_module(module), attribute)
            self.add_command(command, cmd_name)
        return super().get_command(ctx, cmd_name)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="flowloop", prog_name="flowloop")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Configuration file [env FLOWLOOP_CONFIG; default ./flowloop.toml, "
    "else [tool.flowloop] in ./pyproject.toml].",
)
@click.option(
    "--log-format",
    type=click.Choice(FORMATS),
    default=None,
    help="Log lines as text or JSON objects, one per line [default: text].",
)
@click.option(
    "--log-level",
    type=click.Choice(LEVELS, case_sensitive=False),
    default=None,
    help="[default: info for worker, warning otherwise]",
)
@click.option(
    "--trace",
    is_flag=True,
    help="Trace runs with OpenTelemetry (needs flowloop[otel]; exporter from "
    "OTEL_TRACES_EXPORTER: console (stderr, default), otlp or none).",
)
@click.pass_context
def cli(
    ctx: click.Context,
    config_path: str | None,
    log_format: str | None,
    log_level: str | None,
    trace: bool,
) -> None:
    """flowloop: explicit state-machine workflows, journaled step by step.

    Settings come from flowloop.toml (or [tool.flowloop] in pyproject.toml), then
    FLOWLOOP_* environment variables, then flags; later ones win."""
    if ctx.obj is AS_PROGRAM and ctx.invoked_subcommand in BRIEF:
        gc.disable()
    from flowloop.configfile import misspelt_variables, nothing_to_read
    from flowloop.logs import setup_logging

    for variable, meant in misspelt_variables():
        err.print(
            f"warning: ${variable} is no flowloop setting (did you mean ${meant}?)", markup=False
        )

    flags = {"log_format": log_format, "log_level": log_level}
    ctx.meta[GLOBAL_FLAGS] = flags
    ctx.meta[CONFIG_PATH] = config_path
    ctx.meta[TRACE] = trace
    default_level = "info" if ctx.invoked_subcommand == "worker" else "warning"
    ctx.meta[NOTHING_TO_READ] = nothing_to_read(config_path)
    if ctx.meta[NOTHING_TO_READ]:
        # The settings are their defaults and these flags (click checked them): loading
        # pydantic-settings waits until a command asks (common.settings), which `status`,
        # `history` and `replay` never do (issue 13, cold start).
        setup_logging("json" if log_format == "json" else "text", log_level or default_level)
        return
    from flowloop.config import load_settings

    ctx.obj = config = load_settings(flags, config_file=config_path)
    setup_logging(config.log_format, config.log_level or default_level)


def main(argv: Sequence[str] | None = None) -> None:
    # At exit, the interpreter's last collections walk every object the command's imports
    # made (SQLAlchemy, pydantic, rich: some 100,000) only for the process to end: ~60 ms
    # of `flowloop status` (issue 13). Frozen at exit, they are skipped; every atexit
    # handler (logging's, a tracer's flush) still runs, and nothing else changes: the
    # commands close their stores themselves.
    if argv is None:  # run as the program: a caller's own process is left as it is
        atexit.unregister(gc.freeze)
        atexit.register(gc.freeze)
        guard_pipes()
    try:
        cli.main(
            args=list(argv) if argv is not None else None,
            standalone_mode=False,
            obj=AS_PROGRAM if argv is None else None,
        )
    except FlowloopError as error:
        err.print(f"error: {error}", markup=False)
        sys.exit(error.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        err.print(_interrupted(), markup=False)
        sys.exit(130)
    except click.UsageError as error:
        if isinstance(error, NO_ARGS_IS_HELP):
            error.show()  # (`flowloop db`: the group's help)
        else:  # one line, as every other mistake (click printed usage, a hint, the error)
            err.print(f"error: {_usage_line(error)}", markup=False)
        sys.exit(error.exit_code)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except Exception as error:
        # The last line of defence: storage and encoding errors that no command turned
        # into a FlowloopError still get one line, never a traceback.
        from flowloop.lastresort import last_resort

        line, code = last_resort(error)
        if line is None:
            raise
        err.print(f"error: {line}", markup=False)
        sys.exit(code)


# Click 8.2's (pyproject allows 8.1, which has none: an unknown command is a plain
# UsageError there, "No such command 'x'.", read by _unknown_command).
_NO_SUCH_COMMAND: Final[Any] = getattr(click.exceptions, "NoSuchCommand", None)
_NO_SUCH_COMMAND_81: Final = re.compile(r"No such command (?P<name>'[^']*'|\"[^\"]*\")\.")


def _unknown_command(error: click.UsageError) -> str | None:
    """The command ``error`` says there is none of, under click 8.2+ or 8.1."""
    if _NO_SUCH_COMMAND and isinstance(error, _NO_SUCH_COMMAND):
        return str(error.command_name)
    found = _NO_SUCH_COMMAND_81.fullmatch(error.message)
    return found["name"][1:-1] if found else None


def _usage_line(error: click.UsageError) -> str:
    """A usage mistake in one line, with where to look: `missing argument 'RUN_ID' (see
    `flowloop history --help`)`; a misspelt command names the ones meant."""
    from flowloop.suggest import did_you_mean

    ctx = error.ctx
    path = ctx.command_path if ctx is not None else "flowloop"
    unknown = _unknown_command(error)
    if unknown is not None:
        group = ctx.command if ctx is not None else None
        names = group.list_commands(ctx) if isinstance(group, click.Group) and ctx else []
        meant = did_you_mean(unknown, names)
        meant = f"; {meant}" if meant else ""
        return f"no such command {unknown!r}{meant} (`{path} --help` lists them)"
    text = " ".join(error.format_message().split()).replace(". Did you mean", "; did you mean")
    text = text[:1].lower() + text[1:].removesuffix(".")
    return f"{text} (see `{path} --help`)"


def _interrupted() -> str:
    """What a Ctrl-C that no command handled says: while it started up (loading a workflow
    file, say), nothing was started — it named `flowloop resume` as if runs had been."""
    from flowloop.cli.common import OPENED

    if not OPENED:
        return "interrupted before anything was started; nothing to continue"
    return "interrupted; the journal holds every committed step (`flowloop resume`)"


__all__ = ["cli", "main"]
