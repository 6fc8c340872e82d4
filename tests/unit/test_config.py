"""Configuration: flowloop.toml or [tool.flowloop], FLOWLOOP_* variables and flags, in that
order of precedence; every invalid value is one line naming the key, the problem and where
it came from; overrides by name reach workflows and loops without touching their code."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel

from flowloop import Retry, Workflow, configfile
from flowloop.alerts import log_sink
from flowloop.config import Settings, apply_overrides, load_settings, parse_duration
from flowloop.errors import ConfigError
from flowloop.loops import Iteration, Loop


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A working directory of its own and no FLOWLOOP_* settings from the outside."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("FLOWLOOP_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def error_of(**kwargs: object) -> str:
    with pytest.raises(ConfigError) as raised:
        load_settings(**kwargs)  # type: ignore[arg-type]
    message = str(raised.value)
    assert "\n" not in message
    return message


# -- sources and precedence ----------------------------------------------------------------


def test_settings__defaults_without_any_source(tmp_path: Path) -> None:
    settings = load_settings()
    assert (settings.db, settings.concurrency) == (None, 16)
    assert (settings.lease, settings.grace) == (30.0, 30.0)
    assert (settings.log_format, settings.log_level, settings.metrics_port) == ("text", None, None)
    assert settings.metrics_host == "127.0.0.1"
    assert settings.alert_sinks() == [log_sink]


def test_settings__precedence_is_file_then_env_then_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(
        tmp_path / "flowloop.toml",
        """
        concurrency = 4
        lease = "1m"
        grace = 5
        log_format = "json"
    """,
    )
    assert load_settings().concurrency == 4

    monkeypatch.setenv("FLOWLOOP_CONCURRENCY", "8")
    monkeypatch.setenv("FLOWLOOP_LEASE", "45s")
    settings = load_settings()
    assert (settings.concurrency, settings.lease, settings.grace) == (8, 45.0, 5.0)

    settings = load_settings({"concurrency": 12, "lease": None, "log_format": "text"})
    assert (settings.concurrency, settings.lease, settings.log_format) == (12, 45.0, "text")


def test_settings__nested_env_merges_with_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(
        tmp_path / "flowloop.toml",
        """
        [workflows.order.steps.charge]
        timeout = "30s"
        retry = { attempts = 5 }
    """,
    )
    monkeypatch.setenv("FLOWLOOP_WORKFLOWS__ORDER__STEPS__CHARGE__TIMEOUT", "2m")
    monkeypatch.setenv("FLOWLOOP_ALERTS", '[{"type": "log", "level": "critical"}]')
    settings = load_settings()
    charge = settings.workflows["order"].steps["charge"]
    assert charge.timeout == 120.0
    assert charge.retry is not None and charge.retry.attempts == 5
    assert settings.alerts[0].level == "critical"


def test_settings__pyproject_tool_table_when_no_flowloop_toml(tmp_path: Path) -> None:
    write(
        tmp_path / "pyproject.toml",
        """
        [project]
        name = "app"

        [tool.flowloop]
        db = "sqlite:///app.db"
        metrics_port = 9464
    """,
    )
    settings = load_settings()
    assert (settings.db, settings.metrics_port) == ("sqlite:///app.db", 9464)


def test_settings__the_dashboard_token_from_the_file_and_the_env_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "flowloop.toml", 'ui_token = "from-the-file"\n')
    assert load_settings().ui_token == "from-the-file"
    monkeypatch.setenv("FLOWLOOP_UI_TOKEN", "from-the-env")
    assert load_settings().ui_token == "from-the-env"
    write(tmp_path / "flowloop.toml", 'ui_token = ""\n')
    monkeypatch.delenv("FLOWLOOP_UI_TOKEN")
    assert error_of().startswith("invalid configuration: ui_token: String should have at least")


def test_settings__an_empty_variable_is_an_unset_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FLOWLOOP_UI_TOKEN= left blank in a deployment must not break every command."""
    monkeypatch.setenv("FLOWLOOP_UI_TOKEN", "")
    monkeypatch.setenv("FLOWLOOP_METRICS_PORT", "")
    settings = load_settings()
    assert (settings.ui_token, settings.metrics_port) == (None, None)
    write(tmp_path / "flowloop.toml", 'ui_token = "from-the-file"\n')
    assert load_settings().ui_token == "from-the-file"


