"""What every command module shares: the consoles, the common options, the settings and
opening the engine.

Light on purpose: click and the standard library at module level, everything else
(SQLAlchemy, pydantic-settings, the engine, rich) imported when a command runs, so
`flowloop --help` stays fast (issue 13, cold start)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

import click

from flowloop.errors import EXIT_FAILURE, FlowloopError, MissingExtra, UnknownWorkflow

if TYPE_CHECKING:
    from rich.console import Console

    from flowloop.config import Settings
    from flowloop.engine import Engine
    from flowloop.loader import Loaded
    from flowloop.reading import Reader

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_WORKFLOWS: Final = "workflows"
GLOBAL_FLAGS: Final = "flowloop.flags"
CONFIG_PATH: Final = "flowloop.config"
TRACE: Final = "flowloop.trace"
NOTHING_TO_READ: Final = "flowloop.nothing to read"
"""``ctx.meta``: the group found no configuration file and no setting variable."""
SYNCHRONOUS_MODES: Final = ("OFF", "NORMAL", "FULL", "EXTRA")
"""flowloop.store.dialect.SYNCHRONOUS_MODES, spelled here so the options need no SQLAlchemy
(tests/unit/test_cli_support.py keeps the two equal)."""

# Wide enough for run ids when piped (rich falls back to 80 columns without a terminal),
# unless $COLUMNS says how wide.
WIDE = sys.stdout.isatty() or bool(os.environ.get("COLUMNS"))


class _LazyConsole:
    """A rich Console made on first use: importing the commands does not import rich."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Console | None = None

    def made(self) -> Console:
        """The Console itself: for rich's own objects (a Progress enters its console as a
        context manager, which a proxy cannot forward)."""
        if self._console is None:
            from rich.console import Console

            console = self._console = Console(**self._options)
            console.on_broken_pipe = lambda: _quieted(console)  # type: ignore[method-assign]
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.made(), name)


def _quieted(console: Console) -> None:
    """A reader gone (`flowloop run … | head`): later output goes nowhere and the command
    goes on. rich's default exited at once (1, silently) — from a progress line, in the
    middle of `run`, its step cut off and the run left `running` until its lease ran out."""
    console.quiet = True
    _nowhere(console.file)


class _PipeGuard:
    """``sys.stdout``/``sys.stderr`` of the ``flowloop`` program: a reader gone (`flowloop
    run … | head`, `2>&1 | head`) sends later output nowhere, whoever writes it — a step's
    own ``print`` (it failed with BrokenPipeError, and was retried), click's JSON, a log
    line (the interpreter's last flush of stderr failed: exit 120) — and the command goes
    on to its end, its exit code its own."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._buffer: _PipeGuard | None = None

    def write(self, text: Any) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            _nowhere(self._stream)
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    @property
    def buffer(self) -> _PipeGuard:
        """The binary stream under it, guarded alike (``sys.stdout.buffer.write(…)``: a
        step's, `flowloop diagram`'s)."""
        if self._buffer is None:
            self._buffer = _PipeGuard(self._stream.buffer)
        return self._buffer

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            _nowhere(self._stream)
            self._stream.flush()  # (what was buffered goes to /dev/null now)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _nowhere(stream: Any) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, stream.fileno())
    os.close(devnull)


def guard_pipes() -> None:
    """Wrap this process's ``sys.stdout`` and ``sys.stderr`` in :class:`_PipeGuard` (the
    ``flowloop`` program only: a caller's own process is left as it is)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _PipeGuard):
            setattr(sys, name, _PipeGuard(stream))


def real_console(console: Console) -> Console:
    """The rich Console behind :data:`out` or :data:`err`."""
    lazy: Any = console
    return lazy.made() if isinstance(lazy, _LazyConsole) else console


# No emoji codes: rich turned ":label:" in a stored key or context into 🏷 (`run:label:1`
# printed as `run🏷1` — a charge's idempotency key copied wrong from `status`).
out = cast(
    "Console",
    _LazyConsole(highlight=False, soft_wrap=True, emoji=False, width=None if WIDE else 200),
)
err = cast("Console", _LazyConsole(stderr=True, highlight=False, soft_wrap=True, emoji=False))


class _NoArgsIsHelp(click.UsageError):
    """click 8.2's ``NoArgsIsHelpError``, for click 8.1 (pyproject allows it)."""

    def __init__(self, ctx: click.Context) -> None:
        super().__init__(ctx.get_help(), ctx=ctx)

    def show(self, file: Any = None) -> None:
        color = self.ctx.color if self.ctx is not None else None
        click.echo(self.format_message(), file=file, err=True, color=color)


NO_ARGS_IS_HELP: Final[type[click.UsageError]] = getattr(
    click.exceptions, "NoArgsIsHelpError", _NoArgsIsHelp
)
"""What a group given no command raises: its help on stderr, exit 2 (a usage mistake)."""


