"""Cold start (issue 13): `flowloop --help` and `import flowloop` load no engine, database or
settings library, and the commands that only read a database at the current schema
(`status`, `history`) load no Alembic, Mako or prometheus_client. Checked deterministically
on ``sys.modules`` in a fresh interpreter, not by timing: each module named here was
imported eagerly before and is loaded lazily now. The constants spelled twice so that this
holds are checked against their sources here too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from storekit import new_run

from flowloop.errors import SchemaMismatch
from flowloop.store import SQLStore, migrate

# Each was imported by `import flowloop.cli` before the CLI became a package of lazy commands.
LAZY = (
    "sqlalchemy",
    "alembic",
    "mako",
    "pygments",
    "pydantic",
    "pydantic_settings",
    "transitions",
    "rich",
    "asyncio",
    "flowloop.engine",
    "flowloop.config",
    "flowloop.store",
)


# Loaded only to change the schema, explain a mismatch, or serve metrics and alerts.
NOT_FOR_READING = ("alembic", "mako", "prometheus_client", "flowloop.alerts", "flowloop.metrics")


def loaded_after(code: str, cwd: Path, lazy: tuple[str, ...] = LAZY) -> list[str]:
    """The modules of ``lazy`` (or under them) that ``code`` left in ``sys.modules``."""
    probe = (
        f"{code}\n"
        "import json, sys\n"
        f"lazy = {lazy!r}\n"
        "print(json.dumps(sorted({m for m in lazy for name in sys.modules "
        "if name == m or name.startswith(m + '.')})))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    found: list[str] = json.loads(result.stdout.splitlines()[-1])
    return found


def test_cold_start__importing_the_cli_loads_no_engine_or_database(tmp_path: Path) -> None:
    assert loaded_after("import flowloop.cli", tmp_path) == []


def test_cold_start__help_loads_no_engine_or_database(tmp_path: Path) -> None:
    code = (
        "import contextlib, io\n"
        "from flowloop.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as shown:\n"
        "    main(['--help'])\n"
        "assert 'Commands:' in shown.getvalue(), shown.getvalue()\n"
    )
    assert loaded_after(code, tmp_path) == []


def test_cold_start__public_names_load_when_first_used(tmp_path: Path) -> None:
    assert loaded_after("import flowloop", tmp_path) == []
    # `from flowloop import Engine` still works, and loads the engine then.
    code = "from flowloop import Engine, Workflow\nassert Engine.__module__ == 'flowloop.engine'\n"
    assert "flowloop.engine" in loaded_after(code, tmp_path)


# -- commands that read a database -----------------------------------------------------------


@pytest.fixture
def database(tmp_path: Path) -> tuple[str, str]:
    """A SQLite file at the current schema with one run: (its URL, the run's id)."""
    url = f"sqlite:///{tmp_path / 'flowloop.db'}"
    store = SQLStore(url)
    try:
        stored, _ = store.create_run(new_run(key="k-1"))
    finally:
        store.close()
    return url, stored.id


def command(*args: str) -> str:
    """Code that runs ``flowloop ARGS`` in-process, asserting exit 0 and ``shows`` in its
    output (set by the caller)."""
    return (
        "import contextlib, io\n"
        "from flowloop.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as shown:\n"
        f"    main({list(args)!r})\n"
        "assert shows in shown.getvalue(), shown.getvalue()\n"
    )


def test_cold_start__reading_commands_load_no_alembic(
    database: tuple[str, str], tmp_path: Path
) -> None:
    url, run_id = database
    for shows, args in (
        (run_id[:8], ("status", "--db", url)),
        (run_id, ("status", "--db", url, "--json")),
        (run_id, ("status", run_id, "--db", url)),
        ("run_created", ("history", run_id, "--db", url)),
    ):
        code = f"shows = {shows!r}\n" + command(*args)
        assert loaded_after(code, tmp_path, NOT_FOR_READING) == [], args
    # Upgrading still goes through Alembic, which finds the database current.
    code = "shows = 'schema already at revision'\n" + command("db", "upgrade", "--db", url)
    assert "alembic" in loaded_after(code, tmp_path, NOT_FOR_READING)


# Loaded only to drive runs or validate contexts: `status`, `history` and `replay` read
# through flowloop.reading.Reader on the store alone (a context stays the stored JSON).
NOT_FOR_READING_RUNS = ("flowloop.engine", "flowloop.executor", "flowloop.definition", "pydantic")


def test_cold_start__reading_commands_load_no_engine_or_pydantic(
    database: tuple[str, str], tmp_path: Path
) -> None:
    url, run_id = database
    for shows, args in (
        (run_id[:8], ("status", "--db", url)),
        (run_id, ("status", "--db", url, "--json", "--status", "scheduled")),
        ("scheduled", ("status", run_id, "--db", url)),
        ("run_created", ("history", run_id, "--db", url)),
        ("equals the stored row", ("replay", run_id, "--db", url)),
    ):
        code = NO_SETTING_VARIABLES + f"shows = {shows!r}\n" + command(*args)
        assert loaded_after(code, tmp_path, NOT_FOR_READING_RUNS) == [], args


# A plain SQLite file at the current schema is read through the stdlib driver
# (flowloop/store/lite.py): SQLAlchemy's import alone cost these commands half their time.
NO_SQLALCHEMY = ("sqlalchemy", "flowloop.store.sql", "flowloop.store.schema", "asyncio")


def test_cold_start__reading_commands_on_a_sqlite_file_load_no_sqlalchemy(
    database: tuple[str, str], tmp_path: Path
) -> None:
    url, run_id = database
    path = url.removeprefix("sqlite:///")
    for shows, args in (
        (run_id[:8], ("status", "--db", url)),
        (run_id[:8], ("status", "--db", path)),
        (run_id, ("status", "--db", url, "--json", "--status", "scheduled")),
        ("scheduled", ("status", run_id[:6], "--db", url)),
        ("run_created", ("history", run_id, "--db", url)),
        ("equals the stored row", ("replay", run_id, "--db", url)),
    ):
        code = NO_SETTING_VARIABLES + f"shows = {shows!r}\n" + command(*args)
        assert loaded_after(code, tmp_path, NO_SQLALCHEMY) == [], args


def test_cold_start__other_databases_are_read_through_sqlalchemy_as_before(
    database: tuple[str, str], tmp_path: Path
) -> None:
    """A URL with options, or a file not at the current schema, is opened by SQLStore (which
    says what is wrong with it): the stdlib reader only takes what it reads the same."""
    url, run_id = database
    code = f"shows = {run_id[:8]!r}\n" + command("status", "--db", f"{url}?timeout=5")
    # ... through a store that builds no write statements (a Reader's is for reads only)
    code += "from flowloop.store import sql\nassert sql._PREPARED == {}, sql._PREPARED\n"
    assert "flowloop.store.sql" in loaded_after(code, tmp_path, NO_SQLALCHEMY)
    assert loaded_after(code, tmp_path, NOT_FOR_READING_RUNS) == []
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {migrate.VERSION_TABLE} SET version_num = '0001'"))
    finally:
        engine.dispose()
    result = subprocess.run(
        [sys.executable, "-m", "flowloop.cli", "status", "--db", url],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result
    assert "schema revision 0001 is older than this flowloop" in result.stderr
    assert "flowloop db upgrade" in result.stderr and "Traceback" not in result.stderr


def test_cold_start__status_on_the_default_database_loads_no_settings_or_pydantic(
    database: tuple[str, str], tmp_path: Path
) -> None:
    """`flowloop status` as typed, no --db: ./flowloop.db, still without the settings."""
    url, run_id = database
    here = Path(url.removeprefix("sqlite:///")).parent
    code = NO_SETTING_VARIABLES + f"shows = {run_id[:8]!r}\n" + command("status")
    assert loaded_after(code, here, (*SETTINGS_LIBRARY, *NOT_FOR_READING_RUNS)) == []


def _frozen_at_exit(code: str, cwd: Path) -> int:
    probe = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr))\n" + code
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return int(result.stderr.split("frozen ")[1].split()[0])