def test_settings__pyproject_without_the_table_is_ignored(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", '[project]\nname = "app"\n')
    assert load_settings().db is None


def test_settings__explicit_file_and_env_file_beat_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(tmp_path / "flowloop.toml", "concurrency = 2\n")
    other = write(tmp_path / "other.toml", "concurrency = 3\n")
    elsewhere = write(tmp_path / "elsewhere.toml", "concurrency = 5\n")
    assert load_settings(config_file=other).concurrency == 3
    monkeypatch.setenv("FLOWLOOP_CONFIG", str(elsewhere))
    assert load_settings().concurrency == 5
    assert load_settings(config_file=other).concurrency == 3


def test_settings__unrelated_flowloop_variables_are_not_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLOWLOOP_TEST_PG", "postgresql://x")
    monkeypatch.setenv("FLOWLOOP_DB", "sqlite:///env.db")
    assert load_settings().db == "sqlite:///env.db"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        (30, 30.0),
        (1.5, 1.5),
        ("30", 30.0),
        ("500ms", 0.5),
        ("30s", 30.0),
        ("5m", 300.0),
        ("2h", 7200.0),
        ("7d", 604800.0),
        ("1w", 604800.0),
        (" 2.5 h ", 9000.0),
    ],
)
def test_parse_duration__units(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


# -- invalid configuration: one line each ----------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("concurrency = 0", "concurrency: Input should be greater than or equal to 1 (got 0)"),
        ("concurency = 3", "concurency: unknown key (did you mean 'concurrency'?)"),
        (
            'lease = "soon"',
            "lease: 'soon' is not a duration (use seconds or e.g. 500ms, 30s, 5m, 2h, 7d)",
        ),
        ('log_format = "xml"', "log_format: Input should be 'text' or 'json' (got 'xml')"),
        (
            'log_level = "loud"',
            "log_level: Input should be 'debug', 'info', 'warning', 'error' or 'critical' "
            "(got 'loud')",
        ),
        (
            "metrics_port = 70000",
            "metrics_port: Input should be less than or equal to 65535 (got 70000)",
        ),
        ('[[alerts]]\ntype = "webhook"', "alerts.0.url: Field required"),
        (
            '[[alerts]]\ntype = "webhook"\nurl = "ftp://x"',
            "alerts.0.url: String should match pattern '^https?://\\S+$' (got 'ftp://x')",
        ),
        (
            '[[alerts]]\ntype = "pager"',
            "alerts.0: type 'pager' is not one of 'log', 'command', 'webhook', 'python'",
        ),
        (
            '[[alerts]]\ntype = "log"\nlevel = "info"',
            "alerts.0.level: Input should be 'warning' or 'critical' (got 'info')",
        ),
        (
            "[workflows.order]\nmax_concurency = 3",
            "workflows.order.max_concurency: unknown key (did you mean 'max_concurrency'?)",
        ),
        (
            "[workflows.order.steps.charge]\ntimeout = 0",
            "workflows.order.steps.charge.timeout: Input should be greater than 0 (got 0)",
        ),
        (
            "[workflows.order.steps.charge.retry]\nattempts = 0",
            "workflows.order.steps.charge.retry.attempts: Input should be greater than or equal "
            "to 1 (got 0)",
        ),
        (
            '[loops.poll]\nevery = "-1s"',
            "loops.poll.every: '-1s' is not a duration"
            " (use seconds or e.g. 500ms, 30s, 5m, 2h, 7d)",
        ),
        (
            "[loops.poll]\nmax_failures = 0",
            "loops.poll.max_failures: Input should be greater than or equal to 1 (got 0)",
        ),
    ],
)
def test_invalid_config__one_line_naming_key_and_problem(
    tmp_path: Path, toml: str, message: str
) -> None:
    path = write(tmp_path / "flowloop.toml", toml + "\n")
    assert error_of() == f"invalid configuration: {message} [from {path}]"


def test_invalid_config__names_the_env_variable_it_came_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLOWLOOP_CONCURRENCY", "many")
    assert error_of() == (
        "invalid configuration: concurrency: Input should be a valid integer, unable to parse "
        "string as an integer (got 'many') [from $FLOWLOOP_CONCURRENCY]"
    )