class HelpGroup(click.Group):
    """A group that, given no command, shows its help and exits 2 under every click the
    project allows: click 8.1 printed it on stdout and exited 0 (`flowloop db`, `flowloop`
    in a script looked as if they had done something), 8.2 and later exit 2."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args and self.no_args_is_help and not ctx.resilient_parsing:
            raise cast("type[_NoArgsIsHelp]", NO_ARGS_IS_HELP)(ctx)  # (both take the context)
        return super().parse_args(ctx, args)


class Failed(FlowloopError):
    """A command ran but what it checked or drove did not succeed."""

    exit_code = EXIT_FAILURE


def db_option(fn: F) -> F:
    fn = click.option(
        "--synchronous",
        type=click.Choice(SYNCHRONOUS_MODES, case_sensitive=False),
        default="NORMAL",
        show_default=True,
        help="SQLite durability: NORMAL survives crashes, FULL also power loss.",
    )(fn)
    return click.option(
        "--db",
        envvar="FLOWLOOP_DB",
        default=None,
        help="Database URL or SQLite file [env FLOWLOOP_DB, else db in flowloop.toml; "
        "default ./flowloop.db].",
    )(fn)


def workflows_option(fn: F) -> F:
    return click.option(
        "-w",
        "--workflows",
        "workflow_paths",
        multiple=True,
        help="Files or directories that define the workflows [default: ./workflows].",
    )(fn)


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")(fn)


def trace(engine: Engine) -> None:
    try:
        from flowloop import tracing  # lazy: OpenTelemetry only when asked for
    except ImportError as error:
        raise MissingExtra("--trace needs OpenTelemetry", error.name, "otel") from None
    tracing.instrument_from_env(engine)


def settings() -> Settings:
    """The settings the ``flowloop`` group loaded (file < FLOWLOOP_* < global flags), loaded
    here on first use when the group found nothing to read."""
    from flowloop.config import Settings, load_settings

    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return load_settings()
    found = ctx.find_object(Settings)
    if found is None:
        found = load_settings(ctx.meta.get(GLOBAL_FLAGS), config_file=ctx.meta.get(CONFIG_PATH))
        ctx.find_root().obj = found
    return found


def command_settings(**flags: Any) -> Settings:
    """The settings again, with this command's own flags on top (validated the same way)."""
    from flowloop.config import load_settings

    ctx = click.get_current_context()
    given = dict(ctx.meta.get(GLOBAL_FLAGS, {}))
    return load_settings({**given, **flags}, config_file=ctx.meta.get(CONFIG_PATH))


def database(db: str | None) -> str:
    """--db (or $FLOWLOOP_DB), else ``db`` in the configuration file, else ./flowloop.db;
    a PostgreSQL URL's query settings checked (flowloop/cli/dburl.py)."""
    from flowloop.cli.dburl import check_url_settings
    from flowloop.store.urls import default_url

    ctx = click.get_current_context(silent=True)
    if db:
        url = db
    elif ctx is not None and ctx.meta.get(NOTHING_TO_READ):
        url = default_url()  # no file, no variable: the settings' db is None
    else:
        url = settings().db or default_url()
    check_url_settings(url)  # (a misspelt ?setting: exit 2, before anything connects)
    return url


def open_engine(
    db: str | None,
    synchronous: str = "NORMAL",
    loaded: Loaded | None = None,
    *,
    read: bool = False,
    saves: bool = True,
) -> Engine:
    """The engine on --db; ``read``: for a command that reads or changes what the database
    holds already (not run, start, worker, db upgrade), so a database that does not exist
    is refused (exit 2), not created. ``saves=False``: the loaded definitions are not
    stored (a command that only reads: nothing written)."""
    from flowloop.cli import support
    from flowloop.engine import Engine

    url = database(db)
    store = support.read_store(url, synchronous) if read else None
    return prepared(Engine(url, synchronous=synchronous, store=store), loaded, saves=saves)


OPENED: Final[list[str]] = []
"""The databases this process opened an engine on (every command that may write does so
through :func:`prepared`): none when a Ctrl-C comes, and nothing was started."""


def prepared(engine: Engine, loaded: Loaded | None, *, saves: bool = True) -> Engine:
    """``engine`` traced when ``--trace`` asks for it, with every version of ``loaded``
    registered: a run stays on the version it started with (issue 16) — the worker and
    ``resume`` registered the newest only, and parked runs ``check`` had passed."""
    OPENED.append(engine.url)
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.meta.get(TRACE):
        trace(engine)
    if loaded is not None:
        engine.register(*loaded.all_versions(), save=saves)
    return engine