def test_cold_start__the_objects_loaded_are_frozen_at_exit(
    database: tuple[str, str], tmp_path: Path
) -> None:
    """The interpreter's last collection need not walk what the imports made: main(), run
    as the program (argv from the command line), freezes it at exit (an atexit handler
    registered before main() runs after its own); called with arguments from another
    program, it leaves that process's collector as it is."""
    url, run_id = database
    as_program = (
        f"sys.argv = ['flowloop', 'status', '--db', {url!r}]\n"
        "from flowloop.cli import main\n"
        "main()\n"
    )
    frozen = _frozen_at_exit(as_program, tmp_path)
    assert frozen > 10_000  # SQLAlchemy, pydantic and rich make some 100,000 objects
    called = f"shows = {run_id[:8]!r}\n" + command("status", "--db", url)
    assert _frozen_at_exit(called, tmp_path) == 0


def collecting_at_exit(code: str, cwd: Path) -> bool:
    """Whether the cyclic garbage collector was on when ``code`` ended."""
    probe = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('collecting', gc.isenabled(), file=sys.stderr))\n"
        f"{code}\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return {"collecting True": True, "collecting False": False}[result.stderr.splitlines()[-1]]


def test_cold_start__brief_commands_run_as_the_program_do_without_the_collector(
    database: tuple[str, str], tmp_path: Path
) -> None:
    """`flowloop status` (main() reading the command line) turns the cyclic collector off
    for its short life; main([...]) inside another process, and the other commands, leave
    it on."""
    url, run_id = database
    as_program = "from flowloop.cli import main\nsys.argv = ['flowloop', *{args!r}]\nmain()"
    for args in (["status", "--db", url], ["history", run_id, "--db", url]):
        assert not collecting_at_exit(as_program.format(args=args), tmp_path), args
    assert collecting_at_exit(as_program.format(args=["db", "upgrade", "--db", url]), tmp_path)
    assert collecting_at_exit(
        f"shows = {run_id[:8]!r}\n" + command("status", "--db", url), tmp_path
    )