def test_invalid_config__names_the_flag_it_came_from() -> None:
    assert error_of(flags={"metrics_port": -1}) == (
        "invalid configuration: metrics_port: Input should be greater than or equal to 0 "
        "(got -1) [from --metrics-port]"
    )


def test_invalid_config__broken_toml_names_the_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "flowloop.toml", "concurrency = 4\nlease 5\n")
    assert error_of() == (
        f"{path}: invalid TOML: Expected '=' after a key in a key/value pair (at line 2, column 7)"
    )


def test_invalid_config__missing_explicit_file(tmp_path: Path) -> None:
    assert error_of(config_file=tmp_path / "nope.toml") == (
        f"configuration file {tmp_path / 'nope.toml'} does not exist"
    )


def test_invalid_config__several_problems_are_counted_on_the_line(tmp_path: Path) -> None:
    write(tmp_path / "flowloop.toml", "concurrency = 0\nlease = -1\n")
    assert error_of().endswith("(and 1 more problem(s))")


# -- overrides by name ---------------------------------------------------------------------


class Ctx(BaseModel):
    n: int = 0


def order() -> Workflow:
    wf = Workflow("order", context=Ctx)

    @wf.step(initial=True, next="charge")
    def reserve(ctx: Ctx) -> None: ...

    @wf.step(
        next="done",
        timeout=5,
        retry=Retry(attempts=2, backoff="fixed", base=1, on=(ConnectionError,)),
    )
    def charge(ctx: Ctx) -> None: ...

    wf.final("done")
    return wf.validate()


def poll(it: Iteration) -> None: ...


def test_apply_overrides__step_timeout_retry_and_workflow_concurrency(tmp_path: Path) -> None:
    write(
        tmp_path / "flowloop.toml",
        """
        [workflows.order]
        max_concurrency = 3
        [workflows.order.steps.charge]
        timeout = "1m"
        retry = { attempts = 6, backoff = "exponential", base = "2s", cap = "30s" }
    """,
    )
    wf = order()
    fingerprint = wf.fingerprint
    apply_overrides(load_settings(), {"order": wf}, {})
    charge = wf.steps["charge"]
    assert wf.max_concurrency == 3
    assert charge.timeout == 60.0
    assert (charge.retry.attempts, charge.retry.backoff) == (6, "exponential")
    assert (charge.retry.base, charge.retry.cap) == (2.0, 30.0)
    assert charge.retry.on == (ConnectionError,)  # what code declared stays
    assert wf.steps["reserve"].timeout is None
    assert wf.fingerprint == fingerprint  # stored runs stay compatible


def test_apply_overrides__loop_interval_timeout_retry_max_failures(tmp_path: Path) -> None:
    write(
        tmp_path / "flowloop.toml",
        """
        [loops.poll]
        every = "5m"
        timeout = 10
        max_failures = 2
        retry = { attempts = 3, backoff = "fixed", base = 1 }
    """,
    )
    loops = apply_overrides(load_settings(), {}, {"poll": Loop("poll", poll, every=30)})
    loop = loops["poll"]
    assert (loop.every, loop.timeout, loop.max_failures) == (300.0, 10.0, 2)
    assert loop.retry.attempts == 3
    assert loop.schedule.startswith("every 300s")


def test_apply_overrides__a_cron_loop_keeps_its_time_zone(tmp_path: Path) -> None:
    """An override of any setting rebuilds the loop: it kept every argument but tz=, so a
    Berlin 02:30 job ran at 02:30 UTC once flowloop.toml tuned its timeout."""
    write(
        tmp_path / "flowloop.toml",
        """
        [loops.nightly]
        timeout = 10
        [loops.hourly]
        cron = "0 * * * *"
        [loops.poll]
        every = "5m"
    """,
    )
    defined = {
        name: Loop(name, poll, cron="30 2 * * *", tz="Europe/Berlin")
        for name in ("nightly", "hourly", "poll")
    }
    loops = apply_overrides(load_settings(), {}, defined)
    assert (loops["nightly"].tz, loops["nightly"].timeout) == ("Europe/Berlin", 10.0)
    assert loops["nightly"].schedule == "cron 30 2 * * * (Europe/Berlin)"
    assert loops["hourly"].schedule == "cron 0 * * * * (Europe/Berlin)"
    # every= runs in elapsed time: no zone.
    assert (loops["poll"].tz, loops["poll"].schedule) == (None, "every 300s (fixed_rate)")