def open_reader(db: str | None, synchronous: str = "NORMAL") -> Reader | Engine:
    """The runs on --db, for a command that only reads them (status, history, replay): the
    database must exist (exit 2 otherwise, nothing created), and neither the engine's
    executor nor pydantic is loaded — nor SQLAlchemy for a SQLite file at the current
    schema (issue 13, cold start) — unless --trace asks for the engine's tracing, which is
    set up (and its configuration checked) as before."""
    from flowloop.reading import Reader
    from flowloop.store.urls import plain_sqlite_file

    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.meta.get(TRACE):
        return open_engine(db, synchronous, read=True)
    url = database(db)
    path = plain_sqlite_file(url)
    if path is not None:
        # A SQLite file at the current schema is read through the stdlib driver: no
        # SQLAlchemy to import. Anything else (or a file that is not such a database) is
        # opened as before, and the store says what is wrong with it.
        from flowloop.store.lite import LiteStore

        lite = LiteStore.open(path)
        if lite is not None:
            return Reader(lite)
    from flowloop.cli import support

    return Reader(support.read_store(url, synchronous, reads_only=True))


def load_workflow_paths(paths: Sequence[str]) -> Loaded:
    """The workflows and loops in ``paths``, with the configuration's overrides applied."""
    from flowloop.config import apply_overrides
    from flowloop.loader import Loaded, load_paths

    if paths:
        loaded = load_paths(paths)
    elif Path(DEFAULT_WORKFLOWS).is_dir():
        loaded = load_paths([DEFAULT_WORKFLOWS])
    else:
        return Loaded()
    loaded.loops = apply_overrides(settings(), loaded.workflows, loaded.loops)
    return loaded


def looked_in(paths: Sequence[str]) -> str:
    """Where a command looked for definitions (:func:`load_workflow_paths`), said for a
    name none of them defines: ``not defined in …``, or that there was nowhere to look."""
    if paths:
        return f"not defined in {', '.join(paths)}"
    if Path(DEFAULT_WORKFLOWS).is_dir():
        return f"not defined in ./{DEFAULT_WORKFLOWS}"
    return f"no -w given and no ./{DEFAULT_WORKFLOWS} here"


@contextmanager
def defined_in(paths: Sequence[str]) -> Iterator[None]:
    """An unknown workflow (a run's, named by a command) said with where the command
    looked for its definition and what to pass: the usual cause is a workflow file
    outside ./workflows, given to `run` but not to the command that follows."""
    try:
        yield
    except UnknownWorkflow as error:
        where = looked_in(paths)
        raise FlowloopError(f"{error}: {where}; pass -w FILE_OR_DIR that defines it") from error


def seconds_option(value: str, option: str, *, unit: bool = False) -> float:
    """``value`` of ``option`` as seconds; ``unit``: a bare number is refused (a window
    of history: `prune --older-than 30` read as 30 seconds deleted every finished run)."""
    from flowloop.config import parse_duration

    if unit and value.strip().replace(".", "", 1).isdigit():
        raise FlowloopError(
            f"{option} {value}: give a unit — {value}s, {value}m, {value}h or {value}d"
        )
    try:
        return parse_duration(value)
    except ValueError as error:
        if unit and "use seconds" in str(error):  # (it would suggest the number refused)
            raise FlowloopError(f"{option} {value!r} is not a duration (30m, 12h, 30d)") from None
        raise FlowloopError(f"{option} {error}") from None


def sql_engine(engine: Engine) -> Any:
    """The SQLAlchemy engine under ``engine`` (stats and prune are SQL)."""
    from flowloop.store.sql import SQLStore

    if not isinstance(engine.store, SQLStore):
        raise FlowloopError("this command needs the SQL store")
    return engine.store.engine


def parse_context(text: str | None, option: str = "--context") -> Any:
    if text is None:
        return {}
    source = option
    if text.startswith("@"):
        if not text[1:]:  # (Path("") is the current directory: it said "a directory")
            raise FlowloopError(f"{option} @: no file given after @; give @FILE.json")
        path = Path(text[1:])
        if path.is_dir():  # (it said "no such file" of a folder that is there)
            raise FlowloopError(f"{option} {text}: a directory, not a file; give @FILE.json")
        if not path.is_file():
            raise FlowloopError(f"{option} {text}: no such file")
        try:
            source, text = str(path), path.read_text()
        except OSError as error:
            raise FlowloopError(f"{option} {text}: cannot read it ({error.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise FlowloopError(f"{source} is not valid JSON: {error}") from None


def parse_assignments(pairs: Sequence[str]) -> dict[str, Any]:
    """``field=value`` pairs; a value that parses as JSON is taken as JSON, else as text."""
    values: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name:
            raise FlowloopError(f"--set {pair!r}: expected FIELD=VALUE")
        try:
            values[name] = json.loads(raw)
        except json.JSONDecodeError:
            values[name] = raw
    return values