def test_cold_start__a_database_not_at_head_is_still_judged_by_alembic(
    database: tuple[str, str],
) -> None:
    """Only "exactly one row, at HEAD" is told without Alembic; every other version table
    gets Alembic's verdict, with the messages of before."""
    url, _ = database
    engine = sa.create_engine(url)
    try:
        for rows, words in (
            (["0001"], "schema revision 0001 is older than this flowloop .*`flowloop db upgrade`"),
            (["9999"], "schema revision 9999 is newer than this flowloop .*upgrade flowloop"),
            ([], "schema revision none is older than this flowloop"),
        ):
            with engine.begin() as conn:
                conn.execute(sa.text(f"DELETE FROM {migrate.VERSION_TABLE}"))
                for row in rows:
                    conn.execute(
                        sa.text(f"INSERT INTO {migrate.VERSION_TABLE} VALUES (:r)"), {"r": row}
                    )
            with pytest.raises(SchemaMismatch, match=words):
                SQLStore(url, create=False)
    finally:
        engine.dispose()


def test_cold_start__the_head_known_without_alembic_is_alembics_head() -> None:
    # A new revision in flowloop/store/migrations/versions moves flowloop.store.migrate.HEAD.
    assert migrate.head() == migrate.HEAD


def test_cold_start__settings_defaults_are_the_engines() -> None:
    # Spelled in flowloop.config so that loading the settings imports neither module.
    from flowloop import config, executor, metrics

    assert config.DEFAULT_MAX_CONCURRENCY == executor.DEFAULT_MAX_CONCURRENCY
    assert config.DEFAULT_LEASE_SECONDS == executor.DEFAULT_LEASE_SECONDS
    assert config.DEFAULT_METRICS_HOST == metrics.DEFAULT_METRICS_HOST


# -- settings: loaded when there is something to read, or when a command asks -------------

SETTINGS_LIBRARY = ("pydantic_settings", "flowloop.config")
NO_SETTING_VARIABLES = (
    "import os\n"
    "for name in [n for n in os.environ if n.upper().startswith('FLOWLOOP_')]:\n"
    "    del os.environ[name]\n"
)