def test_apply_overrides__a_cron_with_no_time_in_the_loop_bounds_is_refused(
    tmp_path: Path,
) -> None:
    """A cron override is checked against the loop's start_at/end_at like the definition:
    a loop that would never fire is a configuration error naming both, not a loop left
    scheduled past end_at."""
    write(tmp_path / "flowloop.toml", '[loops.sale]\ncron = "0 0 1 * *"\n')
    sale = Loop("sale", poll, every=3600, start_at=1_767_312_000.0, end_at=1_768_867_200.0)
    with pytest.raises(ConfigError) as raised:
        apply_overrides(load_settings(), {}, {"sale": sale})
    assert str(raised.value).startswith(
        "invalid configuration: loops.sale: loop 'sale': cron='0 0 1 * *' has no time from "
        "start_at 2026-01-02 00:00 UTC until end_at 2026-01-20 00:00 UTC"
    )


def test_apply_overrides__env_names_match_without_case(monkeypatch: pytest.MonkeyPatch) -> None:
    wf = Workflow("OrderFlow", context=Ctx)

    @wf.step(initial=True, next="done")
    def Reserve(ctx: Ctx) -> None: ...  # a state name with capitals

    wf.final("done")
    monkeypatch.setenv("FLOWLOOP_WORKFLOWS__ORDERFLOW__STEPS__RESERVE__TIMEOUT", "7")
    apply_overrides(load_settings(), {"OrderFlow": wf.validate()}, {})
    assert wf.steps["Reserve"].timeout == 7.0


def test_apply_overrides__unknown_step_is_a_config_error(tmp_path: Path) -> None:
    write(tmp_path / "flowloop.toml", "[workflows.order.steps.charj]\ntimeout = 1\n")
    with pytest.raises(ConfigError) as raised:
        apply_overrides(load_settings(), {"order": order()}, {})
    assert str(raised.value) == (
        "invalid configuration: workflows.order.steps.charj: workflow 'order' has no step "
        "'charj' (steps: reserve, charge)"
    )


def test_apply_overrides__loop_rule_broken_by_override_is_a_config_error(tmp_path: Path) -> None:
    write(tmp_path / "flowloop.toml", '[loops.poll]\ncron = "not cron"\n')
    with pytest.raises(ConfigError) as raised:
        apply_overrides(load_settings(), {}, {"poll": Loop("poll", poll, every=30)})
    assert str(raised.value).startswith("invalid configuration: loops.poll: loop 'poll': cron=")


def test_apply_overrides__names_not_loaded_here_are_skipped(tmp_path: Path) -> None:
    write(
        tmp_path / "flowloop.toml",
        "[workflows.other]\nmax_concurrency = 1\n[loops.elsewhere]\nevery = 5\n",
    )
    wf = order()
    loops = apply_overrides(load_settings(), {"order": wf}, {})
    assert loops == {}
    assert wf.max_concurrency is None


def test_apply_overrides__a_name_close_to_a_loaded_one_gets_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`[workflows.ordr]` was skipped with an info line only, while a misspelt step is
    refused (new-user audit): a name close to a loaded one is a warning naming it."""
    write(
        tmp_path / "flowloop.toml",
        "[workflows.ordr]\nmax_concurrency = 1\n[workflows.other]\nmax_concurrency = 2\n"
        "[loops.pol]\nevery = 5\n",
    )
    wf = order()
    with caplog.at_level(logging.INFO, logger="flowloop"):
        apply_overrides(load_settings(), {"order": wf}, {"poll": Loop("poll", poll, every=30)})
    shown = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert shown == [
        (
            "WARNING",
            "config: no workflow 'ordr' is loaded here (did you mean 'order'?); its overrides "
            "are skipped",
        ),
        ("INFO", "config: workflow 'other' is not loaded here; its overrides are skipped"),
        (
            "WARNING",
            "config: no loop 'pol' is loaded here (did you mean 'poll'?); its overrides are "
            "skipped",
        ),
    ]
    assert wf.max_concurrency is None


def test_settings__alert_sinks_from_the_file(tmp_path: Path) -> None:
    write(
        tmp_path / "flowloop.toml",
        """
        [[alerts]]
        type = "command"
        command = "cat > /dev/null"
        [[alerts]]
        type = "webhook"
        url = "http://127.0.0.1:1/hook"
        level = "critical"
        [[alerts]]
        type = "python"
        callable = "flowloop.alerts:log_sink"
    """,
    )
    settings = load_settings()
    sinks = settings.alert_sinks()
    assert len(sinks) == 3
    assert sinks[2] is log_sink
    alerts = settings.make_alerts()
    assert alerts.background
    assert isinstance(settings, Settings)


# -- nothing to read: the settings load when first asked (flowloop/configfile.py) ------------


def test_nothing_to_read__names_every_setting() -> None:
    assert set(Settings.model_fields) == configfile.SETTING_NAMES


def test_nothing_to_read__without_a_file_or_a_setting_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert configfile.nothing_to_read()
    monkeypatch.setenv("FLOWLOOP_DB", "sqlite:///elsewhere.db")  # --db reads it itself
    monkeypatch.setenv("FLOWLOOP_TEST_PG", "postgresql://x")  # not a setting
    monkeypatch.setenv("FLOWLOOP_LOG_LEVEL", "")  # empty: unset
    assert configfile.nothing_to_read()
    write(tmp_path / "pyproject.toml", "[project]\nname = 'x'\n")  # no [tool.flowloop]
    assert configfile.nothing_to_read()


@pytest.mark.parametrize(
    "variable",
    [
        "FLOWLOOP_LOG_LEVEL",
        "flowloop_log_level",
        "FLOWLOOP_WORKFLOWS__ORDER__MAX_CONCURRENCY",
        "flowloop_db",  # the settings read it, click's --db does not
    ],
)
def test_nothing_to_read__a_variable_that_sets_something(
    variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, "nope")
    assert not configfile.nothing_to_read()


def test_nothing_to_read__a_file_to_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pyproject = write(tmp_path / "pyproject.toml", "[tool.flowloop]\nconcurrency = 2\n")
    assert not configfile.nothing_to_read()
    pyproject.unlink()
    write(tmp_path / "flowloop.toml", "")
    assert not configfile.nothing_to_read()
    other = write(tmp_path / "sub.toml", "")
    (tmp_path / "flowloop.toml").unlink()
    assert not configfile.nothing_to_read(other)
    monkeypatch.setenv("FLOWLOOP_CONFIG", str(other))
    assert not configfile.nothing_to_read()
    with pytest.raises(ConfigError, match=r"missing\.toml does not exist"):
        configfile.nothing_to_read(tmp_path / "missing.toml")


def test_a_misspelt_setting_variable_is_named_with_the_one_meant() -> None:
    """pydantic-settings skipped FLOWLOOP_CONCURENCY without a word (new-user audit): the
    commands warn, naming the setting meant. Variables far from any setting are a
    program's own; nested keys and the alert commands' variables are flowloop's."""
    from flowloop.configfile import misspelt_variables

    environ = {
        "FLOWLOOP_CONCURENCY": "4",
        "FLOWLOOP_LEASE_SECONDS": "60",  # (a prefix of a setting: a program's own, perhaps)
        "FLOWLOOP_DB_PASSWORD": "secret",
        "flowloop_dbb": "x.db",
        "FLOWLOOP_TEST_PG": "postgresql://",
        "FLOWLOOP_WORKFLOWS__ORDER__MAX_CONCURRENCY": "2",
        "FLOWLOOP_ALERT_KIND": "run_failed",
        "FLOWLOOP_DB": "y.db",
        "FLOWLOOP_CONFIG": "z.toml",
        "HOME": "/root",
    }
    assert sorted(misspelt_variables(environ)) == [
        ("FLOWLOOP_CONCURENCY", "FLOWLOOP_CONCURRENCY"),
        ("flowloop_dbb", "FLOWLOOP_DB"),
    ]


def test_apply_overrides__another_workers_longer_name_gets_no_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`[workflows.orders]` beside a loaded `order` is another worker's workflow, not a typo:
    a warning at every start was noise (review)."""
    write(tmp_path / "flowloop.toml", "[workflows.orders]\nmax_concurrency = 1\n")
    with caplog.at_level(logging.INFO, logger="flowloop"):
        apply_overrides(load_settings(), {"order": order()}, {})
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "config: workflow 'orders' is not loaded here; its overrides are skipped")
    ]