def test_cold_start__reading_commands_without_a_configuration_load_no_settings_library(
    database: tuple[str, str], tmp_path: Path
) -> None:
    """No flowloop.toml, no [tool.flowloop], no FLOWLOOP_* setting: the settings would be
    their defaults, so `status` and `history` never load pydantic-settings."""
    url, run_id = database
    for shows, args in (
        (run_id[:8], ("status", "--db", url)),
        (run_id, ("status", run_id, "--db", url, "--json")),
        ("run_created", ("--log-level", "debug", "history", run_id, "--db", url)),
    ):
        code = NO_SETTING_VARIABLES + f"shows = {shows!r}\n" + command(*args)
        assert loaded_after(code, tmp_path, SETTINGS_LIBRARY) == [], args
    # A file to read: loaded and validated as before, every command.
    (tmp_path / "flowloop.toml").write_text('log_level = "warning"\n')
    code = NO_SETTING_VARIABLES + f"shows = {run_id[:8]!r}\n" + command("status", "--db", url)
    assert loaded_after(code, tmp_path, SETTINGS_LIBRARY) == sorted(SETTINGS_LIBRARY)


def _flowloop(cwd: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("FLOWLOOP_")}
    return subprocess.run(
        [sys.executable, "-m", "flowloop", *args],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cold_start__an_invalid_setting_still_stops_a_reading_command(
    database: tuple[str, str], tmp_path: Path
) -> None:
    url, run_id = database
    assert _flowloop(tmp_path, "status", "--db", url).returncode == 0
    bad = _flowloop(tmp_path, "status", "--db", url, FLOWLOOP_LOG_LEVEL="loud")
    assert bad.returncode == 2
    assert "invalid configuration: log_level" in bad.stderr and "$FLOWLOOP_LOG_LEVEL" in bad.stderr
    (tmp_path / "flowloop.toml").write_text("colour = 'blue'\n")
    bad = _flowloop(tmp_path, "history", run_id, "--db", url)
    assert bad.returncode == 2
    assert "invalid configuration: colour: unknown key" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_cold_start__settings_asked_for_later_keep_the_global_flags(tmp_path: Path) -> None:
    """A command that asks for the settings after the group found nothing to read gets them
    with the group's flags, loaded once."""
    code = NO_SETTING_VARIABLES + (
        "import click, contextlib, io\n"
        "from flowloop.cli import cli, common, main\n"
        "@click.command()\n"
        "def probe():\n"
        "    first = common.settings()\n"
        "    assert common.settings() is first\n"
        "    click.echo(f'{first.log_format} {first.log_level}')\n"
        "cli.add_command(probe)\n"
        "with contextlib.redirect_stdout(io.StringIO()) as shown:\n"
        "    main(['--log-format', 'json', '--log-level', 'error', 'probe'])\n"
        "assert shown.getvalue() == 'json error\\n', shown.getvalue()\n"
    )
    assert loaded_after(code, tmp_path, ("flowloop.config",)) == ["flowloop.config"]


def test_cold_start__a_command_loads_its_own_module_only(
    database: tuple[str, str], tmp_path: Path
) -> None:
    """The group imports a command's module when it runs (flowloop.cli.COMMANDS): `status`
    does not load `worker`'s, `diagram`'s or `ui`'s, and help still lists every command."""
    from flowloop.cli import COMMANDS

    modules = tuple(sorted({where.partition(":")[0] for where in COMMANDS.values()}))
    url, run_id = database
    code = f"shows = {run_id[:8]!r}\n" + command("status", "--db", url)
    assert loaded_after(code, tmp_path, modules) == ["flowloop.cli.runs_view"]
    code = "shows = 'Commands:'\n" + command("--help")
    assert loaded_after(code, tmp_path, modules) == sorted(modules)


def test_cold_start__every_command_is_where_the_group_looks_for_it() -> None:
    import importlib

    import click

    from flowloop.cli import COMMANDS, cli

    names = ["run", "start", "resume", "retry", "send", "status", "history", "replay"]
    names += ["pause", "unpause", "stop", "worker", "check", "migrate", "loops", "trigger"]
    names += ["backfill", "diagram", "db", "stats", "prune", "ui"]
    assert sorted(COMMANDS) == sorted(names)
    for name, where in COMMANDS.items():
        module, _, attribute = where.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        assert isinstance(command, click.Command) and command.name == name, where
    context = click.Context(cli)
    assert cli.list_commands(context) == sorted(COMMANDS)
    assert all(cli.get_command(context, name) is not None for name in COMMANDS)
